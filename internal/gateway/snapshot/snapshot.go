// Package snapshot is the gateway's recorder (issue 13, see
// docs/gateway-state.md): a goroutine that folds every batch the publisher
// sent into its own announced set, so that at any moment it knows exactly
// the set after the last folded sequence number (the cut). From that set it
// builds snapshot replies for late joiners and writes checkpoints.
//
// Neither blocks the publisher. The publisher hands each sent batch to
// Record, which copies it into a bounded queue and returns; the recorder's
// goroutine (Run) folds the queue, builds replies and writes checkpoints
// while Record keeps queueing. If the queue overflows, the recorder fails:
// its set no longer matches what was published, so it answers snapshots
// with an error and stops checkpointing (the journal still holds every
// batch, so a restart recovers).
package snapshot

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"iter"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// Config configures a Recorder.
type Config struct {
	// Epoch is the publisher epoch of a gateway that starts without usable
	// state. Restore replaces it with the restored one.
	Epoch statedir.Epoch
	// QueueBatches bounds the batches Record has queued and Run has not
	// yet folded (65536). Overflow fails the recorder.
	QueueBatches int
	// MaxWaiting bounds the Snapshot calls waiting for the next build (32);
	// one more gets ErrBusy at once.
	MaxWaiting int
	// MaxReplyBytes bounds a reply, all frames together (256 MiB); a larger
	// one is not sent (ErrTooLarge).
	MaxReplyBytes int
	// CheckpointInterval is how often a checkpoint is written when the cut
	// advanced (10 s); 0 writes one only when Run stops.
	CheckpointInterval time.Duration
	// CheckpointAfterChanges writes a checkpoint as soon as that many
	// events (100000) were folded since the last one and at least half as
	// many as the set holds, without waiting for CheckpointInterval (even
	// when it is 0): after a large resync, a crash then replays a journal
	// of at most about half the set, not all of it. The second condition
	// bounds the cost: a checkpoint of n entries follows at least n/2
	// changes. 0 writes checkpoints only by interval and at stop.
	CheckpointAfterChanges int
	// Encoder is the envelope and switches of the live stream: the chunks
	// of a reply are payloads of the same stream.
	Encoder kvevent.EncoderOptions
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		QueueBatches:           65536,
		MaxWaiting:             32,
		MaxReplyBytes:          256 << 20,
		CheckpointInterval:     10 * time.Second,
		CheckpointAfterChanges: 100000,
		Encoder:                kvevent.EncoderOptions{LegacyCompat: true, ObjectKey: true},
	}
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if c.QueueBatches < 1 {
		errs = append(errs, fmt.Errorf("recorder-queue must be >= 1, got %d", c.QueueBatches))
	}
	if c.MaxWaiting < 1 {
		errs = append(errs, fmt.Errorf("snapshot-max-waiting must be >= 1, got %d", c.MaxWaiting))
	}
	if c.MaxReplyBytes < frameHeaderBytes {
		errs = append(errs, fmt.Errorf("snapshot-max-bytes must be >= %d, got %d", frameHeaderBytes, c.MaxReplyBytes))
	}
	if c.CheckpointInterval < 0 {
		errs = append(errs, fmt.Errorf("checkpoint interval must be >= 0, got %v", c.CheckpointInterval))
	}
	if c.CheckpointAfterChanges < 0 {
		errs = append(errs, fmt.Errorf("checkpoint-after-changes must be >= 0, got %d", c.CheckpointAfterChanges))
	}
	if c.Encoder.Envelope.BackendID == "" {
		errs = append(errs, errors.New("encoder: backend_id is required"))
	}
	return errors.Join(errs...)
}

// Checkpointer persists a checkpoint: the header and every entry of the
// set it describes. It is called on the recorder's goroutine; entries is
// valid only during the call. While it runs nothing is folded (Record keeps
// queueing), so it must take well under QueueBatches batches' time.
type Checkpointer interface {
	WriteCheckpoint(h statedir.Header, entries iter.Seq[kvevent.Event]) error
}

// Deps are the recorder's collaborators.
type Deps struct {
	// Checkpointer writes checkpoints; nil persists nothing.
	Checkpointer Checkpointer
	// Subscribers returns the number of PUB subscribers (Header.Subscribers);
	// nil is 0.
	Subscribers func() int
	// Now is the clock of chunk timestamps and checkpoint headers; nil is
	// time.Now.
	Now func() time.Time
}

// Errors Snapshot returns. Every one of them is answered with the
// "unavailable" cut (-2).
var (
	// ErrFailed: the recorder's queue overflowed (or Record was misused);
	// its set no longer matches what was published, for the rest of the
	// process.
	ErrFailed = errors.New("snapshot: recorder failed")
	// ErrBusy: MaxWaiting requests already wait for the next build.
	ErrBusy = errors.New("snapshot: too many waiting requests")
	// ErrTooLarge: the reply would exceed MaxReplyBytes.
	ErrTooLarge = errors.New("snapshot: reply exceeds the size limit")
	// ErrStopped: Run has returned.
	ErrStopped = errors.New("snapshot: recorder stopped")
)

// Stats are the recorder's counters.
type Stats struct {
	// Cut is the last folded sequence number, -1 before any.
	Cut int64
	// Entries is the size of the recorder's set.
	Entries int
	// QueueDepth is the number of batches queued that Run has not taken up
	// yet.
	QueueDepth int
	// Failed reports the recorder failed (see ErrFailed).
	Failed bool
	// SnapshotsBuilt counts replies built (each may serve many requests).
	SnapshotsBuilt uint64
	// SnapshotsReused counts requests served with the chunks of an earlier
	// build because no event was folded since (see Snapshot).
	SnapshotsReused uint64
	// SnapshotRequests counts Snapshot calls; SnapshotErrors those that
	// returned an error.
	SnapshotRequests uint64
	SnapshotErrors   uint64
	// LastBuildDuration and LastReplyBytes describe the last reply built.
	LastBuildDuration time.Duration
	LastReplyBytes    int
	// Checkpoints and CheckpointErrors count WriteCheckpoint calls that
	// succeeded and failed.
	Checkpoints      uint64
	CheckpointErrors uint64
	// LastCheckpointUnixMilli is the header time of the last checkpoint
	// written (0: none).
	LastCheckpointUnixMilli int64
	// BufferBytes is the memory of reply buffers held: replies being
	// sent, the last reply, and the free list (see reply.go).
	BufferBytes int64
}

// Recorder folds published batches into its own announced set and serves
// snapshots and checkpoints from it. Record and Snapshot may be called from
// any goroutine; Restore only before Run and Record.
type Recorder struct {
	cfg  Config
	deps Deps
	lg   *slog.Logger
	enc  *kvevent.Encoder
	// evFixed bounds the encoded size of one stored event without its
	// tenant, key and group bytes (a first reply's size estimate).
	evFixed int

	wake    chan struct{} // Record queued into an empty queue (or failed)
	reqWake chan struct{} // a Snapshot request waits

	// mu guards the queue, the sequence check and the failure flag: what
	// Record touches. Run holds it only to swap the queue out or recycle
	// its blocks, never while folding, building or checkpointing.
	mu       sync.Mutex
	items    []item  // queued batches, oldest first
	inUse    [][]rec // the blocks items' events live in; cur is the last
	cur      []rec   // the block Record appends to (nil: none yet)
	free     [][]rec // cleared blocks for reuse
	spareIts []item  // the other half of items' double buffer
	spareBls [][]rec
	lastSeq  uint64 // the last sequence Record accepted (or Restore set)
	haveSeq  bool
	queued   bool // Record was called: Restore is too late
	failed   bool
	epoch    statedir.Epoch

	// wmu guards the waiting requests.
	wmu     sync.Mutex
	waiting []*waiter
	stopped bool

	started atomic.Bool
	// recordedEvents counts the events Record queued: a build rests while
	// it moves (live traffic, see buildRest).
	recordedEvents atomic.Uint64

	// pmu guards the reply buffers (reply.go): freeSegs, pooling,
	// freeLimit and every replyBufs' refs and stale. It is never held
	// with mu or wmu.
	pmu       sync.Mutex
	freeSegs  [][]byte // segments of released replies, for the next build
	pooling   bool     // released segments go to freeSegs (false once idle)
	freeLimit int      // see maxFreeLocked

	// Owned by Run (after Restore).
	set         *announced.Set
	cut         int64 // -1: nothing folded
	pos         statedir.Position
	lastEventID uint64
	dirty       bool   // the set or cut changed since the last checkpoint
	changes     int    // events folded since the last checkpoint
	version     uint64 // events folded ever: while it stays, the set does
	last        lastReply
	chunkEnc    chunkEncoder
	lastBytes   int // size of the last reply (a first segment's size hint)

	stats struct {
		cut, entries                atomic.Int64
		failed                      atomic.Bool
		built, requests, reqErrors  atomic.Uint64
		reused                      atomic.Uint64
		buildNanos, replyBytes      atomic.Int64
		checkpoints, checkpointErrs atomic.Uint64
		lastCheckpoint              atomic.Int64
		bufferBytes                 atomic.Int64
	}
}

// rec is one queued event: what folding reads of a kvevent.Event.
type rec struct {
	tenant, key, group string
	typ                kvevent.EventType
	medium             kvevent.Medium
}

// item is one queued batch.
type item struct {
	seq, lastEventID uint64
	pos              statedir.Position
	evs              []rec // in a block of inUse
}

type waiter struct {
	done  chan result
	state atomic.Int32 // waiterWaiting, then waiterServed (by serve) or waiterGone (by the caller)
}

const (
	waiterWaiting = iota
	waiterServed  // serve took a reference for it and sends its result
	waiterGone    // the caller's context ended first
)

type result struct {
	frames [][]byte
	bufs   *replyBufs // nil: nothing to release
	err    error
}

const (
	// blockRecs is the number of events in a queue block (about 224 KiB).
	blockRecs = 4096
	// maxFreeBlocks bounds the blocks kept for reuse after a backlog.
	maxFreeBlocks = 16
	// frameHeaderBytes is the cut and epoch frames.
	frameHeaderBytes = 8 + statedir.EpochLen
)

// New returns a recorder of an empty set under cfg.Epoch (see Restore).
func New(cfg Config, deps Deps, lg *slog.Logger) (*Recorder, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if deps.Now == nil {
		deps.Now = time.Now
	}
	if lg == nil {
		lg = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	r := &Recorder{
		cfg:     cfg,
		deps:    deps,
		lg:      lg,
		enc:     kvevent.NewEncoder(cfg.Encoder),
		wake:    make(chan struct{}, 1),
		reqWake: make(chan struct{}, 1),
		epoch:   cfg.Epoch,
		set:     announced.New(),
		cut:     -1,
	}
	// The largest a stored event can encode to with empty strings: the
	// largest event_id and timestamp (the batch's own few bytes make it
	// larger still).
	b, err := r.enc.AppendBatch(nil, math.MaxInt64, []kvevent.Event{{ID: math.MaxUint64, Type: kvevent.Stored, Medium: kvevent.MediumDisk}})
	if err != nil {
		return nil, fmt.Errorf("snapshot: encoder: %w", err)
	}
	r.evFixed = len(b)
	r.stats.cut.Store(-1)
	return r, nil
}

// Restore starts the recorder from persisted state instead of an empty
// set: the publisher epoch, the last sequence number folded into set (0:
// none, and then set must be empty: a reply of cut -1 has no chunks), that
// batch's master position and last event_id. The recorder
// takes set over; the caller must not use it afterwards. Call it before Run
// and before the first Record.
func (r *Recorder) Restore(epoch statedir.Epoch, seq uint64, pos statedir.Position, lastEventID uint64, set *announced.Set) {
	if r.started.Load() {
		panic("snapshot: Restore after Run")
	}
	if seq > math.MaxInt64 {
		panic(fmt.Sprintf("snapshot: Restore at sequence %d", seq))
	}
	if seq == 0 && set != nil && set.Len() > 0 {
		panic(fmt.Sprintf("snapshot: Restore of %d entries at sequence 0", set.Len()))
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.queued {
		panic("snapshot: Restore after Record")
	}
	if set == nil {
		set = announced.New()
	}
	r.epoch = epoch
	r.lastSeq, r.haveSeq = seq, seq > 0
	r.set, r.pos, r.lastEventID = set, pos, lastEventID
	r.cut = -1
	if seq > 0 {
		r.cut = int64(seq)
	}
	r.dirty = true // what the state directory holds may be older (journal replay)
	r.stats.cut.Store(r.cut)
	r.stats.entries.Store(int64(set.Len()))
}

// Epoch returns the publisher epoch.
func (r *Recorder) Epoch() statedir.Epoch {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.epoch
}

// Record queues a batch the publisher sent: its sequence number (above the
// last one recorded; gaps are fine), master position, last event_id and
// events (none for a heartbeat). It copies what it needs of evs and never
// blocks: a full queue fails the recorder instead.
func (r *Recorder) Record(seq uint64, pos statedir.Position, lastEventID uint64, evs []kvevent.Event) {
	r.mu.Lock()
	r.queued = true
	if r.failed {
		r.mu.Unlock()
		return
	}
	var reason string
	switch {
	case seq > math.MaxInt64 || (r.haveSeq && seq <= r.lastSeq):
		reason = fmt.Sprintf("sequence %d recorded after %d", seq, r.lastSeq)
	case len(r.items) >= r.cfg.QueueBatches:
		reason = fmt.Sprintf("queue full (%d batches): the recorder fell behind the publisher", len(r.items))
	}
	if reason != "" {
		r.failLocked()
		r.mu.Unlock()
		r.lg.Error("snapshot recorder failed; snapshots are unavailable and checkpoints stop until restart",
			"reason", reason, "seq", seq)
		select {
		case r.wake <- struct{}{}:
		default:
		}
		return
	}
	r.lastSeq, r.haveSeq = seq, true
	it := item{seq: seq, pos: pos, lastEventID: lastEventID}
	if len(evs) > 0 {
		cur := r.cur
		if cap(cur)-len(cur) < len(evs) {
			cur = r.blockLocked(len(evs))
		}
		start := len(cur)
		for i := range evs {
			e := &evs[i]
			cur = append(cur, rec{tenant: e.Tenant, key: e.Key, group: e.GroupID, typ: e.Type, medium: e.Medium})
		}
		it.evs = cur[start:len(cur):len(cur)]
		r.cur = cur
	}
	first := len(r.items) == 0
	r.items = append(r.items, it)
	r.mu.Unlock()
	if len(evs) > 0 {
		r.recordedEvents.Add(uint64(len(evs)))
	}
	if first {
		select {
		case r.wake <- struct{}{}:
		default:
		}
	}
}

// blockLocked starts a new block of at least n events and returns it.
func (r *Recorder) blockLocked(n int) []rec {
	var b []rec
	if k := len(r.free); k > 0 && n <= blockRecs {
		b, r.free = r.free[k-1][:0], r.free[:k-1]
	} else {
		b = make([]rec, 0, max(n, blockRecs))
	}
	r.inUse = append(r.inUse, b)
	r.cur = b
	return b
}

// failLocked fails the recorder and drops its queue.
func (r *Recorder) failLocked() {
	r.failed = true
	r.stats.failed.Store(true)
	clear(r.items)
	r.items, r.inUse, r.cur, r.free = nil, nil, nil, nil
}

// Stats returns the counters.
func (r *Recorder) Stats() Stats {
	r.mu.Lock()
	depth := len(r.items)
	r.mu.Unlock()
	return Stats{
		Cut:                     r.stats.cut.Load(),
		Entries:                 int(r.stats.entries.Load()),
		QueueDepth:              depth,
		Failed:                  r.stats.failed.Load(),
		SnapshotsBuilt:          r.stats.built.Load(),
		SnapshotsReused:         r.stats.reused.Load(),
		SnapshotRequests:        r.stats.requests.Load(),
		SnapshotErrors:          r.stats.reqErrors.Load(),
		LastBuildDuration:       time.Duration(r.stats.buildNanos.Load()),
		LastReplyBytes:          int(r.stats.replyBytes.Load()),
		Checkpoints:             r.stats.checkpoints.Load(),
		CheckpointErrors:        r.stats.checkpointErrs.Load(),
		LastCheckpointUnixMilli: r.stats.lastCheckpoint.Load(),
		BufferBytes:             r.stats.bufferBytes.Load(),
	}
}

// Snapshot returns a reply: the cut (int64 big-endian, -1 before anything
// was recorded), the 16-byte epoch, then the set as payloads of at most 64
// stored events each, with event_id 0. The frames are the caller's: they
// are copies, the recorder's own buffers go back to it (Reply serves
// without copying). Requests are served
// together: the recorder folds everything queued when it takes them, then
// builds one reply for all of them. The cut always covers every batch
// recorded before the request: if no event was folded since the last
// build (no batch, or only heartbeats) and its reply is still held, that
// reply is served again, under the new cut if heartbeats advanced it
// (Stats.SnapshotsReused); otherwise a new one is built.
func (r *Recorder) Snapshot(ctx context.Context) ([][]byte, error) {
	frames, release, err := r.Reply(ctx)
	if err != nil {
		return nil, err
	}
	defer release()
	out := make([][]byte, len(frames))
	for i, f := range frames {
		out[i] = bytes.Clone(f)
	}
	return out, nil
}

// Reply is Snapshot for a caller that sends the frames and is then done
// with them: it calls release exactly once when it no longer reads them
// (the reply was written, or the write failed), and the recorder may then
// reuse their buffers for a later build. release is nil when err is not.
// Reusing the buffers keeps a reply of a large set (300 MB for a million
// entries) from becoming garbage at every request; the recorder drops the
// buffers it holds once no request came for replyIdle.
func (r *Recorder) Reply(ctx context.Context) (frames [][]byte, release func(), err error) {
	r.stats.requests.Add(1)
	res := r.snapshot(ctx)
	if res.err != nil {
		r.stats.reqErrors.Add(1)
		return nil, nil, res.err
	}
	return res.frames, r.releaser(res.bufs), nil
}

func (r *Recorder) snapshot(ctx context.Context) result {
	if r.stats.failed.Load() {
		return result{err: ErrFailed}
	}
	if err := ctx.Err(); err != nil {
		return result{err: err}
	}
	w := &waiter{done: make(chan result, 1)}
	r.wmu.Lock()
	switch {
	case r.stopped:
		r.wmu.Unlock()
		return result{err: ErrStopped}
	case len(r.waiting) >= r.cfg.MaxWaiting:
		r.wmu.Unlock()
		return result{err: ErrBusy}
	}
	r.waiting = append(r.waiting, w)
	r.wmu.Unlock()
	select {
	case r.reqWake <- struct{}{}:
	default:
	}
	select {
	case res := <-w.done:
		return res
	case <-ctx.Done():
		if !w.state.CompareAndSwap(waiterWaiting, waiterGone) {
			// serve took a reference for this request: its result is
			// on its way and holds it.
			res := <-w.done
			if res.err == nil {
				r.releaser(res.bufs)()
			}
			return result{err: ctx.Err()}
		}
		r.wmu.Lock()
		r.waiting = slices.DeleteFunc(r.waiting, func(x *waiter) bool { return x == w })
		r.wmu.Unlock()
		return result{err: ctx.Err()}
	}
}

// Run folds the queue, serves snapshot requests and writes checkpoints
// until ctx ends; then it folds what is queued, writes a last checkpoint
// and returns nil. A failed recorder keeps running (answering ErrFailed).
func (r *Recorder) Run(ctx context.Context) error {
	if r.started.Swap(true) {
		return errors.New("snapshot: Run called twice")
	}
	var tick <-chan time.Time
	if r.cfg.CheckpointInterval > 0 {
		t := time.NewTicker(r.cfg.CheckpointInterval)
		defer t.Stop()
		tick = t.C
	}
	idle := time.NewTimer(replyIdle) // see dropReplies
	defer idle.Stop()
	for {
		select {
		case <-ctx.Done():
			r.drain()
			r.checkpoint()
			r.stop()
			return nil
		case <-r.wake:
			r.drain()
			r.earlyCheckpoint()
		case <-r.reqWake:
			r.serve()
			r.earlyCheckpoint()
			idle.Reset(replyIdle)
		case <-idle.C:
			r.dropReplies()
		case <-tick:
			r.drain()
			r.checkpoint()
		}
	}
}

// stop answers every waiting request with ErrStopped and refuses new ones.
func (r *Recorder) stop() {
	r.wmu.Lock()
	ws := r.waiting
	r.waiting, r.stopped = nil, true
	r.wmu.Unlock()
	for _, w := range ws {
		if w.state.CompareAndSwap(waiterWaiting, waiterServed) {
			w.done <- result{err: ErrStopped}
		}
	}
	r.dropReplies()
}

// drain folds every batch queued at the moment it is called (a finite cut:
// batches Record queues meanwhile wait for the next drain).
func (r *Recorder) drain() {
	r.mu.Lock()
	if r.failed {
		r.mu.Unlock()
		return
	}
	items, blocks := r.items, r.inUse
	r.items, r.inUse, r.cur = r.spareIts[:0], r.spareBls[:0], nil
	r.spareIts, r.spareBls = nil, nil
	r.mu.Unlock()

	for i := range items {
		r.fold(&items[i])
	}
	if len(items) > 0 {
		r.stats.cut.Store(r.cut)
		r.stats.entries.Store(int64(r.set.Len()))
	}

	// Drop the strings before the blocks wait for reuse: a key may share
	// the buffer of a whole decoded watch response.
	clear(items)
	for _, b := range blocks {
		clear(b[:cap(b)])
	}
	r.mu.Lock()
	if !r.failed {
		for _, b := range blocks {
			if len(r.free) < maxFreeBlocks && cap(b) == blockRecs {
				r.free = append(r.free, b[:0])
			}
		}
		clear(blocks)
		r.spareIts, r.spareBls = items[:0], blocks[:0]
	}
	r.mu.Unlock()
}

func (r *Recorder) fold(it *item) {
	for i := range it.evs {
		e := &it.evs[i]
		switch e.typ {
		case kvevent.Stored:
			r.set.Store(e.tenant, e.key, e.medium, e.group)
		case kvevent.Removed:
			r.set.Remove(e.tenant, e.key, e.medium)
		case kvevent.Cleared:
			r.set.Clear(e.tenant)
		}
	}
	r.cut, r.pos, r.lastEventID = int64(it.seq), it.pos, it.lastEventID
	r.dirty = true
	r.changes += len(it.evs)
	r.version += uint64(len(it.evs))
}

func (r *Recorder) isFailed() bool { return r.stats.failed.Load() }

// serve answers every waiting request with one reply built after folding
// the queue.
func (r *Recorder) serve() {
	r.wmu.Lock()
	ws := r.waiting
	r.waiting = nil
	r.wmu.Unlock()
	waiting := func(w *waiter) bool { return w.state.Load() == waiterWaiting }
	if !slices.ContainsFunc(ws, waiting) {
		return
	}
	r.drain()
	var res result
	if r.isFailed() {
		res.err = ErrFailed
	} else if res.frames, res.bufs = r.reuse(); res.frames != nil {
		r.stats.reused.Add(uint64(len(ws)))
	} else {
		start := time.Now()
		res.frames, res.bufs, res.err = r.build()
		if res.err == nil {
			r.stats.built.Add(1)
			r.stats.buildNanos.Store(int64(time.Since(start)))
			r.remember(res.frames, res.bufs)
		} else {
			r.lg.Warn("snapshot not served", "err", res.err, "entries", r.set.Len(), "cut", r.cut)
		}
	}
	// Requests whose caller gave up meanwhile are not answered; each
	// other one holds a reference to the reply's buffers until released.
	ws = slices.DeleteFunc(ws, func(w *waiter) bool { return !w.state.CompareAndSwap(waiterWaiting, waiterServed) })
	if res.err == nil {
		r.pmu.Lock()
		res.bufs.refs += len(ws)
		r.pmu.Unlock()
	}
	for _, w := range ws {
		w.done <- res
	}
}

// earlyCheckpoint writes a checkpoint if enough changes were folded since
// the last one (Config.CheckpointAfterChanges).
func (r *Recorder) earlyCheckpoint() {
	if n := r.cfg.CheckpointAfterChanges; n > 0 && r.changes >= n && 2*r.changes >= r.set.Len() {
		r.checkpoint()
	}
}

// checkpoint writes a checkpoint if there is a Checkpointer, the set
// changed since the last one and the recorder has not failed.
func (r *Recorder) checkpoint() {
	cp := r.deps.Checkpointer
	if cp == nil || !r.dirty || r.isFailed() {
		return
	}
	subs := 0
	if r.deps.Subscribers != nil {
		subs = r.deps.Subscribers()
	}
	h := statedir.Header{
		PublisherEpoch:   r.epoch,
		Seq:              uint64(max(r.cut, 0)),
		Master:           r.pos,
		LastEventID:      r.lastEventID,
		WrittenUnixMilli: r.deps.Now().UnixMilli(),
		Subscribers:      subs,
		Entries:          uint64(r.set.Len()),
	}
	// A failed checkpoint is retried at the next interval, or after as
	// many changes again: not after every batch.
	r.changes = 0
	if err := cp.WriteCheckpoint(h, r.set.All()); err != nil {
		if errors.Is(err, statedir.ErrInvalidated) {
			return // the journal failed (logged): the next start resets
		}
		r.stats.checkpointErrs.Add(1)
		r.lg.Error("checkpoint failed; retrying at the next interval", "err", err, "seq", h.Seq, "entries", h.Entries)
		return
	}
	r.dirty = false
	r.stats.checkpoints.Add(1)
	r.stats.lastCheckpoint.Store(h.WrittenUnixMilli)
}

// lastReply is the last reply built (or served again under a new cut):
// its frames are immutable and, while no event was folded since, can be
// served again. Its buffers are held until the next build or replyIdle.
type lastReply struct {
	frames  [][]byte // nil: none
	bufs    *replyBufs
	cut     int64
	version uint64
}

// remember keeps frames (a reply just built at r.cut, in bufs) for reuse.
func (r *Recorder) remember(frames [][]byte, bufs *replyBufs) {
	r.last = lastReply{frames: frames, bufs: bufs, cut: r.cut, version: r.version}
}

// reuse returns the last reply's chunks as a reply at r.cut, and their
// buffers, if no event was folded since it was built, else nil. Callers
// have drained the queue first, so r.cut covers every batch recorded
// before their requests: an identical reply (no batch folded since) is
// served as it is; after batches without events (heartbeats) the set is
// the same and only the cut frame is new.
func (r *Recorder) reuse() ([][]byte, *replyBufs) {
	if r.last.frames == nil || r.last.version != r.version {
		return nil, nil
	}
	if r.last.cut == r.cut {
		return r.last.frames, r.last.bufs
	}
	next := make([][]byte, len(r.last.frames))
	copy(next, r.last.frames)
	head := make([]byte, 8)
	binary.BigEndian.PutUint64(head, uint64(r.cut))
	next[0] = head
	r.remember(next, r.last.bufs)
	return next, r.last.bufs
}
