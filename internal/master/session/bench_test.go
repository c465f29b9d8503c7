package session

import (
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// BenchmarkReserveThroughput measures Reserve round trips through the
// batcher and a real gRPC stream (bufconn) to a fake agent that answers at
// once, with many concurrent callers of one item each, as concurrent
// PutStarts to one agent would be.
func BenchmarkReserveThroughput(b *testing.B) {
	for _, bc := range []struct {
		name   string
		window time.Duration
	}{
		{"window=0.2ms", 200 * time.Microsecond},
		{"window=1ms", time.Millisecond},
	} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := fastConfig()
			cfg.BatchWindow = bc.window
			h := newHarness(b, cfg, harnessOpts{})
			a := h.connectAgent("bench")
			items := []*masterv1.ReserveItem{{SegmentId: "bench-mem-0", Size: 4096, Key: "k"}}
			var failed atomic.Int64
			b.SetParallelism(32) // 32 × GOMAXPROCS concurrent callers
			b.ResetTimer()
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := h.m.Reserve(b.Context(), "bench", items); err != nil {
						failed.Add(1)
					}
				}
			})
			elapsed := time.Since(start)
			b.StopTimer()
			if n := failed.Load(); n > 0 {
				b.Fatalf("%d reserves failed", n)
			}
			msgs, got := a.counts("reserve")
			b.ReportMetric(float64(got)/elapsed.Seconds(), "items/s")
			if msgs > 0 {
				b.ReportMetric(float64(got)/float64(msgs), "items/msg")
			}
		})
	}
}
