// Package publisher turns events into the KV event stream: a bounded queue
// that drops the oldest events (each burning one sequence number), one
// publishing goroutine that batches up to 64 events per message, numbers
// messages from 1, encodes them and hands them to the PUB socket (bounded
// per-subscriber queues) and to the replay ring served by the ROUTER socket.
//
// Sequence numbers: a message consumes one number; a dropped event consumes
// one number of its own, charged just before the next message, so a
// subscriber sees a gap exactly as wide as the number of events dropped
// (dropped_events) at the place they were dropped. Messages a slow
// subscriber's own queue discards leave a gap of one number each in that
// subscriber's stream and are counted separately (subscriber_dropped_batches).
//
// Restarts (docs/gateway-state.md): a publisher continues a persisted
// sequence (Config.Epoch, StartSeq, StartEventID, RestoreRing), hands every
// batch to a Journal before sending it and to a Recorder after, carries the
// master position of the events it publishes (EnqueueAt), holds publication
// after a restart until its subscribers are back (ResumeSubscribers), and
// serves the Recorder's snapshots on a ROUTER socket (SnapshotEndpoint).
package publisher

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Config configures a Publisher.
type Config struct {
	// PubEndpoint is the PUB bind endpoint (tcp://*:5557).
	PubEndpoint string
	// ReplayEndpoint is the ROUTER bind endpoint (tcp://*:5558); "" disables replay.
	ReplayEndpoint string
	// ReplayLegacy answers replays as [b"", seq, payload] instead of
	// [b"", topic, seq, payload].
	ReplayLegacy bool
	// QueueCapacity bounds queued events (65536).
	QueueCapacity int
	// MaxBatch bounds events per message (64, the contract's maximum).
	MaxBatch int
	// FlushInterval is how long a partial batch waits for more events. The
	// default 0 publishes as soon as the publishing goroutine is free: a
	// lone event goes out at once, and events that arrive while it encodes
	// and sends are batched (full batches under load). A positive interval
	// trades latency for fuller batches at moderate rates; note that Go
	// rounds sub-millisecond sleeps of an idle process up to about 1ms.
	FlushInterval time.Duration
	// ReplayBuffer and ReplayBufferBytes bound the replay ring.
	ReplayBuffer      int
	ReplayBufferBytes int
	// SubQueueBatches and SubQueueBytes bound each subscriber's send queue.
	SubQueueBatches int
	SubQueueBytes   int
	// MaxSubscribers bounds PUB connections (and replay connections),
	// including those still handshaking.
	MaxSubscribers int
	// ReplayMaxConnsPerPeer bounds the replay connections from one remote
	// IP (TCP only), so one host cannot take every replay slot.
	ReplayMaxConnsPerPeer int
	// ReplayIdleTimeout closes a replay connection that sends no request
	// for this long (a DEALER reconnects on its own when it has one).
	ReplayIdleTimeout time.Duration
	// HandshakeTimeout bounds a ZMTP handshake (PUB and replay): a peer
	// that connects and does not complete it is dropped.
	HandshakeTimeout time.Duration
	// SubWriteTimeout disconnects a subscriber whose write makes no
	// progress for this long; 0 never does (its queue still drops).
	SubWriteTimeout time.Duration
	// ReplayWriteTimeout bounds each replay write.
	ReplayWriteTimeout time.Duration
	// Encoder is the envelope and the contract's switches.
	Encoder kvevent.EncoderOptions

	// Format is the stream's framing: FormatMooncake (the default, the
	// contract byte for byte) or FormatSnapshot (24-byte sequence frames
	// carrying the epoch, heartbeats).
	Format Format
	// Epoch is the publisher epoch, the identity of one unbroken sequence
	// (restored state keeps it). Zero: New draws a random one.
	Epoch statedir.Epoch
	// StartSeq is the last sequence number already used (restored state):
	// the first batch takes StartSeq+1.
	StartSeq uint64
	// StartEventID is the last event_id already used.
	StartEventID uint64
	// Topic (FormatSnapshot only; "" by default) is the topic frame of
	// every PUB message, heartbeats included, and of every replay reply
	// but the end marker: llm-d's snapshot consumer wants
	// kv@<address:port>@<model>, as vLLM publishes. At most MaxTopicLen
	// bytes of printable ASCII. The Mooncake format's topic is always
	// empty. A PUB subscription matches when it is a prefix of the topic.
	Topic string
	// HeartbeatInterval (FormatSnapshot only): when nothing was published
	// for this long, a batch with no events is (1s; 0 means 1s).
	HeartbeatInterval time.Duration
	// ResumeSubscribers > 0 holds publication (events queue meanwhile)
	// until that many PUB subscribers are connected and subscribed, or
	// ResumeHold has passed since Run started: a restored publisher gives
	// the subscribers it had a chance to reconnect first.
	ResumeSubscribers int
	ResumeHold        time.Duration
	// SnapshotEndpoint is the snapshot ROUTER bind endpoint (tcp://*:5559);
	// "" disables it. It shares the replay socket's limits, per-peer cap,
	// idle and write timeouts.
	SnapshotEndpoint string
	// SnapshotTimeout bounds the wait for one snapshot to be built (30s;
	// 0 means 30s).
	SnapshotTimeout time.Duration
}

// Defaults of the fields whose zero value means "the default".
const (
	DefaultHeartbeatInterval = time.Second
	DefaultSnapshotTimeout   = 30 * time.Second
)

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		PubEndpoint:           "tcp://*:5557",
		ReplayEndpoint:        "tcp://*:5558",
		QueueCapacity:         65536,
		MaxBatch:              kvevent.MaxEventsPerBatch,
		FlushInterval:         0,
		ReplayBuffer:          10000,
		ReplayBufferBytes:     64 << 20,
		SubQueueBatches:       8192,
		SubQueueBytes:         32 << 20,
		MaxSubscribers:        1024,
		ReplayMaxConnsPerPeer: 32,
		ReplayIdleTimeout:     time.Minute,
		HandshakeTimeout:      5 * time.Second,
		ReplayWriteTimeout:    10 * time.Second,
		Encoder:               kvevent.EncoderOptions{LegacyCompat: true, ObjectKey: true},
		HeartbeatInterval:     DefaultHeartbeatInterval,
		ResumeHold:            2 * time.Second,
		SnapshotTimeout:       DefaultSnapshotTimeout,
	}
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if _, _, err := zmtp.SplitEndpoint(c.PubEndpoint); err != nil {
		errs = append(errs, fmt.Errorf("pub: %w", err))
	}
	if c.ReplayEndpoint != "" {
		if _, _, err := zmtp.SplitEndpoint(c.ReplayEndpoint); err != nil {
			errs = append(errs, fmt.Errorf("replay: %w", err))
		}
	}
	if c.SnapshotEndpoint != "" {
		if _, _, err := zmtp.SplitEndpoint(c.SnapshotEndpoint); err != nil {
			errs = append(errs, fmt.Errorf("snapshot: %w", err))
		}
	}
	if c.Format != FormatMooncake && c.Format != FormatSnapshot {
		errs = append(errs, fmt.Errorf("unknown stream format %v", c.Format))
	}
	if err := c.validateTopic(); err != nil {
		errs = append(errs, err)
	}
	if c.HeartbeatInterval < 0 || c.ResumeHold < 0 || c.SnapshotTimeout < 0 {
		errs = append(errs, errors.New("heartbeat-interval, resume-hold and snapshot-timeout must be >= 0"))
	}
	if c.ResumeSubscribers < 0 {
		errs = append(errs, fmt.Errorf("resume-subscribers must be >= 0, got %d", c.ResumeSubscribers))
	}
	if c.QueueCapacity < 1 {
		errs = append(errs, fmt.Errorf("queue-capacity must be >= 1, got %d", c.QueueCapacity))
	}
	if c.MaxBatch < 1 || c.MaxBatch > kvevent.MaxEventsPerBatch {
		errs = append(errs, fmt.Errorf("max-batch must be 1..%d, got %d", kvevent.MaxEventsPerBatch, c.MaxBatch))
	}
	if c.FlushInterval < 0 {
		errs = append(errs, fmt.Errorf("flush-interval must be >= 0, got %v", c.FlushInterval))
	}
	if c.ReplayBuffer < 0 || c.ReplayBufferBytes < 0 {
		errs = append(errs, errors.New("replay-buffer and replay-buffer-bytes must be >= 0"))
	}
	if c.SubQueueBatches < 1 || c.SubQueueBytes < 1 {
		errs = append(errs, errors.New("sub-queue-batches and sub-queue-bytes must be >= 1"))
	}
	if c.MaxSubscribers < 1 {
		errs = append(errs, errors.New("max-subscribers must be >= 1"))
	}
	if c.ReplayMaxConnsPerPeer < 1 {
		errs = append(errs, fmt.Errorf("replay-max-conns-per-peer must be >= 1, got %d", c.ReplayMaxConnsPerPeer))
	}
	if c.ReplayIdleTimeout <= 0 {
		errs = append(errs, fmt.Errorf("replay-idle-timeout must be > 0, got %v", c.ReplayIdleTimeout))
	}
	if c.HandshakeTimeout <= 0 || c.ReplayWriteTimeout <= 0 || c.SubWriteTimeout < 0 {
		errs = append(errs, errors.New("handshake and replay write timeouts must be > 0, sub-write-timeout >= 0"))
	}
	if c.Encoder.Envelope.BackendID == "" {
		errs = append(errs, errors.New("backend-id must be set"))
	}
	return errors.Join(errs...)
}

// validateTopic: a topic only in FormatSnapshot (the contract's topic
// frame is empty), at most MaxTopicLen bytes of printable ASCII.
func (c Config) validateTopic() error {
	if c.Topic == "" {
		return nil
	}
	if c.Format != FormatSnapshot {
		return fmt.Errorf("topic %q needs the snapshot stream format (the %v format's topic frame is always empty)", c.Topic, c.Format)
	}
	if len(c.Topic) > MaxTopicLen {
		return fmt.Errorf("topic has %d bytes, at most %d allowed", len(c.Topic), MaxTopicLen)
	}
	for i := 0; i < len(c.Topic); i++ {
		if b := c.Topic[i]; b < 0x20 || b > 0x7e {
			return fmt.Errorf("topic %q: byte %d (%#02x) is not printable ASCII", c.Topic, i, b)
		}
	}
	return nil
}

// Stats are the publisher's counters.
type Stats struct {
	// Enabled: the PUB socket is bound and the publishing goroutine runs.
	Enabled bool
	// PublishedBatches are messages handed to the PUB socket (heartbeats
	// included); PublishedEvents the events inside them.
	PublishedBatches, PublishedEvents uint64
	// HeartbeatsSent are the batches without events (FormatSnapshot).
	HeartbeatsSent uint64
	// DroppedEvents were dropped by the full queue, each burning a sequence number.
	DroppedEvents uint64
	// SkippedKeylessEvents are stored/removed events suppressed by ObjectKey=false.
	SkippedKeylessEvents uint64
	// EnqueuedEvents were accepted into the queue; each is eventually
	// published or dropped (Enqueued = Published + Dropped + QueueDepth,
	// except for the batch being encoded).
	EnqueuedEvents uint64
	// LastSequence is the last sequence number assigned (burned or sent);
	// NextSequence = LastSequence+1 is the one the next batch takes.
	LastSequence, NextSequence uint64
	QueueDepth                 int
	// Format is the stream format; Epoch the publisher epoch.
	Format Format
	Epoch  statedir.Epoch
	// Position is the master position of the last batch published.
	Position statedir.Position
	// Holding: the resume hold keeps the publisher from publishing.
	Holding bool
	// JournalErrors are batches the Journal failed to append (each was
	// published all the same).
	JournalErrors uint64
	// ReplayBatches are batches held by the replay ring.
	ReplayBatches int
	// Subscribers are connections subscribed to the stream (after Run, the
	// number when it stopped).
	Subscribers int
	// SubscriberDroppedBatches were discarded from slow subscribers' queues.
	SubscriberDroppedBatches uint64
	// SubscriberUnansweredPings are subscribers' PINGs left without a
	// PONG: more than a few waiting in one queue, or pushed out of it.
	SubscriberUnansweredPings uint64
	ReplayRequests            uint64
	// SnapshotRequests were received on the snapshot socket;
	// SnapshotsServed answered with a snapshot, SnapshotErrors with -2.
	SnapshotRequests, SnapshotsServed, SnapshotErrors uint64
	// PeersRefused are PUB, replay and snapshot connections closed as they
	// were accepted: over MaxSubscribers, or over ReplayMaxConnsPerPeer.
	PeersRefused uint64
	// PeersDropped are PUB, replay and snapshot connections closed for
	// what the peer did: a failed or timed-out handshake, an oversized or
	// malformed frame, or (ROUTER) no request within ReplayIdleTimeout.
	PeersDropped uint64
}

// Journal persists every batch before it is sent (statedir's journal).
// Append is called on the publishing goroutine, before the batch is handed
// to the PUB socket; the record's Payload is immutable and may be kept. An
// error is counted (JournalErrors) and the batch is published anyway.
type Journal interface {
	Append(statedir.Record) error
}

// Recorder folds every published batch into the announced set that
// snapshots and checkpoints are made of (internal/gateway/snapshot).
// Record is called on the publishing goroutine after the batch was handed
// to the PUB socket, heartbeats included (no events); evs is valid only
// during the call. It must not block.
type Recorder interface {
	Record(seq uint64, pos statedir.Position, lastEventID uint64, evs []kvevent.Event)
}

// Publisher owns the event queue, the sequence and the sockets.
type Publisher struct {
	cfg  Config
	lg   *slog.Logger
	enc  *kvevent.Encoder
	q    *queue
	ring *ring
	now  func() time.Time

	epoch  statedir.Epoch
	suffix []byte // after the 8-byte sequence in the sequence frame: epoch[:] in FormatSnapshot
	// headroom is the room left in front of an encoded payload for its
	// frame headers: wireHeadroom, plus the topic's length when one is set.
	headroom int

	batches, events, skipped, encodeDrops, lastSeq atomic.Uint64
	heartbeats, journalErrs                        atomic.Uint64
	enabled, holding                               atomic.Bool

	// mu guards pub, replay, snapshot, journal, recorder, snapSrc and ringLast.
	mu       sync.Mutex
	pub      *pubSocket
	replay   *replaySocket
	snapshot *snapshotSocket
	journal  Journal
	recorder Recorder
	snapSrc  SnapshotSource
	ringLast uint64 // the last sequence RestoreRing added

	// posMu guards lastPos, the Stats copy of pos.
	posMu   sync.Mutex
	lastPos statedir.Position

	// enqMu guards enqBuf, the items of one Enqueue call.
	enqMu  sync.Mutex
	enqBuf []item

	// Owned by the publishing goroutine (journal and recorder are Run's
	// copies of the fields mu guards).
	seq          uint64
	nextID       uint64
	pos          statedir.Position // of the last batch
	items        []item
	evs          []kvevent.Event
	links        []trace.SpanContext // of the batch being published
	scratch      []byte              // a message is encoded here, then copied out at its size
	lastSend     time.Time
	runJournal   Journal
	runRecorder  Recorder
	journalBurst uint64 // consecutive journal errors

	running    atomic.Bool
	subsAtStop atomic.Int64 // PUB subscribers when Run stopped
}

// New builds a publisher. It does no I/O.
func New(cfg Config, lg *slog.Logger) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Epoch == (statedir.Epoch{}) {
		rand.Read(cfg.Epoch[:]) // never fails (crypto/rand)
	}
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if cfg.SnapshotTimeout == 0 {
		cfg.SnapshotTimeout = DefaultSnapshotTimeout
	}
	p := &Publisher{
		cfg: cfg, lg: lg, enc: kvevent.NewEncoder(cfg.Encoder),
		q: newQueue(cfg.QueueCapacity), ring: newRing(cfg.ReplayBuffer, cfg.ReplayBufferBytes),
		now: time.Now, scratch: make([]byte, 0, 32<<10),
		epoch: cfg.Epoch, seq: cfg.StartSeq, nextID: cfg.StartEventID,
		headroom: headroom(cfg.Topic),
	}
	if cfg.Format == FormatSnapshot {
		p.suffix = p.epoch[:]
	}
	p.lastSeq.Store(cfg.StartSeq)
	return p, nil
}

// SetJournal sets the journal every batch is appended to before it is
// sent. Call it before Run.
func (p *Publisher) SetJournal(j Journal) { p.beforeRun("SetJournal", func() { p.journal = j }) }

// SetRecorder sets the recorder every published batch is handed to. Call
// it before Run.
func (p *Publisher) SetRecorder(r Recorder) { p.beforeRun("SetRecorder", func() { p.recorder = r }) }

// SetSnapshotSource sets what the snapshot socket serves (without one it
// answers every request with -2). Call it before Run.
func (p *Publisher) SetSnapshotSource(s SnapshotSource) {
	p.beforeRun("SetSnapshotSource", func() { p.snapSrc = s })
}

// beforeRun runs set under mu; calling a setter after Run is a bug.
func (p *Publisher) beforeRun(what string, set func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running.Load() {
		panic("publisher: " + what + " called after Run")
	}
	set()
}

// RestoreRing puts journaled batches (oldest first) into the replay ring,
// framed exactly as they were published (with the current Config.Topic),
// so a replay after a restart serves batches from before it. Sequence
// numbers must increase and none may exceed Config.StartSeq. Call it
// before Run.
func (p *Publisher) RestoreRing(recs []statedir.Record) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running.Load() {
		return errors.New("publisher: RestoreRing called after Run")
	}
	last := p.ringLast
	for _, r := range recs {
		if r.Seq <= last || r.Seq > p.cfg.StartSeq {
			return fmt.Errorf("publisher: restored batch %d after %d (start sequence %d): out of order", r.Seq, last, p.cfg.StartSeq)
		}
		last = r.Seq
	}
	for _, r := range recs {
		buf := make([]byte, p.headroom+len(r.Payload))
		copy(buf[p.headroom:], r.Payload)
		p.ring.add(r.Seq, frameMessage(buf, p.cfg.Topic, r.Seq, p.suffix))
	}
	p.ringLast = last
	return nil
}

// Listen binds the PUB, replay and snapshot sockets (Run calls it when
// needed), so callers and tests learn the bound endpoints first.
func (p *Publisher) Listen() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub == nil {
		l, err := zmtp.Listen(p.cfg.PubEndpoint)
		if err != nil {
			return fmt.Errorf("pub listen %s: %w", p.cfg.PubEndpoint, err)
		}
		p.pub = newPubSocket(p.lg, l, p.cfg.Topic, p.cfg.SubQueueBatches, p.cfg.SubQueueBytes, p.cfg.MaxSubscribers, p.cfg.HandshakeTimeout, p.cfg.SubWriteTimeout)
	}
	if p.replay == nil && p.cfg.ReplayEndpoint != "" {
		l, err := zmtp.Listen(p.cfg.ReplayEndpoint)
		if err != nil {
			return fmt.Errorf("replay listen %s: %w", p.cfg.ReplayEndpoint, err)
		}
		p.replay = newReplaySocket(p.lg, l, p.ring, p.cfg)
	}
	if p.snapshot == nil && p.cfg.SnapshotEndpoint != "" {
		l, err := zmtp.Listen(p.cfg.SnapshotEndpoint)
		if err != nil {
			return fmt.Errorf("snapshot listen %s: %w", p.cfg.SnapshotEndpoint, err)
		}
		p.snapshot = newSnapshotSocket(p.lg, l, p.epoch, p.cfg)
	}
	return nil
}

// PubEndpoint is the dialable PUB endpoint after Listen ("" before).
func (p *Publisher) PubEndpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub == nil {
		return ""
	}
	return zmtp.Endpoint(p.pub.l)
}

// ReplayEndpoint is the dialable ROUTER endpoint after Listen ("" when disabled).
func (p *Publisher) ReplayEndpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.replay == nil {
		return ""
	}
	return zmtp.Endpoint(p.replay.l)
}

// SnapshotEndpoint is the dialable snapshot endpoint after Listen ("" when disabled).
func (p *Publisher) SnapshotEndpoint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.snapshot == nil {
		return ""
	}
	return zmtp.Endpoint(p.snapshot.l)
}

// Run binds (if needed), serves the sockets and publishes until ctx ends;
// then it publishes what is still queued and closes the sockets. It may be
// called once.
func (p *Publisher) Run(ctx context.Context) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("publisher: Run called twice")
	}
	start := time.Now()
	if err := p.Listen(); err != nil {
		return err
	}
	p.mu.Lock()
	pub, replay, snapshot := p.pub, p.replay, p.snapshot
	p.runJournal, p.runRecorder = p.journal, p.recorder
	if snapshot != nil {
		snapshot.src = p.snapSrc
	}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(pub.serve)
	if replay != nil {
		wg.Go(replay.serve)
	}
	if snapshot != nil {
		wg.Go(snapshot.serve)
	}
	p.enabled.Store(true)
	p.lg.Info("kv event publisher running", "pub", p.PubEndpoint(), "replay", p.ReplayEndpoint(), "snapshot", p.SnapshotEndpoint(),
		"format", p.cfg.Format.String(), "topic", p.cfg.Topic, "epoch", fmt.Sprintf("%x", p.epoch[:]), "next_seq", p.seq+1)
	if p.hold(ctx, pub, start) {
		p.loop(ctx, pub)
	}
	// Publish what the source already handed us, then stop.
	for p.q.len() > 0 {
		p.publishNext(pub)
	}
	// Stats keep reporting the subscribers of the end of the run: the
	// final checkpoint records them, so the next start waits for as many
	// (Config.ResumeSubscribers).
	p.subsAtStop.Store(int64(pub.subscribers()))
	p.enabled.Store(false)
	pub.close()
	if replay != nil {
		replay.close()
	}
	if snapshot != nil {
		snapshot.close()
	}
	wg.Wait()
	return nil
}

// hold waits, when ResumeSubscribers is set, until that many subscribers
// are connected or ResumeHold has passed since start; false when ctx ended
// first.
func (p *Publisher) hold(ctx context.Context, pub *pubSocket, start time.Time) bool {
	want := p.cfg.ResumeSubscribers
	if want <= 0 {
		return true
	}
	p.holding.Store(true)
	defer p.holding.Store(false)
	deadline := time.NewTimer(p.cfg.ResumeHold - time.Since(start))
	defer deadline.Stop()
	for {
		if n := pub.subscribers(); n >= want {
			p.lg.Info("resume hold ended: the subscribers reconnected", "subscribers", n, "want", want, "waited", time.Since(start))
			return true
		}
		select {
		case <-ctx.Done():
			p.lg.Info("resume hold ended: stopping", "subscribers", pub.subscribers(), "want", want)
			return false
		case <-deadline.C:
			p.lg.Info("resume hold ended: the hold time passed", "subscribers", pub.subscribers(), "want", want, "hold", p.cfg.ResumeHold)
			return true
		case <-pub.subsChanged:
		}
	}
}

// loop is the only goroutine that numbers, encodes and sends batches.
func (p *Publisher) loop(ctx context.Context, pub *pubSocket) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var idle *time.Timer // heartbeats, FormatSnapshot only
	if p.cfg.Format == FormatSnapshot {
		idle = time.NewTimer(time.Hour)
		idle.Stop()
		defer idle.Stop()
	}
	p.lastSend = time.Now()
	for {
		if !p.waitEvents(ctx, pub, idle) {
			return
		}
		if p.cfg.FlushInterval > 0 && p.q.len() < p.cfg.MaxBatch {
			timer.Reset(p.cfg.FlushInterval)
		wait:
			for p.q.len() < p.cfg.MaxBatch {
				select {
				case <-ctx.Done():
					return
				case <-p.q.notify:
				case <-timer.C:
					break wait
				}
			}
			timer.Stop()
		}
		p.publishNext(pub)
	}
}

// waitEvents waits until events are queued, publishing a heartbeat
// whenever nothing was published for HeartbeatInterval (idle not nil); it
// returns false when ctx ends first.
func (p *Publisher) waitEvents(ctx context.Context, pub *pubSocket, idle *time.Timer) bool {
	for p.q.len() == 0 {
		var beat <-chan time.Time
		if idle != nil {
			d := p.cfg.HeartbeatInterval - time.Since(p.lastSend)
			if d <= 0 {
				p.heartbeat(pub)
				continue
			}
			idle.Reset(d)
			beat = idle.C
		}
		select {
		case <-ctx.Done():
			return false
		case <-p.q.notify:
		case <-beat:
		}
	}
	return true
}

// advance takes pos (when not zero) as the master position of what is
// published from now on.
func (p *Publisher) advance(pos statedir.Position) {
	if pos == (statedir.Position{}) || pos == p.pos {
		return
	}
	p.pos = pos
	p.posMu.Lock()
	p.lastPos = pos
	p.posMu.Unlock()
}

// publishNext takes up to MaxBatch events and publishes them as one message.
func (p *Publisher) publishNext(pub *pubSocket) {
	var burned uint64
	var pos statedir.Position
	p.items, burned, pos = p.q.take(p.items[:0], p.cfg.MaxBatch)
	p.seq += burned
	p.advance(pos)
	if len(p.items) == 0 {
		p.lastSeq.Store(p.seq)
		return
	}
	p.seq++
	span := p.publishSpan(len(p.items))
	defer span.End()
	ts := p.now().UnixMilli()
	p.evs = p.evs[:0]
	for _, it := range p.items {
		p.nextID++
		p.evs = append(p.evs, kvevent.Event{ID: p.nextID, Timestamp: ts, Type: it.typ, Tenant: it.tenant, Key: it.key, Medium: it.medium, GroupID: it.group})
	}
	clear(p.items)
	// Encode into the reused scratch buffer, after room for the longest
	// frame headers and the topic (p.headroom), which are then written in
	// front of the payload; the message is then copied out at its exact
	// size (the ring and the subscriber queues keep it). A message buffer
	// allocated ahead had to be sized by guess (the last size + 25%), all
	// of it zeroed and kept.
	buf, err := p.enc.AppendBatch(p.scratch[:p.headroom], ts, p.evs)
	p.scratch = buf[:0]
	if err != nil {
		// Enqueue validated every event, so this is a bug; the sequence
		// number stays burned so the loss is visible.
		p.encodeDrops.Add(uint64(len(p.items)))
		p.lastSeq.Store(p.seq)
		clear(p.evs)
		p.lg.Error("kv event batch failed to encode", "seq", p.seq, "err", err)
		return
	}
	p.send(pub, buf, ts, p.evs)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Bytes.Int(len(buf)-p.headroom), attrSeq.Int64(int64(p.seq)))
	}
	clear(p.evs) // keep no strings alive
}

// tracer makes the gateway's publish, replay and snapshot spans.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/gateway/publisher")

// attrSeq is the batch sequence number a span published or a replay
// started from.
const attrSeq = attribute.Key("crescent.kv.seq")

// publishSpan starts the span of one batch of n events: a trace of its
// own (ZMQ carries no context), linked to the spans that recorded the
// changes behind its events (at most tracectx.MaxLinks; none with tracing
// off), so a put's trace leads to the batch that announced it.
func (p *Publisher) publishSpan(n int) trace.Span {
	p.links = p.q.linksTaken(p.links[:0])
	opts := tracectx.ProducerKind
	if len(p.links) > 0 {
		opts = append(opts[:len(opts):len(opts)], trace.WithLinks(tracectx.Links(p.links)...))
	}
	_, span := tracer.Start(context.Background(), "gateway.publish", opts...)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Items.Int(n))
	}
	return span
}

// heartbeat publishes a batch with no events (FormatSnapshot): it takes
// the next sequence number and a pending master position, and is
// journaled, retained and recorded like any batch.
func (p *Publisher) heartbeat(pub *pubSocket) {
	_, burned, pos := p.q.take(nil, 0)
	p.seq += burned + 1
	p.advance(pos)
	ts := p.now().UnixMilli()
	buf, _ := p.enc.AppendHeartbeat(p.scratch[:p.headroom], max(ts, 0))
	p.scratch = buf[:0]
	p.heartbeats.Add(1)
	p.send(pub, buf, ts, nil)
}

// send frames the payload at buf[p.headroom:] as batch p.seq, journals
// it, hands it to the replay ring and then to the subscribers (in that
// order: a subscriber whose subscription took effect too late for the
// batch finds it in the ring; see subConn.readLoop), and records it.
func (p *Publisher) send(pub *pubSocket, buf []byte, ts int64, evs []kvevent.Event) {
	wire := bytes.Clone(frameMessage(buf, p.cfg.Topic, p.seq, p.suffix))
	if p.runJournal != nil {
		payload := wire[len(wire)-(len(buf)-p.headroom):]
		p.appendJournal(statedir.Record{Seq: p.seq, Master: p.pos, LastEventID: p.nextID, UnixMilli: ts, Payload: payload})
	}
	p.ring.add(p.seq, wire)
	pub.broadcast(wire)
	// lastSeq first: whoever sees the event count sees its sequence too.
	p.lastSeq.Store(p.seq)
	p.batches.Add(1)
	p.events.Add(uint64(len(evs)))
	p.lastSend = time.Now() // not p.now: heartbeats follow the clock, whatever the timestamps
	if p.runRecorder != nil {
		p.runRecorder.Record(p.seq, p.pos, p.nextID, evs)
	}
}

// appendJournal appends rec; a failure is counted and logged once per run
// of failures, and the batch is published all the same (availability
// first: the journal marks the persisted state invalid itself).
func (p *Publisher) appendJournal(rec statedir.Record) {
	err := p.runJournal.Append(rec)
	switch {
	case err != nil:
		p.journalErrs.Add(1)
		if p.journalBurst++; p.journalBurst == 1 {
			p.lg.Error("journal append failed; publishing without it", "seq", rec.Seq, "err", err)
		}
	case p.journalBurst > 0:
		p.lg.Warn("journal appends succeed again", "seq", rec.Seq, "failed", p.journalBurst)
		p.journalBurst = 0
	}
}

// Enqueue queues events for publishing. It never blocks: when the queue is
// full the oldest events are dropped (see the package doc). Per-object
// events are counted and skipped when ObjectKey is off; invalid events
// (unknown type, per-object without medium) are logged and skipped.
func (p *Publisher) Enqueue(evs ...kvevent.Event) { p.EnqueueAt(statedir.Position{}, evs...) }

// EnqueueAt is Enqueue with pos, the master position after these events
// (zero: none). The batch that publishes the last of them carries pos; a
// call without events (or whose events are all skipped) still advances the
// position of the next batch (or heartbeat).
func (p *Publisher) EnqueueAt(pos statedir.Position, evs ...kvevent.Event) {
	p.EnqueueLinkedAt(pos, nil, evs...)
}

// EnqueueLinkedAt is EnqueueAt for events whose changes were recorded
// under links (sampled spans at the master): the batch publishing the
// last of them links its span to them.
func (p *Publisher) EnqueueLinkedAt(pos statedir.Position, links []trace.SpanContext, evs ...kvevent.Event) {
	p.enqMu.Lock()
	defer p.enqMu.Unlock()
	items := p.enqBuf[:0]
	for i := range evs {
		if it, ok := p.item(&evs[i]); ok {
			items = append(items, it)
		}
	}
	// One push: the events of one call are queued (or dropped) together.
	p.q.pushLinked(items, pos, links)
	clear(items) // keep no strings alive
	p.enqBuf = items[:0]
}

// EnqueueWait queues events without dropping: it waits for room, honouring
// ctx. A bulk producer (a resync diff) uses it so it cannot overrun the
// queue and drop the live events before it.
func (p *Publisher) EnqueueWait(ctx context.Context, evs ...kvevent.Event) error {
	return p.EnqueueWaitAt(ctx, statedir.Position{}, evs...)
}

// EnqueueWaitAt is EnqueueWait with pos, the master position after these
// events, as EnqueueAt. When ctx ends first, pos is not taken.
func (p *Publisher) EnqueueWaitAt(ctx context.Context, pos statedir.Position, evs ...kvevent.Event) error {
	items := make([]item, 0, len(evs))
	for i := range evs {
		if it, ok := p.item(&evs[i]); ok {
			items = append(items, it)
		}
	}
	return p.q.pushWait(ctx, items, pos)
}

func (p *Publisher) item(ev *kvevent.Event) (item, bool) {
	switch {
	case ev.Type == kvevent.Cleared:
		return item{typ: ev.Type, tenant: ev.Tenant}, true
	case ev.Type.PerObject() && (ev.Medium == kvevent.MediumCPU || ev.Medium == kvevent.MediumDisk):
		if !p.enc.Emits(ev.Type) {
			p.skipped.Add(1)
			return item{}, false
		}
		return item{typ: ev.Type, tenant: ev.Tenant, key: ev.Key, medium: ev.Medium, group: ev.GroupID}, true
	default:
		p.lg.Error("invalid kv event skipped", "type", ev.Type.String(), "medium", ev.Medium.String(), "tenant", ev.Tenant)
		return item{}, false
	}
}

// Stats returns a snapshot of the counters.
func (p *Publisher) Stats() Stats {
	pushed, dropped, depth := p.q.counts()
	s := Stats{
		Enabled:              p.enabled.Load(),
		PublishedBatches:     p.batches.Load(),
		PublishedEvents:      p.events.Load(),
		DroppedEvents:        dropped + p.encodeDrops.Load(),
		SkippedKeylessEvents: p.skipped.Load(),
		EnqueuedEvents:       pushed,
		HeartbeatsSent:       p.heartbeats.Load(),
		LastSequence:         p.lastSeq.Load(),
		QueueDepth:           depth,
		Format:               p.cfg.Format,
		Epoch:                p.epoch,
		Holding:              p.holding.Load(),
		JournalErrors:        p.journalErrs.Load(),
		ReplayBatches:        p.ring.len(),
	}
	s.NextSequence = s.LastSequence + 1
	p.posMu.Lock()
	s.Position = p.lastPos
	p.posMu.Unlock()
	p.mu.Lock()
	pub, replay, snapshot := p.pub, p.replay, p.snapshot
	p.mu.Unlock()
	if pub != nil {
		s.Subscribers = pub.subscribers()
		if !s.Enabled && p.running.Load() {
			s.Subscribers = int(p.subsAtStop.Load())
		}
		s.SubscriberDroppedBatches = pub.droppedBatches.Load()
		s.SubscriberUnansweredPings = pub.unanswered.Load()
		s.PeersRefused += pub.refused.Load()
		s.PeersDropped += pub.dropped.Load()
	}
	if replay != nil {
		s.ReplayRequests = replay.requests.Load()
		s.PeersRefused += replay.refused.Load()
		s.PeersDropped += replay.dropped.Load()
	}
	if snapshot != nil {
		s.SnapshotRequests = snapshot.requests.Load()
		s.SnapshotsServed = snapshot.served.Load()
		s.SnapshotErrors = snapshot.errors.Load()
		s.PeersRefused += snapshot.refused.Load()
		s.PeersDropped += snapshot.dropped.Load()
	}
	return s
}

// Close releases the listeners when Run was never called. Idempotent.
func (p *Publisher) Close() {
	if p.running.Load() {
		return // Run closes its sockets when its context ends
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub != nil {
		p.pub.l.Close()
	}
	if p.replay != nil {
		p.replay.l.Close()
	}
	if p.snapshot != nil {
		p.snapshot.l.Close()
	}
}
