package source

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// sink records events and applies them to an index.
type sink struct {
	mu  sync.Mutex
	evs []kvevent.Event
	idx *kvevent.Index
	// calls records each call's position and event count.
	calls []sinkCall
}

type sinkCall struct {
	pos statedir.Position
	n   int
}

func newSink() *sink { return &sink{idx: kvevent.NewIndex()} }

func (s *sink) EnqueueAt(pos statedir.Position, evs ...kvevent.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = append(s.calls, sinkCall{pos, len(evs)})
	s.evs = append(s.evs, evs...)
	for _, e := range evs {
		s.idx.Apply(e)
	}
}

func (s *sink) EnqueueWaitAt(ctx context.Context, pos statedir.Position, evs ...kvevent.Event) error {
	s.EnqueueAt(pos, evs...)
	return ctx.Err()
}

func (s *sink) positions() []sinkCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

func (s *sink) events() []kvevent.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.evs)
}

func (s *sink) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.evs, s.calls = nil, nil
}

type harness struct {
	m    *fakemaster.Master
	src  *Source
	sink *sink
}

func run(t *testing.T, m *fakemaster.Master) *harness {
	t.Helper()
	return runWith(t, m, Config{}, nil)
}

// runWith starts a source with cfg (backoffs filled in) and, before Run,
// calls restore on it when given.
func runWith(t *testing.T, m *fakemaster.Master, cfg Config, restore func(*Source)) *harness {
	t.Helper()
	addr, stop, err := fakemaster.Serve(m)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{m: m, sink: newSink()}
	cfg.BackoffMin, cfg.BackoffMax = time.Millisecond, 20*time.Millisecond
	h.src = New(cfg, masterv1.NewChangeServiceClient(cc), h.sink, testutil.Logger())
	if restore != nil {
		restore(h.src)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.src.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		cc.Close()
		stop()
	})
	return h
}

// caughtUp waits until the source applied the master's head in its epoch.
func (h *harness) caughtUp(t *testing.T) {
	t.Helper()
	testutil.Eventually(t, 20*time.Second, func() bool {
		s := h.src.Status()
		return s.Epoch == h.m.Epoch() && s.Revision == h.m.Head()
	}, "the source to catch up (master epoch %d head %d)", h.m.Epoch(), h.m.Head())
}

// indexMatches asserts that applying every published event yields the master's readable set.
func (h *harness) indexMatches(t *testing.T) {
	t.Helper()
	var want []kvevent.Key
	for k := range h.m.Readable() {
		want = append(want, kvevent.Key{Tenant: k.Tenant, Key: k.Key, Medium: announced.Medium(k.Medium)})
	}
	slices.SortFunc(want, func(a, b kvevent.Key) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Medium, b.Medium))
	})
	got := h.sink.idx.Keys()
	if !slices.Equal(got, want) {
		t.Fatalf("published set (%d) differs from the master's readable set (%d):\n got %v\nwant %v", len(got), len(want), got, want)
	}
}

const (
	mem  = masterv1.Medium_MEDIUM_MEMORY
	disk = masterv1.Medium_MEDIUM_DISK
)

func TestInitialSnapshotThenWatch(t *testing.T) {
	m := fakemaster.New(7)
	m.Put("t", "a", mem, "g1")
	m.Put("t", "b", disk, "")
	h := run(t, m)
	h.caughtUp(t)
	got := h.sink.events()
	want := []kvevent.Event{
		{Type: kvevent.Stored, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU, GroupID: "g1"},
		{Type: kvevent.Stored, Tenant: "t", Key: "b", Medium: kvevent.MediumDisk},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("initial events = %+v, want %+v", got, want)
	}
	h.sink.reset()
	m.Put("t", "a", mem, "g2") // upsert: removed (old group), stored
	m.Remove("t", "b", disk)
	m.RemoveAll("u") // empty tenant: nothing
	m.Put("u", "x", mem, "")
	m.RemoveAll("u")
	h.caughtUp(t)
	want = []kvevent.Event{
		{Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU, GroupID: "g1"},
		{Type: kvevent.Stored, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU, GroupID: "g2"},
		{Type: kvevent.Removed, Tenant: "t", Key: "b", Medium: kvevent.MediumDisk},
		{Type: kvevent.Stored, Tenant: "u", Key: "x", Medium: kvevent.MediumCPU},
		{Type: kvevent.Cleared, Tenant: "u"},
	}
	if got := h.sink.events(); !slices.Equal(got, want) {
		t.Fatalf("watched events =\n %+v\nwant\n %+v", got, want)
	}
	h.indexMatches(t)
	if s := h.src.Status(); s.Resyncs != 1 || s.Epoch != 7 || s.Announced != 1 {
		t.Errorf("status = %+v, want 1 resync, epoch 7, 1 announced", s)
	}
}

// TestResumeAfterStreamDrops: streams dropped again and again in the
// middle of a workload; the events equal the change log exactly, once each.
func TestResumeAfterStreamDrops(t *testing.T) {
	m := fakemaster.New(1)
	m.MaxPerResponse = 7
	h := run(t, m)
	h.caughtUp(t)
	var want []kvevent.Event
	var drops int64
	for i := range 600 {
		k := fmt.Sprintf("k%03d", i%50)
		if i%3 == 2 {
			if m.Remove("t", k, mem) {
				want = append(want, kvevent.Event{Type: kvevent.Removed, Tenant: "t", Key: k, Medium: kvevent.MediumCPU, GroupID: "g"})
			}
		} else {
			if _, ok := m.Readable()[fakemaster.Key{Tenant: "t", Key: k, Medium: mem}]; ok {
				want = append(want, kvevent.Event{Type: kvevent.Removed, Tenant: "t", Key: k, Medium: kvevent.MediumCPU, GroupID: "g"})
			}
			m.Put("t", k, mem, "g")
			want = append(want, kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: k, Medium: kvevent.MediumCPU, GroupID: "g"})
		}
		if i%40 == 0 {
			// Drop a live stream: wait for the reconnect after the previous drop.
			testutil.Eventually(t, 20*time.Second, func() bool { return m.WatchCalls.Load() > drops }, "a new watch")
			m.DropStreams()
			drops++
		}
	}
	h.caughtUp(t)
	if got := h.sink.events(); !slices.Equal(got, want) {
		t.Fatalf("got %d events, want %d (no loss, no duplicates, in order)", len(got), len(want))
	}
	if s := h.src.Status(); s.Resyncs != 1 {
		t.Errorf("resyncs = %d, want 1 (only the initial snapshot)", s.Resyncs)
	}
	if m.WatchCalls.Load() <= drops {
		t.Errorf("watch calls = %d, want more than the %d drops", m.WatchCalls.Load(), drops)
	}
	h.indexMatches(t)
}

// diffSince returns the events that turn set a into set b, as the source must publish them.
func diffOf(a, b map[fakemaster.Key]string) []kvevent.Event {
	conv := func(s map[fakemaster.Key]string) *announced.Set {
		out := announced.New()
		for k, g := range s {
			out.Store(k.Tenant, k.Key, announced.Medium(k.Medium), g)
		}
		return out
	}
	return announced.Diff(conv(a), conv(b))
}

func TestResyncAfterCompaction(t *testing.T) {
	m := fakemaster.New(3)
	for i := range 20 {
		m.Put("t", fmt.Sprintf("k%02d", i), mem, "")
	}
	m.Put("gone", "x", disk, "")
	h := run(t, m)
	h.caughtUp(t)
	before := m.Readable()
	m.SetDown(true) // the gateway loses the master...
	testutil.Eventually(t, 20*time.Second, func() bool { return !h.src.Status().Watching }, "the stream to stop")
	h.sink.reset()
	// ...while the master changes a lot and compacts its log.
	for i := range 10 {
		m.Remove("t", fmt.Sprintf("k%02d", i), mem)
	}
	m.RemoveAll("gone")
	m.Put("t", "new1", disk, "g")
	m.Put("t", "k15", mem, "regrouped") // removed + stored: same key, new group
	m.Put("v", "y", mem, "")
	m.Compact(2)
	after := m.Readable()
	m.SetDown(false)
	h.caughtUp(t)
	want := diffOf(before, after)
	if got := h.sink.events(); !slices.Equal(got, want) {
		t.Fatalf("resync published\n %+v\nwant exactly the difference\n %+v", got, want)
	}
	if s := h.src.Status(); s.Resyncs != 2 {
		t.Errorf("resyncs = %d, want 2", s.Resyncs)
	}
	h.indexMatches(t)
	// It keeps watching from the snapshot revision.
	h.sink.reset()
	m.Put("t", "later", mem, "")
	h.caughtUp(t)
	if got := h.sink.events(); len(got) != 1 || got[0].Key != "later" {
		t.Errorf("after the resync: %+v, want the one new stored", got)
	}
}

func TestResyncAfterEpochChange(t *testing.T) {
	for _, ignore := range []bool{false, true} {
		name := "master rejects the old epoch"
		if ignore {
			name = "new epoch seen in a response"
		}
		t.Run(name, func(t *testing.T) {
			m := fakemaster.New(10)
			m.IgnoreRequestEpoch(ignore)
			for i := range 5 {
				m.Put("t", fmt.Sprintf("k%d", i), mem, "")
			}
			h := run(t, m)
			h.caughtUp(t)
			before := m.Readable()
			h.sink.reset()
			// Failover: new epoch, revisions restart; the new leader's view
			// differs (an agent was lost, others registered).
			m.Restart(11)
			m.Remove("t", "k0", mem)
			m.Remove("t", "k1", mem)
			m.Put("t", "k9", disk, "")
			if ignore {
				// Move the head past the old revision so the resumed Watch is
				// served (the new epoch shows up in the response).
				for i := range 10 {
					m.Put("w", fmt.Sprintf("w%d", i), mem, "")
				}
			}
			after := m.Readable()
			h.caughtUp(t)
			want := diffOf(before, after)
			if got := h.sink.events(); !slices.Equal(got, want) {
				t.Fatalf("resync published\n %+v\nwant\n %+v", got, want)
			}
			if s := h.src.Status(); s.Epoch != 11 || s.Resyncs != 2 {
				t.Errorf("status = %+v, want epoch 11 after 2 resyncs", s)
			}
			h.indexMatches(t)
		})
	}
}

func TestClearedForgetsTenant(t *testing.T) {
	m := fakemaster.New(1)
	m.Put("t", "a", mem, "")
	m.Put("t", "b", disk, "")
	m.Put("u", "c", mem, "")
	h := run(t, m)
	h.caughtUp(t)
	m.RemoveAll("t")
	h.caughtUp(t)
	if s := h.src.Status(); s.Announced != 1 {
		t.Fatalf("announced = %d after cleared, want 1", s.Announced)
	}
	// A resync now must not re-announce t's objects as removed.
	m.SetDown(true)
	testutil.Eventually(t, 20*time.Second, func() bool { return !h.src.Status().Watching }, "the stream to stop")
	h.sink.reset()
	m.Compact(0)
	m.Put("u", "d", mem, "")
	m.Compact(0)
	m.SetDown(false)
	h.caughtUp(t)
	want := []kvevent.Event{{Type: kvevent.Stored, Tenant: "u", Key: "d", Medium: kvevent.MediumCPU}}
	if got := h.sink.events(); !slices.Equal(got, want) {
		t.Errorf("resync after cleared = %+v, want %+v", got, want)
	}
}

func TestRunReturnsWhenMasterUnreachable(t *testing.T) {
	cc, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	src := New(Config{BackoffMin: time.Millisecond, BackoffMax: 5 * time.Millisecond}, masterv1.NewChangeServiceClient(cc), newSink(), testutil.Logger())
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if err := src.Run(ctx); err != nil {
		t.Errorf("Run = %v, want nil after ctx ends", err)
	}
	if s := src.Status(); s.Resyncs != 0 || s.Watching {
		t.Errorf("status = %+v, want nothing synced", s)
	}
}

func TestDiffSets(t *testing.T) {
	fk := func(t, k string, m masterv1.Medium) fakemaster.Key {
		return fakemaster.Key{Tenant: t, Key: k, Medium: m}
	}
	a := map[fakemaster.Key]string{fk("t", "a", mem): "", fk("t", "b", mem): "g", fk("t", "b", disk): ""}
	b := map[fakemaster.Key]string{fk("t", "b", mem): "g2", fk("t", "c", mem): "", fk("t", "b", disk): ""}
	want := []kvevent.Event{
		{Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU},
		{Type: kvevent.Stored, Tenant: "t", Key: "b", Medium: kvevent.MediumCPU, GroupID: "g2"},
		{Type: kvevent.Stored, Tenant: "t", Key: "c", Medium: kvevent.MediumCPU},
	}
	if got := diffOf(a, b); !slices.Equal(got, want) {
		t.Errorf("diff = %+v, want %+v", got, want)
	}
	if got := diffOf(a, maps.Clone(a)); len(got) != 0 {
		t.Errorf("diff of equal sets = %+v, want none", got)
	}
}

// TestPositions: live events carry the position after them; a resync
// diff's chunks carry the position from before it except the last, so a
// gateway stopped in the middle of a diff diffs again after a restart.
func TestPositions(t *testing.T) {
	m := fakemaster.New(3)
	for i := range 5 {
		m.Put("t", fmt.Sprintf("k%d", i), mem, "")
	}
	h := runWith(t, m, Config{ResyncChunk: 2}, nil)
	h.caughtUp(t)
	first := statedir.Position{Epoch: 3, Revision: m.Head()}
	want := []sinkCall{{statedir.Position{}, 2}, {statedir.Position{}, 2}, {first, 1}}
	if got := h.sink.positions(); !slices.Equal(got, want) {
		t.Fatalf("initial resync calls = %+v, want %+v", got, want)
	}
	h.sink.reset()
	m.Put("t", "k9", mem, "")
	h.caughtUp(t)
	want = []sinkCall{{statedir.Position{Epoch: 3, Revision: m.Head()}, 1}}
	if got := h.sink.positions(); !slices.Equal(got, want) {
		t.Fatalf("live calls = %+v, want %+v", got, want)
	}
}

// TestRestoreResumesWatch: a source restored with the set and position a
// stopped gateway had published resumes Watch from that position, so it
// publishes only the changes made since, with no resync.
func TestRestoreResumesWatch(t *testing.T) {
	m := fakemaster.New(5)
	m.Put("t", "a", mem, "g")
	m.Put("t", "b", disk, "")
	set := announced.New()
	set.Store("t", "a", kvevent.MediumCPU, "g")
	set.Store("t", "b", kvevent.MediumDisk, "")
	pos := statedir.Position{Epoch: 5, Revision: m.Head()}
	m.Remove("t", "a", mem) // while the gateway was down
	m.Put("t", "c", mem, "")
	h := runWith(t, m, Config{}, func(s *Source) { s.Restore(set, pos) })
	h.caughtUp(t)
	want := []kvevent.Event{
		{Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU, GroupID: "g"},
		{Type: kvevent.Stored, Tenant: "t", Key: "c", Medium: kvevent.MediumCPU},
	}
	if got := h.sink.events(); !slices.Equal(got, want) {
		t.Fatalf("events after restore = %+v, want %+v", got, want)
	}
	if s := h.src.Status(); s.Resyncs != 0 || s.Announced != 2 {
		t.Errorf("status = %+v, want no resync and 2 announced", s)
	}
}

// TestRestoreThenResync: the master restarted while the gateway was down
// (a new epoch), so the restored position cannot be resumed; the source
// resyncs and publishes only the difference from the restored set.
func TestRestoreThenResync(t *testing.T) {
	m := fakemaster.New(5)
	m.Put("t", "a", mem, "")
	m.Put("t", "b", mem, "")
	set := announced.New()
	set.Store("t", "a", kvevent.MediumCPU, "")
	set.Store("t", "b", kvevent.MediumCPU, "")
	pos := statedir.Position{Epoch: 5, Revision: m.Head()}
	m.Restart(6)
	m.Remove("t", "a", mem)
	m.Put("t", "c", disk, "")
	h := runWith(t, m, Config{}, func(s *Source) { s.Restore(set, pos) })
	h.caughtUp(t)
	want := []kvevent.Event{
		{Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU},
		{Type: kvevent.Stored, Tenant: "t", Key: "c", Medium: kvevent.MediumDisk},
	}
	if got := h.sink.events(); !slices.Equal(got, want) {
		t.Fatalf("events after restore = %+v, want %+v", got, want)
	}
	if s := h.src.Status(); s.Resyncs != 1 || s.Epoch != 6 {
		t.Errorf("status = %+v, want one resync into epoch 6", s)
	}
}
