package link

import (
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testutil"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// resumeRegister checks that r is a Connect's offer to resume at the feed's
// position now.
func resumeRegister(t *testing.T, h *harness, r *masterv1.Register) {
	t.Helper()
	inst, v := h.feed.Position()
	if !r.GetResume() || !r.GetChunked() || r.GetAllocationCount() != 0 || len(r.GetAllocations()) != 0 {
		t.Fatalf("Register resume %v, chunked %v, allocation_count %d, %d allocations; want a chunked resume of none",
			r.GetResume(), r.GetChunked(), r.GetAllocationCount(), len(r.GetAllocations()))
	}
	if p := r.GetTablePosition(); p.GetInstance() != inst || p.GetVersion() != v {
		t.Fatalf("Register table_position %v, want %s/%d", p, inst, v)
	}
	if len(r.GetSegments()) != 1 || r.GetAgentId() != "agent-1" {
		t.Fatalf("Register = %v", r)
	}
}

// TestResumeAccepted: with a feed, Connect offers to resume: a Register
// with the table's position and no chunk after it; the master's Settings
// (resumed) completes the registration, and heartbeats follow.
func TestResumeAccepted(t *testing.T) {
	h := newHarness(t, harnessOpts{feed: true})
	sealedAlloc(t, h.mem, "a", []byte("one"))
	sealedAlloc(t, h.mem, "b", []byte("two"))
	h.start()
	s := h.session()
	resumeRegister(t, h, s.reg)
	if s.reg.GetTablePosition().GetVersion() != 2 {
		t.Fatalf("table_position version %d, want 2 (two seals)", s.reg.GetTablePosition().GetVersion())
	}
	st := settings(3)
	st.GetSettings().Resumed = true
	s.send <- st
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected")
	// Nothing but heartbeats after the Register: no chunk.
	for hb := 0; hb < 3; {
		select {
		case m := <-s.recv:
			if m.GetHeartbeat() == nil {
				t.Fatalf("got %T after a resumed registration, want heartbeats only", m.GetMsg())
			}
			hb++
		case <-time.After(5 * time.Second):
			t.Fatal("no heartbeat")
		}
	}
	if got := promtest.ToFloat64(h.link.met.resumes.WithLabelValues("resumed")); got != 1 {
		t.Fatalf("resumes{resumed} = %v, want 1", got)
	}
}

// TestResumeRefusedSendsTable: a master that answers the resume Register
// with TableRequest gets a full registration on the same stream (a chunked
// Register without resume, with the position, announcing every allocation,
// then the chunks), and its Settings completes it.
func TestResumeRefusedSendsTable(t *testing.T) {
	h := newHarness(t, harnessOpts{feed: true})
	sealedAlloc(t, h.mem, "a", []byte("one"))
	sealedAlloc(t, h.mem, "b", []byte("two"))
	if _, err := h.mem.Reserve(&masterv1.ReserveItem{Size: 10, Key: "pending"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	h.start()
	s := h.session()
	resumeRegister(t, h, s.reg)
	r, table := s.requestTable(t, "no Follow of this instance")
	inst, v := h.feed.Position()
	if r.GetResume() || !r.GetChunked() || r.GetAllocationCount() != 3 || len(table) != 3 {
		t.Fatalf("full Register resume %v, chunked %v, allocation_count %d, chunks carried %d; want chunked, 3, 3",
			r.GetResume(), r.GetChunked(), r.GetAllocationCount(), len(table))
	}
	if p := r.GetTablePosition(); p.GetInstance() != inst || p.GetVersion() != v {
		t.Fatalf("full Register table_position %v, want %s/%d", p, inst, v)
	}
	for _, a := range table {
		if a.GetSegmentId() != h.mem.ID() {
			t.Fatalf("row %v not of segment %s", a, h.mem.ID())
		}
	}
	if h.link.State() == StateConnected {
		t.Fatal("connected before Settings")
	}
	s.send <- settings(4)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected")
	s.heartbeat(t)
	if got := h.link.Epoch(); got != 4 {
		t.Fatalf("Epoch = %d, want 4", got)
	}
	if got := promtest.ToFloat64(h.link.met.resumes.WithLabelValues("table_requested")); got != 1 {
		t.Fatalf("resumes{table_requested} = %v, want 1", got)
	}
}

// TestResumeWaitsForAnswer: the resume Register's answer is bounded by
// SettingsTimeout like any registration's; the agent dials again.
func TestResumeWaitsForAnswer(t *testing.T) {
	h := newHarness(t, harnessOpts{feed: true, cfg: Config{SettingsTimeout: 50 * time.Millisecond}})
	h.start()
	s1 := h.session()
	resumeRegister(t, h, s1.reg)
	s2 := h.session()
	resumeRegister(t, h, s2.reg)
	select {
	case <-s1.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the first session never ended")
	}
	s2.send <- settings(1)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected")
}
