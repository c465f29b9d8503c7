package gateway

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// pipeline is fake master → gateway → kvevent subscriber, as in production
// but with the master replaced by the scripted ChangeService.
type pipeline struct {
	m        *fakemaster.Master
	gw       *running
	sub      *kvevent.Subscriber
	received atomic.Int64
	onEvent  func(kvevent.Event, time.Time)
}

func newPipeline(b *testing.B, onEvent func(kvevent.Event, time.Time)) *pipeline {
	b.Helper()
	// Scripted: the benchmark times the gateway alone, not a real master's puts, which would dominate its CPU.
	p := &pipeline{m: fakemaster.New(1), onEvent: onEvent}
	p.m.MaxPerResponse = 1024
	cfg := testConfig(startMaster(b, p.m))
	if d, err := time.ParseDuration(os.Getenv("BENCH_FLUSH_INTERVAL")); err == nil {
		cfg.FlushInterval = d
	}
	p.gw = startGateway(b, cfg)
	testutil.Eventually(b, 30*time.Second, func() bool { return p.gw.g.Status().Watching }, "the initial snapshot")
	sub, err := kvevent.Subscribe(b.Context(), p.gw.g.PubEndpoint(), kvevent.Options{
		Logger: testutil.Logger(), DisableIndex: true,
		OnBatch: func(bt kvevent.Batch) {
			if p.onEvent != nil {
				now := time.Now()
				for _, e := range bt.Events {
					p.onEvent(e, now)
				}
			}
			p.received.Add(int64(len(bt.Events)))
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { sub.Close() })
	p.sub = sub
	testutil.Eventually(b, 30*time.Second, func() bool { return p.gw.g.Status().Subscribers == 1 }, "the subscriber")
	return p
}

// op i: stored for even i, removed of the same key for odd i (one change
// each, a bounded readable set). Keys carry i for latency bookkeeping.
func (p *pipeline) op(i int) {
	k := "bench/" + strconv.Itoa(i/2)
	if i%2 == 0 {
		p.m.Put("t", k, masterv1.Medium_MEDIUM_MEMORY, "")
	} else {
		p.m.Remove("t", k, masterv1.Medium_MEDIUM_MEMORY)
	}
}

// throttle keeps the fake master's log bounded (compacting what the
// gateway has applied) and keeps the producer within the subscriber's
// queue bound: a subscriber that keeps up, as the targets assume.
func (p *pipeline) throttle(b *testing.B, i int) {
	if i%4096 != 0 {
		return
	}
	for int64(i)-p.received.Load() > 1<<15 {
		time.Sleep(50 * time.Microsecond)
	}
	if i%65536 == 0 {
		p.m.Compact(1 << 19)
	}
}

func (p *pipeline) check(b *testing.B) {
	st, ss := p.gw.g.Status(), p.sub.Stats()
	b.ReportMetric(float64(st.DroppedEvents), "queue-drops")
	b.ReportMetric(float64(ss.MissingSeqs), "seq-gaps")
	b.ReportMetric(float64(st.SubscriberDroppedBatches), "sub-drops")
	if st.Resyncs != 1 {
		b.Errorf("resyncs = %d, want 1: the gateway fell behind the master's retained log", st.Resyncs)
	}
}

// BenchmarkEndToEnd is sustained throughput from a master mutation to the
// decoded event at a subscriber, with full batches.
func BenchmarkEndToEnd(b *testing.B) {
	p := newPipeline(b, nil)
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		p.op(i)
		p.throttle(b, i)
	}
	testutil.Eventually(b, 30*time.Second, func() bool { return p.received.Load() >= int64(b.N) }, "every event")
	elapsed := time.Since(start)
	b.StopTimer()
	st := p.gw.g.Status()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "events/s")
	b.ReportMetric(float64(st.PublishedEvents)/float64(max(st.PublishedBatches, 1)), "events/batch")
	p.check(b)
}

// BenchmarkLatency50k publishes at a fixed 50k events/s and reports the
// latency from the master mutation to the decoded event at a subscriber.
func BenchmarkLatency50k(b *testing.B) {
	const rate = 50_000
	sent := make([]int64, b.N)
	lat := make([]time.Duration, 0, b.N)
	var latMu atomic.Int32 // OnBatch runs on one goroutine; this only guards the final read
	p := newPipeline(b, func(e kvevent.Event, now time.Time) {
		i, err := strconv.Atoi(strings.TrimPrefix(e.Key, "bench/"))
		if err != nil {
			return
		}
		op := 2 * i
		if e.Type == kvevent.Removed {
			op++
		}
		if op < len(sent) {
			lat = append(lat, now.Sub(time.Unix(0, atomic.LoadInt64(&sent[op]))))
		}
	})
	b.ResetTimer()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	const perTick = rate / 1000
	for i := 0; i < b.N; {
		<-tick.C
		for j := 0; j < perTick && i < b.N; j++ {
			atomic.StoreInt64(&sent[i], time.Now().UnixNano())
			p.op(i)
			i++
		}
	}
	testutil.Eventually(b, 30*time.Second, func() bool { return p.received.Load() >= int64(b.N) }, "every event")
	b.StopTimer()
	latMu.Store(1)
	p.sub.Close() // no more callbacks: lat is ours
	slices.Sort(lat)
	pct := func(q float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(q*float64(len(lat))))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(pct(1), "max-ms")
	b.ReportMetric(rate, "target-events/s")
	p.check(b)
	_ = fmt.Sprint()
}
