package kvevent

import (
	"encoding/hex"
	"errors"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
)

// pubWorld is a scripted publisher with state: what it sends live (through
// the fake PUB), what its snapshot socket serves (capture) and what its
// replay ring holds (router, optional). Keys "x" are stored, "-x" removed,
// all under tenant "t" on the cpu medium.
type pubWorld struct {
	t      *testing.T
	pub    *fakePub
	router *fakeRouter // every batch is retained there when set
	wide   bool        // snapshot stream format: 24-byte sequence frames

	mu    sync.Mutex // guards the rest
	epoch []byte
	seq   uint64
	st    *stream
	set   map[string]bool
	sent  map[uint64][]byte // payload by sequence, this process
}

func newPubWorld(t *testing.T, pub *fakePub, wide bool) *pubWorld {
	return &pubWorld{t: t, pub: pub, wide: wide, epoch: newEpoch(), st: newStream(), set: map[string]bool{}, sent: map[uint64][]byte{}}
}

func (w *pubWorld) frame(seq uint64) []byte {
	if w.wide {
		return PutSeqEpoch(seq, w.epoch)
	}
	return PutSeq(seq)
}

// next numbers a batch of keys (nil: a heartbeat), folds it into the state
// and the ring, and returns its frames.
func (w *pubWorld) next(retain bool, keys []string) (uint64, [][]byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var p []byte
	if keys == nil {
		p = heartbeatPayload(w.t)
	} else {
		evs := make([]Event, len(keys))
		for i, k := range keys {
			if rest, ok := strings.CutPrefix(k, "-"); ok {
				evs[i] = Event{Type: Removed, Tenant: "t", Key: rest, Medium: MediumCPU}
				delete(w.set, rest)
			} else {
				evs[i] = stored(k)
				w.set[k] = true
			}
		}
		p = w.st.payload(w.t, evs...)
	}
	w.seq++
	w.sent[w.seq] = p
	if retain && w.router != nil {
		w.router.put(w.seq, p)
	}
	return w.seq, [][]byte{nil, w.frame(w.seq), p}
}

// publish sends one batch live and returns its sequence.
func (w *pubWorld) publish(keys ...string) uint64 {
	seq, frames := w.next(true, keys)
	w.pub.send(frames...)
	return seq
}

func (w *pubWorld) heartbeat() uint64 { return w.publish() }

// lose numbers a batch (nil keys: a heartbeat) that no subscriber receives;
// retain keeps it in the replay ring.
func (w *pubWorld) lose(retain bool, keys ...string) uint64 {
	if keys == nil {
		keys = nil
	}
	seq, _ := w.next(retain, keys)
	return seq
}

// resend sends batch seq again (a duplicate).
func (w *pubWorld) resend(seq uint64) {
	w.mu.Lock()
	p := w.sent[seq]
	w.mu.Unlock()
	w.pub.send(nil, w.frame(seq), p)
}

// capture is the snapshot reply of the current state.
func (w *pubWorld) capture() [][][]byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	cut := int64(w.seq)
	if w.seq == 0 {
		cut = CutNone
	}
	keys := make([]string, 0, len(w.set))
	for k := range w.set {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	frames := [][]byte{putCut(cut), w.epoch}
	for c := range slices.Chunk(keys, MaxEventsPerBatch) {
		frames = append(frames, chunk(w.t, c...))
	}
	return snapshotReply(frames...)
}

// restart makes a new publisher process: a new epoch, sequence and event
// ids from 1, an empty set and replay ring.
func (w *pubWorld) restart() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.epoch, w.seq, w.st, w.set, w.sent = newEpoch(), 0, newStream(), map[string]bool{}, map[uint64][]byte{}
	if w.router != nil {
		w.router.replace(map[uint64][]byte{})
	}
}

// rewind makes the sequence continue from after seq under the same epoch
// (a machine crash that lost the journal's tail).
func (w *pubWorld) rewind(seq uint64) {
	w.mu.Lock()
	w.seq = seq
	w.mu.Unlock()
}

func (w *pubWorld) epochHex() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return hex.EncodeToString(w.epoch)
}

// serveSnapshots starts a snapshot socket double that answers every
// request with the world's state.
func (w *pubWorld) serveSnapshots() *routerDouble {
	return newRouterDouble(w.t, func(int, [][]byte) [][][]byte { return w.capture() })
}

// snapRecorder collects what a snapshot-mode subscriber delivers.
type snapRecorder struct {
	mu      sync.Mutex
	batches []Batch
	gaps    []Gap
}

func (r *snapRecorder) opts(o Options) Options {
	o.OnBatch = func(b Batch) { r.mu.Lock(); r.batches = append(r.batches, b); r.mu.Unlock() }
	o.OnGap = func(g Gap) { r.mu.Lock(); r.gaps = append(r.gaps, g); r.mu.Unlock() }
	return o
}

// live is the sequences of the live and replayed batches delivered.
func (r *snapRecorder) live() []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []uint64
	for _, b := range r.batches {
		if !b.Snapshot {
			out = append(out, b.Seq)
		}
	}
	return out
}

func (r *snapRecorder) gapList() []Gap {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.gaps)
}

func (r *snapRecorder) waitLive(t *testing.T, want ...uint64) {
	t.Helper()
	var got []uint64
	testutil.Eventually(t, 10*time.Second, func() bool {
		got = r.live()
		return len(got) >= len(want)
	}, "live batches %v (got %v)", want, &got)
	if !slices.Equal(got, want) {
		t.Fatalf("live batches = %v, want %v", got, want)
	}
}

func waitStats(t *testing.T, sub *Subscriber, what string, cond func(Stats) bool) Stats {
	t.Helper()
	var st Stats
	testutil.Eventually(t, 10*time.Second, func() bool {
		st = sub.Stats()
		return cond(st)
	}, "%s (stats %+v)", what, &st)
	return st
}

func indexKeys(keys ...string) []Key {
	out := make([]Key, len(keys))
	for i, k := range keys {
		out[i] = Key{"t", k, MediumCPU}
	}
	return out
}

func checkIndex(t *testing.T, sub *Subscriber, keys ...string) {
	t.Helper()
	if got, want := sub.Index().Keys(), indexKeys(keys...); !slices.Equal(got, want) {
		t.Errorf("index = %v, want %v", got, want)
	}
}

// fastRebuild keeps the tests' backoffs short.
func fastRebuild(o Options) Options {
	o.RebuildMin, o.RebuildMax = 5*time.Millisecond, 20*time.Millisecond
	o.ReconnectMin, o.ReconnectMax = time.Millisecond, 10*time.Millisecond
	return o
}

// TestSnapshotBootstrapSplice: live messages that arrive while the snapshot
// is fetched are buffered; those at or below the cut are dropped, the rest
// applied in order; heartbeats advance the sequence without reaching OnBatch.
func TestSnapshotBootstrapSplice(t *testing.T) {
	pub := newFakePub(t)
	w := newPubWorld(t, pub, true)
	w.publish("a")
	w.publish("b", "c") // before anyone subscribed
	hold := make(chan [][][]byte)
	stop := make(chan struct{})
	srv := newRouterDouble(t, func(int, [][]byte) [][][]byte {
		select {
		case r := <-hold:
			return r
		case <-stop:
			return nil
		}
	})
	t.Cleanup(func() { close(stop) })
	var rec snapRecorder
	sub := subscribe(t, pub.endpoint(), rec.opts(Options{SnapshotEndpoint: srv.endpoint()}))
	pub.waitSub()
	srv.waitAsked(t, 1)
	// In flight while the snapshot is built: folded into it.
	w.publish("d")
	w.heartbeat()
	reply := w.capture() // cut 4
	// Published after the cut.
	w.publish("e")
	w.heartbeat()
	w.publish("-a")
	time.Sleep(50 * time.Millisecond) // let them reach the buffer (the outcome is the same if not)
	if st := sub.Stats(); st.Synced || st.Batches != 0 || sub.Index().Len() != 0 {
		t.Fatalf("before the snapshot: stats %+v, index %d; want nothing applied", st, sub.Index().Len())
	}
	hold <- reply
	rec.waitLive(t, 5, 7)
	checkIndex(t, sub, "b", "c", "d", "e")
	rec.mu.Lock()
	var chunks, chunkEvents int
	for i, b := range rec.batches {
		if b.Snapshot {
			chunks++
			chunkEvents += len(b.Events)
			if b.Seq != 4 || i >= len(rec.batches)-2 {
				t.Errorf("chunk %d: seq %d, want 4, before the live batches", i, b.Seq)
			}
		}
	}
	rec.mu.Unlock()
	if chunks != 1 || chunkEvents != 4 {
		t.Errorf("%d chunks with %d events, want 1 with 4", chunks, chunkEvents)
	}
	st := waitStats(t, sub, "the snapshot counted", func(s Stats) bool { return s.Snapshots == 1 })
	if !st.Synced || st.Heartbeats != 1 || st.LastSeq != 7 || st.Epoch != w.epochHex() || st.MissingSeqs != 0 || st.SnapshotFailures != 0 {
		t.Errorf("stats = %+v, want synced, 1 heartbeat, last 7, epoch %s", st, w.epochHex())
	}
	if g := rec.gapList(); len(g) != 0 {
		t.Errorf("gaps = %+v, want none", g)
	}
}

// TestSnapshotHeartbeatTimeout: silence past HeartbeatTimeout on a stream
// with epochs means the publisher is gone: reconnect and rebuild.
func TestSnapshotHeartbeatTimeout(t *testing.T) {
	pub := newFakePub(t)
	w := newPubWorld(t, pub, true)
	srv := w.serveSnapshots()
	var rec snapRecorder
	sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: srv.endpoint(), HeartbeatTimeout: 500 * time.Millisecond})))
	pub.waitSub()
	waitStats(t, sub, "the bootstrap", func(s Stats) bool { return s.Snapshots == 1 })
	w.publish("a")
	w.heartbeat()
	rec.waitLive(t, 1)
	waitStats(t, sub, "a heartbeat", func(s Stats) bool { return s.Heartbeats == 1 })
	pub.waitSub() // it reconnected
	st := waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots >= 2 })
	gaps := rec.gapList()
	if len(gaps) == 0 || !gaps[0].Rebuilt || gaps[0].Reset || gaps[0].Err == nil || !strings.Contains(gaps[0].Err.Error(), "heartbeat timeout") {
		t.Fatalf("gaps = %+v, want a rebuild for the heartbeat timeout", gaps)
	}
	if st.Reconnects < 1 {
		t.Errorf("stats %+v, want a reconnect", st)
	}
	checkIndex(t, sub, "a")
}

// TestSnapshotEpochChange: a live batch of another epoch is a new publisher
// process: rebuild from its snapshot. The first snapshot (nothing published
// yet, cut -1) is followed by sequence 1.
func TestSnapshotEpochChange(t *testing.T) {
	pub := newFakePub(t)
	w := newPubWorld(t, pub, true)
	srv := w.serveSnapshots()
	var rec snapRecorder
	sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: srv.endpoint()})))
	pub.waitSub()
	waitStats(t, sub, "the bootstrap", func(s Stats) bool { return s.Snapshots == 1 && s.Synced })
	w.publish("a")
	w.publish("b")
	rec.waitLive(t, 1, 2)
	checkIndex(t, sub, "a", "b")
	old := w.epochHex()
	w.restart()
	w.publish("x") // sequence 1 of the new process
	st := waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots == 2 && s.Synced })
	w.publish("y")
	testutil.Eventually(t, 10*time.Second, func() bool { return sub.Index().Len() == 2 }, "the new process's batch")
	checkIndex(t, sub, "x", "y")
	gaps := rec.gapList()
	if len(gaps) != 1 || !gaps[0].Rebuilt || !gaps[0].Reset || !strings.Contains(gaps[0].Err.Error(), "epoch changed") {
		t.Fatalf("gaps = %+v, want one rebuild for the epoch change", gaps)
	}
	if st.Resets != 1 || st.Epoch != w.epochHex() || st.Epoch == old {
		t.Errorf("stats %+v, want 1 reset and the new epoch %s", st, w.epochHex())
	}
}

// TestSnapshotGapAfterCut: a gap after the cut is filled from the replay
// socket (heartbeats included) when it can be, else the index is rebuilt.
func TestSnapshotGapAfterCut(t *testing.T) {
	t.Run("replay repairs", func(t *testing.T) {
		pub := newFakePub(t)
		w := newPubWorld(t, pub, true)
		w.router = newFakeRouter(t, false) // 8-byte replay frames, as vLLM's
		srv := w.serveSnapshots()
		var rec snapRecorder
		sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: srv.endpoint(), ReplayEndpoint: w.router.endpoint()})))
		pub.waitSub()
		waitStats(t, sub, "the bootstrap", func(s Stats) bool { return s.Snapshots == 1 })
		w.publish("a")
		w.lose(true, "b")
		w.lose(true) // a heartbeat
		w.publish("c")
		rec.waitLive(t, 1, 2, 4)
		checkIndex(t, sub, "a", "b", "c")
		st := sub.Stats()
		if st.Snapshots != 1 || st.Replayed != 2 || st.Heartbeats != 1 || st.MissingSeqs != 2 || st.Unrepaired != 0 {
			t.Errorf("stats %+v, want 1 snapshot, 2 replayed (one a heartbeat), nothing unrepaired", st)
		}
		if g := rec.gapList(); len(g) != 0 {
			t.Errorf("gaps = %+v, want none", g)
		}
	})
	for _, tt := range []struct {
		name   string
		replay bool
	}{{"no replay endpoint", false}, {"not in the ring", true}} {
		t.Run(tt.name+" rebuilds", func(t *testing.T) {
			pub := newFakePub(t)
			w := newPubWorld(t, pub, true)
			o := Options{}
			if tt.replay {
				w.router = newFakeRouter(t, false)
				o.ReplayEndpoint = w.router.endpoint()
			}
			srv := w.serveSnapshots()
			o.SnapshotEndpoint = srv.endpoint()
			var rec snapRecorder
			sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(o)))
			pub.waitSub()
			waitStats(t, sub, "the bootstrap", func(s Stats) bool { return s.Snapshots == 1 })
			w.publish("a")
			w.lose(false, "b")
			w.publish("c")
			st := waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots == 2 && s.Synced })
			checkIndex(t, sub, "a", "b", "c")
			gaps := rec.gapList()
			if len(gaps) != 1 || !gaps[0].Rebuilt || gaps[0].Reset || gaps[0].From != 2 || gaps[0].To != 3 || gaps[0].Err == nil {
				t.Fatalf("gaps = %+v, want one rebuild for [2, 3)", gaps)
			}
			if st.MissingSeqs != 1 || st.Unrepaired != 0 || st.LastSeq != 3 {
				t.Errorf("stats %+v, want 1 missing (rebuilt), last 3", st)
			}
			w.publish("d")
			rec.waitLive(t, 1, 4)
		})
	}
}

// TestSnapshotRetries: an unavailable (-2) or malformed reply is retried
// with backoff; the subscriber is not synced meanwhile.
func TestSnapshotRetries(t *testing.T) {
	for _, tt := range []struct {
		name  string
		first func(w *pubWorld) [][][]byte
	}{
		{"unavailable", func(w *pubWorld) [][][]byte { return snapshotReply(putCut(CutUnavailable), w.epoch) }},
		{"malformed", func(w *pubWorld) [][][]byte { return snapshotReply(putCut(0), w.epoch[:15]) }},
		{"malformed chunk", func(w *pubWorld) [][][]byte { return snapshotReply(putCut(0), w.epoch, []byte{0x93}) }},
		{"hang-up", func(*pubWorld) [][][]byte { return nil }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pub := newFakePub(t)
			w := newPubWorld(t, pub, true)
			srv := newRouterDouble(t, func(n int, _ [][]byte) [][][]byte {
				if n == 1 {
					return tt.first(w)
				}
				return w.capture()
			})
			var rec snapRecorder
			sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: srv.endpoint()})))
			pub.waitSub()
			st := waitStats(t, sub, "the second attempt", func(s Stats) bool { return s.Snapshots == 1 })
			if st.SnapshotFailures != 1 || !st.Synced {
				t.Errorf("stats %+v, want 1 failure then synced", st)
			}
			w.publish("a")
			rec.waitLive(t, 1)
			if g := rec.gapList(); len(g) != 0 {
				t.Errorf("gaps = %+v, want none (a failed bootstrap is no rebuild)", g)
			}
		})
	}
	t.Run("unreachable", func(t *testing.T) {
		pub := newFakePub(t)
		w := newPubWorld(t, pub, true)
		srv := newRouterDouble(t, func(int, [][]byte) [][][]byte { return nil })
		ep := srv.endpoint()
		srv.l.Close() // nobody listens there
		var rec snapRecorder
		sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: ep})))
		pub.waitSub()
		w.publish("a")
		st := waitStats(t, sub, "failed attempts", func(s Stats) bool { return s.SnapshotFailures >= 3 })
		if st.Synced || st.Snapshots != 0 || sub.Index().Len() != 0 || len(rec.live()) != 0 {
			t.Errorf("stats %+v, index %d, live %v: want nothing applied without a snapshot", st, sub.Index().Len(), rec.live())
		}
	})
}

// TestSnapshotBufferOverflow: more live messages than the buffer holds
// during a fetch fail the attempt; the next one succeeds.
func TestSnapshotBufferOverflow(t *testing.T) {
	pub := newFakePub(t)
	w := newPubWorld(t, pub, true)
	stop := make(chan struct{})
	srv := newRouterDouble(t, func(n int, _ [][]byte) [][][]byte {
		if n == 1 {
			<-stop // never answers
			return nil
		}
		return w.capture()
	})
	t.Cleanup(func() { close(stop) })
	var rec snapRecorder
	sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: srv.endpoint(), SnapshotBufferMessages: 2})))
	pub.waitSub()
	srv.waitAsked(t, 1)
	w.publish("a")
	w.publish("b")
	w.publish("c")
	st := waitStats(t, sub, "the second attempt", func(s Stats) bool { return s.Snapshots == 1 && s.Synced })
	if st.SnapshotFailures != 1 {
		t.Errorf("stats %+v, want 1 failure (buffer full)", st)
	}
	checkIndex(t, sub, "a", "b", "c")
}

// TestSnapshotSeqBackwards: the sequence going back under the same epoch
// (a gateway that lost its journal's tail) is a reset: rebuild.
func TestSnapshotSeqBackwards(t *testing.T) {
	pub := newFakePub(t)
	w := newPubWorld(t, pub, true)
	srv := w.serveSnapshots()
	var rec snapRecorder
	sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{SnapshotEndpoint: srv.endpoint()})))
	pub.waitSub()
	waitStats(t, sub, "the bootstrap", func(s Stats) bool { return s.Snapshots == 1 })
	w.publish("a")
	w.publish("b")
	w.publish("c")
	rec.waitLive(t, 1, 2, 3)
	w.rewind(1)
	w.publish("z") // sequence 2 again
	st := waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots == 2 && s.Synced })
	gaps := rec.gapList()
	if len(gaps) != 1 || !gaps[0].Rebuilt || !gaps[0].Reset || !strings.Contains(gaps[0].Err.Error(), "went back") {
		t.Fatalf("gaps = %+v, want one rebuild for the sequence going back", gaps)
	}
	if st.Resets != 1 || st.LastSeq != 2 {
		t.Errorf("stats %+v, want 1 reset, last 2 (the new cut)", st)
	}
	checkIndex(t, sub, "a", "b", "c", "z")
}

// TestSnapshotMooncakeFormat: with 8-byte frames there are no epochs and
// no heartbeats; after a reconnect the replay ring proves continuity, and a
// snapshot replaces what today's logic reports as a reset.
func TestSnapshotMooncakeFormat(t *testing.T) {
	setup := func(t *testing.T, replay bool) (*pubWorld, *Subscriber, *snapRecorder) {
		pub := newFakePub(t)
		w := newPubWorld(t, pub, false)
		o := Options{}
		if replay {
			w.router = newFakeRouter(t, false)
			o.ReplayEndpoint = w.router.endpoint()
		}
		srv := w.serveSnapshots()
		o.SnapshotEndpoint = srv.endpoint()
		rec := &snapRecorder{}
		sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(o)))
		pub.waitSub()
		waitStats(t, sub, "the bootstrap", func(s Stats) bool { return s.Snapshots == 1 })
		w.publish("a")
		w.publish("b")
		rec.waitLive(t, 1, 2)
		return w, sub, rec
	}
	t.Run("live", func(t *testing.T) {
		w, sub, rec := setup(t, false)
		st := sub.Stats()
		if st.Heartbeats != 0 || st.Epoch != w.epochHex() || !st.Synced {
			t.Errorf("stats %+v, want no heartbeats, the snapshot's epoch, synced", st)
		}
		w.lose(false, "c")
		w.publish("d")
		waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots == 2 && s.Synced })
		checkIndex(t, sub, "a", "b", "c", "d")
		if g := rec.gapList(); len(g) != 1 || !g[0].Rebuilt || g[0].From != 3 {
			t.Errorf("gaps = %+v, want a rebuild from 3", g)
		}
	})
	t.Run("same publisher after reconnect", func(t *testing.T) {
		w, sub, rec := setup(t, true)
		// Lost before the connection drops, as published while the
		// subscriber is away: lost after it, a reconnect quicker than this
		// goroutine found nothing to fill and missed them.
		w.lose(true, "c")
		w.lose(true, "d")
		w.pub.dropConns()
		w.pub.waitSub()
		rec.waitLive(t, 1, 2, 3, 4)
		w.resend(4) // in flight: a duplicate
		w.publish("e")
		rec.waitLive(t, 1, 2, 3, 4, 5)
		st := sub.Stats()
		if st.Snapshots != 1 || st.Resets != 0 || st.Replayed != 2 {
			t.Errorf("stats %+v, want no rebuild, 2 replayed", st)
		}
		checkIndex(t, sub, "a", "b", "c", "d", "e")
		if g := rec.gapList(); len(g) != 0 {
			t.Errorf("gaps = %+v, want none", g)
		}
	})
	t.Run("restarted publisher after reconnect", func(t *testing.T) {
		w, sub, rec := setup(t, true)
		// The restart before the connection drops (see above).
		w.restart()
		w.st.nextID = 100 // event ids that do not go back
		for _, k := range []string{"n1", "n2", "n3", "n4"} {
			w.lose(true, k)
		}
		w.pub.dropConns()
		w.pub.waitSub()
		st := waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots == 2 && s.Synced })
		checkIndex(t, sub, "n1", "n2", "n3", "n4")
		gaps := rec.gapList()
		if len(gaps) != 1 || !gaps[0].Rebuilt || !gaps[0].Reset {
			t.Fatalf("gaps = %+v, want one rebuild for a restart", gaps)
		}
		if st.Resets != 1 || st.Unrepaired != 0 {
			t.Errorf("stats %+v, want 1 reset, nothing unrepaired", st)
		}
		w.publish("n5")
		testutil.Eventually(t, 10*time.Second, func() bool { return sub.Index().Len() == 5 }, "the live batch after the rebuild")
	})
	t.Run("no replay endpoint rebuilds after reconnect", func(t *testing.T) {
		w, sub, rec := setup(t, false)
		// c is lost before the connection drops (see above): lost after
		// it, a reconnect quicker than this goroutine rebuilt from a
		// snapshot without it.
		w.lose(false, "c")
		w.pub.dropConns()
		w.pub.waitSub()
		waitStats(t, sub, "the rebuild", func(s Stats) bool { return s.Snapshots == 2 && s.Synced })
		checkIndex(t, sub, "a", "b", "c")
		if g := rec.gapList(); len(g) != 1 || !g[0].Rebuilt || g[0].Reset {
			t.Errorf("gaps = %+v, want one rebuild (not a reset)", g)
		}
	})
}

// TestSnapshotFormatWithoutSnapshotEndpoint: a subscriber without a
// snapshot endpoint follows the snapshot format too: heartbeats are
// counted, an epoch change is a reset, silence a reconnect.
func TestSnapshotFormatWithoutSnapshotEndpoint(t *testing.T) {
	t.Run("heartbeats and epoch change", func(t *testing.T) {
		pub := newFakePub(t)
		w := newPubWorld(t, pub, true)
		var rec snapRecorder
		sub := subscribe(t, pub.endpoint(), rec.opts(Options{}))
		pub.waitSub()
		w.publish("a")
		w.heartbeat()
		w.publish("b")
		rec.waitLive(t, 1, 3)
		st := sub.Stats()
		if st.Heartbeats != 1 || st.Epoch != w.epochHex() || st.LastSeq != 3 || st.MissingSeqs != 0 || st.Synced {
			t.Errorf("stats %+v, want 1 heartbeat, the epoch, last 3, not synced (no snapshots)", st)
		}
		w.restart()
		w.publish("x")
		rec.waitLive(t, 1, 3, 1)
		checkIndex(t, sub, "x")
		if g := rec.gapList(); len(g) != 1 || !g[0].Reset || g[0].Rebuilt {
			t.Errorf("gaps = %+v, want one reset", g)
		}
		if st := sub.Stats(); st.Resets != 1 || st.Epoch != w.epochHex() {
			t.Errorf("stats %+v, want 1 reset and the new epoch", st)
		}
	})
	t.Run("heartbeat timeout reconnects", func(t *testing.T) {
		pub := newFakePub(t)
		w := newPubWorld(t, pub, true)
		var rec snapRecorder
		sub := subscribe(t, pub.endpoint(), rec.opts(fastRebuild(Options{HeartbeatTimeout: 500 * time.Millisecond})))
		pub.waitSub()
		w.heartbeat()
		waitStats(t, sub, "a heartbeat", func(s Stats) bool { return s.Heartbeats == 1 })
		pub.waitSub() // silence: it reconnects
		if st := waitStats(t, sub, "a reconnect", func(s Stats) bool { return s.Reconnects >= 1 }); st.MissingSeqs != 0 || st.Resets != 0 {
			t.Errorf("stats %+v, want nothing missing", st)
		}
	})
}

func TestSubscribeSnapshotOptions(t *testing.T) {
	pub := newFakePub(t)
	if _, err := Subscribe(t.Context(), pub.endpoint(), Options{SnapshotEndpoint: "tcp://127.0.0.1:1", FromSeq: 1, ReplayEndpoint: "tcp://127.0.0.1:2"}); err == nil {
		t.Error("FromSeq with SnapshotEndpoint accepted")
	}
	if _, err := Subscribe(t.Context(), pub.endpoint(), Options{SnapshotEndpoint: "udp://x:1"}); err == nil {
		t.Error("a udp snapshot endpoint accepted")
	}
	// Close while a snapshot request is outstanding ends promptly.
	stop := make(chan struct{})
	srv := newRouterDouble(t, func(int, [][]byte) [][][]byte { <-stop; return nil })
	t.Cleanup(func() { close(stop) })
	sub, err := Subscribe(t.Context(), pub.endpoint(), Options{SnapshotEndpoint: srv.endpoint()})
	if err != nil {
		t.Fatal(err)
	}
	srv.waitAsked(t, 1)
	done := make(chan struct{})
	go func() { sub.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung on an outstanding snapshot request")
	}
	if err := sub.Err(); err != nil && !errors.Is(err, nil) {
		t.Errorf("Err after Close = %v, want nil", err)
	}
}

// TestSnapshotForeignEpochBacksOff: a snapshot socket that answers for
// another publisher (its epoch never matches the live stream's) is asked
// again with backoff, not in a tight loop.
func TestSnapshotForeignEpochBacksOff(t *testing.T) {
	pub := newFakePub(t)
	live := newPubWorld(t, pub, true)
	other := newPubWorld(t, nil, true)
	srv := other.serveSnapshots()
	var rec snapRecorder
	o := fastRebuild(Options{SnapshotEndpoint: srv.endpoint()})
	o.RebuildMin, o.RebuildMax = 40*time.Millisecond, 80*time.Millisecond
	sub := subscribe(t, pub.endpoint(), rec.opts(o))
	pub.waitSub()
	// Heartbeats keep the live stream's epoch in front of the subscriber
	// until four snapshots were asked for and failed. No fixed window: on a
	// loaded machine requests come later, never sooner, than the backoff.
	testutil.Eventually(t, 20*time.Second, func() bool {
		live.heartbeat()
		st := sub.Stats()
		return srv.reqs.Load() >= 4 && st.SnapshotFailures >= 3 && st.Resets >= 3
	}, "four snapshot requests, three failed")
	// Between requests the subscriber waits at least the backoff's floor:
	// half of 40ms after the first failure, half of 80ms after later ones.
	at := srv.arrivals()
	for i := 1; i < len(at); i++ {
		if gap := at[i].Sub(at[i-1]); gap < 20*time.Millisecond {
			t.Errorf("request %d came %v after request %d, want at least 20ms (backoff)", i+1, gap, i)
		}
	}
	if len(rec.live()) != 0 {
		t.Errorf("live %v: nothing live may be applied under a foreign snapshot", rec.live())
	}
	for _, g := range rec.gapList() {
		if !g.Rebuilt || !g.Reset || !strings.Contains(g.Err.Error(), "epoch changed") {
			t.Errorf("gap %+v, want rebuilds for the epoch mismatch", g)
		}
	}
}
