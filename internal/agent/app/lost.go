package app

import (
	"fmt"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/link"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/prometheus/client_golang/prometheus"
)

// lostLogWindow and maxCorruptLogLines bound the WARN lines of allocations
// lost while serving: a disk gone bad as a whole would otherwise log one
// per object read. The metric counts them all.
const lostLogWindow = time.Minute

// lostSink is what the segments call with each allocation they drop
// while serving it (segment.SetLostSink): it is counted, logged and
// reported to the master by lk, which removes the replica.
func (a *Agent) lostSink(lk *link.Link) func(segment.LostAllocation) {
	lost := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "crescent_agent_allocations_lost_total",
		Help: "Sealed allocations dropped while serving them, by medium and cause: checksum (their bytes no longer hash to the sealed checksum: found by a disk read, or by a client's VERIFY) or io_error (a disk read failed with EIO). Each is reported to the master, which removes the replica."},
		[]string{"medium", "cause"})
	for _, m := range []string{"memory", "disk"} {
		for _, c := range []string{"checksum", "io_error"} {
			lost.WithLabelValues(m, c)
		}
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
		medium := "memory"
		if l.Medium == masterv1.Medium_MEDIUM_DISK {
			medium = "disk"
		}
		lost.WithLabelValues(medium, cause).Inc()
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
			a.lg.Warn("more allocations lost this minute (not logged one by one; see crescent_agent_allocations_lost_total)")
			return
		default:
			return
		}
		al := l.Allocation
		attrs := []any{"segment_id", al.GetSegmentId(), "allocation_id", al.GetAllocationId(), "tenant", al.GetTenant(), "key", al.GetKey(),
			"replica_id", al.GetReplicaId(), "offset", al.GetOffset(), "size", al.GetSize(), "medium", medium, "cause", cause, "want", fmt.Sprintf("%016x", al.GetChecksum())}
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
		a.lg.Warn("allocation lost while serving: dropped and reported to the master", attrs...)
	}
}
