package app

import (
	"context"
	"fmt"
	"time"

	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/prometheus/client_golang/prometheus"
)

// maxCorruptLogLines bounds the WARN lines of one disk verification (a
// failing disk could otherwise log one per object); the summary line counts
// them all.
const maxCorruptLogLines = 100

// verifyMetrics are the disk segment's start-up verification metrics.
type verifyMetrics struct {
	verified, corrupt prometheus.Counter
	took              prometheus.Gauge
}

func newVerifyMetrics(reg prometheus.Registerer) *verifyMetrics {
	m := &verifyMetrics{
		verified: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_disk_verify_bytes_total",
			Help: "Object bytes of sealed disk allocations read and checked against their checksum when the disk segment was reopened."}),
		corrupt: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_disk_corrupt_allocations_total",
			Help: "Sealed disk allocations whose bytes failed their checksum check when the disk segment was reopened (dropped and reported lost)."}),
		took: prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_disk_verify_seconds",
			Help: "How long the disk segment's start-up checksum verification took."}),
	}
	reg.MustRegister(m.verified, m.corrupt, m.took)
	return m
}

// verifyDisk checks every sealed allocation of the reopened disk segment s
// (segment.VerifySealed), dropping corrupt ones, with a progress line every
// few seconds and the crescent_agent_disk_* metrics.
func (a *Agent) verifyDisk(ctx context.Context, s *segment.Segment, m *verifyMetrics) error {
	if !a.cfg.VerifyDisk {
		a.lg.Warn("disk segment not verified: --verify-disk is off; bytes corrupted while the agent was down are served until a client checks the checksum", "segment_id", s.ID())
		return nil
	}
	lg := a.lg.With("segment_id", s.ID(), "dir", s.Name())
	var counted uint64
	rep, err := s.VerifySealed(ctx, segment.VerifyConfig{Progress: func(p segment.VerifyProgress) {
		m.verified.Add(float64(p.VerifiedBytes - counted))
		counted = p.VerifiedBytes
		if p.VerifiedBytes < p.TotalBytes {
			lg.Info("disk segment verify progress", "verified_bytes", p.VerifiedBytes, "total_bytes", p.TotalBytes,
				"allocations", p.Allocations, "corrupt", p.Corrupt, "rate_mib_s", mibPerSecond(p.VerifiedBytes, p.Elapsed))
		}
	}})
	if err != nil {
		return fmt.Errorf("verify disk segment %s: %w", s.Name(), err)
	}
	m.corrupt.Add(float64(rep.CorruptCount))
	m.took.Set(rep.Took.Seconds())
	for i, c := range rep.Corrupt {
		if i == maxCorruptLogLines {
			lg.Warn("more corrupt disk allocations dropped (not logged one by one)", "count", rep.CorruptCount-i)
			break
		}
		attrs := []any{"allocation_id", c.ID, "tenant", c.Tenant, "key", c.Key, "replica_id", c.ReplicaID,
			"offset", c.Offset, "size", c.Size, "want_checksum", fmt.Sprintf("%#x", c.Want)}
		if c.Err != nil {
			attrs = append(attrs, "err", c.Err) // unreadable (EIO)
		} else {
			attrs = append(attrs, "got_checksum", fmt.Sprintf("%#x", c.Got))
		}
		lg.Warn("corrupt disk allocation dropped: reported lost, never served", attrs...)
	}
	lg.Info("disk segment verified", "allocations", rep.Allocations, "bytes", rep.Bytes, "corrupt", rep.CorruptCount,
		"took", rep.Took.Round(time.Millisecond).String(), "rate_mib_s", mibPerSecond(rep.Bytes, rep.Took))
	return nil
}

func mibPerSecond(n uint64, d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(float64(n) / (1 << 20) / d.Seconds())
}
