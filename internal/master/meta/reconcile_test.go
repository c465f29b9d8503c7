package meta

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

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
		Identity: cluster.Identity{Epoch: 43, Keys: token.NewRing(0, nil)}}, nil)
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
			_ = e.s.withObject(DefaultTenant, "k", func(_ *shard, o *object) error { sum, n = o.checksum, len(o.replicas); return nil })
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
	if got := rpcerr.Reason(err); got != "PUT_EXPIRED" {
		t.Fatalf("PutEnd of a dropped write: got %q, want PUT_EXPIRED (TestPutLostMidWriteExpired)", got)
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

// TestReconcilePrepaysTenants: a rebuild charges each tenant once per
// shard run (mut.prepay) instead of once per object; with two tenants
// interleaved in a chunk, an object that exists already, a duplicate
// replica, a RESERVED allocation and one refused for its bounds, each
// tenant's usage still equals what it holds afterwards.
func TestReconcilePrepaysTenants(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	sealed := masterv1.AllocationState_ALLOCATION_STATE_SEALED
	var allocs []*masterv1.Allocation
	for i := range 200 {
		tn := []string{"t1", "t2"}[i%2]
		allocs = append(allocs, &masterv1.Allocation{SegmentId: "seg-0-0", AllocationId: uint64(1000 + i), Offset: uint64(4096 * (i + 1)),
			Size: uint64(10 + i), State: sealed, Tenant: tn, Key: fmt.Sprintf("k%03d", i), SealedUnixMs: 1, Checksum: 7})
	}
	allocs = append(allocs,
		&masterv1.Allocation{SegmentId: "seg-0-0", AllocationId: 5000, Offset: 1 << 19, Size: 10, State: sealed, Tenant: "t1", Key: "k000", SealedUnixMs: 1, Checksum: 7},
		&masterv1.Allocation{SegmentId: "seg-0-0", AllocationId: 5001, Offset: 1<<19 + 4096, Size: 50, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Tenant: "t2", Key: "reserved"},
		&masterv1.Allocation{SegmentId: "seg-0-0", AllocationId: 5002, Offset: 0, Size: 1 << 40, State: sealed, Tenant: "t2", Key: "huge", SealedUnixMs: 1},
	)
	e.s.Reconcile(t.Context(), "agent-0", e.c.Reg.Segments(), allocs)
	type usage struct{ bytes, objects uint64 }
	held := map[string]usage{}
	for i := range e.s.shards {
		sh := &e.s.shards[i]
		sh.mu.Lock()
		for tn, objs := range sh.tenants {
			for _, o := range objs.all() {
				u := held[e.s.tenants.get(tn).name]
				u.bytes += o.size
				u.objects++
				held[e.s.tenants.get(tn).name] = u
			}
		}
		sh.mu.Unlock()
	}
	for _, tn := range []string{"t1", "t2"} {
		q, err := e.s.TenantQuota(t.Context(), tn)
		if err != nil {
			t.Fatal(err)
		}
		if h := held[tn]; q.GetUsedObjects() != h.objects || q.GetUsedBytes() != h.bytes || h.objects != 100 {
			t.Fatalf("tenant %s: usage %d objects %d bytes, holds %d objects %d bytes (want 100 objects)",
				tn, q.GetUsedObjects(), q.GetUsedBytes(), h.objects, h.bytes)
		}
	}
}
