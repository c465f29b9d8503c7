package meta

import (
	"cmp"
	"context"
	"fmt"
	"runtime"
	"slices"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/token"
)

// BenchmarkReconcileRebuild is a restarted master's rebuild (issue 15,
// item 1) without the network: two agents' tables of 512k sealed 64 B
// allocations each, marshalled as the agents send them (RegisterChunks of
// 16,384 allocations of one segment), are decoded as the master's codec
// decodes them and applied to a new, empty store. It reports the time, the
// bytes and the allocations per object of decode and apply together: fresh
// heap is what a restarted master pays for most, page faults included.
//
// together: the agents' chunks interleave (they register at once); turns:
// one agent's whole table, then the other's, whose objects are older than
// most of the list by then (a registration that lags).
func BenchmarkReconcileRebuild(b *testing.B) {
	b.Run("together", func(b *testing.B) { benchRebuild(b, true) })
	b.Run("turns", func(b *testing.B) { benchRebuild(b, false) })
}

func benchRebuild(b *testing.B, together bool) {
	const perAgent, chunk = 1 << 19, 16384
	c := metatest.NewCluster(2, 1, 1<<40)
	segs := c.Reg.Segments()
	chunks := make([][][]byte, len(segs))
	for a, sg := range segs {
		for lo := 0; lo < perAgent; lo += chunk {
			ch := &masterv1.RegisterChunk{SegmentId: sg.ID, Last: lo+chunk >= perAgent}
			for i := lo; i < lo+chunk; i++ {
				ch.Allocations = append(ch.Allocations, &masterv1.Allocation{
					AllocationId: uint64(i + 1), Offset: uint64(i) * 64, Size: 64,
					State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Tenant: "default",
					Key: fmt.Sprintf("restart/%d/%08d", a, i), ReplicaId: 1, Checksum: uint64(i)*0x9e3779b97f4a7c15 + 1,
					CreatedUnixMs: 1_800_000_000_000, SealedUnixMs: 1_800_000_000_000 + int64(i/1000),
				})
			}
			buf, err := ch.MarshalVT()
			if err != nil {
				b.Fatal(err)
			}
			chunks[a] = append(chunks[a], buf)
		}
	}
	const n = 2 * perAgent
	ctx := context.Background()
	var total runtime.MemStats
	for b.Loop() {
		b.StopTimer()
		s, err := New(Config{}, Deps{Registry: c.Reg, Agents: &metatest.NullAgents{},
			Identity: cluster.Identity{Epoch: 1, Keys: token.NewRing(0, nil)}}, nil)
		if err != nil {
			b.Fatal(err)
		}
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		b.StartTimer()
		// The agents register at once: their chunks interleave.
		runs := make([]cluster.Reconciler, len(segs))
		for a, sg := range segs {
			runs[a] = s.BeginReconcile(ctx, sg.AgentID, []cluster.Segment{sg}, perAgent)
		}
		type step struct{ agent, chunk int }
		var order []step
		for i := range chunks[0] {
			for a := range runs {
				order = append(order, step{a, i})
			}
		}
		if !together {
			slices.SortStableFunc(order, func(x, y step) int { return cmp.Compare(x.agent, y.agent) })
		}
		for _, st := range order {
			{
				r, buf := runs[st.agent], chunks[st.agent][st.chunk]
				ch := &masterv1.RegisterChunk{}
				if err := ch.UnmarshalVT(buf); err != nil {
					b.Fatal(err)
				}
				for _, al := range ch.GetAllocations() {
					al.SegmentId = ch.GetSegmentId()
				}
				if back := r.Apply(ctx, ch.GetAllocations()); len(back) != 0 {
					b.Fatalf("%d allocations returned", len(back))
				}
			}
		}
		for _, r := range runs {
			r.Finish(ctx)
		}
		b.StopTimer()
		runtime.ReadMemStats(&after)
		if objs, _, _ := s.Stats(); objs != n {
			b.Fatalf("%d objects rebuilt, want %d", objs, n)
		}
		total.TotalAlloc += after.TotalAlloc - before.TotalAlloc
		total.Mallocs += after.Mallocs - before.Mallocs
		runtime.KeepAlive(s)
		b.StartTimer()
	}
	per := float64(b.N) * n
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/per, "ns/object")
	b.ReportMetric(float64(total.TotalAlloc)/per, "B/object")
	b.ReportMetric(float64(total.Mallocs)/per, "allocs/object")
}
