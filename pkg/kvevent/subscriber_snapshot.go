package kvevent

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
)

// A subscriber with Options.SnapshotEndpoint runs this file's loop. A
// reader goroutine (pump) hands it the SUB socket's messages, so that it
// can buffer them while a snapshot is fetched on another goroutine, and
// notice silence (the heartbeat timeout). The loop itself owns every piece
// of state, as run does.
//
// Why the splice is exact: the publisher folds every batch into its
// snapshot state before sending it, and folds everything pending before it
// replies. Every live message received before the request was sent is
// therefore at or below the cut; everything after it is buffered; so
// dropping what is at or below the cut and requiring cut+1, cut+2, ...
// leaves nothing out.

// snapPhase is where a snapshot-mode subscriber is.
type snapPhase uint8

const (
	// phaseNeedFetch: request a snapshot as soon as the SUB socket is up.
	phaseNeedFetch snapPhase = iota
	// phaseFetching: a request is in flight; live messages are buffered.
	phaseFetching
	// phaseWaiting: backing off after a failed attempt; live messages are
	// dropped (the next snapshot covers them).
	phaseWaiting
	// phaseInstalled: live batches above the cut are applied in order.
	phaseInstalled
)

type fetchResult struct {
	snap *Snapshot
	err  error
}

// snapState is the snapshot-mode state, owned by the run goroutine
// (lastRecv excepted).
type snapState struct {
	phase    snapPhase
	fetch    chan fetchResult   // the attempt in flight, nil otherwise
	cancel   context.CancelFunc // the attempt in flight's
	buf      []zmtp.Message     // live messages received during the attempt
	bufBytes int
	retry    *time.Timer // set while waiting
	backoff  *retry.Backoff
	// pending is the rebuild to report once a snapshot is installed.
	pending *Gap
	// installedOnce: a snapshot was installed (later ones are rebuilds).
	installedOnce bool
	cut           int64
	spliced       bool // a live batch above the cut was applied
	// liveEpochs: the last live sequence frame carried an epoch (snapshot
	// stream format: heartbeats are due).
	liveEpochs bool
	// lastRecv is when the pump last read anything (unix ns).
	lastRecv atomic.Int64
}

func (s *Subscriber) runSnapshot(ctx context.Context, conn *zmtp.Conn) {
	defer close(s.done)
	defer s.bg.Wait() // the fetch goroutines, cancelled below
	sn := &s.snap
	sn.backoff = retry.NewBackoff(s.opts.RebuildMin, s.opts.RebuildMax)
	backoff := retry.NewBackoff(s.opts.ReconnectMin, s.opts.ReconnectMax)
	stop := func() {
		s.abandonFetch()
		s.stopRetry()
		s.finish(ctx)
	}
	reconnected := false
	for {
		healthy, err := s.serveSnapshot(ctx, conn, reconnected)
		s.countProtocolError(err)
		// Buffered messages of this connection cannot be spliced with those
		// of the next one: an attempt in flight starts over once reconnected.
		s.abandonFetch()
		if ctx.Err() != nil {
			stop()
			return
		}
		if healthy {
			backoff.Reset()
		}
		s.lg.Warn("kv event subscription lost; reconnecting", "err", err)
		for {
			if err := backoff.Wait(ctx); err != nil {
				stop()
				return
			}
			conn, err = s.dial(ctx)
			if err == nil {
				break
			}
			s.lg.Debug("kv event reconnect failed", "err", err)
		}
		s.reconnects.Add(1)
		reconnected = true
	}
}

// serveSnapshot runs one connection until it fails, ctx ends or the
// heartbeat times out; healthy reports whether a message arrived.
func (s *Subscriber) serveSnapshot(ctx context.Context, conn *zmtp.Conn, reconnected bool) (healthy bool, err error) {
	sn := &s.snap
	msgs := make(chan zmtp.Message)
	quit := make(chan struct{})
	pumpErr := make(chan error, 1)
	pumped := false
	sn.lastRecv.Store(time.Now().UnixNano())
	go func() { pumpErr <- s.pump(conn, msgs, quit) }()
	defer func() {
		close(quit)
		conn.Close()
		if !pumped {
			<-pumpErr
		}
	}()
	hb := time.NewTimer(s.opts.HeartbeatTimeout)
	defer hb.Stop()
	if reconnected {
		s.resumeSnapshot(ctx)
	}
	if sn.phase == phaseNeedFetch {
		s.startFetch(ctx)
	}
	for {
		var hbC, retryC <-chan time.Time
		if sn.liveEpochs {
			hbC = hb.C
		}
		if sn.retry != nil {
			retryC = sn.retry.C
		}
		select {
		case <-ctx.Done():
			return healthy, ctx.Err()
		case err := <-pumpErr:
			pumped = true
			return healthy, err
		case m := <-msgs:
			healthy = true
			s.onLive(ctx, m)
			hb.Reset(s.opts.HeartbeatTimeout)
		case r := <-sn.fetch:
			s.onSnapshot(ctx, r)
		case <-retryC:
			sn.retry = nil
			s.startFetch(ctx)
		case <-hbC:
			// Not silence if the loop itself was busy (a replay) while
			// messages waited.
			select {
			case m := <-msgs:
				healthy = true
				s.onLive(ctx, m)
				hb.Reset(s.opts.HeartbeatTimeout)
				continue
			default:
			}
			if idle := time.Since(time.Unix(0, sn.lastRecv.Load())); idle < s.opts.HeartbeatTimeout {
				hb.Reset(s.opts.HeartbeatTimeout - idle)
				continue
			}
			err := fmt.Errorf("kvevent: nothing received for %v (heartbeat timeout)", s.opts.HeartbeatTimeout)
			// The publisher is gone or the connection is half-open: reconnect,
			// then rebuild.
			s.beginRebuild(Gap{Err: err})
			return healthy, err
		}
	}
}

// pump reads conn until it fails or quit closes, answering ZMTP PINGs (it
// is the connection's only writer once subscribed) and handing data
// messages to out.
func (s *Subscriber) pump(conn *zmtp.Conn, out chan<- zmtp.Message, quit <-chan struct{}) error {
	for {
		m, err := conn.ReadMessage()
		if err != nil {
			return err
		}
		s.snap.lastRecv.Store(time.Now().UnixNano())
		if m.Command != "" {
			if m.Command == "PING" && len(m.Frames[0]) >= 2 {
				if err := conn.Write(zmtp.AppendCommand(nil, "PONG", m.Frames[0][2:]), s.opts.DialTimeout); err != nil {
					return err
				}
			}
			continue
		}
		select {
		case out <- m:
		case <-quit:
			return nil
		}
	}
}

// onLive takes one live message.
func (s *Subscriber) onLive(ctx context.Context, m zmtp.Message) {
	sn := &s.snap
	if len(m.Frames) == 3 {
		switch len(m.Frames[1]) {
		case 8:
			sn.liveEpochs = false
		case 8 + EpochLen:
			sn.liveEpochs = true
		}
	}
	switch sn.phase {
	case phaseFetching:
		size := 0
		for _, f := range m.Frames {
			size += len(f)
		}
		if len(sn.buf) >= s.opts.SnapshotBufferMessages || size > s.opts.SnapshotBufferBytes-sn.bufBytes {
			s.attemptFailed(fmt.Errorf("kvevent: more than %d live messages or %d bytes arrived while the snapshot was fetched",
				s.opts.SnapshotBufferMessages, s.opts.SnapshotBufferBytes))
			return
		}
		sn.buf = append(sn.buf, m)
		sn.bufBytes += size
	case phaseInstalled:
		s.applyLive(ctx, m)
	}
	// Waiting: the next snapshot covers what arrives now.
}

// applyLive decodes and applies one live message after a snapshot.
func (s *Subscriber) applyLive(ctx context.Context, m zmtp.Message) {
	b, err := s.dec.DecodeMessage(m.Frames)
	if err != nil {
		s.malformedN.Add(1)
		s.lg.Warn("malformed kv event message", "err", err)
		if len(m.Frames) == 3 {
			// A batch the index needed and cannot have: rebuild.
			if seq, _, serr := DecodeSeqFrame(m.Frames[1]); serr == nil && seq != EndSeq && seq >= s.expected {
				s.missing.Add(seq + 1 - s.expected)
				s.rebuild(ctx, Gap{From: s.expected, To: seq + 1, Err: err})
			}
		}
		return
	}
	s.applyBatch(ctx, b)
}

func (s *Subscriber) applyBatch(ctx context.Context, b Batch) {
	sn := &s.snap
	if b.Epoch != nil && !bytes.Equal(b.Epoch, s.epoch) {
		s.rebuild(ctx, Gap{Reset: true, Err: fmt.Errorf("kvevent: publisher epoch changed from %x to %x", s.epoch, b.Epoch)})
		return
	}
	if s.dupHi > 0 {
		if b.Seq >= s.dupLo && b.Seq <= s.dupHi && s.replayedAlready(b) {
			return // already delivered by a replay
		}
		s.dupLo, s.dupHi = 0, 0
	}
	if !sn.spliced {
		switch {
		case sn.cut >= 0 && b.Seq <= uint64(sn.cut):
			return // covered by the snapshot
		case sn.cut == CutNone && b.Seq >= 1:
			// Nothing was published before the snapshot: this contract's
			// publisher starts at 1 (vLLM's at 0, which expected already is).
			s.expected = 1
		}
	}
	if b.Seq < s.expected {
		s.rebuild(ctx, Gap{Reset: true, Err: fmt.Errorf("kvevent: sequence went back to %d (expected %d)", b.Seq, s.expected)})
		return
	}
	if b.Epoch == nil && s.idBackwards(b) {
		s.rebuild(ctx, Gap{Reset: true, Err: fmt.Errorf("kvevent: event_id went back from %d to %d", s.lastEventID, b.Events[0].ID)})
		return
	}
	if b.Seq > s.expected && !s.repairSnapshot(ctx, s.expected, b.Seq) {
		return
	}
	if !sn.spliced {
		sn.spliced = true
		sn.backoff.Reset() // the snapshot joined the live stream
	}
	s.deliver(b)
}

// repairSnapshot fills [from, to) from the replay socket; when it cannot,
// it starts a rebuild and returns false.
func (s *Subscriber) repairSnapshot(ctx context.Context, from, to uint64) bool {
	s.missing.Add(to - from)
	if s.opts.ReplayEndpoint == "" {
		s.rebuild(ctx, Gap{From: from, To: to, Err: errors.New("kvevent: sequence gap and no replay endpoint")})
		return false
	}
	next := from
	err := Replay(ctx, s.opts.ReplayEndpoint, from, s.replayOptions(), func(rb Batch) error {
		if rb.Seq >= to {
			return ErrStopReplay
		}
		if rb.Seq != next {
			return fmt.Errorf("kvevent: the replay ring no longer holds sequence %d", next)
		}
		if rb.Epoch != nil && !bytes.Equal(rb.Epoch, s.epoch) {
			return fmt.Errorf("kvevent: the replay socket answered for publisher epoch %x", rb.Epoch)
		}
		s.replayed.Add(1)
		s.deliver(rb)
		next = rb.Seq + 1
		return nil
	})
	if next < to {
		if err == nil {
			err = errors.New("kvevent: the replay ring does not hold these sequences")
		}
		s.rebuild(ctx, Gap{From: next, To: to, Err: err})
		return false
	}
	return true
}

// resumeSnapshot runs after a reconnect. In the snapshot stream format
// nothing is needed: the next live message (a heartbeat at the latest)
// shows a restart or a gap. The Mooncake format has neither epochs nor
// heartbeats, so the subscriber asks the replay ring for its last batch
// again, as run's resume does; when that does not prove the same process
// continued, it rebuilds from a snapshot.
func (s *Subscriber) resumeSnapshot(ctx context.Context) {
	sn := &s.snap
	if sn.phase != phaseInstalled || sn.liveEpochs {
		return
	}
	if s.opts.ReplayEndpoint == "" || !s.haveID {
		s.rebuild(ctx, Gap{Err: errors.New("kvevent: reconnected and cannot verify the stream continued (Mooncake format: no replay endpoint or no batch since the snapshot)")})
		return
	}
	last := s.lastFP
	same, decided := false, false
	next := last.seq + 1
	err := Replay(ctx, s.opts.ReplayEndpoint, last.seq, s.replayOptions(), func(rb Batch) error {
		if !decided {
			decided = true
			if rb.Seq == last.seq && fingerprintOf(rb) == last {
				same = true
				return nil // delivered before the outage
			}
			return ErrStopReplay
		}
		if rb.Seq != next {
			return fmt.Errorf("kvevent: the replay ring no longer holds sequence %d", next)
		}
		s.replayed.Add(1)
		s.deliver(rb)
		next = rb.Seq + 1
		return nil
	})
	switch {
	case same && err == nil:
		if s.expected > last.seq+1 {
			s.dupLo, s.dupHi = last.seq+1, s.expected-1
		}
	case err == nil:
		s.rebuild(ctx, Gap{Reset: true, Err: errors.New("kvevent: the publisher restarted while disconnected (its replay ring no longer holds the last batch delivered)")})
	default:
		s.rebuild(ctx, Gap{Err: fmt.Errorf("kvevent: reconnected and cannot verify the stream continued: %w", err)})
	}
}

// rebuild drops the index and requests a snapshot: now when a live batch
// had been spliced onto the last one, else after the backoff, as for a
// failed attempt (the snapshot did not join the live stream: another
// publisher epoch, a gap right after its cut), so that a publisher whose
// snapshots never fit is not asked in a tight loop.
func (s *Subscriber) rebuild(ctx context.Context, g Gap) {
	joined := s.snap.spliced
	s.beginRebuild(g)
	if joined {
		s.startFetch(ctx)
		return
	}
	s.attemptFailed(g.Err)
}

// beginRebuild drops the index and schedules a snapshot request for when
// the SUB socket is connected; g is reported once one is installed.
func (s *Subscriber) beginRebuild(g Gap) {
	sn := &s.snap
	s.abandonFetch()
	s.stopRetry()
	g.Rebuilt = true
	if g.Reset {
		s.resets.Add(1)
	}
	s.lg.Warn("kv event stream lost continuity; rebuilding from a snapshot", "err", g.Err, "reset", g.Reset, "from", g.From, "to", g.To)
	s.index.Clear()
	s.synced.Store(false)
	if sn.installedOnce && sn.pending == nil {
		sn.pending = &g
	}
	sn.phase, sn.spliced = phaseNeedFetch, false
	s.dupLo, s.dupHi = 0, 0
}

// startFetch requests a snapshot on another goroutine; live messages are
// buffered until it answers.
func (s *Subscriber) startFetch(ctx context.Context) {
	sn := &s.snap
	s.abandonFetch()
	s.stopRetry()
	fctx, cancel := context.WithCancel(ctx)
	ch := make(chan fetchResult, 1)
	sn.fetch, sn.cancel, sn.phase = ch, cancel, phaseFetching
	s.synced.Store(false)
	ep := s.opts.SnapshotEndpoint
	opts := SnapshotOptions{Timeout: s.opts.SnapshotTimeout, MaxReplyBytes: s.opts.MaxSnapshotBytes,
		MaxFrame: s.opts.MaxFrame, Decoder: Decoder{AllowUnknownKeys: s.opts.AllowUnknownKeys, Topic: s.opts.Topic}}
	s.bg.Go(func() {
		snap, err := FetchSnapshot(fctx, ep, opts)
		ch <- fetchResult{snap, err}
	})
}

// abandonFetch cancels the attempt in flight, if any, and drops its buffer.
func (s *Subscriber) abandonFetch() {
	sn := &s.snap
	if sn.fetch != nil {
		sn.cancel()
		sn.fetch, sn.cancel = nil, nil
		if sn.phase == phaseFetching {
			sn.phase = phaseNeedFetch
		}
	}
	sn.buf, sn.bufBytes = nil, 0
}

func (s *Subscriber) stopRetry() {
	if sn := &s.snap; sn.retry != nil {
		sn.retry.Stop()
		sn.retry = nil
	}
}

// attemptFailed backs off before the next snapshot request.
func (s *Subscriber) attemptFailed(err error) {
	sn := &s.snap
	s.abandonFetch()
	s.snapshotFailures.Add(1)
	d := sn.backoff.Next()
	s.lg.Warn("kv event snapshot failed; retrying", "err", err, "in", d)
	sn.phase = phaseWaiting
	sn.retry = time.NewTimer(d)
}

func (s *Subscriber) onSnapshot(ctx context.Context, r fetchResult) {
	sn := &s.snap
	sn.cancel()
	sn.fetch, sn.cancel = nil, nil
	if r.err != nil {
		s.attemptFailed(r.err)
		return
	}
	s.install(ctx, r.snap)
}

// install applies a snapshot to the cleared index, reports the rebuild it
// ends, and splices the live messages buffered meanwhile.
func (s *Subscriber) install(ctx context.Context, snap *Snapshot) {
	sn := &s.snap
	buf := sn.buf
	sn.buf, sn.bufBytes = nil, 0
	s.index.Clear()
	s.setEpoch(snap.Epoch)
	sn.cut, sn.spliced, sn.phase, sn.installedOnce = snap.Cut, false, phaseInstalled, true
	s.started, s.haveID, s.lastEventID = true, false, 0
	s.dupLo, s.dupHi = 0, 0
	s.expected = uint64(snap.Cut + 1) // 0 after CutNone
	if snap.Cut >= 0 {
		s.lastSeq.Store(uint64(snap.Cut))
	}
	s.lg.Info("kv event snapshot installed", "cut", snap.Cut, "epoch", hex.EncodeToString(snap.Epoch),
		"events", snap.Events(), "buffered", len(buf))
	if g := sn.pending; g != nil {
		sn.pending = nil
		s.report(*g)
	}
	for _, b := range snap.Batches {
		s.deliverChunk(b)
	}
	// The index now mirrors the publisher at the cut; the buffered
	// batches bring it forward (a rebuild among them clears synced again).
	s.snapshots.Add(1)
	s.synced.Store(true)
	for _, m := range buf {
		if sn.phase != phaseInstalled {
			break // a rebuild began; its snapshot covers the rest
		}
		s.applyLive(ctx, m)
	}
}

// deliverChunk applies one chunk of a snapshot.
func (s *Subscriber) deliverChunk(b Batch) {
	if !s.opts.DisableIndex {
		s.index.ApplyBatch(b)
	}
	s.batches.Add(1)
	s.events.Add(uint64(len(b.Events)))
	if s.opts.OnBatch != nil {
		s.opts.OnBatch(b)
	}
}
