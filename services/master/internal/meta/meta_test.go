package meta

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/services/master/internal/adminsvc"
	"github.com/crescent-kv/crescent/services/master/internal/changelog"
	"github.com/crescent-kv/crescent/services/master/internal/cluster"
	"github.com/crescent-kv/crescent/services/master/internal/meta/metatest"
)

// The store is what AdminService and the agent side consume.
var (
	_ adminsvc.Meta    = (*Store)(nil)
	_ cluster.Metadata = (*Store)(nil)
)

func (e *env) put(t testing.TB, sp PutSpec) {
	t.Helper()
	if sp.ClientID == "" {
		sp.ClientID = "w"
	}
	if sp.Size == 0 {
		sp.Size = 10
	}
	ctx := context.Background()
	if _, err := e.s.PutStart(ctx, sp); err != nil {
		t.Fatalf("PutStart %s/%s: %v", sp.Tenant, sp.Key, err)
	}
	if err := e.s.PutEnd(ctx, PutEndSpec{Tenant: sp.Tenant, Key: sp.Key, ClientID: sp.ClientID, Checksum: sp.Size * 7}); err != nil {
		t.Fatalf("PutEnd %s/%s: %v", sp.Tenant, sp.Key, err)
	}
}

func (e *env) records(t testing.TB) []string {
	t.Helper()
	recs, _, _, err := e.s.log.Read(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range recs {
		out = append(out, fmt.Sprintf("%s:%s/%s", map[changelog.Type]string{changelog.Stored: "stored", changelog.Removed: "removed", changelog.Cleared: "cleared"}[r.Type], r.Tenant, r.Key))
	}
	return out
}

// objectView is what a restarted master must rebuild.
type objectView struct {
	size, checksum  uint64
	group           string
	hard, soft      bool
	replicas        int
	readableOnSegs  string
	softPinDeadline int64
}

func views(s *Store) map[ObjectRef]objectView {
	out := map[ObjectRef]objectView{}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for t, objs := range sh.tenants {
			for k, o := range objs {
				var segs []string
				for _, r := range o.replicas {
					if r.status == stComplete {
						segs = append(segs, s.segs.get(r.seg).id)
					}
				}
				slices.Sort(segs)
				out[ObjectRef{s.tenants.get(t).name, k}] = objectView{
					size: o.size, checksum: o.checksum, group: o.group,
					hard: o.flags&flagHardPin != 0, soft: o.flags&flagSoftPin != 0,
					replicas: len(o.replicas), readableOnSegs: fmt.Sprint(segs), softPinDeadline: o.softPinMs,
				}
			}
		}
		sh.mu.Unlock()
	}
	return out
}

func TestReconcileRebuildsAfterRestart(t *testing.T) {
	e := newEnv(t, 3, 1, 1<<20, Config{Shards: 8})
	ctx := t.Context()
	for i := range 20 {
		e.put(t, PutSpec{Tenant: []string{"", "a", "b"}[i%3], Key: fmt.Sprintf("k%d", i), Size: uint64(10 + i), ReplicaNum: 1 + i%3,
			Group: fmt.Sprintf("g%d", i%2), HardPin: i%5 == 0, SoftPin: i%4 == 0})
	}
	// A write in progress: its RESERVED allocation is not adopted.
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "open", Size: 5, ReplicaNum: 1, ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	before := views(e.s)
	delete(before, ObjectRef{DefaultTenant, "open"})
	wantUse, _ := e.s.TenantQuota(ctx, "a")

	// A new master (new epoch) learns everything from registrations.
	s2, err := New(Config{Shards: 8}, Deps{Registry: e.c.Reg, Agents: e.c.Agents, Now: e.clk.Now,
		Identity: cluster.Identity{Epoch: 43, TokenKey: []byte("k")}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for h := range 3 {
		agent := fmt.Sprintf("agent-%d", h)
		var segs []cluster.Segment
		for _, sg := range e.c.Reg.Segments() {
			if sg.AgentID == agent {
				segs = append(segs, sg)
			}
		}
		if back := s2.Reconcile(ctx, agent, segs, e.c.Agents.Table(agent)); len(back) != 0 {
			t.Fatalf("Reconcile(%s) returned %v, want nothing to release", agent, back)
		}
	}
	if got := views(s2); !maps.Equal(got, before) {
		t.Fatalf("rebuilt objects differ:\n got %v\nwant %v", got, before)
	}
	gotUse, _ := s2.TenantQuota(ctx, "a")
	if gotUse.UsedBytes != wantUse.UsedBytes || gotUse.UsedObjects != wantUse.UsedObjects {
		t.Fatalf("tenant a usage: got %v, want %v", gotUse, wantUse)
	}
	e2 := &env{s: s2, c: e.c, clk: e.clk}
	f := &follower{set: map[rkey]bool{}}
	f.catchUp(t, s2.log)
	if want := readableSet(s2); !maps.Equal(f.set, want) || len(want) != 20 {
		t.Fatalf("change log of the new master: got %d entries, want %d (20)", len(f.set), len(want))
	}
	// Reconciling again (a reconnect) changes nothing.
	head := s2.log.Head()
	for h := range 3 {
		agent := fmt.Sprintf("agent-%d", h)
		s2.Reconcile(ctx, agent, e.c.Reg.Segments()[h:h+1], e.c.Agents.Table(agent))
	}
	if s2.log.Head() != head {
		t.Fatalf("second reconcile recorded %d changes, want 0", s2.log.Head()-head)
	}
	// The open put's reservation is the agent's to expire; forget it here.
	for r, al := range e.c.Agents.Live() {
		if al.Key == "open" {
			_ = e.c.Agents.Release(ctx, e.c.Reg.Segments()[0].AgentID, []*masterv1.AllocationRef{{SegmentId: r.Segment, AllocationId: r.ID}})
		}
	}
	checkInvariants(t, e2, &follower{set: map[rkey]bool{}})
}

func alloc(seg string, id uint64, tenant, key string, checksum uint64, sealedMs int64) *masterv1.Allocation {
	return &masterv1.Allocation{SegmentId: seg, AllocationId: id, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED,
		Tenant: tenant, Key: key, ReplicaId: 1, Checksum: checksum, SealedUnixMs: sealedMs}
}

func segsOf(c *metatest.Cluster, agent string) []cluster.Segment {
	var out []cluster.Segment
	for _, sg := range c.Reg.Segments() {
		if sg.AgentID == agent {
			out = append(out, sg)
		}
	}
	return out
}

func TestReconcileRules(t *testing.T) {
	type call struct {
		agent  string
		allocs []*masterv1.Allocation
	}
	tests := []struct {
		name     string
		setup    func(t *testing.T, e *env)
		calls    []call
		returned [][]uint64 // allocation ids returned per call
		checksum uint64     // of object "k" afterwards (0 = absent)
		replicas int
		recs     []string
	}{
		{name: "adopt new object", calls: []call{{"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 1, "", "k", 5, 100)}}},
			returned: [][]uint64{nil}, checksum: 5, replicas: 1, recs: []string{"stored:default/k"}},
		{name: "same version on two agents: both adopted",
			calls:    []call{{"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 1, "", "k", 5, 100)}}, {"agent-1", []*masterv1.Allocation{alloc("seg-1-0", 9, "", "k", 5, 100)}}},
			returned: [][]uint64{nil, nil}, checksum: 5, replicas: 2, recs: []string{"stored:default/k"}},
		{name: "newer sealed wins when it registers second",
			calls:    []call{{"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 1, "", "k", 5, 100)}}, {"agent-1", []*masterv1.Allocation{alloc("seg-1-0", 9, "", "k", 6, 200)}}},
			returned: [][]uint64{nil, nil}, checksum: 6, replicas: 1, recs: []string{"stored:default/k", "removed:default/k", "stored:default/k"}},
		{name: "older sealed loses when it registers second",
			calls:    []call{{"agent-1", []*masterv1.Allocation{alloc("seg-1-0", 9, "", "k", 6, 200)}}, {"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 1, "", "k", 5, 100)}}},
			returned: [][]uint64{nil, {1}}, checksum: 6, replicas: 1, recs: []string{"stored:default/k"}},
		{name: "two versions on one agent: newest wins",
			calls:    []call{{"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 1, "", "k", 5, 100), alloc("seg-0-1", 2, "", "k", 6, 300)}}},
			returned: [][]uint64{{1}}, checksum: 6, replicas: 1, recs: []string{"stored:default/k"}},
		{name: "invalid tag is returned", calls: []call{{"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 1, "", "", 5, 100)}}},
			returned: [][]uint64{{1}}},
		{name: "reserved allocation is left alone", calls: []call{{"agent-0", []*masterv1.Allocation{{SegmentId: "seg-0-0", AllocationId: 3, Size: 10,
			State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Key: "k"}}}}, returned: [][]uint64{nil}},
		{name: "write in progress: sealed allocation returned", setup: func(t *testing.T, e *env) {
			if _, err := e.s.PutStart(t.Context(), PutSpec{Key: "k", Size: 10, ClientID: "w", PreferLocalHost: "host-1"}); err != nil {
				t.Fatal(err)
			}
		}, calls: []call{{"agent-0", []*masterv1.Allocation{alloc("seg-0-0", 77, "", "k", 5, 100)}}}, returned: [][]uint64{{77}}, replicas: 1},
		{name: "reconnect keeps a write in progress", setup: func(t *testing.T, e *env) {
			if _, err := e.s.PutStart(t.Context(), PutSpec{Key: "k", Size: 10, ClientID: "w", Preferred: []string{"seg-0-0"}}); err != nil {
				t.Fatal(err)
			}
		}, calls: []call{{"agent-0", nil}}, returned: [][]uint64{nil}, replicas: 1},
		{name: "replica the agent lacks is removed", setup: func(t *testing.T, e *env) {
			e.put(t, PutSpec{Key: "k", ReplicaNum: 2, Preferred: []string{"seg-0-0", "seg-1-0"}})
			e.put(t, PutSpec{Key: "solo", Preferred: []string{"seg-0-0"}})
		}, calls: []call{{"agent-0", []*masterv1.Allocation{}}}, returned: [][]uint64{nil}, checksum: 70, replicas: 1,
			recs: []string{"stored:default/k", "stored:default/solo", "removed:default/solo"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, 2, 2, 1<<20, Config{Shards: 4})
			if tt.setup != nil {
				tt.setup(t, e)
			}
			for i, c := range tt.calls {
				allocs := c.allocs
				if allocs == nil {
					allocs = e.c.Agents.Table(c.agent) // the agent's real table
				}
				back := e.s.Reconcile(t.Context(), c.agent, segsOf(e.c, c.agent), allocs)
				var ids []uint64
				for _, r := range back {
					ids = append(ids, r.AllocationId)
				}
				if !slices.Equal(ids, tt.returned[i]) {
					t.Fatalf("call %d returned %v, want %v", i, ids, tt.returned[i])
				}
			}
			var sum uint64
			n := 0
			_ = e.s.withObject(DefaultTenant, "k", func(o *object) error { sum, n = o.checksum, len(o.replicas); return nil })
			if sum != tt.checksum || n != tt.replicas {
				t.Fatalf("object k: checksum %d replicas %d, want %d, %d", sum, n, tt.checksum, tt.replicas)
			}
			if got := e.records(t); !slices.Equal(got, tt.recs) {
				t.Fatalf("changes: got %v, want %v", got, tt.recs)
			}
		})
	}
}

func TestDropSegments(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Key: "both", ReplicaNum: 2})
	e.put(t, PutSpec{Key: "only0", Preferred: []string{"seg-0-0"}, Size: 30})
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "writing", Size: 5, ClientID: "w", Preferred: []string{"seg-0-0"}}); err != nil {
		t.Fatal(err)
	}
	if got := e.s.SegmentReplicaCounts(); got["seg-0-0"] != 3 || got["seg-1-0"] != 1 {
		t.Fatalf("replica counts: got %v, want seg-0-0:3 seg-1-0:1", got)
	}
	e.s.DropSegments(ctx, []string{"seg-0-0", "unknown"})
	e.c.Agents.Unmount("seg-0-0")
	if got, want := e.records(t), []string{"stored:default/both", "stored:default/only0", "removed:default/only0"}; !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	if _, err := e.s.Get(ctx, GetSpec{Key: "both"}); err != nil {
		t.Fatalf("both after drop: %v", err)
	}
	err := e.s.PutEnd(ctx, PutEndSpec{Key: "writing", ClientID: "w"})
	if got := rpcerr.Reason(err); got != "OBJECT_NOT_FOUND" {
		t.Fatalf("PutEnd of a dropped write: got %q, want OBJECT_NOT_FOUND", got)
	}
	if got := e.s.SegmentReplicaCounts(); got["seg-0-0"] != 0 || got["seg-1-0"] != 1 {
		t.Fatalf("replica counts: got %v", got)
	}
	objs, bytes, _ := e.s.Stats()
	if objs != 1 || bytes != 10 {
		t.Fatalf("stats: got %d objects %d bytes, want 1, 10", objs, bytes)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

func TestDrainMovesReplicas(t *testing.T) {
	e := newEnv(t, 3, 1, 1000, Config{Shards: 4})
	ctx := t.Context()
	for i := range 5 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 50, Preferred: []string{"seg-0-0"}, HardPin: i == 0})
	}
	e.put(t, PutSpec{Key: "two", Size: 50, ReplicaNum: 2, Preferred: []string{"seg-0-0", "seg-1-0"}})
	if err := e.s.DrainSegment(ctx, "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	sg, _ := e.c.Reg.Segment("seg-0-0")
	if sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
		t.Fatalf("lifecycle: got %v, want DRAINED", sg.Lifecycle)
	}
	if n := e.s.SegmentReplicaCounts()["seg-0-0"]; n != 0 {
		t.Fatalf("replicas left on the drained segment: %d", n)
	}
	for _, r := range e.records(t) {
		if r[:7] == "removed" {
			t.Fatalf("drain with room recorded %s; want no visibility change", r)
		}
	}
	v := views(e.s)
	if got := v[ObjectRef{DefaultTenant, "two"}].readableOnSegs; got != "[seg-1-0 seg-2-0]" {
		t.Fatalf("two: readable on %s, want seg-1-0 and seg-2-0", got)
	}
	if !v[ObjectRef{DefaultTenant, "k0"}].hard {
		t.Fatal("k0 lost its hard pin in the move")
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed || al.Checksum != 350 {
			t.Fatalf("allocation %v: sealed %v checksum %d, want sealed with 350", r, al.Sealed, al.Checksum)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	_ = e.s.DrainSegment(ctx, "nope")
	if err := e.s.DrainSegment(ctx, "nope"); rpcerr.Reason(err) != "SEGMENT_NOT_FOUND" {
		t.Fatalf("drain unknown: got %v, want SEGMENT_NOT_FOUND", err)
	}
}

func TestDrainWithoutRoomRemoves(t *testing.T) {
	e := newEnv(t, 2, 1, 100, Config{Shards: 4})
	e.put(t, PutSpec{Key: "a", Size: 60, Preferred: []string{"seg-0-0"}})
	e.put(t, PutSpec{Key: "b", Size: 60, Preferred: []string{"seg-1-0"}})
	if err := e.s.DrainSegment(t.Context(), "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	if got, want := e.records(t), []string{"stored:default/a", "stored:default/b", "removed:default/a"}; !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

func TestEvictionOrder(t *testing.T) {
	// One 1000-byte segment, 100-byte objects: 9 objects reach the 90 %
	// watermark; eviction goes down to 80 %.
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	ctx := t.Context()
	for i := range 9 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100, HardPin: i == 0, SoftPin: i == 1})
		e.clk.Advance(time.Second)
	}
	// k2 is leased (read now); k3 was read long ago, which refreshes its
	// clock past k4..k8's completion.
	e.clk.Advance(-20 * time.Second)
	if _, err := e.s.Get(ctx, GetSpec{Key: "k3"}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(40 * time.Second)
	if _, err := e.s.Get(ctx, GetSpec{Key: "k2"}); err != nil {
		t.Fatal(err)
	}
	e.s.evictOverHigh(ctx)
	gone := func() []string {
		var out []string
		for i := range 9 {
			if _, err := e.s.GetSize(ctx, DefaultTenant, fmt.Sprintf("k%d", i)); err != nil {
				out = append(out, fmt.Sprintf("k%d", i))
			}
		}
		return out
	}
	// Needs 100 bytes: the least recently used unpinned, unleased one is k3.
	if got, want := gone(), []string{"k3"}; !slices.Equal(got, want) {
		t.Fatalf("evicted: got %v, want %v", got, want)
	}
	// Ask for much more: every unpinned candidate goes before the soft-pinned
	// k1; the hard-pinned k0 and leased k2 never go.
	e.s.evict(ctx, []evictTarget{{seg: 0, need: 450}})
	if got, want := gone(), []string{"k3", "k4", "k5", "k6", "k7", "k8"}; !slices.Equal(got, want) {
		t.Fatalf("evicted: got %v, want %v", got, want)
	}
	e.s.evict(ctx, []evictTarget{{seg: 0, need: 1000}})
	if got, want := gone(), []string{"k1", "k3", "k4", "k5", "k6", "k7", "k8"}; !slices.Equal(got, want) {
		t.Fatalf("evicted: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

func TestPutStartEvictsWhenFull(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	for i := range 10 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100})
	}
	// Full: the next put evicts (down to the low watermark) and retries.
	e.put(t, PutSpec{Key: "new", Size: 100})
	if used := e.c.Agents.Used("seg-0-0"); used > 900 {
		t.Fatalf("segment use after eviction: got %d, want <= 900", used)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
	// Everything hard-pinned: no room, and the put fails cleanly.
	e2 := newEnv(t, 1, 1, 300, Config{Shards: 4})
	for i := range 3 {
		e2.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100, HardPin: true})
	}
	_, err := e2.s.PutStart(t.Context(), PutSpec{Key: "x", Size: 100, ClientID: "w"})
	if got := rpcerr.Reason(err); got != "NO_AVAILABLE_HANDLE" {
		t.Fatalf("put on a pinned-full segment: got %q, want NO_AVAILABLE_HANDLE", got)
	}
	checkInvariants(t, e2, &follower{set: map[rkey]bool{}})
}

func TestRunEvictsInBackground(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4, EvictInterval: time.Hour})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	for i := range 10 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 95})
	}
	deadline := time.Now().Add(5 * time.Second)
	for e.c.Agents.Used("seg-0-0") > 800 {
		if time.Now().After(deadline) {
			t.Fatalf("background eviction did not run: use %d", e.c.Agents.Used("seg-0-0"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := e.s.Close(); err != nil {
		t.Fatal(err)
	}
	_ = e.s.Close()
}

func TestSoftPinTTL(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	e.put(t, PutSpec{Key: "k", SoftPin: true, SoftPinTTL: time.Minute})
	_ = e.s.withObject(DefaultTenant, "k", func(o *object) error {
		if !o.softPinned(e.clk.ms.Load()) {
			t.Fatal("want soft-pinned right after PutEnd")
		}
		if !o.softPinned(e.clk.ms.Load()+59_000) || o.softPinned(e.clk.ms.Load()+61_000) {
			t.Fatal("soft pin must last one minute from completion")
		}
		return nil
	})
	_, err := e.s.PutStart(t.Context(), PutSpec{Key: "x", Size: 1, SoftPin: true, SoftPinTTL: 25 * time.Hour, ClientID: "w"})
	if rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("25h soft pin: got %v, want INVALID_PARAMS", err)
	}
}

func TestQuotaShrunkBelowUsageRejectsOnlyGrowth(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Tenant: "q", Key: "a", Size: 100})
	e.put(t, PutSpec{Tenant: "q", Key: "b", Size: 100})
	if _, err := e.s.SetTenantQuota(ctx, "q", 150, 0); err != nil {
		t.Fatal(err)
	}
	_, err := e.s.PutStart(ctx, PutSpec{Tenant: "q", Key: "c", Size: 1, ClientID: "w"})
	if rpcerr.Reason(err) != "TENANT_QUOTA_EXCEEDED" {
		t.Fatalf("growth over quota: got %v", err)
	}
	// Shrinking an object by upsert is allowed; growing it is not.
	if _, err := e.s.PutStart(ctx, PutSpec{Tenant: "q", Key: "a", Size: 200, ClientID: "w", Upsert: true}); rpcerr.Reason(err) != "TENANT_QUOTA_EXCEEDED" {
		t.Fatalf("upsert growth: got %v", err)
	}
	if _, err := e.s.GetSize(ctx, "q", "a"); err != nil {
		t.Fatalf("a failed upsert must keep the old object: %v", err)
	}
	e.put(t, PutSpec{Tenant: "q", Key: "a", Size: 10, Upsert: true})
	if err := e.s.Remove(ctx, RemoveSpec{Tenant: "q", Key: "b"}); err != nil {
		t.Fatal(err)
	}
	q, _ := e.s.TenantQuota(ctx, "q")
	if q.UsedBytes != 10 || q.UsedObjects != 1 || q.MaxBytes != 150 {
		t.Fatalf("quota: got %v", q)
	}
	if l := e.s.ListTenants(ctx); len(l) != 1 || l[0].Tenant != "q" {
		t.Fatalf("tenants: got %v", l)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestConcurrentOverlappingKeys runs many goroutines on a few keys with
// every operation, then checks the invariants once the dust settles.
func TestConcurrentOverlappingKeys(t *testing.T) {
	e := newEnv(t, 3, 2, 4000, Config{Shards: 8})
	ctx := t.Context()
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	tenants := []string{"x", "y"}
	var wg sync.WaitGroup
	wg.Go(func() {
		// Drains race with everything else.
		for _, seg := range []string{"seg-0-0", "seg-1-1"} {
			for deadline := time.Now().Add(10 * time.Second); e.s.log.Head() < 100 && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
			if err := e.s.DrainSegment(ctx, seg); err != nil {
				t.Errorf("drain %s: %v", seg, err)
			}
		}
	})
	for g := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			client := fmt.Sprintf("c%d", g)
			for range 300 {
				tn, k := tenants[rng.IntN(2)], keys[rng.IntN(len(keys))]
				switch rng.IntN(9) {
				case 0, 1:
					if _, err := e.s.PutStart(ctx, PutSpec{Tenant: tn, Key: k, Size: uint64(1 + rng.IntN(300)), ReplicaNum: 1 + rng.IntN(3), ClientID: client, Upsert: rng.IntN(2) == 0}); err == nil {
						if rng.IntN(4) == 0 {
							_ = e.s.PutRevoke(ctx, PutRevokeSpec{Tenant: tn, Key: k, ClientID: client})
						} else {
							_ = e.s.PutEnd(ctx, PutEndSpec{Tenant: tn, Key: k, ClientID: client, Checksum: 1})
						}
					}
				case 2:
					specs := []PutSpec{{Tenant: tn, Key: k, Size: 50, ClientID: client}, {Tenant: tn, Key: keys[rng.IntN(len(keys))], Size: 70, ClientID: client}}
					var ends []PutEndSpec
					for i, r := range e.s.BatchPutStart(ctx, specs) {
						if r.Err == nil {
							ends = append(ends, PutEndSpec{Tenant: tn, Key: specs[i].Key, ClientID: client})
						}
					}
					e.s.BatchPutEnd(ctx, ends)
				case 3:
					_, _ = e.s.Get(ctx, GetSpec{Tenant: tn, Key: k})
				case 4:
					e.s.BatchGet(ctx, []GetSpec{{Tenant: tn, Key: k}, {Tenant: tn, Key: keys[rng.IntN(len(keys))]}})
				case 5:
					_ = e.s.Remove(ctx, RemoveSpec{Tenant: tn, Key: k, Force: rng.IntN(2) == 0})
				case 6:
					e.s.BatchRemove(ctx, []RemoveSpec{{Tenant: tn, Key: k, Force: true}, {Tenant: tn, Key: keys[rng.IntN(len(keys))]}})
				case 7:
					if rng.IntN(10) == 0 {
						_, _, _ = e.s.RemoveAll(ctx, tn, true)
					} else {
						_, _ = e.s.Exist(ctx, tn, k)
					}
				case 8:
					if rng.IntN(10) == 0 {
						e.s.evictFor(ctx, masterv1.Medium_MEDIUM_MEMORY, 500, 300)
					} else {
						_, _, _ = e.s.Snapshot(ctx, tn)
					}
				}
			}
		})
	}
	wg.Wait()
	// Puts left open by a racing writer are revoked so the check sees no
	// pending work; the invariants must hold either way.
	for _, tn := range tenants {
		for _, k := range keys {
			_ = e.s.withObject(tn, k, func(o *object) error {
				if o.put != nil {
					t.Logf("open put left on %s/%s", tn, k)
				}
				return nil
			})
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestListObjectsPages lists a tenant of a few thousand keys spread over
// every shard in pages of several sizes, with and without a prefix, and
// gets every matching key exactly once, in order.
func TestListObjectsPages(t *testing.T) {
	e := newEnv(t, 2, 2, 1<<40, Config{})
	rng := rand.New(rand.NewPCG(1, 2))
	var all []string
	seen := map[string]bool{}
	for len(all) < 3000 {
		k := fmt.Sprintf("%s/%x", []string{"a", "b", "ab"}[rng.IntN(3)], rng.Uint64()%1_000_000)
		if seen[k] {
			continue
		}
		seen[k] = true
		all = append(all, k)
		e.put(t, PutSpec{Tenant: "t", Key: k, Size: 1, ReplicaNum: 1, ClientID: "w"})
	}
	e.put(t, PutSpec{Tenant: "other", Key: "a/0", Size: 1, ReplicaNum: 1, ClientID: "w"})
	slices.Sort(all)
	for _, prefix := range []string{"", "a", "ab/", "zz"} {
		var want []string
		for _, k := range all {
			if strings.HasPrefix(k, prefix) {
				want = append(want, k)
			}
		}
		for _, size := range []int{1, 7, 1000, 5000} {
			var got []string
			tok := ""
			for pages := 0; ; pages++ {
				infos, next, err := e.s.ListObjects(t.Context(), "t", prefix, size, tok)
				if err != nil {
					t.Fatal(err)
				}
				if len(infos) > size {
					t.Fatalf("prefix %q size %d: page of %d", prefix, size, len(infos))
				}
				for _, in := range infos {
					got = append(got, in.GetKey())
				}
				if tok = next; tok == "" {
					break
				}
				if pages > len(all) {
					t.Fatalf("prefix %q size %d: listing does not end", prefix, size)
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("prefix %q page size %d: got %d keys, want %d (first difference near %v)", prefix, size, len(got), len(want), firstDiff(got, want))
			}
		}
	}
}

func firstDiff(a, b []string) string {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Sprintf("index %d: %q vs %q", i, a[i], b[i])
		}
	}
	return fmt.Sprintf("lengths %d vs %d", len(a), len(b))
}
