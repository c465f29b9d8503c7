package meta

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/token"
)

// BenchmarkEvictPass is one background eviction pass (evictOverHigh) over
// 200k objects of 4 KiB on two segments filled to about 92 %: the pass
// brings both down to the 80 % low watermark, i.e. evicts the least
// recently used ~13 %. Between iterations, outside the timer, the evicted
// keys are put again (newest clock), so every pass starts from the same
// fill and evicts the next-oldest objects. Run it with -benchtime=20x or
// so: every iteration refills some 26k objects untimed.
func BenchmarkEvictPass(b *testing.B) {
	const (
		n    = 200_000
		size = 4096
	)
	// Two segments holding n objects at 92 %.
	capacity := uint64(n * size / 2 * 100 / 92)
	c := metatest.NewCluster(1, 2, capacity)
	clk := newClock()
	s, err := New(Config{}, Deps{Registry: c.Reg, Agents: &metatest.NullAgents{}, Now: clk.Now,
		Identity: cluster.Identity{Epoch: 1, Keys: token.NewRing(0, nil)}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%032x", uint64(i)*0x9e3779b97f4a7c15)
	}
	put := func(ks []string) {
		specs := make([]PutSpec, 0, 256)
		ends := make([]PutEndSpec, 0, 256)
		for lo := 0; lo < len(ks); lo += 256 {
			specs, ends = specs[:0], ends[:0]
			for _, k := range ks[lo:min(lo+256, len(ks))] {
				specs = append(specs, PutSpec{Key: k, Size: size, ClientID: "w"})
				ends = append(ends, PutEndSpec{Key: k, ClientID: "w"})
			}
			for _, r := range s.BatchPutStart(ctx, specs) {
				if r.Err != nil {
					b.Fatal(r.Err)
				}
			}
			for _, err := range s.BatchPutEnd(ctx, ends) {
				if err != nil {
					b.Fatal(err)
				}
			}
			clk.Advance(time.Millisecond) // 256 objects share an access time
		}
	}
	put(keys)
	missing := func() []string {
		var out []string
		for _, k := range keys {
			if s.withObject(DefaultTenant, k, func(*shard, *object) error { return nil }) != nil {
				out = append(out, k)
			}
		}
		return out
	}
	evicted, walked := 0, 0
	b.ReportAllocs()
	for b.Loop() {
		before, _, _ := s.Stats()
		s.evictOverHigh(ctx)
		b.StopTimer()
		after, _, _ := s.Stats()
		if after >= before {
			b.Fatalf("pass evicted nothing (%d objects)", before)
		}
		evicted += int(before - after)
		walked += s.lastPass.walked
		put(missing())
		runtime.GC() // the refill's garbage is not the pass's
		b.StartTimer()
	}
	b.ReportMetric(float64(evicted)/float64(b.N), "evicted/op")
	b.ReportMetric(float64(walked)/float64(b.N), "walked/op")
}
