package registry

import (
	"slices"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func newTestRegistry(t *testing.T) (*Registry, *testutil.Clock, *prometheus.Registry) {
	t.Helper()
	clk := testutil.NewClock(time.Unix(1_700_000_000, 0))
	reg := prometheus.NewRegistry()
	r, err := New(Config{Retention: time.Minute, DefaultGrace: 10 * time.Second}, Deps{Clock: clk.Now, Metrics: reg}, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	return r, clk, reg
}

func mem(id string, capacity uint64) *masterv1.SegmentInfo {
	return &masterv1.SegmentInfo{SegmentId: id, Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: capacity, Alignment: 64, Name: "mem-" + id}
}

func registration(agent string, segs ...*masterv1.SegmentInfo) Registration {
	return Registration{AgentID: agent, HostID: "host-" + agent, DataEndpoint: agent + ":50052", Segments: segs}
}

func mustRegister(t *testing.T, r *Registry, reg Registration) uint64 {
	t.Helper()
	gen, gone, err := r.Register(reg)
	if err != nil {
		t.Fatalf("Register(%s): %v", reg.AgentID, err)
	}
	if len(gone) != 0 {
		t.Fatalf("Register(%s) gone: got %v, want none", reg.AgentID, gone)
	}
	if _, ok := r.Activate(reg.AgentID, gen); !ok {
		t.Fatalf("Activate(%s) failed", reg.AgentID)
	}
	return gen
}

func state(t *testing.T, r *Registry, id string) (masterv1.SegmentLifecycle, masterv1.SegmentHealth) {
	t.Helper()
	s, ok := r.Segment(id)
	if !ok {
		t.Fatalf("segment %s not found", id)
	}
	return s.Lifecycle, s.Health
}

func wantState(t *testing.T, r *Registry, id string, lc masterv1.SegmentLifecycle, h masterv1.SegmentHealth) {
	t.Helper()
	gotLC, gotH := state(t, r, id)
	if gotLC != lc || gotH != h {
		t.Fatalf("segment %s: got %s/%s, want %s/%s", id, LifecycleLabel(gotLC), HealthLabel(gotH), LifecycleLabel(lc), HealthLabel(h))
	}
}

func TestCanTransition(t *testing.T) {
	all := []masterv1.SegmentLifecycle{lcOK, lcDraining, lcDrained, lcGraceful, lcUnmounting, lcUnmounted}
	legal := map[[2]masterv1.SegmentLifecycle]bool{
		{lcOK, lcDraining}: true, {lcOK, lcGraceful}: true, {lcOK, lcUnmounting}: true,
		{lcDraining, lcDrained}: true, {lcDraining, lcOK}: true, {lcDraining, lcGraceful}: true, {lcDraining, lcUnmounting}: true,
		{lcDrained, lcOK}: true, {lcDrained, lcDraining}: true, {lcDrained, lcGraceful}: true, {lcDrained, lcUnmounting}: true,
		{lcGraceful, lcUnmounting}:  true,
		{lcUnmounting, lcUnmounted}: true,
	}
	for _, from := range all {
		for _, to := range all {
			want := from == to || legal[[2]masterv1.SegmentLifecycle{from, to}]
			if got := CanTransition(from, to); got != want {
				t.Errorf("CanTransition(%s, %s): got %v, want %v", LifecycleLabel(from), LifecycleLabel(to), got, want)
			}
		}
	}
	if CanTransition(masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNSPECIFIED, lcOK) {
		t.Error("CanTransition from UNSPECIFIED: got true, want false")
	}
}

func TestSetLifecycle(t *testing.T) {
	tests := []struct {
		name     string
		path     []masterv1.SegmentLifecycle
		wantCode codes.Code
	}{
		{"drain", []masterv1.SegmentLifecycle{lcDraining, lcDrained}, codes.OK},
		{"drain then undrain", []masterv1.SegmentLifecycle{lcDraining, lcDrained, lcOK}, codes.OK},
		{"same state is a no-op", []masterv1.SegmentLifecycle{lcOK}, codes.OK},
		{"ok to drained skips draining", []masterv1.SegmentLifecycle{lcDrained}, codes.FailedPrecondition},
		{"unmounting is the session's", []masterv1.SegmentLifecycle{lcUnmounting}, codes.InvalidArgument},
		{"graceful is the session's", []masterv1.SegmentLifecycle{lcGraceful}, codes.InvalidArgument},
		{"unmounted is the session's", []masterv1.SegmentLifecycle{lcUnmounted}, codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, _, _ := newTestRegistry(t)
			mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
			var err error
			for _, lc := range tt.path {
				if err = r.SetLifecycle("s1", lc); err != nil {
					break
				}
			}
			if got := status.Code(rpcerr.Status(err)); got != tt.wantCode {
				t.Fatalf("code: got %v, want %v (err %v)", got, tt.wantCode, err)
			}
			if err == nil {
				wantState(t, r, "s1", tt.path[len(tt.path)-1], healthy)
			}
		})
	}
	r, _, _ := newTestRegistry(t)
	err := r.SetLifecycle("nope", lcDraining)
	if got := rpcerr.Reason(err); got != "SEGMENT_NOT_FOUND" {
		t.Fatalf("unknown segment reason: got %q, want SEGMENT_NOT_FOUND", got)
	}
}

func TestRegisterReconcilingThenHealthy(t *testing.T) {
	r, _, _ := newTestRegistry(t)
	gen, _, err := r.Register(registration("a1", mem("s1", 1<<20), mem("s2", 2<<20)))
	if err != nil {
		t.Fatal(err)
	}
	s, _ := r.Segment("s1")
	if s.CanAllocate() || s.CanServeRead() {
		t.Fatalf("segment usable before Activate: %+v", s)
	}
	segs, ok := r.Activate("a1", gen)
	if !ok || len(segs) != 2 {
		t.Fatalf("Activate: got %d segments ok=%v, want 2 true", len(segs), ok)
	}
	for _, s := range r.Segments() {
		if !s.CanAllocate() || !s.CanServeRead() || !s.CanContinueCleanup() {
			t.Fatalf("segment %s not usable after Activate: %+v", s.ID, s)
		}
		if s.AgentID != "a1" || s.HostID != "host-a1" || s.DataEndpoint != "a1:50052" || s.Medium != masterv1.Medium_MEDIUM_MEMORY {
			t.Fatalf("segment %s fields: got %+v", s.ID, s)
		}
	}
	d, _ := r.Detail("s2")
	if d.Alignment != 64 || d.Capacity != 2<<20 || d.Name != "mem-s2" {
		t.Fatalf("detail: got %+v", d)
	}
	a, _ := r.Agent("a1")
	if !a.Connected || !slices.Equal(a.SegmentIDs, []string{"s1", "s2"}) {
		t.Fatalf("agent: got %+v", a)
	}
}

func TestLivenessSuspectRecoverUnmount(t *testing.T) {
	const suspect, unmount = 3 * time.Second, 30 * time.Second
	r, clk, _ := newTestRegistry(t)
	gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20)))

	clk.Advance(2 * time.Second)
	if x := r.Expire(suspect, unmount); len(x.Suspected)+len(x.Unmounting) != 0 {
		t.Fatalf("early expiry: %+v", x)
	}
	r.Heartbeat("a1", gen, []*masterv1.SegmentInfo{{SegmentId: "s1", Capacity: 1 << 20, Used: 4096}})
	if s, _ := r.Segment("s1"); s.Used != 4096 {
		t.Fatalf("heartbeat usage: got %d, want 4096", s.Used)
	}
	clk.Advance(suspect)
	x := r.Expire(suspect, unmount)
	if !slices.Equal(x.Suspected, []string{"s1"}) {
		t.Fatalf("suspected: got %v, want [s1]", x.Suspected)
	}
	wantState(t, r, "s1", lcOK, suspected)

	r.Heartbeat("a1", gen, nil)
	wantState(t, r, "s1", lcOK, healthy)

	clk.Advance(unmount)
	x = r.Expire(suspect, unmount)
	if !slices.Equal(x.Unmounting, []string{"s1"}) || !slices.Equal(x.Lost, []string{"a1"}) {
		t.Fatalf("expiry: got %+v, want s1 unmounting and a1 lost", x)
	}
	wantState(t, r, "s1", lcUnmounting, healthy)
	if s, _ := r.Segment("s1"); s.CanAllocate() || s.CanServeRead() {
		t.Fatal("UNMOUNTING segment must not allocate or serve reads")
	}
	r.MarkUnmounted(x.Unmounting)
	wantState(t, r, "s1", lcUnmounted, healthy)
	if got := len(r.Segments()); got != 0 {
		t.Fatalf("Segments after unmount: got %d, want 0", got)
	}
	if got := len(r.Details()); got != 1 {
		t.Fatalf("Details keeps UNMOUNTED: got %d, want 1", got)
	}
	r.Disconnect("a1", gen)
	clk.Advance(2 * time.Minute)
	r.Expire(suspect, unmount)
	if _, ok := r.Segment("s1"); ok {
		t.Fatal("UNMOUNTED segment not forgotten after retention")
	}
	if _, ok := r.Agent("a1"); ok {
		t.Fatal("lost agent not forgotten after retention")
	}
}

func TestReconnectWithinWindow(t *testing.T) {
	r, clk, _ := newTestRegistry(t)
	gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20), mem("s2", 1<<20)))
	if err := r.SetLifecycle("s2", lcDraining); err != nil {
		t.Fatal(err)
	}
	if got := r.Disconnect("a1", gen); len(got) != 0 {
		t.Fatalf("Disconnect unmounting: got %v, want none", got)
	}
	wantState(t, r, "s1", lcOK, suspected)
	clk.Advance(5 * time.Second)
	if x := r.Expire(3*time.Second, 30*time.Second); len(x.Unmounting) != 0 {
		t.Fatalf("unmounted inside the window: %+v", x)
	}
	gen2, gone, err := r.Register(registration("a1", mem("s1", 1<<20), mem("s2", 1<<20)))
	if err != nil || len(gone) != 0 {
		t.Fatalf("re-register: gone %v err %v", gone, err)
	}
	if gen2 <= gen {
		t.Fatalf("gen: got %d, want > %d", gen2, gen)
	}
	if r.Heartbeat("a1", gen, nil) {
		t.Fatal("heartbeat with the old gen accepted")
	}
	r.Activate("a1", gen2)
	wantState(t, r, "s1", lcOK, healthy)
	wantState(t, r, "s2", lcDraining, healthy)
}

func TestRegisterDropsSegmentsNoLongerListed(t *testing.T) {
	r, _, _ := newTestRegistry(t)
	gen := mustRegister(t, r, registration("a1", mem("old-mem", 1<<20), mem("disk", 1<<20)))
	r.Disconnect("a1", gen)
	// The agent restarted: a memory segment gets a new id, the disk one keeps its id.
	_, gone, err := r.Register(registration("a1", mem("new-mem", 1<<20), mem("disk", 1<<20)))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gone, []string{"old-mem"}) {
		t.Fatalf("gone: got %v, want [old-mem]", gone)
	}
	wantState(t, r, "old-mem", lcUnmounting, suspected)
	r.MarkUnmounted(gone)
	a, _ := r.Agent("a1")
	if !slices.Equal(a.SegmentIDs, []string{"disk", "new-mem"}) {
		t.Fatalf("agent segments: got %v", a.SegmentIDs)
	}
}

func TestRegisterConflicts(t *testing.T) {
	r, _, _ := newTestRegistry(t)
	gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20)))

	_, _, err := r.Register(registration("a2", mem("s1", 1<<20)))
	if got := status.Code(rpcerr.Status(err)); got != codes.FailedPrecondition {
		t.Fatalf("segment of a connected agent: got %v, want FailedPrecondition", got)
	}

	r.Disconnect("a1", gen)
	r.Unmount("a1", gen, []string{"s1"}) // disconnected: ignored
	wantState(t, r, "s1", lcOK, suspected)

	// Force UNMOUNTING through liveness, then a registration must wait.
	r2, clk, _ := newTestRegistry(t)
	g := mustRegister(t, r2, registration("a1", mem("s1", 1<<20)))
	r2.Disconnect("a1", g)
	clk.Advance(time.Hour)
	x := r2.Expire(time.Second, 2*time.Second)
	if !slices.Equal(x.Unmounting, []string{"s1"}) {
		t.Fatalf("unmounting: got %v", x.Unmounting)
	}
	_, _, err = r2.Register(registration("a1", mem("s1", 1<<20)))
	if got := status.Code(rpcerr.Status(err)); got != codes.FailedPrecondition || rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("register during unmount: got %v %q, want FailedPrecondition SEGMENT_UNAVAILABLE", got, rpcerr.Reason(err))
	}
	r2.MarkUnmounted(x.Unmounting)
	// A disk segment coming back after it was unmounted is mounted afresh,
	// even by another agent.
	g2, _, err := r2.Register(registration("a2", mem("s1", 1<<20)))
	if err != nil {
		t.Fatalf("remount: %v", err)
	}
	r2.Activate("a2", g2)
	wantState(t, r2, "s1", lcOK, healthy)
	if s, _ := r2.Segment("s1"); s.AgentID != "a2" {
		t.Fatalf("remounted owner: got %q, want a2", s.AgentID)
	}
}

func TestGracefulUnmount(t *testing.T) {
	t.Run("deadline", func(t *testing.T) {
		r, clk, _ := newTestRegistry(t)
		gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
		r.Deregister("a1", gen, 5*time.Second)
		wantState(t, r, "s1", lcGraceful, healthy)
		s, _ := r.Segment("s1")
		if s.CanAllocate() || !s.CanServeRead() {
			t.Fatalf("GRACEFULLY_UNMOUNTING: CanAllocate %v CanServeRead %v, want false true", s.CanAllocate(), s.CanServeRead())
		}
		clk.Advance(4 * time.Second)
		r.Heartbeat("a1", gen, nil)
		if x := r.Expire(3*time.Second, 30*time.Second); len(x.Unmounting) != 0 {
			t.Fatalf("unmounted before the deadline: %+v", x)
		}
		clk.Advance(time.Second)
		r.Heartbeat("a1", gen, nil)
		x := r.Expire(3*time.Second, 30*time.Second)
		if !slices.Equal(x.Unmounting, []string{"s1"}) || !slices.Equal(x.Lost, []string{"a1"}) {
			t.Fatalf("at the deadline: got %+v", x)
		}
		// The lost agent's stream may end before or after the unmount
		// completes; either way the segment ends UNMOUNTED/HEALTHY.
		if got := r.Disconnect("a1", gen); len(got) != 0 {
			t.Fatalf("Disconnect during the unmount: got %v, want none", got)
		}
		wantState(t, r, "s1", lcUnmounting, healthy)
		r.MarkUnmounted([]string{"s1"})
		wantState(t, r, "s1", lcUnmounted, healthy)
	})
	t.Run("stream closes", func(t *testing.T) {
		r, _, _ := newTestRegistry(t)
		gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
		r.Deregister("a1", gen, time.Minute)
		if got := r.Disconnect("a1", gen); !slices.Equal(got, []string{"s1"}) {
			t.Fatalf("Disconnect after Deregister: got %v, want [s1]", got)
		}
		wantState(t, r, "s1", lcUnmounting, suspected)
	})
	t.Run("never back to ok", func(t *testing.T) {
		r, _, _ := newTestRegistry(t)
		gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
		r.Deregister("a1", gen, time.Minute)
		if err := r.SetLifecycle("s1", lcOK); err == nil {
			t.Fatal("GRACEFULLY_UNMOUNTING → OK accepted")
		}
		mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
		wantState(t, r, "s1", lcGraceful, healthy)
	})
	t.Run("reconnect keeps the deadline", func(t *testing.T) {
		r, clk, _ := newTestRegistry(t)
		gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
		r.Deregister("a1", gen, 5*time.Second)
		r.Disconnect("a1", gen) // closes after Deregister: unmount now
		r.MarkUnmounted([]string{"s1"})
		// The agent comes back, not stopping, with a new segment and a
		// second one that had been stopping on another path.
		gen = mustRegister(t, r, registration("a1", mem("s2", 1<<20), mem("s3", 1<<20)))
		r.Deregister("a1", gen, 5*time.Second)
		r.Disconnect("a1", gen)
		r.MarkUnmounted([]string{"s2", "s3"})
		gen = mustRegister(t, r, registration("a1", mem("s4", 1<<20)))
		clk.Advance(10 * time.Second)
		r.Heartbeat("a1", gen, nil)
		if x := r.Expire(3*time.Second, 30*time.Second); len(x.Unmounting)+len(x.Lost) != 0 {
			t.Fatalf("a fresh registration after a graceful stop expired: %+v", x)
		}
		wantState(t, r, "s4", lcOK, healthy)
	})
	t.Run("graceful segment survives a reconnect until its deadline", func(t *testing.T) {
		r, clk, _ := newTestRegistry(t)
		gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20), mem("s2", 1<<20)))
		r.Deregister("a1", gen, 5*time.Second)
		r.Disconnect("a1", gen)
		r.MarkUnmounted([]string{"s1", "s2"})
		reg := registration("a1", mem("s3", 1<<20))
		reg.Graceful = true
		mustRegister(t, r, reg)
		wantState(t, r, "s3", lcGraceful, healthy)
		// A replacing Connect without graceful: s3 stays
		// GRACEFULLY_UNMOUNTING and still ends at its deadline
		// (DefaultGrace, 10 s).
		gen, _, err := r.Register(registration("a1", mem("s3", 1<<20)))
		if err != nil {
			t.Fatal(err)
		}
		r.Activate("a1", gen)
		wantState(t, r, "s3", lcGraceful, healthy)
		clk.Advance(9 * time.Second)
		r.Heartbeat("a1", gen, nil)
		if x := r.Expire(3*time.Second, 30*time.Second); len(x.Unmounting) != 0 {
			t.Fatalf("before the deadline: %+v", x)
		}
		clk.Advance(time.Second)
		r.Heartbeat("a1", gen, nil)
		x := r.Expire(3*time.Second, 30*time.Second)
		if !slices.Equal(x.Unmounting, []string{"s3"}) || !slices.Equal(x.Lost, []string{"a1"}) {
			t.Fatalf("at the deadline: got %+v, want s3 unmounting and a1 lost", x)
		}
	})
	t.Run("graceful registration", func(t *testing.T) {
		r, _, _ := newTestRegistry(t)
		reg := registration("a1", mem("s1", 1<<20))
		reg.Graceful = true
		mustRegister(t, r, reg)
		wantState(t, r, "s1", lcGraceful, healthy)
		if a, _ := r.Agent("a1"); a.GraceDeadline.IsZero() {
			t.Fatal("graceful registration without a deadline")
		}
	})
}

func TestMountUnmountUpdate(t *testing.T) {
	r, _, _ := newTestRegistry(t)
	mustRegister(t, r, registration("a1", mem("s1", 1<<20)))
	mustRegister(t, r, registration("a2", mem("other", 1<<20)))
	gen := mustRegister(t, r, registration("a1", mem("s1", 1<<20))) // reconnect: new gen
	if skipped := r.Mount("a1", gen, []*masterv1.SegmentInfo{mem("s2", 1<<20), mem("other", 1)}); !slices.Equal(skipped, []string{"other"}) {
		t.Fatalf("skipped: got %v, want [other]", skipped)
	}
	wantState(t, r, "s2", lcOK, healthy)
	if got := r.Unmount("a1", gen, []string{"s2", "other", "nope"}); !slices.Equal(got, []string{"s2"}) {
		t.Fatalf("unmount: got %v, want [s2]", got)
	}
	r.MarkUnmounted([]string{"s2"})
	wantState(t, r, "s2", lcUnmounted, healthy)
}

func TestSegmentsMetric(t *testing.T) {
	r, _, reg := newTestRegistry(t)
	gen := mustRegister(t, r, registration("a1", mem("s1", 1), mem("s2", 1)))
	if err := r.SetLifecycle("s2", lcDraining); err != nil {
		t.Fatal(err)
	}
	r.Disconnect("a1", gen)
	want := `
# HELP crescent_master_segments Segments known to the master, by lifecycle and health.
# TYPE crescent_master_segments gauge
crescent_master_segments{health="suspected",lifecycle="draining"} 1
crescent_master_segments{health="suspected",lifecycle="ok"} 1
`
	if err := promtest.GatherAndCompare(reg, strings.NewReader(want), "crescent_master_segments"); err != nil {
		t.Fatal(err)
	}
}

// TestRegisterHostBound: with the host proven by a certificate, an agent of
// another host cannot take over an agent_id or a segment, even one whose
// agent is disconnected (the unauthenticated rule only protects connected
// ones); an UNMOUNTED segment may be mounted afresh from anywhere.
func TestRegisterHostBound(t *testing.T) {
	r, clk, _ := newTestRegistry(t)
	bound := func(reg Registration) Registration { reg.HostBound = true; return reg }
	gen := mustRegister(t, r, bound(registration("a1", mem("s1", 1<<20))))
	r.Disconnect("a1", gen)

	wantDenied := func(what string, reg Registration) {
		t.Helper()
		_, _, err := r.Register(reg)
		if got := status.Code(rpcerr.Status(err)); got != codes.PermissionDenied || rpcerr.Reason(err) != "ILLEGAL_CLIENT" {
			t.Fatalf("%s: got %v %q (%v), want PermissionDenied ILLEGAL_CLIENT", what, got, rpcerr.Reason(err), err)
		}
	}
	// Same agent_id, no segments, another host: the attack that dropped a
	// real agent's replicas.
	evil := bound(registration("a1"))
	evil.HostID = "host-evil"
	wantDenied("agent_id of another host", evil)
	// Another agent_id claiming the disconnected agent's segment.
	wantDenied("segment of another host", bound(registration("evil", mem("s1", 1<<20))))
	if s, _ := r.Segment("s1"); s.AgentID != "a1" || s.HostID != "host-a1" {
		t.Fatalf("s1 changed hands: %+v", s)
	}
	// The rightful host comes back.
	if _, _, err := r.Register(bound(registration("a1", mem("s1", 1<<20)))); err != nil {
		t.Fatalf("rightful re-register: %v", err)
	}
	// Once unmounted, the segment id is free.
	clk.Advance(time.Hour)
	r.Disconnect("a1", 2)
	x := r.Expire(time.Second, 2*time.Second)
	r.MarkUnmounted(x.Unmounting)
	if _, _, err := r.Register(bound(registration("a2", mem("s1", 1<<20)))); err != nil {
		t.Fatalf("unmounted segment from another host: %v", err)
	}
}
