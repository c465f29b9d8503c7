package meta

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

// tableDiff is what changed in an agent's table between two reads, as
// its Follow feed reports it: allocations newly SEALED, SEALED ones gone.
func tableDiff(before, after []*masterv1.Allocation) (sealed, released []*masterv1.Allocation) {
	type k struct {
		seg string
		id  uint64
	}
	sealedIn := func(t []*masterv1.Allocation) map[k]*masterv1.Allocation {
		m := map[k]*masterv1.Allocation{}
		for _, a := range t {
			if a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
				m[k{a.GetSegmentId(), a.GetAllocationId()}] = a
			}
		}
		return m
	}
	b, a := sealedIn(before), sealedIn(after)
	for key, x := range a {
		if _, ok := b[key]; !ok {
			sealed = append(sealed, x)
		}
	}
	for key, x := range b {
		if _, ok := a[key]; !ok {
			released = append(released, x)
		}
	}
	return sealed, released
}

// TestFollowMatchesRebuild runs puts, upserts and removes on a leader's
// store while a following store takes each agent's table once and then
// only its changes (FollowDelta, with deltas that repeat what the table
// showed): after every round the follower holds what the leader holds,
// and what a rebuild from the tables would. Promote keeps the objects and
// starts the change log over in the new epoch.
func TestFollowMatchesRebuild(t *testing.T) {
	for seed := range uint64(8) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { testFollowMatchesRebuild(t, seed) })
	}
}

func testFollowMatchesRebuild(t *testing.T, seed uint64) {
	e := newEnv(t, 3, 1, 1<<20, Config{Shards: 8})
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 2))
	for i := range 30 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: uint64(10 + i), ReplicaNum: 1 + i%3})
	}
	f, err := New(Config{Shards: 8}, Deps{Registry: e.c.Reg, Agents: e.c.Agents, Now: e.clk.Now,
		Identity: cluster.Identity{Epoch: 0, Keys: token.NewRing(0, nil)}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.SetFollowing(true)
	agents := map[string][]cluster.Segment{}
	for _, sg := range e.c.Reg.Segments() {
		agents[sg.AgentID] = append(agents[sg.AgentID], sg)
	}
	last := map[string][]*masterv1.Allocation{}
	for a, segs := range agents {
		// The table, then a delta repeating part of it (the feed's
		// changes after the position read before the table was taken).
		last[a] = e.c.Agents.Table(a)
		if back := f.Reconcile(ctx, a, segs, last[a]); len(back) != 0 {
			t.Fatalf("follow registration of %s returned %v", a, back)
		}
		rep, _ := tableDiff(nil, last[a])
		f.FollowDelta(ctx, a, segs, rep[:len(rep)/2], nil)
	}
	for round := range 20 {
		for range 10 {
			k := fmt.Sprintf("k%d", rng.IntN(40))
			switch rng.IntN(3) {
			case 0:
				_ = e.s.Remove(ctx, RemoveSpec{Key: k, Force: true})
			default:
				sp := PutSpec{Key: k, Size: uint64(10 + rng.IntN(50)), ReplicaNum: 1 + rng.IntN(3), Upsert: true, ClientID: "w"}
				if _, err := e.s.PutStart(ctx, sp); err != nil {
					continue
				}
				if err := e.s.PutEnd(ctx, PutEndSpec{Key: k, ClientID: "w", Checksum: sp.Size * 7}); err != nil {
					t.Fatal(err)
				}
			}
			e.clk.Advance(1)
		}
		for a, segs := range agents {
			now := e.c.Agents.Table(a)
			sealed, released := tableDiff(last[a], now)
			f.FollowDelta(ctx, a, segs, sealed, released)
			last[a] = now
		}
		if got, want := views(f), views(e.s); !maps.Equal(got, want) {
			t.Fatalf("round %d: follower differs from the leader:\n got %v\nwant %v", round, got, want)
		}
	}
	if owed := f.TakeOwed("agent-0", segIDs(e.c.Reg.Segments())); len(owed) != 0 {
		t.Fatalf("follower owes %v; the leader released everything itself", owed)
	}
	before := views(f)
	f.Promote(cluster.Identity{Epoch: 77, Keys: token.NewRing(0, nil)})
	if f.Epoch() != 77 || f.Log().Epoch() != 77 || f.Log().Head() != 0 {
		t.Fatalf("promoted: epoch %d, log epoch %d head %d; want 77, 77, 0", f.Epoch(), f.Log().Epoch(), f.Log().Head())
	}
	if got := views(f); !maps.Equal(got, before) {
		t.Fatalf("Promote changed the objects")
	}
}

// TestFollowOwesLosers checks that a following store never sends a
// release: an older version it will not adopt is owed, and handed out
// once by TakeOwed; releasing it at the agent clears the debt.
func TestFollowOwesLosers(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := context.Background()
	e.s.SetFollowing(true)
	segs := e.c.Reg.Segments()
	a0, a1 := segs[0], segs[1]
	mk := func(sg cluster.Segment, id uint64, sum uint64, sealedMs int64) *masterv1.Allocation {
		return &masterv1.Allocation{SegmentId: sg.ID, AllocationId: id, Offset: id * 64, Size: 10, Tenant: "",
			State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k", Checksum: sum, SealedUnixMs: sealedMs}
	}
	old, newer := mk(a0, 1, 100, 1), mk(a1, 1, 200, 2)
	e.s.FollowDelta(ctx, a0.AgentID, []cluster.Segment{a0}, []*masterv1.Allocation{old}, nil)
	e.s.FollowDelta(ctx, a1.AgentID, []cluster.Segment{a1}, []*masterv1.Allocation{newer}, nil)
	if _, _, rel := e.c.Agents.Calls(); rel != 0 {
		t.Fatalf("a following store sent %d releases", rel)
	}
	owed := e.s.TakeOwed(a0.AgentID, []string{a0.ID, a1.ID})
	if len(owed) != 1 || owed[0].GetSegmentId() != a0.ID || owed[0].GetAllocationId() != 1 {
		t.Fatalf("owed %v, want the older version on %s", owed, a0.ID)
	}
	if again := e.s.TakeOwed(a0.AgentID, []string{a0.ID}); len(again) != 0 {
		t.Fatalf("TakeOwed twice: %v", again)
	}
	// The newer version is the object; released, it is gone.
	e.s.FollowDelta(ctx, a1.AgentID, []cluster.Segment{a1}, nil, []*masterv1.Allocation{newer})
	if o, _, _ := e.s.Stats(); o != 0 {
		t.Fatalf("%d objects after the release, want 0", o)
	}
}

// TestPromoteDropsReplicasOnUnmountedSegments: a delta applied after its
// segment was unmounted (the standby's sweep found the agent lost while
// its follow stream went on) left replicas on a segment no registration
// drops again: listed after the election, never readable. Promote drops
// them.
func TestPromoteDropsReplicasOnUnmountedSegments(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := context.Background()
	e.s.SetFollowing(true)
	segs := e.c.Reg.Segments()
	a0, a1 := segs[0], segs[1]
	mk := func(sg cluster.Segment, id uint64, key string) *masterv1.Allocation {
		return &masterv1.Allocation{SegmentId: sg.ID, AllocationId: id, Offset: id * 64, Size: 10,
			State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: key, Checksum: 100 + id, SealedUnixMs: int64(id)}
	}
	e.s.FollowDelta(ctx, a0.AgentID, []cluster.Segment{a0}, []*masterv1.Allocation{mk(a0, 1, "lost")}, nil)
	e.s.FollowDelta(ctx, a1.AgentID, []cluster.Segment{a1}, []*masterv1.Allocation{mk(a1, 1, "kept")}, nil)
	e.s.DropSegments(ctx, []string{a0.ID})
	if err := e.c.Reg.SetLifecycle(a0.ID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED); err != nil {
		t.Fatal(err)
	}
	e.s.FollowDelta(ctx, a0.AgentID, []cluster.Segment{a0}, []*masterv1.Allocation{mk(a0, 2, "ghost")}, nil)
	if o, _, _ := e.s.Stats(); o != 2 {
		t.Fatalf("%d objects before the promotion, want 2 (kept, and the ghost on the unmounted segment)", o)
	}
	e.s.Promote(cluster.Identity{MasterID: "m2", Epoch: 43, Keys: token.NewRing(0, nil)})
	if o, _, _ := e.s.Stats(); o != 1 {
		t.Fatalf("%d objects after the promotion, want 1 (kept)", o)
	}
	if ok, err := e.s.Exist(ctx, DefaultTenant, "kept"); err != nil || !ok {
		t.Fatalf("Exist(kept) = %v, %v", ok, err)
	}
}

func segIDs(segs []cluster.Segment) []string {
	out := make([]string, len(segs))
	for i, s := range segs {
		out[i] = s.ID
	}
	return out
}

// TestPutEndRetriedAfterEnd: a PutEnd for an object that has ended (the
// retry of one whose answer was lost, or one sent to a new leader that
// holds the object from the agents' tables) is OK for the same bytes and
// PUT_EXPIRED for others, alone and in a batch.
func TestPutEndRetriedAfterEnd(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "k", Size: 10, ReplicaNum: 2}) // checksum 70
	for _, sum := range []uint64{70, 71} {
		single := e.s.PutEnd(ctx, PutEndSpec{Key: "k", ClientID: "w", Checksum: sum})
		batch := e.s.BatchPutEnd(ctx, []PutEndSpec{{Key: "k", ClientID: "w", Checksum: sum}})[0]
		for name, err := range map[string]error{"PutEnd": single, "BatchPutEnd": batch} {
			if ok := err == nil; ok != (sum == 70) {
				t.Fatalf("%s again with checksum %d: %v", name, sum, err)
			}
			if sum == 71 && rpcerr.Reason(err) != "PUT_EXPIRED" {
				t.Fatalf("%s with other bytes: %v, want PUT_EXPIRED", name, err)
			}
		}
	}
}
