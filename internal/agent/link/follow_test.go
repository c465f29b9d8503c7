package link

import (
	"fmt"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/testutil"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// followHarness is a link with a feed and one standby, following it, whose
// Connect session with the master is registered.
func followHarness(t *testing.T, o harnessOpts) *harness {
	t.Helper()
	o.feed, o.standbys, o.cfg.FollowStandbys = true, 1, true
	if o.cfg.FollowRetry == 0 {
		o.cfg.FollowRetry = 50 * time.Millisecond
	}
	h := newHarness(t, o)
	sealedAlloc(t, h.mem, "before-0", []byte("zero"))
	gone := sealedAlloc(t, h.mem, "before-1", []byte("one"))
	if err := h.mem.Release(gone.GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	sealedAlloc(t, h.mem, "before-2", []byte("two"))
	h.start()
	s := h.session()
	st := settings(1)
	st.GetSettings().Resumed = true
	s.send <- st
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected")
	return h
}

// sealedTable is the SEALED rows of table by allocation id.
func sealedTable(table []*masterv1.Allocation) map[uint64]*masterv1.Allocation {
	out := map[uint64]*masterv1.Allocation{}
	for _, a := range table {
		if a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			out[a.GetAllocationId()] = a
		}
	}
	return out
}

// TestFollowerDeltas: the follower registers with the standby as a Connect
// does (the whole table, with the position read before it), waits for
// Settings with standby, then sends every change after that position in
// TableDeltas whose versions chain without a gap, and heartbeats; the
// table plus the deltas is the agent's table. The leader's MASTER_IS_LEADER
// does not disturb it.
func TestFollowerDeltas(t *testing.T) {
	h := followHarness(t, harnessOpts{})
	fs := h.follow(h.standbys[0])
	r := fs.reg
	inst, v0 := h.feed.Position()
	if r.GetResume() || !r.GetChunked() || r.GetAllocationCount() != 2 || len(fs.allocs) != 2 || r.GetAgentId() != "agent-1" || len(r.GetSegments()) != 1 {
		t.Fatalf("follow Register = %v with %d allocations; want a full chunked registration of 2", r, len(fs.allocs))
	}
	if p := r.GetTablePosition(); p.GetInstance() != inst || p.GetVersion() != v0 || v0 != 4 {
		t.Fatalf("follow table_position %v, want %s/4", p, inst)
	}
	fs.send <- standbySettings()

	// Changes while following: seals, releases of sealed allocations, and
	// a reservation released unsealed (not a change).
	var live []uint64
	for i := range 40 {
		a := sealedAlloc(t, h.mem, fmt.Sprint("k", i), []byte(strings.Repeat("x", i+1)))
		live = append(live, a.GetAllocationId())
		if i%3 == 2 {
			if err := h.mem.Release(live[0]); err != nil {
				t.Fatal(err)
			}
			live = live[1:]
		}
	}
	p, err := h.mem.Reserve(&masterv1.ReserveItem{Size: 3, Key: "pending"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := h.mem.Release(p.GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	_, final := h.feed.Position()
	if final != v0+40+13 {
		t.Fatalf("feed version %d, want %d", final, v0+40+13)
	}

	table := sealedTable(fs.allocs)
	deltas := 0
	for from := v0; from < final; {
		d := fs.next(t).GetTableDelta()
		if d == nil {
			t.Fatal("want a TableDelta")
		}
		if d.GetFromVersion() != from {
			t.Fatalf("delta from_version %d, want %d (the previous delta's version)", d.GetFromVersion(), from)
		}
		if n := uint64(len(d.GetSealed()) + len(d.GetReleased())); d.GetVersion() != from+n || n == 0 {
			t.Fatalf("delta %d..%d carries %d changes", d.GetFromVersion(), d.GetVersion(), n)
		}
		for _, a := range d.GetSealed() {
			table[a.GetAllocationId()] = a
		}
		for _, a := range d.GetReleased() {
			if a.GetSegmentId() != h.mem.ID() || a.GetKey() == "" || a.GetTenant() != "t" {
				t.Fatalf("released %v, want its segment, tenant and key", a)
			}
			delete(table, a.GetAllocationId())
		}
		from = d.GetVersion()
		deltas++
	}
	want := sealedTable(h.segs.Table())
	if len(table) != len(want) {
		t.Fatalf("table with the deltas holds %d sealed allocations, want %d", len(table), len(want))
	}
	for id, a := range want {
		if !proto.Equal(table[id], a) {
			t.Fatalf("allocation %d: %v, want %v", id, table[id], a)
		}
	}
	hb := fs.heartbeat(t)
	if len(hb.GetSegments()) != 1 || hb.GetSegments()[0].GetSegmentId() != h.mem.ID() {
		t.Fatalf("follow heartbeat = %v", hb)
	}
	if got := h.master.followCalls.Load(); got < 1 {
		t.Fatal("the leader was never asked to be followed")
	}
	for name, tc := range map[string]struct {
		got, want float64
	}{
		"established": {promtest.ToFloat64(h.link.met.followEstablished), 1},
		"streams":     {promtest.ToFloat64(h.link.met.following), 1},
		"deltas":      {promtest.ToFloat64(h.link.met.followDeltas), float64(deltas)},
		"changes":     {promtest.ToFloat64(h.link.met.followChanges), float64(final - v0)},
		"resyncs":     {promtest.ToFloat64(h.link.met.followResyncs), 0},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %v, want %v", name, tc.got, tc.want)
		}
	}
}

// TestFollowRetriesWithoutSpinning: the leader answers every Follow with
// MASTER_IS_LEADER and is asked again every FollowRetry; a master failing
// otherwise is asked again after a growing backoff.
func TestFollowRetriesWithoutSpinning(t *testing.T) {
	h := followHarness(t, harnessOpts{cfg: Config{FollowRetry: 100 * time.Millisecond},
		standbyFollowErr: func() error { return status.Error(codes.Unavailable, "standby down") }})
	leader0, standby0 := h.master.followCalls.Load(), h.standbys[0].followCalls.Load()
	time.Sleep(1200 * time.Millisecond)
	leader, standby := h.master.followCalls.Load()-leader0, h.standbys[0].followCalls.Load()-standby0
	t.Logf("in 1.2 s: %d Follow calls to the leader, %d to the failing standby", leader, standby)
	// Every 80-100 ms: 12 to 15 calls.
	if leader < 6 || leader > 16 {
		t.Errorf("leader asked %d times in 1.2 s, want about 12 (FollowRetry 100ms)", leader)
	}
	// 200 ms, 400 ms, 800 ms (each jittered to half): at most 6.
	if standby < 1 || standby > 6 {
		t.Errorf("failing standby asked %d times in 1.2 s, want a few (backoff from 200ms)", standby)
	}
	if got := promtest.ToFloat64(h.link.met.followEstablished); got != 0 {
		t.Errorf("follow streams established = %v, want 0", got)
	}
}

// TestFollowBehindResyncs: a follower the feed's ring has moved past ends
// its stream and follows again with the whole table, from the position
// now.
func TestFollowBehindResyncs(t *testing.T) {
	h := followHarness(t, harnessOpts{feedSize: 4})
	fs := h.follow(h.standbys[0])
	_, v0 := h.feed.Position()
	if fs.reg.GetTablePosition().GetVersion() != v0 {
		t.Fatalf("follow table_position %v, want version %d", fs.reg.GetTablePosition(), v0)
	}
	fs.send <- standbySettings()

	// One batch of 10 seals: more than the ring holds before the follower
	// can read any of them.
	const n = 10
	args := make([]segment.SealArg, n)
	for i := range args {
		a, err := h.mem.Reserve(&masterv1.ReserveItem{SegmentId: h.mem.ID(), Size: 8, Tenant: "t", Key: fmt.Sprint("batch-", i), ReplicaId: 1}, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		args[i] = segment.SealArg{ID: a.GetAllocationId(), Checksum: checksum.Sum(make([]byte, 8))}
	}
	for i, err := range h.mem.Seal(args, time.Now()) {
		if err != nil {
			t.Fatalf("seal %d: %v", i, err)
		}
	}
	_, v1 := h.feed.Position()

	fs2 := h.follow(h.standbys[0])
	if p := fs2.reg.GetTablePosition(); p.GetVersion() != v1 || len(fs2.allocs) != 2+n || fs2.reg.GetAllocationCount() != 2+n {
		t.Fatalf("second follow registration at %v with %d allocations, want version %d and %d", p, len(fs2.allocs), v1, 2+n)
	}
	select {
	case <-fs.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the stream that fell behind never ended")
	}
	if got := promtest.ToFloat64(h.link.met.followResyncs); got != 1 {
		t.Fatalf("resyncs = %v, want 1", got)
	}
	fs2.send <- standbySettings()
	sealedAlloc(t, h.mem, "after", []byte("after"))
	d := fs2.next(t).GetTableDelta()
	if d.GetFromVersion() != v1 || d.GetVersion() != v1+1 || len(d.GetSealed()) != 1 || d.GetSealed()[0].GetKey() != "after" {
		t.Fatalf("delta after the resync = %v, want the seal of %q from version %d", d, "after", v1)
	}
}

// TestFollowNeedsStandby: Settings without standby on a Follow stream ends
// it; the follower tries again.
func TestFollowNeedsStandby(t *testing.T) {
	h := followHarness(t, harnessOpts{})
	fs := h.follow(h.standbys[0])
	fs.send <- settings(1)
	select {
	case <-fs.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the follow stream did not end")
	}
	fs2 := h.follow(h.standbys[0])
	fs2.send <- standbySettings()
	testutil.Eventually(t, 5*time.Second, func() bool { return promtest.ToFloat64(h.link.met.following) == 1 }, "following")
}

// TestFollowOncePerMaster: a master listed twice is followed once (two
// streams of one agent would replace each other at the master).
func TestFollowOncePerMaster(t *testing.T) {
	h := followHarness(t, harnessOpts{masters: func(list string) string { return list + ",passthrough:///standby-0" }})
	fs := h.follow(h.standbys[0])
	fs.send <- standbySettings()
	testutil.Eventually(t, 5*time.Second, func() bool { return promtest.ToFloat64(h.link.met.following) == 1 }, "following")
	time.Sleep(200 * time.Millisecond)
	if n := h.standbys[0].followCalls.Load(); n != 1 {
		t.Fatalf("standby asked to be followed %d times, want 1", n)
	}
}

// TestNoFollowUnlessEnabled: without FollowStandbys the link never calls
// Follow.
func TestNoFollowUnlessEnabled(t *testing.T) {
	h := newHarness(t, harnessOpts{feed: true, standbys: 1})
	s := connected(t, h, 1)
	s.heartbeat(t)
	time.Sleep(100 * time.Millisecond)
	if a, b := h.master.followCalls.Load(), h.standbys[0].followCalls.Load(); a != 0 || b != 0 {
		t.Fatalf("Follow calls %d and %d, want none", a, b)
	}
}

// TestDeltaBounds: a TableDelta holds at most maxDeltaChanges changes (the
// read's limit) and about maxDeltaBytes, and at least one change.
func TestDeltaBounds(t *testing.T) {
	mem, err := segment.NewMemory("bounds", 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	f := segment.NewFeed(1 << 14)
	mem.SetFeed(f)
	seal := func(n, keyLen int) {
		args := make([]segment.SealArg, n)
		for i := range args {
			a, err := mem.Reserve(&masterv1.ReserveItem{SegmentId: mem.ID(), Size: 1, Tenant: "t", Key: fmt.Sprintf("%0*d", keyLen, i)}, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			args[i] = segment.SealArg{ID: a.GetAllocationId(), Checksum: checksum.Sum(make([]byte, 1))}
		}
		for _, err := range mem.Seal(args, time.Now()) {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	seal(maxDeltaChanges+100, 8)
	changes, err := f.Read(nil, 0, maxDeltaChanges)
	if err != nil {
		t.Fatal(err)
	}
	if d := newDelta(0, changes); d.GetVersion() != maxDeltaChanges || len(d.GetSealed()) != maxDeltaChanges || d.SizeVT() > maxDeltaBytes {
		t.Fatalf("delta of small changes: version %d, %d sealed, %d bytes", d.GetVersion(), len(d.GetSealed()), d.SizeVT())
	}
	_, v := f.Position()
	seal(2000, 1000) // about 1 KiB each
	changes, err = f.Read(nil, v, maxDeltaChanges)
	if err != nil {
		t.Fatal(err)
	}
	d := newDelta(v, changes)
	if n := d.GetVersion() - v; n < 500 || n >= 2000 || d.SizeVT() > maxDeltaBytes+2048 {
		t.Fatalf("delta of 1 KiB changes: %d changes, %d bytes; want about %d bytes", n, d.SizeVT(), maxDeltaBytes)
	}
	seal(1, 2<<20) // one change past the bound still goes
	_, v = f.Position()
	changes, err = f.Read(nil, v-1, maxDeltaChanges)
	if err != nil {
		t.Fatal(err)
	}
	if d := newDelta(v-1, changes); d.GetVersion() != v {
		t.Fatalf("delta of one large change: version %d, want %d", d.GetVersion(), v)
	}
}

// TestFollowedStandbyElected: a followed standby that ends its follow
// stream with MASTER_IS_LEADER was elected. The link leaves its session
// with the old leader at once and connects to the standby, instead of
// waiting for that session to fail: a leader that froze (SIGSTOP) kept it
// open until keepalive gave up, 15 s, and the new leader waits for this
// agent before it serves (make run-ha: puts came back 15.1 s after the
// freeze).
func TestFollowedStandbyElected(t *testing.T) {
	h := followHarness(t, harnessOpts{}) // its session with the leader is up
	sb := h.standbys[0]
	fs := h.follow(sb)
	fs.send <- standbySettings()
	sealedAlloc(t, h.mem, "after", []byte("x"))
	fs.next(t) // its delta: the follow stream is established
	fs.drop <- errMasterLeader()
	select {
	case s := <-sb.sessions:
		if !s.reg.GetResume() {
			t.Errorf("the Connect to the elected standby does not resume (the standby holds the table): %v", s.reg)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the link did not connect to the elected standby within 5 s; its session with the old leader is still open")
	}
}
