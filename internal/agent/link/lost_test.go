package link

import (
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// lostReports receives AllocationsLost messages until n allocations came,
// and returns them with the reason each came under.
func lostReports(t *testing.T, s *fakeSession, n int) (allocs []*masterv1.Allocation, reasons []string) {
	t.Helper()
	for len(allocs) < n {
		m := s.next(t).GetAllocationsLost()
		if m == nil {
			t.Fatalf("agent sent %v, want AllocationsLost", m)
		}
		for _, a := range m.GetAllocations() {
			allocs = append(allocs, a)
			reasons = append(reasons, m.GetReason())
		}
	}
	return allocs, reasons
}

// TestReportLost: allocations reported lost reach the master in
// AllocationsLost messages, with the identity fields only and each under
// its own reason (cut to the master's limit); one reported while no
// session is up waits for the next session.
func TestReportLost(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	// Queued before any session.
	h.link.ReportLost(&masterv1.Allocation{SegmentId: "seg-a", AllocationId: 1, Tenant: "t", Key: "early", ReplicaId: 3, Size: 99, Checksum: 7, GroupId: "g"}, "checksum mismatch")
	s := connected(t, h, 4)
	allocs, reasons := lostReports(t, s, 1)
	want := &masterv1.Allocation{SegmentId: "seg-a", AllocationId: 1, Tenant: "t", Key: "early", ReplicaId: 3}
	if a := allocs[0]; a.String() != want.String() || reasons[0] != "checksum mismatch" {
		t.Fatalf("reported %v (%q), want %v (checksum mismatch)", a, reasons[0], want)
	}
	long := strings.Repeat("x", 5000)
	h.link.ReportLost(&masterv1.Allocation{SegmentId: "seg-a", AllocationId: 2, Key: "k2"}, "checksum mismatch")
	h.link.ReportLost(&masterv1.Allocation{SegmentId: "seg-a", AllocationId: 3, Key: "k3"}, "read: input/output error")
	h.link.ReportLost(&masterv1.Allocation{SegmentId: "seg-a", AllocationId: 4, Key: "k4"}, long)
	allocs, reasons = lostReports(t, s, 3)
	for i, want := range []string{"checksum mismatch", "read: input/output error", long[:maxLostReason]} {
		if allocs[i].GetAllocationId() != uint64(i+2) || reasons[i] != want {
			t.Fatalf("report %d = allocation %d under %.40q, want allocation %d under %.40q", i, allocs[i].GetAllocationId(), reasons[i], i+2, want)
		}
	}
	if got := promtest.ToFloat64(h.link.met.lostReported); got != 4 {
		t.Fatalf("lost reported counter = %v, want 4", got)
	}
}

// TestReportLostOverflow: more losses at once than the queue holds end
// the session; the agent registers again with its table (which settles
// them), and reports queued after that are sent as usual.
func TestReportLostOverflow(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	// Queued while no session drains the queue (a connected link drains
	// it as fast as reports come here).
	for i := range maxLostQueued + 1 {
		h.link.ReportLost(&masterv1.Allocation{SegmentId: "seg-a", AllocationId: uint64(i + 1), Key: "k"}, "checksum mismatch")
	}
	h.start()
	s := h.session()
	s.send <- settings(4)
	select {
	case <-s.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the session outlived an overflowing lost queue")
	}
	s = h.session()
	if !s.reg.GetChunked() || s.reg.GetResume() {
		t.Fatalf("registration after the overflow = %v, want one carrying the table", s.reg)
	}
	s.send <- settings(4)
	h.link.ReportLost(&masterv1.Allocation{SegmentId: "seg-a", AllocationId: 1 << 20, Key: "after"}, "checksum mismatch")
	if allocs, _ := lostReports(t, s, 1); len(allocs) != 1 || allocs[0].GetKey() != "after" {
		t.Fatalf("after the overflow the agent reported %d allocations (first %v), want only the new one", len(allocs), allocs[0])
	}
}
