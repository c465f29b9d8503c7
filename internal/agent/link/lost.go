package link

import (
	"errors"
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Allocations a segment dropped while serving them (a disk read found bad
// bytes: segment.LostAllocation) are reported to the master on the Connect
// session in AllocationsLost messages, so that it removes their replicas
// and the event stream announces them gone. The queue lives in the Link,
// not the session: a loss found while no session is up waits for the next
// one. That report is then moot (the registration's table no longer holds
// the allocation, and the master's reconcile removed the replica), and the
// master ignores allocations no replica points at.

const (
	// maxLostQueued bounds the allocations waiting to be reported. More
	// lost at once (a disk gone bad as a whole) end the session instead:
	// the next registration carries the table, which settles them all.
	maxLostQueued = 1 << 16
	// maxLostPerMessage is the most allocations one AllocationsLost
	// carries (the master refuses more).
	maxLostPerMessage = 16384
	// maxLostReason bounds a reason's bytes (the master's limit).
	maxLostReason = 1024
)

// errLostOverflow ends a session whose lost queue overflowed.
var errLostOverflow = errors.New("more allocations lost at once than the report queue holds; registering again so the master takes the table")

type lostItem struct {
	a      *masterv1.Allocation
	reason string
}

// lostQueue holds the allocations to report.
type lostQueue struct {
	mu       sync.Mutex
	items    []lostItem
	overflow bool
	wake     chan struct{} // buffered 1: a report is waiting
}

func newLostQueue() *lostQueue { return &lostQueue{wake: make(chan struct{}, 1)} }

// ReportLost queues a dropped allocation for the master (its segment id,
// allocation id, tenant, key and replica id are what travels), with why.
// It never blocks.
func (l *Link) ReportLost(a *masterv1.Allocation, reason string) {
	if len(reason) > maxLostReason {
		reason = reason[:maxLostReason]
	}
	it := lostItem{a: &masterv1.Allocation{SegmentId: a.GetSegmentId(), AllocationId: a.GetAllocationId(),
		Tenant: a.GetTenant(), Key: a.GetKey(), ReplicaId: a.GetReplicaId()}, reason: reason}
	q := l.lost
	q.mu.Lock()
	if len(q.items) < maxLostQueued {
		q.items = append(q.items, it)
	} else {
		q.overflow = true
	}
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// take returns the queued reports as AllocationsLost messages (runs of one
// reason, at most maxLostPerMessage each), or errLostOverflow when some
// were not queued; either way the queue is empty after.
func (q *lostQueue) take() ([]*masterv1.AllocationsLost, error) {
	q.mu.Lock()
	items, overflow := q.items, q.overflow
	q.items, q.overflow = nil, false
	q.mu.Unlock()
	if overflow {
		return nil, errLostOverflow
	}
	var out []*masterv1.AllocationsLost
	var cur *masterv1.AllocationsLost
	for _, it := range items {
		if cur == nil || cur.Reason != it.reason || len(cur.Allocations) == maxLostPerMessage {
			cur = &masterv1.AllocationsLost{Reason: it.reason}
			out = append(out, cur)
		}
		cur.Allocations = append(cur.Allocations, it.a)
	}
	return out, nil
}

// sendLost hands the queued reports to the session's sender; an overflow
// ends the session.
func (s *session) sendLost() error {
	msgs, err := s.l.lost.take()
	if err != nil {
		s.l.lg.Warn("lost allocations not reported one by one", "err", err)
		return err
	}
	for _, m := range msgs {
		s.enqueue(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_AllocationsLost{AllocationsLost: m}})
		s.l.met.lostReported.Add(float64(len(m.GetAllocations())))
	}
	return nil
}
