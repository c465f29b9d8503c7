package app

import (
	"fmt"
	"sync"
	"time"

	"github.com/crescent-kv/crescent/internal/agent/link"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/prometheus/client_golang/prometheus"
)

// lostLogWindow and maxCorruptLogLines bound the WARN lines of allocations
// lost while serving: a disk gone bad as a whole would otherwise log one
// per object read. The metric counts them all.
const lostLogWindow = time.Minute

// lostSink is what the disk segments call with each allocation they drop
// while serving it (segment.SetLostSink): it is counted, logged and
// reported to the master by lk, which removes the replica.
func (a *Agent) lostSink(lk *link.Link) func(segment.LostAllocation) {
	lost := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "crescent_agent_disk_allocations_lost_total",
		Help: "Sealed disk allocations dropped while serving them, by cause: checksum (their bytes no longer hash to the sealed checksum) or io_error (a read failed with EIO). Each is reported to the master, which removes the replica."},
		[]string{"cause"})
	for _, c := range []string{"checksum", "io_error"} {
		lost.WithLabelValues(c)
	}
	a.reg.MustRegister(lost)
	var mu sync.Mutex
	var windowStart time.Time
	logged := 0
	return func(l segment.LostAllocation) {
		cause := "checksum"
		if l.Err != nil {
			cause = "io_error"
		}
		lost.WithLabelValues(cause).Inc()
		lk.ReportLost(l.Allocation, l.Reason())

		mu.Lock()
		now := time.Now()
		if now.Sub(windowStart) >= lostLogWindow {
			windowStart, logged = now, 0
		}
		logged++
		n := logged
		mu.Unlock()
		switch {
		case n < maxCorruptLogLines:
		case n == maxCorruptLogLines:
			a.lg.Warn("more disk allocations lost this minute (not logged one by one; see crescent_agent_disk_allocations_lost_total)")
			return
		default:
			return
		}
		al := l.Allocation
		attrs := []any{"segment_id", al.GetSegmentId(), "allocation_id", al.GetAllocationId(), "tenant", al.GetTenant(), "key", al.GetKey(),
			"replica_id", al.GetReplicaId(), "offset", al.GetOffset(), "size", al.GetSize(), "cause", cause, "want", fmt.Sprintf("%016x", al.GetChecksum())}
		if l.Err != nil {
			attrs = append(attrs, "err", l.Err)
		} else {
			attrs = append(attrs, "got", fmt.Sprintf("%016x", l.Got))
		}
		if l.JournalErr != nil {
			// A restart brings it back (until a read or --verify-disk
			// finds it again).
			attrs = append(attrs, "journal_err", l.JournalErr)
		}
		a.lg.Warn("disk allocation lost while serving: dropped and reported to the master", attrs...)
	}
}
