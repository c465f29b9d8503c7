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
package publisher

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
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
}

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

// Stats are the publisher's counters.
type Stats struct {
	// Enabled: the PUB socket is bound and the publishing goroutine runs.
	Enabled bool
	// PublishedBatches are messages handed to the PUB socket;
	// PublishedEvents the events inside them.
	PublishedBatches, PublishedEvents uint64
	// DroppedEvents were dropped by the full queue, each burning a sequence number.
	DroppedEvents uint64
	// SkippedKeylessEvents are stored/removed events suppressed by ObjectKey=false.
	SkippedKeylessEvents uint64
	// EnqueuedEvents were accepted into the queue; each is eventually
	// published or dropped (Enqueued = Published + Dropped + QueueDepth,
	// except for the batch being encoded).
	EnqueuedEvents uint64
	// LastSequence is the last sequence number assigned (burned or sent).
	LastSequence uint64
	QueueDepth   int
	// ReplayBatches are batches held by the replay ring.
	ReplayBatches int
	// Subscribers are connections subscribed to the stream.
	Subscribers int
	// SubscriberDroppedBatches were discarded from slow subscribers' queues.
	SubscriberDroppedBatches uint64
	ReplayRequests           uint64
	// PeersRefused are PUB and replay connections closed as they were
	// accepted: over MaxSubscribers, or over ReplayMaxConnsPerPeer.
	PeersRefused uint64
	// PeersDropped are PUB and replay connections closed for what the peer
	// did: a failed or timed-out handshake, an oversized or malformed frame,
	// or (replay) no request within ReplayIdleTimeout.
	PeersDropped uint64
}

// Publisher owns the event queue, the sequence and the sockets.
type Publisher struct {
	cfg  Config
	lg   *slog.Logger
	enc  *kvevent.Encoder
	q    *queue
	ring *ring
	now  func() time.Time

	batches, events, skipped, encodeDrops, lastSeq atomic.Uint64
	enabled                                        atomic.Bool

	// mu guards pub, replay.
	mu     sync.Mutex
	pub    *pubSocket
	replay *replaySocket

	// enqMu guards enqBuf, the items of one Enqueue call.
	enqMu  sync.Mutex
	enqBuf []item

	// Owned by the publishing goroutine.
	seq     uint64
	nextID  uint64
	items   []item
	evs     []kvevent.Event
	scratch []byte // a message is encoded here, then copied out at its size

	running atomic.Bool
}

// New builds a publisher. It does no I/O.
func New(cfg Config, lg *slog.Logger) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Publisher{
		cfg: cfg, lg: lg, enc: kvevent.NewEncoder(cfg.Encoder),
		q: newQueue(cfg.QueueCapacity), ring: newRing(cfg.ReplayBuffer, cfg.ReplayBufferBytes),
		now: time.Now, scratch: make([]byte, 0, 32<<10),
	}, nil
}

// Listen binds the PUB and replay sockets (Run calls it when needed), so
// callers and tests learn the bound endpoints first.
func (p *Publisher) Listen() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub == nil {
		l, err := zmtp.Listen(p.cfg.PubEndpoint)
		if err != nil {
			return fmt.Errorf("pub listen %s: %w", p.cfg.PubEndpoint, err)
		}
		p.pub = newPubSocket(p.lg, l, p.cfg.SubQueueBatches, p.cfg.SubQueueBytes, p.cfg.MaxSubscribers, p.cfg.HandshakeTimeout, p.cfg.SubWriteTimeout)
	}
	if p.replay == nil && p.cfg.ReplayEndpoint != "" {
		l, err := zmtp.Listen(p.cfg.ReplayEndpoint)
		if err != nil {
			return fmt.Errorf("replay listen %s: %w", p.cfg.ReplayEndpoint, err)
		}
		p.replay = newReplaySocket(p.lg, l, p.ring, p.cfg)
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

// Run binds (if needed), serves the sockets and publishes until ctx ends;
// then it publishes what is still queued and closes the sockets. It may be
// called once.
func (p *Publisher) Run(ctx context.Context) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("publisher: Run called twice")
	}
	if err := p.Listen(); err != nil {
		return err
	}
	p.mu.Lock()
	pub, replay := p.pub, p.replay
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(pub.serve)
	if replay != nil {
		wg.Go(replay.serve)
	}
	p.enabled.Store(true)
	p.lg.Info("kv event publisher running", "pub", p.PubEndpoint(), "replay", p.ReplayEndpoint())
	p.loop(ctx, pub)
	// Publish what the source already handed us, then stop.
	for p.q.len() > 0 {
		p.publishNext(pub)
	}
	p.enabled.Store(false)
	pub.close()
	if replay != nil {
		replay.close()
	}
	wg.Wait()
	return nil
}

// loop is the only goroutine that numbers, encodes and sends batches.
func (p *Publisher) loop(ctx context.Context, pub *pubSocket) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		for p.q.len() == 0 {
			select {
			case <-ctx.Done():
				return
			case <-p.q.notify:
			}
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

// publishNext takes up to MaxBatch events and publishes them as one message.
func (p *Publisher) publishNext(pub *pubSocket) {
	var burned uint64
	p.items, burned = p.q.take(p.items[:0], p.cfg.MaxBatch)
	p.seq += burned
	if len(p.items) == 0 {
		p.lastSeq.Store(p.seq)
		return
	}
	p.seq++
	ts := p.now().UnixMilli()
	p.evs = p.evs[:0]
	for _, it := range p.items {
		p.nextID++
		p.evs = append(p.evs, kvevent.Event{ID: p.nextID, Type: it.typ, Tenant: it.tenant, Key: it.key, Medium: it.medium, GroupID: it.group})
	}
	clear(p.items)
	// Encode into the reused scratch buffer, after room for the longest
	// frame headers, which are then written in front of the payload; the
	// message is then copied out at its exact size (the ring and the
	// subscriber queues keep it). A message buffer allocated ahead had to
	// be sized by guess (the last size + 25%), all of it zeroed and kept.
	buf, err := p.enc.AppendBatch(p.scratch[:wireHeadroom], ts, p.evs)
	p.scratch = buf[:0]
	clear(p.evs)
	if err != nil {
		// Enqueue validated every event, so this is a bug; the sequence
		// number stays burned so the loss is visible.
		p.encodeDrops.Add(uint64(len(p.items)))
		p.lastSeq.Store(p.seq)
		p.lg.Error("kv event batch failed to encode", "seq", p.seq, "err", err)
		return
	}
	wire := bytes.Clone(frameInPlace(buf, p.seq))
	pub.broadcast(wire)
	p.ring.add(p.seq, wire)
	// lastSeq first: whoever sees the event count sees its sequence too.
	p.lastSeq.Store(p.seq)
	p.batches.Add(1)
	p.events.Add(uint64(len(p.items)))
}

// wireHeadroom fits the frame headers of [topic, seq, payload]: 2 for the
// empty topic, 2+8 for the sequence, 9 for a long payload header.
const wireHeadroom = 2 + 2 + 8 + 9

// frameInPlace writes the ZMTP headers of [b"", seq, payload] in front of
// the payload at buf[wireHeadroom:] and returns the message's wire bytes
// (identical to zmtp.AppendMessage(nil, nil, seq8, payload)).
func frameInPlace(buf []byte, seq uint64) []byte {
	n := len(buf) - wireHeadroom
	start := 0
	if n <= 255 {
		start = 7 // a short payload header takes 2 bytes, not 9
	}
	w := buf[start:wireHeadroom]
	w[0], w[1] = 0x01, 0 // topic: MORE, empty
	w[2], w[3] = 0x01, 8 // sequence: MORE, 8 bytes
	binary.BigEndian.PutUint64(w[4:12], seq)
	if n <= 255 {
		w[12], w[13] = 0, byte(n)
	} else {
		w[12] = 0x02 // LONG
		binary.BigEndian.PutUint64(w[13:21], uint64(n))
	}
	return buf[start:]
}

// Enqueue queues events for publishing. It never blocks: when the queue is
// full the oldest events are dropped (see the package doc). Per-object
// events are counted and skipped when ObjectKey is off; invalid events
// (unknown type, per-object without medium) are logged and skipped.
func (p *Publisher) Enqueue(evs ...kvevent.Event) {
	p.enqMu.Lock()
	defer p.enqMu.Unlock()
	items := p.enqBuf[:0]
	for i := range evs {
		if it, ok := p.item(&evs[i]); ok {
			items = append(items, it)
		}
	}
	// One push: the events of one call are queued (or dropped) together.
	p.q.push(items)
	clear(items) // keep no strings alive
	p.enqBuf = items[:0]
}

// EnqueueWait queues events without dropping: it waits for room, honouring
// ctx. A bulk producer (a resync diff) uses it so it cannot overrun the
// queue and drop the live events before it.
func (p *Publisher) EnqueueWait(ctx context.Context, evs ...kvevent.Event) error {
	items := make([]item, 0, len(evs))
	for i := range evs {
		if it, ok := p.item(&evs[i]); ok {
			items = append(items, it)
		}
	}
	return p.q.pushWait(ctx, items)
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
		LastSequence:         p.lastSeq.Load(),
		QueueDepth:           depth,
		ReplayBatches:        p.ring.len(),
	}
	p.mu.Lock()
	pub, replay := p.pub, p.replay
	p.mu.Unlock()
	if pub != nil {
		s.Subscribers = pub.subscribers()
		s.SubscriberDroppedBatches = pub.droppedBatches.Load()
		s.PeersRefused += pub.refused.Load()
		s.PeersDropped += pub.dropped.Load()
	}
	if replay != nil {
		s.ReplayRequests = replay.requests.Load()
		s.PeersRefused += replay.refused.Load()
		s.PeersDropped += replay.dropped.Load()
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
}
