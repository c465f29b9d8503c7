package app

import (
	"context"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
)

// scrubMetrics are the disk segments' background verification metrics.
type scrubMetrics struct {
	bytes, passes  prometheus.Counter
	last, interval prometheus.Gauge
}

func newScrubMetrics(reg prometheus.Registerer) *scrubMetrics {
	m := &scrubMetrics{
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_disk_scrub_bytes_total",
			Help: "Object bytes of sealed disk allocations read again and checked against their checksum while serving (--scrub-interval, --scrub-rate)."}),
		passes: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_disk_scrub_passes_total",
			Help: "Scrub passes finished over a disk segment (every sealed object checked)."}),
		last: prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_disk_scrub_last_pass_timestamp_seconds",
			Help: "When the last scrub pass over a disk segment finished (Unix seconds; 0 before the first)."}),
		interval: prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_disk_scrub_interval_seconds",
			Help: "--scrub-interval when this agent scrubs a disk segment, 0 when it scrubs none (no disk segment, or scrubbing off): alert CrescentDiskScrubBehind compares the last pass with it."}),
	}
	reg.MustRegister(m.bytes, m.passes, m.last, m.interval)
	return m
}

// startScrubs scrubs every disk segment of segs in the background until
// stop is called (which waits for them).
func (a *Agent) startScrubs(ctx context.Context, segs *segment.Set) (stop func()) {
	m := newScrubMetrics(a.reg)
	if a.cfg.ScrubInterval <= 0 {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, s := range segs.All() {
		if s.Medium() == masterv1.Medium_MEDIUM_DISK {
			m.interval.Set(a.cfg.ScrubInterval.Seconds())
			wg.Go(func() { a.scrub(ctx, s, m) })
		}
	}
	return func() {
		cancel()
		wg.Wait()
	}
}

// scrub verifies s every ScrubInterval (the first pass one interval after
// start: VerifySealed has just read it all), at most ScrubRate bytes a
// second, until ctx ends.
func (a *Agent) scrub(ctx context.Context, s *segment.Segment, m *scrubMetrics) {
	r := int(a.cfg.ScrubRate)
	lim := rate.NewLimiter(rate.Limit(r), max(r, 1<<20))
	t := time.NewTimer(a.cfg.ScrubInterval)
	defer t.Stop()
	lg := a.lg.With("segment_id", s.ID())
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rep, err := s.Scrub(ctx, lim)
		m.bytes.Add(float64(rep.Bytes))
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			lg.Warn("disk scrub pass stopped", "err", err, "allocations", rep.Allocations, "lost", rep.Lost)
		default:
			m.passes.Inc()
			m.last.SetToCurrentTime()
			lg.Info("disk scrub pass finished", "allocations", rep.Allocations, "bytes", rep.Bytes, "lost", rep.Lost,
				"took", rep.Took.Round(time.Millisecond).String(), "rate_mib_s", mibPerSecond(rep.Bytes, rep.Took))
		}
		t.Reset(a.cfg.ScrubInterval)
	}
}
