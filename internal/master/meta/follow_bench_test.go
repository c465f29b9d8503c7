package meta

import (
	"context"
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/token"
)

// BenchmarkFollowDelta is a warm standby's steady state (issue 15): one
// agent's two segments, each TableDelta sealing size new objects and
// releasing the size sealed `live` objects earlier (a cache at its memory
// bound, evicting as it stores), so the store holds about live objects.
// ns/change is per change applied (a seal or a release).
func BenchmarkFollowDelta(b *testing.B) {
	for _, size := range []int{16, 128, 1024} {
		b.Run(fmt.Sprintf("delta=%d", size), func(b *testing.B) { benchFollowDelta(b, size) })
	}
}

func benchFollowDelta(b *testing.B, size int) {
	const live = 1 << 16
	e := newEnv(b, 1, 2, 1<<40, Config{})
	f, err := New(Config{}, Deps{Registry: e.c.Reg, Agents: e.c.Agents, Now: e.clk.Now,
		Identity: cluster.Identity{Keys: token.NewRing(0, nil)}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	f.SetFollowing(true)
	segs := e.c.Reg.Segments()
	agent := segs[0].AgentID
	ctx := context.Background()
	var id uint64
	alloc := func() *masterv1.Allocation {
		id++
		sg := segs[id%uint64(len(segs))]
		return &masterv1.Allocation{SegmentId: sg.ID, AllocationId: id, Offset: id * 4096, Size: 4096, Tenant: "default",
			Key: fmt.Sprintf("bench/object-%012d", id), State: masterv1.AllocationState_ALLOCATION_STATE_SEALED,
			Checksum: id, SealedUnixMs: 1_700_000_000_000 + int64(id)}
	}
	// ring holds the live allocations, oldest first, released in turn.
	ring := make([]*masterv1.Allocation, 0, live+size)
	for len(ring) < live {
		sealed := make([]*masterv1.Allocation, size)
		for i := range sealed {
			sealed[i] = alloc()
		}
		f.FollowDelta(ctx, agent, segs, sealed, nil)
		ring = append(ring, sealed...)
	}
	deltas := make([][2][]*masterv1.Allocation, 64) // prepared outside the timer
	prepare := func() {
		for i := range deltas {
			sealed := make([]*masterv1.Allocation, size)
			for j := range sealed {
				sealed[j] = alloc()
			}
			released := make([]*masterv1.Allocation, size)
			for j, a := range ring[:size] {
				released[j] = &masterv1.Allocation{SegmentId: a.GetSegmentId(), AllocationId: a.GetAllocationId(), Tenant: a.GetTenant(), Key: a.GetKey()}
			}
			ring = append(ring[size:], sealed...)
			deltas[i] = [2][]*masterv1.Allocation{sealed, released}
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%len(deltas) == 0 {
			b.StopTimer()
			prepare()
			b.StartTimer()
		}
		d := deltas[i%len(deltas)]
		f.FollowDelta(ctx, agent, segs, d[0], d[1])
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*2*size), "ns/change")
	if n, _, _ := f.Stats(); n < live/2 {
		b.Fatalf("the follower holds %d objects, want about %d", n, live)
	}
}
