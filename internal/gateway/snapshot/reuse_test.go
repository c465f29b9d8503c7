package snapshot

import (
	"bytes"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

func stored(id uint64, key string) []kvevent.Event {
	return []kvevent.Event{{ID: id, Type: kvevent.Stored, Tenant: "t", Key: key, Medium: kvevent.MediumCPU, GroupID: "g"}}
}

// TestSnapshotReuse: two requests with no batch recorded between them
// share one build (the very same frames); a request after a batch with
// events gets a new build at the new cut; after batches without events
// (heartbeats) the chunks are the same and only the cut is new.
func TestSnapshotReuse(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	start(t, r)
	ref := model{}
	var seq uint64
	for i := range 200 {
		seq++
		evs := stored(seq, fmt.Sprint("k", i))
		ref.apply(evs)
		r.Record(seq, statedir.Position{}, seq, evs)
	}
	get := func() ([][]byte, reply) {
		t.Helper()
		f, release, err := r.Reply(t.Context()) // not copied: sharing shows
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(release)
		return f, decodeReply(t, f, cfg.Encoder)
	}
	check := func(rep reply, cut int64) {
		t.Helper()
		if rep.cut != cut || rep.epoch != testEpoch {
			t.Fatalf("cut %d epoch %x, want %d", rep.cut, rep.epoch, cut)
		}
		ref.equal(t, rep.set)
	}

	f1, rep1 := get()
	check(rep1, int64(seq))
	f2, rep2 := get() // nothing recorded since: the same reply
	check(rep2, int64(seq))
	if &f2[0] != &f1[0] || len(f2) != len(f1) {
		t.Fatal("a request with no batch since the last build got another reply")
	}
	if st := r.Stats(); st.SnapshotsBuilt != 1 || st.SnapshotsReused != 1 {
		t.Fatalf("stats %+v", st)
	}

	seq++ // a batch with an event: a new build, at the new cut
	evs := stored(seq, "new")
	ref.apply(evs)
	r.Record(seq, statedir.Position{}, seq, evs)
	f3, rep3 := get()
	check(rep3, int64(seq))
	if &f3[2][0] == &f1[2][0] {
		t.Fatal("a request after a new batch got the old chunks")
	}
	if st := r.Stats(); st.SnapshotsBuilt != 2 || st.SnapshotsReused != 1 {
		t.Fatalf("stats %+v", st)
	}

	seq++ // a heartbeat: the set is the same, the cut is new
	r.Record(seq, statedir.Position{}, seq-1, nil)
	f4, rep4 := get()
	check(rep4, int64(seq))
	if &f4[2][0] != &f3[2][0] || len(f4) != len(f3) || &f4[0][0] == &f3[0][0] {
		t.Fatal("after a heartbeat: want the same chunks under a new cut frame")
	}
	if rep3.cut == rep4.cut {
		t.Fatal("same cut after a heartbeat")
	}
	f5, rep5 := get() // and that one is shared in turn
	check(rep5, int64(seq))
	if &f5[0] != &f4[0] {
		t.Fatal("the reply after a heartbeat was not shared")
	}
	if st := r.Stats(); st.SnapshotsBuilt != 2 || st.SnapshotsReused != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// TestSnapshotReuseAfterQueued: a batch recorded before a request but not
// yet folded when the request arrives is folded first, so the request
// gets a new cut, not the last reply.
func TestSnapshotReuseAfterQueued(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	start(t, r)
	for i := range 10 {
		r.Record(uint64(i+1), statedir.Position{}, uint64(i+1), stored(uint64(i+1), fmt.Sprint("k", i)))
	}
	f1, err := r.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 { // each request right after its batch
		seq := uint64(11 + i)
		r.Record(seq, statedir.Position{}, seq, stored(seq, fmt.Sprint("x", i)))
		f, err := r.Snapshot(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if rep := decodeReply(t, f, cfg.Encoder); rep.cut != int64(seq) || len(rep.set) != 11+i {
			t.Fatalf("request after batch %d: cut %d, %d entries", seq, rep.cut, len(rep.set))
		}
		f1 = f
	}
	_ = f1
}

// TestEarlyCheckpoint: with no interval, a checkpoint is written as soon
// as CheckpointAfterChanges events were folded, once they are at least
// half the set; not before.
func TestEarlyCheckpoint(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.CheckpointInterval = 0
		cfg.CheckpointAfterChanges = 100
		cp := &fakeCheckpointer{}
		r, _ := newRecorder(t, cfg, Deps{Checkpointer: cp})
		stop := start(t, r)
		defer stop()
		var keys int
		recordEntries := func(r *Recorder, seq uint64, n int) uint64 { // n new keys
			for range n {
				keys++
				r.Record(seq, statedir.Position{Epoch: 1, Revision: seq}, seq, stored(seq, fmt.Sprint("k", keys)))
				seq++
			}
			return seq
		}
		next := recordEntries(r, 1, 99)
		synctest.Wait()
		if cp.count() != 0 {
			t.Fatal("checkpoint after 99 changes")
		}
		next = recordEntries(r, next, 1)
		synctest.Wait()
		if c := cp.last(); cp.count() != 1 || c.h.Seq != next-1 || c.h.Entries != 100 {
			t.Fatalf("%d checkpoints, last %+v", cp.count(), c.h)
		}
		// Stores only: the next one once the changes reach the set's size
		// at the last one (half the set then), here 100 more, then 200.
		for _, want := range []uint64{200, 400} {
			before := cp.count()
			n := int(want / 2)
			next = recordEntries(r, next, n-1)
			synctest.Wait()
			if cp.count() != before {
				t.Fatalf("checkpoint after %d changes to a set of %d", n-1, want-1)
			}
			next = recordEntries(r, next, 1)
			synctest.Wait()
			if c := cp.last(); cp.count() != before+1 || c.h.Seq != next-1 || c.h.Entries != want {
				t.Fatalf("%d checkpoints, last %+v; want one more, of %d entries", cp.count(), c.h, want)
			}
		}
	})
}

// TestReplyBuffersReused: a reply's buffers are reused by a later build
// only once it was released and a newer build replaced it; a reply taken
// with Snapshot (never released) keeps its buffers.
func TestReplyBuffersReused(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	start(t, r)
	ref := model{}
	var seq uint64
	record := func() {
		seq++
		evs := stored(seq, fmt.Sprint("k", seq))
		ref.apply(evs)
		r.Record(seq, statedir.Position{}, seq, evs)
	}
	reply := func() ([][]byte, func()) {
		t.Helper()
		f, release, err := r.Reply(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if rep := decodeReply(t, f, cfg.Encoder); rep.cut != int64(seq) {
			t.Fatalf("cut %d, want %d", rep.cut, seq)
		} else {
			ref.equal(t, rep.set)
		}
		return f, release
	}
	same := func(a, b [][]byte) bool { return &a[2][0] == &b[2][0] } // the first chunk starts a segment

	for range 100 {
		record()
	}
	f1, rel1 := reply()
	record()
	f2, rel2 := reply() // f1 is still being sent: new buffers
	if same(f1, f2) {
		t.Fatal("a build reused the buffers of a reply not yet released")
	}
	rel1()
	rel1() // a second call is a no-op
	record()
	f3, rel3 := reply() // f1 released and replaced: its buffers serve again
	if !same(f3, f1) {
		t.Fatal("a build did not reuse the buffers of a released reply")
	}
	rel2()
	rel3()

	record()
	g1, err := r.Snapshot(t.Context()) // a copy: nothing to release
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(g1[2])
	for range 3 {
		record()
		_, rel := reply()
		rel()
	}
	if !bytes.Equal(g1[2], want) {
		t.Fatal("the buffers of a reply taken with Snapshot were reused")
	}
}

// TestReplyBuffersFreed: once the recorder stopped and every reply was
// released, no reply buffer is held (they live outside the Go heap: one
// not freed would never be), whatever order things happened in.
func TestReplyBuffersFreed(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	stop := start(t, r)
	var rels []func()
	for i := range 2000 {
		seq := uint64(i + 1)
		r.Record(seq, statedir.Position{}, seq, stored(seq, fmt.Sprint("k", i)))
		if i%100 == 0 {
			_, rel, err := r.Reply(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if i%200 == 0 {
				rel() // released while the recorder runs
			} else {
				rels = append(rels, rel) // still being sent when it stops
			}
		}
	}
	if _, err := r.Snapshot(t.Context()); err != nil {
		t.Fatal(err)
	}
	if r.Stats().BufferBytes == 0 {
		t.Fatal("no reply buffers held while replies are being sent")
	}
	stop()
	for _, rel := range rels {
		rel()
	}
	if b := r.Stats().BufferBytes; b != 0 {
		t.Fatalf("%d bytes of reply buffers held after stop and every release, want 0", b)
	}
}

// TestReplyBuffersDroppedWhenIdle: replyIdle after the last request the
// recorder holds no reply buffers (a request then builds afresh); a
// request before that is served the last reply again.
func TestReplyBuffersDroppedWhenIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		r, _ := newRecorder(t, cfg, Deps{})
		stop := start(t, r)
		defer stop()
		for i := range 100 {
			r.Record(uint64(i+1), statedir.Position{}, uint64(i+1), stored(uint64(i+1), fmt.Sprint("k", i)))
		}
		request := func() {
			t.Helper()
			_, rel, err := r.Reply(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			rel()
		}
		pooling := func() (bool, int) {
			synctest.Wait()
			r.pmu.Lock()
			defer r.pmu.Unlock()
			return r.pooling, len(r.freeSegs)
		}
		request()
		time.Sleep(replyIdle - time.Second)
		request() // the last reply again
		if on, _ := pooling(); !on {
			t.Fatal("not pooling while requests come")
		}
		if st := r.Stats(); st.SnapshotsBuilt != 1 || st.SnapshotsReused != 1 {
			t.Fatalf("stats %+v: want the second request served the first reply", st)
		}
		time.Sleep(replyIdle)
		if on, free := pooling(); on || free != 0 {
			t.Fatalf("replyIdle after the last request: pooling %v, %d free segments; want neither", on, free)
		}
		if b := r.Stats().BufferBytes; b != 0 {
			t.Fatalf("replyIdle after the last request: %d bytes of reply buffers held, want 0", b)
		}
		request()
		if st := r.Stats(); st.SnapshotsBuilt != 2 || st.SnapshotsReused != 1 {
			t.Fatalf("stats %+v: want a new build after the idle drop", st)
		}
	})
}

// TestReplyConcurrentRelease: requests that release their replies while
// batches keep coming always read an intact reply of their cut (a reused
// buffer overwritten too early would break decoding or the count).
func TestReplyConcurrentRelease(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	start(t, r)
	const batches = 3000
	var wg sync.WaitGroup
	done := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				f, rel, err := r.Reply(t.Context())
				if err != nil {
					t.Error(err)
					return
				}
				// Batch seq stores one new key: the set at cut c holds c.
				if rep := decodeReply(t, f, cfg.Encoder); rep.cut >= 0 && int64(len(rep.set)) != rep.cut {
					t.Errorf("reply at cut %d holds %d entries", rep.cut, len(rep.set))
				}
				rel()
			}
		})
	}
	for i := range batches {
		seq := uint64(i + 1)
		r.Record(seq, statedir.Position{}, seq, stored(seq, fmt.Sprint("k", i)))
		if i%50 == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	close(done)
	wg.Wait()
	if st := r.Stats(); st.SnapshotsBuilt < 2 {
		t.Fatalf("stats %+v: want several builds", st)
	}
}
