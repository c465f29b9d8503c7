package session

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestRegisterSettingsFirst(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	h.meta.release = func(_ string, allocs []*masterv1.Allocation) []*masterv1.AllocationRef {
		return []*masterv1.AllocationRef{{SegmentId: allocs[0].GetSegmentId(), AllocationId: allocs[0].GetAllocationId()}}
	}
	alloc := &masterv1.Allocation{SegmentId: "a1-mem-0", AllocationId: 42, Size: 100, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Tenant: "t", Key: "k", Checksum: 9}
	a := h.connectAgent("a1", withAllocations(alloc))

	s := a.settings
	if s.GetEpoch() != testEpoch || s.GetMasterId() != "master-test" || !sameKeys(s.GetTokenKeys(), testTokenKey) {
		t.Fatalf("settings identity: got epoch %d master %q keys %v", s.GetEpoch(), s.GetMasterId(), s.GetTokenKeys())
	}
	for name, pair := range map[string][2]time.Duration{
		"heartbeat_interval": {s.GetHeartbeatInterval().AsDuration(), 20 * time.Millisecond},
		"suspect_after":      {s.GetSuspectAfter().AsDuration(), 100 * time.Millisecond},
		"unmount_after":      {s.GetUnmountAfter().AsDuration(), 500 * time.Millisecond},
		"reserved_grace":     {s.GetReservedGrace().AsDuration(), time.Second},
	} {
		if pair[0] != pair[1] {
			t.Errorf("%s: got %v, want %v", name, pair[0], pair[1])
		}
	}
	if got := s.GetReleaseAllocations(); len(got) != 1 || got[0].GetAllocationId() != 42 {
		t.Fatalf("release_allocations: got %v, want [a1-mem-0/42]", got)
	}
	calls := h.meta.reconcileCalls()
	if len(calls) != 1 || calls[0].agentID != "a1" || len(calls[0].segments) != 1 || calls[0].segments[0].ID != "a1-mem-0" || len(calls[0].allocs) != 1 {
		t.Fatalf("reconcile calls: got %+v", calls)
	}
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
	sg, _ := h.reg.Segment("a1-mem-0")
	if !sg.CanAllocate() || sg.DataEndpoint != "a1:50052" || sg.TransferEndpoint != "a1:50054" || sg.HostID != "host-a1" {
		t.Fatalf("registered segment: got %+v", sg)
	}
	if !h.m.Connected("a1") {
		t.Fatal("Connected(a1): got false, want true")
	}
	if got := promtest.ToFloat64(h.m.met.sessions); got != 1 {
		t.Fatalf("sessions gauge: got %v, want 1", got)
	}
}

func TestFirstMessageRejected(t *testing.T) {
	tests := []struct {
		name   string
		first  *masterv1.ConnectRequest
		code   codes.Code
		reason string
		msg    string
	}{
		{"heartbeat first", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: 3}}},
			codes.InvalidArgument, "INVALID_PARAMS", "first message must be Register, got heartbeat"},
		{"stale result first", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{RequestId: 9}}},
			codes.InvalidArgument, "INVALID_PARAMS", "got reserve_result"},
		{"empty envelope", &masterv1.ConnectRequest{}, codes.InvalidArgument, "INVALID_PARAMS", "an empty message"},
		{"no agent id", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{DataEndpoint: "x:1"}}},
			codes.InvalidArgument, "INVALID_PARAMS", "agent_id is required"},
		{"no data endpoint", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{AgentId: "a"}}},
			codes.InvalidArgument, "INVALID_PARAMS", "data_endpoint is required"},
		{"newer epoch seen", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{AgentId: "a", DataEndpoint: "x:1", KnownEpoch: testEpoch + 1}}},
			codes.FailedPrecondition, "STALE_EPOCH", "epoch 8"},
		{"allocation on unlisted segment", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a",
			withAllocations(&masterv1.Allocation{SegmentId: "ghost", AllocationId: 1, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k"}))}},
			codes.InvalidArgument, "INVALID_PARAMS", "did not list"},
		{"segment without medium", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{AgentId: "a", DataEndpoint: "x:1",
			Segments: []*masterv1.SegmentInfo{{SegmentId: "s", Capacity: 1}}}}},
			codes.InvalidArgument, "INVALID_PARAMS", "not memory or disk"},
	}
	h := newHarness(t, fastConfig(), harnessOpts{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conn, stream, cancel := h.open(tt.first)
			defer conn.Close()
			defer cancel()
			_, err := stream.Recv()
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code: got %v, want %v (%v)", got, tt.code, err)
			}
			if got := rpcerr.Reason(err); got != tt.reason {
				t.Fatalf("reason: got %q, want %q", got, tt.reason)
			}
			if !strings.Contains(status.Convert(err).Message(), tt.msg) {
				t.Fatalf("message: got %q, want it to contain %q", status.Convert(err).Message(), tt.msg)
			}
		})
	}
	t.Run("register timeout", func(t *testing.T) {
		cfg := fastConfig()
		cfg.RegisterTimeout = 50 * time.Millisecond
		h := newHarness(t, cfg, harnessOpts{})
		conn, stream, cancel := h.open(nil)
		defer conn.Close()
		defer cancel()
		_, err := stream.Recv()
		if got := rpcerr.Reason(err); got != "INVALID_PARAMS" {
			t.Fatalf("reason: got %q, want INVALID_PARAMS (%v)", got, err)
		}
	})
	t.Run("second register on a stream", func(t *testing.T) {
		a := h.connectAgent("twice")
		a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("twice")}})
		err := a.waitEnded(time.Second)
		if got := rpcerr.Reason(err); got != "INVALID_PARAMS" {
			t.Fatalf("reason: got %q, want INVALID_PARAMS (%v)", got, err)
		}
	})
}

func TestHeartbeatsKeepHealthy(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	h.connectAgent("a1")
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
	// Twelve steps of 60 ms cover 720 ms of liveness time, past both
	// suspect_after (100 ms) and unmount_after (500 ms); a heartbeat lands
	// in every step, so the segment never leaves HEALTHY.
	for i := range 12 {
		h.advance(60 * time.Millisecond)
		if got := segState(h, "a1-mem-0"); got != "ok/healthy" {
			t.Fatalf("step %d: got %s, want ok/healthy", i, got)
		}
		h.beatAfter("a1")
	}
	if d := h.meta.dropped(); len(d) != 0 {
		t.Fatalf("dropped: got %v, want none", d)
	}
}

func TestMissedHeartbeatsSuspectThenUnmount(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1", withSegments("s1", "s2"))
	waitState(t, h, "s1", "ok/healthy", time.Second)
	h.quiesce(a)

	h.advance(99 * time.Millisecond)
	if got := segState(h, "s1"); got != "ok/healthy" {
		t.Fatalf("before suspect_after: got %s, want ok/healthy", got)
	}
	h.advance(time.Millisecond)
	waitState(t, h, "s1", "ok/suspected", time.Second)
	sg, _ := h.reg.Segment("s1")
	if sg.CanAllocate() || sg.CanServeRead() || sg.CanContinueCleanup() {
		t.Fatalf("SUSPECTED segment predicates: got %v %v %v, want all false", sg.CanAllocate(), sg.CanServeRead(), sg.CanContinueCleanup())
	}
	if d := h.meta.dropped(); len(d) != 0 {
		t.Fatalf("dropped while SUSPECTED: %v", d)
	}
	h.advance(400 * time.Millisecond)
	waitState(t, h, "s1", "unmounted/suspected", time.Second)
	waitState(t, h, "s2", "unmounted/suspected", time.Second)
	if got := h.meta.dropped(); !slices.Equal(got, []string{"s1", "s2"}) {
		t.Fatalf("dropped: got %v, want [s1 s2]", got)
	}
	if !h.meta.droppedWhileUnmounting() {
		t.Fatal("DropSegments saw a segment that was not UNMOUNTING")
	}
	// The master ends the session of a lost agent.
	err := a.waitEnded(time.Second)
	if got := status.Code(err); got != codes.Unavailable {
		t.Fatalf("lost agent's stream: got %v, want Unavailable", err)
	}
	testutil.Eventually(t, time.Second, func() bool { return !h.m.Connected("a1") }, "agent disconnected")
	if _, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "s1", Size: 1}}); rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("reserve at a lost agent: got %v, want AGENT_UNAVAILABLE", err)
	}
}

func TestSuspectedRecoversOnHeartbeat(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	h.quiesce(a)
	h.advance(200 * time.Millisecond)
	waitState(t, h, "a1-mem-0", "ok/suspected", time.Second)
	a.setHeartbeat(true)
	h.beatAfter("a1")
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
	h.advance(400 * time.Millisecond) // 600 ms since the last beat before the pause
	if got := segState(h, "a1-mem-0"); got == "unmounting/suspected" || strings.HasPrefix(got, "unmounted") {
		t.Fatalf("recovered segment unmounted: %s", got)
	}
}

func TestReconnectWithinWindow(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	alloc := &masterv1.Allocation{SegmentId: "a1-mem-0", AllocationId: 1, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k"}
	a := h.connectAgent("a1", withAllocations(alloc))
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
	a.stop()
	// A lost stream makes the segment SUSPECTED at once.
	waitState(t, h, "a1-mem-0", "ok/suspected", time.Second)
	h.advance(400 * time.Millisecond) // inside unmount_after (500 ms)

	h.connectAgent("a1", withAllocations(alloc))
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
	calls := h.meta.reconcileCalls()
	if len(calls) != 2 || len(calls[1].allocs) != 1 || calls[1].allocs[0].GetAllocationId() != 1 {
		t.Fatalf("reconcile on reconnect: got %+v", calls)
	}
	// Past the first connection's unmount window nothing is dropped: the
	// reconnect restarted liveness.
	h.advance(200 * time.Millisecond)
	if d := h.meta.dropped(); len(d) != 0 {
		t.Fatalf("dropped: got %v, want none", d)
	}
	if got := segState(h, "a1-mem-0"); got == "absent" || strings.HasPrefix(got, "unmount") {
		t.Fatalf("segment after reconnect: got %s", got)
	}
}

func TestSecondConnectReplacesFirst(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	first := h.connectAgent("a1")
	second := h.connectAgent("a1")
	err := first.waitEnded(time.Second)
	if got := status.Code(err); got != codes.Aborted {
		t.Fatalf("replaced stream: got %v, want Aborted", err)
	}
	res, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 8, Key: "k", ReplicaId: 3}})
	if err != nil || len(res) != 1 || res[0].GetOffset() != 30 {
		t.Fatalf("reserve after replace: got %v, %v", res, err)
	}
	if m, _ := second.counts("reserve"); m != 1 {
		t.Fatalf("second session reserve messages: got %d, want 1", m)
	}
	if m, _ := first.counts("reserve"); m != 0 {
		t.Fatalf("first session reserve messages: got %d, want 0", m)
	}
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
	if got := len(h.meta.reconcileCalls()); got != 2 {
		t.Fatalf("reconciles: got %d, want 2", got)
	}
}

func TestBatchingRoutesResults(t *testing.T) {
	cfg := fastConfig()
	cfg.BatchWindow = 2 * time.Millisecond
	cfg.MaxInFlight = 2
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	const callers = 200
	var wg sync.WaitGroup
	errs := make(chan error, callers*3)
	for i := range callers {
		wg.Go(func() {
			items := []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 64, Key: fmt.Sprint("k", i), ReplicaId: uint32(i)}}
			if i%2 == 0 { // some calls carry two items
				items = append(items, &masterv1.ReserveItem{SegmentId: "a1-mem-0", Size: 64, Key: fmt.Sprint("k", i), ReplicaId: uint32(i + 1000)})
			}
			res, err := h.m.Reserve(t.Context(), "a1", items)
			if err != nil {
				errs <- err
				return
			}
			if len(res) != len(items) {
				errs <- fmt.Errorf("caller %d: got %d results, want %d", i, len(res), len(items))
				return
			}
			for j, r := range res {
				if want := uint64(items[j].GetReplicaId()) * 10; r.GetOffset() != want {
					errs <- fmt.Errorf("caller %d item %d: got offset %d, want %d (misrouted)", i, j, r.GetOffset(), want)
				}
			}
			sealItems := []*masterv1.SealItem{{SegmentId: "a1-mem-0", AllocationId: res[0].GetAllocationId(), Checksum: uint64(i % 3)}}
			st, err := h.m.Seal(t.Context(), "a1", sealItems)
			if err != nil || len(st) != 1 {
				errs <- fmt.Errorf("caller %d seal: %v %v", i, st, err)
				return
			}
			if gotBad, wantBad := st[0].GetCode() != 0, i%3 == 0; gotBad != wantBad {
				errs <- fmt.Errorf("caller %d seal status: got %v, want failure %v", i, st[0], wantBad)
			}
			if err := h.m.Release(t.Context(), "a1", []*masterv1.AllocationRef{{SegmentId: "a1-mem-0", AllocationId: res[0].GetAllocationId()}}); err != nil {
				errs <- fmt.Errorf("caller %d release: %v", i, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for _, kind := range []string{"reserve", "seal", "release"} {
		msgs, items := a.counts(kind)
		wantItems := callers
		if kind == "reserve" {
			wantItems = callers + callers/2
		}
		if items != wantItems {
			t.Errorf("%s items: got %d, want %d", kind, items, wantItems)
		}
		if msgs >= callers {
			t.Errorf("%s messages: got %d for %d calls, want fewer (coalesced)", kind, msgs, callers)
		}
		if got := roundTrips(t, h.m.met, kind); got != uint64(msgs) {
			t.Errorf("%s round trips observed: got %d, want one per message (%d)", kind, got, msgs)
		}
		t.Logf("%s: %d calls in %d messages", kind, callers, msgs)
	}
	a.mu.Lock()
	for _, e := range a.epochs {
		if e != testEpoch {
			t.Errorf("command epoch: got %d, want %d", e, testEpoch)
		}
	}
	a.mu.Unlock()
	if got := promtest.ToFloat64(h.m.met.batches.WithLabelValues("reserve")); got < 1 {
		t.Errorf("batches metric: got %v, want >= 1", got)
	}
}

// roundTrips is how many command messages of kind came back, as
// crescent_master_agent_command_seconds counted them.
func roundTrips(t *testing.T, m *metrics, kind string) uint64 {
	t.Helper()
	var out dto.Metric
	if err := m.commandSeconds.WithLabelValues(kind).(prometheus.Histogram).Write(&out); err != nil {
		t.Fatal(err)
	}
	return out.GetHistogram().GetSampleCount()
}

func TestMaxBatchItemsSplits(t *testing.T) {
	cfg := fastConfig()
	cfg.BatchWindow = time.Second // only the item limit can flush a busy agent's batch
	cfg.MaxBatchItems = 4
	cfg.RequestTimeout = 300 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	// An idle agent gets a call at once; this one stays unanswered, so the
	// agent is busy while the next calls arrive.
	a.answer.Store(false)
	first := make(chan error, 1)
	go func() {
		_, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 1, Key: "first"}})
		first <- err
	}()
	testutil.Eventually(t, time.Second, func() bool { m, _ := a.counts("reserve"); return m == 1 }, "first reserve sent")
	a.answer.Store(true)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			if _, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 1, Key: "k", ReplicaId: uint32(i)}}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if msgs, items := a.counts("reserve"); msgs != 3 || items != 9 {
		t.Fatalf("reserve: got %d messages / %d items, want 3 / 9 (1 + 4 + 4)", msgs, items)
	}
	if err := <-first; rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("unanswered reserve: got %v, want AGENT_UNAVAILABLE", err)
	}
}

func TestDeadAgentTimesOutWithoutBlockingOthers(t *testing.T) {
	cfg := fastConfig()
	cfg.RequestTimeout = 300 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{})
	dead := h.connectAgent("dead")
	dead.answer.Store(false) // alive (heartbeats) but never answers
	h.connectAgent("live")

	deadDone := make(chan error, 20)
	start := time.Now()
	for i := range 20 {
		go func() {
			_, err := h.m.Reserve(t.Context(), "dead", []*masterv1.ReserveItem{{SegmentId: "dead-mem-0", Size: 1, Key: "k", ReplicaId: uint32(i)}})
			deadDone <- err
		}()
	}
	// While the dead agent's calls are pending, the live agent answers.
	for i := range 50 {
		if _, err := h.m.Reserve(t.Context(), "live", []*masterv1.ReserveItem{{SegmentId: "live-mem-0", Size: 1, Key: "k", ReplicaId: uint32(i)}}); err != nil {
			t.Fatalf("live agent reserve %d: %v", i, err)
		}
	}
	if len(deadDone) != 0 && time.Since(start) < cfg.RequestTimeout {
		t.Fatal("dead agent's calls finished before their timeout")
	}
	for range 20 {
		err := <-deadDone
		if got := rpcerr.Reason(err); got != "AGENT_UNAVAILABLE" || status.Code(rpcerr.Status(err)) != codes.Unavailable {
			t.Fatalf("dead agent reserve: got %v, want UNAVAILABLE/AGENT_UNAVAILABLE", err)
		}
	}
	if got := promtest.ToFloat64(h.m.met.timeouts.WithLabelValues("reserve")); got != 20 {
		t.Fatalf("timeouts metric: got %v, want 20", got)
	}
}

func TestLateReservationsReleased(t *testing.T) {
	cfg := fastConfig()
	cfg.RequestTimeout = 100 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	a.delay.Store(int64(200 * time.Millisecond))
	_, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 1, Key: "k"}, {SegmentId: "a1-mem-0", Size: 1, Key: "k2"}})
	if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("slow reserve: got %v, want AGENT_UNAVAILABLE", err)
	}
	a.delay.Store(0)
	testutil.Eventually(t, 2*time.Second, func() bool { return len(a.releasedRefs()) == 2 }, "late reservations released")
	for _, r := range a.releasedRefs() {
		if r.GetSegmentId() != "a1-mem-0" || r.GetAllocationId() == 0 {
			t.Fatalf("released ref: got %v", r)
		}
	}
}

func TestCallerContext(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	a.answer.Store(false)
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		// Cancel once the reserve is pending on the agent.
		_ = testutil.Poll(t, time.Second, func() error {
			if m, _ := a.counts("reserve"); m == 0 {
				return errors.New("reserve not sent yet")
			}
			return nil
		})
		cancel()
	}()
	if _, err := h.m.Reserve(ctx, "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 1, Key: "k"}}); err != context.Canceled {
		t.Fatalf("cancelled caller: got %v, want context.Canceled", err)
	}
	ctx, cancel2 := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel2()
	if _, err := h.m.Reserve(ctx, "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 1, Key: "k"}}); rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("caller deadline: got %v, want AGENT_UNAVAILABLE", err)
	}
	if _, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{Size: 1}}); rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("item without segment: got %v, want INVALID_PARAMS", err)
	}
	if _, err := h.m.Reserve(t.Context(), "nobody", []*masterv1.ReserveItem{{SegmentId: "x", Size: 1}}); rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("unknown agent: got %v, want AGENT_UNAVAILABLE", err)
	}
}

func TestSessionEndFailsPending(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	a.answer.Store(false)
	done := make(chan error, 1)
	go func() {
		_, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 1, Key: "k"}})
		done <- err
	}()
	testutil.Eventually(t, time.Second, func() bool { m, _ := a.counts("reserve"); return m == 1 }, "reserve sent")
	a.stop()
	select {
	case err := <-done:
		if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
			t.Fatalf("pending reserve after session end: got %v, want AGENT_UNAVAILABLE", err)
		}
	case <-time.After(time.Second):
		t.Fatal("pending reserve not failed when the session ended")
	}
}

// TestCopy: a batched Copy travels as one message of the session's epoch
// with the caller's items, split at MaxBatchItems; statuses come back per
// item in order; items without a source, a target or an endpoint are
// refused before anything is sent.
func TestCopy(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxBatchItems = 3
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	item := func(alloc uint64, tok string) *masterv1.CopyItem {
		return &masterv1.CopyItem{
			Source: &masterv1.AllocationRef{SegmentId: "a1-mem-0", AllocationId: alloc}, TargetEndpoint: "b:50052", TargetTransferEndpoint: "b:50053",
			Target: &masterv1.AllocationRef{SegmentId: "b-mem-0", AllocationId: alloc + 100}, TargetToken: []byte(tok),
		}
	}
	items := []*masterv1.CopyItem{item(1, "tok"), item(2, "bad"), item(3, "tok"), item(4, "tok"), item(5, "bad")}
	out, err := h.m.Copy(t.Context(), "a1", items)
	if err != nil {
		t.Fatal(err)
	}
	var codes []int32
	for _, st := range out {
		codes = append(codes, st.GetCode())
	}
	if want := []int32{0, 7, 0, 0, 7}; !slices.Equal(codes, want) {
		t.Fatalf("statuses: got %v, want %v", codes, want)
	}
	a.mu.Lock()
	sent := append([]*masterv1.CopyRequest(nil), a.copies...)
	a.mu.Unlock()
	if len(sent) != 2 {
		t.Fatalf("copy messages: got %d, want 2 (5 items at MaxBatchItems 3)", len(sent))
	}
	n := 0
	for _, req := range sent {
		if req.GetEpoch() != testEpoch || req.GetRequestId() == 0 || req.GetSource() != nil {
			t.Fatalf("copy request: got %v", req)
		}
		n += len(req.GetItems())
	}
	if n != len(items) {
		t.Fatalf("items sent: got %d, want %d", n, len(items))
	}
	if items[0].GetTarget().GetAllocationId() != 101 || string(items[0].GetTargetToken()) != "tok" {
		t.Fatal("Copy mutated the caller's items")
	}
	for _, bad := range [][]*masterv1.CopyItem{{{}}, {nil}, {{Source: items[0].GetSource(), Target: items[0].GetTarget()}}} {
		if _, err := h.m.Copy(t.Context(), "a1", bad); rpcerr.Reason(err) != "INVALID_PARAMS" {
			t.Fatalf("copy of %v: got %v, want INVALID_PARAMS", bad, err)
		}
	}
	if out, err := h.m.Copy(t.Context(), "a1", nil); err != nil || out != nil {
		t.Fatalf("empty copy: got %v, %v; want nothing", out, err)
	}
}

// TestCopyRefusedWhole: an agent that answers a copy with one status and
// no item statuses (it refused the request, or knows only the single form)
// fails the whole call with that status.
func TestCopyRefusedWhole(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	a.answer.Store(false)
	done := make(chan error, 1)
	go func() {
		_, err := h.m.Copy(t.Context(), "a1", []*masterv1.CopyItem{{Source: &masterv1.AllocationRef{SegmentId: "a1-mem-0"},
			Target: &masterv1.AllocationRef{SegmentId: "b-mem-0"}, TargetEndpoint: "b:1"}})
		done <- err
	}()
	var id uint64
	testutil.Eventually(t, time.Second, func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		if len(a.copies) == 0 {
			return false
		}
		id = a.copies[0].GetRequestId()
		return true
	}, "copy sent")
	a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: id,
		Status: &masterv1.ItemStatus{Code: 8, Reason: "LIMIT_EXCEEDED"}}}})
	if err := <-done; rpcerr.Reason(err) != "LIMIT_EXCEEDED" {
		t.Fatalf("refused copy: got %v, want LIMIT_EXCEEDED", err)
	}
}

func TestDeregister(t *testing.T) {
	t.Run("grace deadline", func(t *testing.T) {
		h := newHarness(t, fastConfig(), harnessOpts{})
		a := h.connectAgent("a1")
		waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)
		a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Deregister{Deregister: &masterv1.Deregister{Grace: durationpb.New(200 * time.Millisecond), Reason: "SIGTERM"}}})
		waitState(t, h, "a1-mem-0", "gracefully_unmounting/healthy", time.Second)
		sg, _ := h.reg.Segment("a1-mem-0")
		if sg.CanAllocate() || !sg.CanServeRead() {
			t.Fatalf("graceful segment: CanAllocate %v CanServeRead %v, want false true", sg.CanAllocate(), sg.CanServeRead())
		}
		h.advance(50 * time.Millisecond)
		h.beatAfter("a1")
		h.advance(50 * time.Millisecond)
		if d := h.meta.dropped(); len(d) != 0 {
			t.Fatalf("dropped before the deadline: %v", d)
		}
		h.beatAfter("a1")
		h.advance(100 * time.Millisecond)
		waitState(t, h, "a1-mem-0", "unmounted/healthy", time.Second)
		if got := h.meta.dropped(); !slices.Equal(got, []string{"a1-mem-0"}) {
			t.Fatalf("dropped: got %v, want [a1-mem-0]", got)
		}
		if err := a.waitEnded(time.Second); status.Code(err) != codes.Unavailable {
			t.Fatalf("stream after the grace deadline: got %v, want Unavailable", err)
		}
	})
	t.Run("stream closes after deregister", func(t *testing.T) {
		h := newHarness(t, fastConfig(), harnessOpts{})
		a := h.connectAgent("a1")
		a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Deregister{Deregister: &masterv1.Deregister{Grace: durationpb.New(time.Minute)}}})
		waitState(t, h, "a1-mem-0", "gracefully_unmounting/healthy", time.Second)
		a.stop()
		waitState(t, h, "a1-mem-0", "unmounted/suspected", time.Second)
		if got := h.meta.dropped(); !slices.Equal(got, []string{"a1-mem-0"}) {
			t.Fatalf("dropped: got %v, want [a1-mem-0]", got)
		}
	})
}

func TestSegmentsUpdate(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{
		Mounted: []*masterv1.SegmentInfo{{SegmentId: "a1-disk-0", Medium: masterv1.Medium_MEDIUM_DISK, Capacity: 1 << 30}},
	}}})
	waitState(t, h, "a1-disk-0", "ok/healthy", time.Second)
	a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{
		UnmountedSegmentIds: []string{"a1-mem-0"},
	}}})
	waitState(t, h, "a1-mem-0", "unmounted/healthy", time.Second)
	if got := h.meta.dropped(); !slices.Equal(got, []string{"a1-mem-0"}) {
		t.Fatalf("dropped: got %v, want [a1-mem-0]", got)
	}
	ag, _ := h.reg.Agent("a1")
	if !slices.Equal(ag.SegmentIDs, []string{"a1-disk-0"}) {
		t.Fatalf("agent segments: got %v, want [a1-disk-0]", ag.SegmentIDs)
	}
}

func TestRestartedAgentDropsOldMemorySegments(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1", withSegments("mem-old", "disk-0"))
	a.stop()
	waitState(t, h, "mem-old", "ok/suspected", time.Second)
	h.connectAgent("a1", withSegments("mem-new", "disk-0"))
	waitState(t, h, "mem-old", "unmounted/suspected", time.Second)
	waitState(t, h, "disk-0", "ok/healthy", time.Second)
	waitState(t, h, "mem-new", "ok/healthy", time.Second)
	if got := h.meta.dropped(); !slices.Equal(got, []string{"mem-old"}) {
		t.Fatalf("dropped: got %v, want [mem-old]", got)
	}
}

func TestCloseEndsSessions(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	if err := h.m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	err := a.waitEnded(time.Second)
	if got := status.Code(err); got != codes.Unavailable {
		t.Fatalf("stream after Close: got %v, want Unavailable", err)
	}
	conn, stream, cancel := h.open(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("late")}})
	defer conn.Close()
	defer cancel()
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("connect after Close: got %v, want Unavailable", err)
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Config)
		ok   bool
	}{
		{"defaults", func(*Config) {}, true},
		{"suspect not above heartbeat", func(c *Config) { c.SuspectAfter = c.HeartbeatInterval }, false},
		{"unmount not above suspect", func(c *Config) { c.UnmountAfter = c.SuspectAfter }, false},
		{"negative timeout", func(c *Config) { c.RequestTimeout = -1 }, false},
		{"negative batch", func(c *Config) { c.MaxBatchItems = -1 }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			tt.mod(&c)
			err := c.withDefaults().Validate()
			if got := err == nil; got != tt.ok {
				t.Fatalf("Validate: got err %v, want ok %v", err, tt.ok)
			}
		})
	}
}

func TestMetadataSetAfterNew(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	h.m.meta.Store(nil) // as if New had no Metadata yet
	conn, stream, cancel := h.open(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a1")}})
	defer conn.Close()
	defer cancel()
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("connect before SetMetadata: got %v, want Unavailable", err)
	}
	h.m.SetMetadata(h.meta)
	h.connectAgent("a1")
	waitState(t, h, "a1-mem-0", "ok/healthy", time.Second)

	if _, err := New(fastConfig(), Deps{}, nil); err == nil {
		t.Fatal("New without a Registry: got nil error")
	}
}

// TestLargeCallSplitIntoMessages: one call with more items than
// MaxBatchItems goes out as several messages (a RemoveByPrefix of 100k
// objects must not become one message past the agent's receive limit), and
// the results come back in item order.
func TestLargeCallSplitIntoMessages(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxBatchItems = 4
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	items := make([]*masterv1.ReserveItem, 10)
	for i := range items {
		items[i] = &masterv1.ReserveItem{SegmentId: "a1-mem-0", Size: 1, Key: "k", ReplicaId: uint32(i)}
	}
	res, err := h.m.Reserve(t.Context(), "a1", items)
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != len(items) {
		t.Fatalf("got %d results, want %d", len(res), len(items))
	}
	seen := map[uint64]bool{}
	for i, r := range res {
		if r.GetStatus().GetCode() != 0 || seen[r.GetAllocationId()] {
			t.Fatalf("result %d: %v (duplicate=%v)", i, r, seen[r.GetAllocationId()])
		}
		seen[r.GetAllocationId()] = true
	}
	if msgs, n := a.counts("reserve"); msgs != 3 || n != 10 {
		t.Fatalf("reserve: got %d messages / %d items, want 3 / 10 (4 + 4 + 2)", msgs, n)
	}
	refs := make([]*masterv1.AllocationRef, 9)
	for i := range refs {
		refs[i] = &masterv1.AllocationRef{SegmentId: "a1-mem-0", AllocationId: uint64(i + 1)}
	}
	if err := h.m.Release(t.Context(), "a1", refs); err != nil {
		t.Fatal(err)
	}
	if msgs, n := a.counts("release"); msgs != 3 || n != 9 {
		t.Fatalf("release: got %d messages / %d items, want 3 / 9", msgs, n)
	}
}

// TestLargeCopySplitAtAgentLimit: a Copy never sends more items in one
// message than agents accept (MaxCopyItems), even when MaxBatchItems is
// larger, and its statuses come back in item order.
func TestLargeCopySplitAtAgentLimit(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxBatchItems = 2 * MaxCopyItems
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	items := make([]*masterv1.CopyItem, MaxCopyItems+5)
	for i := range items {
		items[i] = &masterv1.CopyItem{Source: &masterv1.AllocationRef{SegmentId: "a1-mem-0", AllocationId: uint64(i)}, TargetTransferEndpoint: "b:1",
			Target: &masterv1.AllocationRef{SegmentId: "b-mem-0", AllocationId: uint64(i)}, TargetToken: []byte("tok")}
	}
	items[MaxCopyItems+2].TargetToken = []byte("bad")
	out, err := h.m.Copy(t.Context(), "a1", items)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(items) {
		t.Fatalf("got %d statuses, want %d", len(out), len(items))
	}
	for i, st := range out {
		if bad := i == MaxCopyItems+2; (st.GetCode() != 0) != bad {
			t.Fatalf("status %d: %v", i, st)
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.copies) != 2 || len(a.copies[0].GetItems())+len(a.copies[1].GetItems()) != len(items) ||
		max(len(a.copies[0].GetItems()), len(a.copies[1].GetItems())) != MaxCopyItems {
		t.Fatalf("copy messages: %d, want 2 of at most %d items", len(a.copies), MaxCopyItems)
	}
}

// TestRegisterBoundToCertificate: with an agent principal (mTLS), Register
// may name only the certificate's host, and a certificate for another host
// cannot take over a registered agent_id or its segments — the attack in
// issue 14 where a fake agent reusing a real agent's id made the master drop
// its replicas.
func TestRegisterBoundToCertificate(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	real := h.connectAgent("a1") // host-a1, segment a1-mem-0
	const evil = "spiffe://crescent.local/agent/host-evil"

	deny := func(name, spiffe string, reg *masterv1.Register, msg string) {
		t.Helper()
		conn, stream, cancel := h.openAs(spiffe, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: reg}})
		defer conn.Close()
		defer cancel()
		_, err := stream.Recv()
		if status.Code(err) != codes.PermissionDenied || rpcerr.Reason(err) != "ILLEGAL_CLIENT" || !strings.Contains(status.Convert(err).Message(), msg) {
			t.Fatalf("%s: got %v (%v), want PermissionDenied ILLEGAL_CLIENT containing %q", name, status.Code(err), err, msg)
		}
	}
	// Naming the real host with another host's certificate.
	deny("host of another certificate", evil, registerMsg("a1"), `not this certificate's host "host-evil"`)
	// The real agent's id from the attacker's own host, with no segments.
	empty := registerMsg("a1", withSegments())
	empty.HostId = "host-evil"
	deny("agent_id of another host", evil, empty, `agent_id "a1" is registered from host "host-a1"`)
	// Another agent id claiming the real agent's segment.
	steal := registerMsg("evil", withSegments("a1-mem-0"))
	steal.HostId = "host-evil"
	deny("segment of another host", evil, steal, `segment "a1-mem-0" belongs to host "host-a1"`)

	// The real agent was not disturbed: still connected, segment still its.
	if !h.m.Connected("a1") {
		t.Fatal("a1 lost its session")
	}
	if s, ok := h.reg.Segment("a1-mem-0"); !ok || s.AgentID != "a1" || s.HostID != "host-a1" {
		t.Fatalf("a1-mem-0: got %+v, %v", s, ok)
	}
	_ = real

	// The rightful certificate registers (and replaces the session).
	conn, stream, cancel := h.openAs("spiffe://crescent.local/agent/host-a1", &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a1")}})
	defer conn.Close()
	defer cancel()
	first, err := stream.Recv()
	if err != nil || first.GetSettings() == nil {
		t.Fatalf("rightful register: got %v, %v", first, err)
	}
}

// TestEventsArriveBeforeAcknowledged: Arrive runs before the registration
// is acknowledged, and its error refuses the registration (UNAVAILABLE:
// the agent retries), leaving nothing registered; Depart hears of a
// graceful stop.
func TestEventsArriveBeforeAcknowledged(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	var (
		mu       sync.Mutex
		arrived  []string
		departed = make(chan string, 1)
		refuse   = true
	)
	h.m.SetEvents(Events{
		Arrive: func(_ context.Context, id string) error {
			mu.Lock()
			defer mu.Unlock()
			if refuse {
				return errors.New("etcd unreachable")
			}
			arrived = append(arrived, id)
			return nil
		},
		Depart: func(id string) { departed <- id },
	})
	conn, stream, cancel := h.open(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a1")}})
	_, err := stream.Recv()
	cancel()
	conn.Close()
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "etcd unreachable") {
		t.Fatalf("registration whose arrival failed: %v, want UNAVAILABLE naming the cause", err)
	}
	if h.m.Connected("a1") {
		t.Fatal("a1 connected although its arrival was refused")
	}
	if _, ok := h.reg.Segment("a1-mem-0"); ok {
		t.Fatal("a1's segment registered although its arrival was refused")
	}

	mu.Lock()
	refuse = false
	mu.Unlock()
	a := h.connectAgent("a1")
	mu.Lock()
	got := slices.Clone(arrived)
	mu.Unlock()
	if !slices.Equal(got, []string{"a1"}) {
		t.Fatalf("arrivals before the acknowledgement: %v, want [a1]", got)
	}
	a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Deregister{Deregister: &masterv1.Deregister{Grace: durationpb.New(time.Minute)}}})
	waitState(t, h, "a1-mem-0", "gracefully_unmounting/healthy", time.Second)
	a.stop()
	select {
	case id := <-departed:
		if id != "a1" {
			t.Fatalf("departed %q, want a1", id)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no departure after a graceful stop")
	}
}

// TestSegmentsReadableOnceSettingsApplied: a registering agent's segments
// stay SUSPECTED (no lookup hands out their replicas) until the agent
// answers the registration's Settings, which carry the token keys it
// verifies reads with; a restarted master's key is new to every agent.
// The answer is SettingsApplied, or from an agent that predates it its
// first heartbeat; an agent that sends neither is activated after
// RegisterTimeout, as before the answer existed.
func TestSegmentsReadableOnceSettingsApplied(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	register := func(t *testing.T, id string) masterv1.SegmentService_ConnectClient {
		conn, stream, cancel := h.open(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg(id)}})
		t.Cleanup(func() {
			cancel()
			_ = conn.Close()
		})
		if m, err := stream.Recv(); err != nil || m.GetSettings() == nil {
			t.Fatalf("first response: %v, %v; want Settings", m, err)
		}
		return stream
	}
	// unanswered checks that seg stays SUSPECTED while its agent is silent.
	unanswered := func(t *testing.T, seg string) {
		t.Helper()
		for range 10 {
			if got := segState(h, seg); got != "ok/suspected" {
				t.Fatalf("segment %s before its agent applied Settings: %s, want ok/suspected", seg, got)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	send := func(t *testing.T, stream masterv1.SegmentService_ConnectClient, m *masterv1.ConnectRequest) {
		t.Helper()
		if err := stream.Send(m); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("applied", func(t *testing.T) {
		stream := register(t, "acks")
		unanswered(t, "acks-mem-0")
		// Other messages meanwhile are served, and do not activate.
		send(t, stream, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{}}})
		unanswered(t, "acks-mem-0")
		send(t, stream, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SettingsApplied{SettingsApplied: &masterv1.SettingsApplied{TokenKeyId: testTokenKey.ID}}})
		waitState(t, h, "acks-mem-0", "ok/healthy", time.Second)
	})
	t.Run("older agent's heartbeat", func(t *testing.T) {
		stream := register(t, "beats")
		unanswered(t, "beats-mem-0")
		send(t, stream, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: 1}}})
		waitState(t, h, "beats-mem-0", "ok/healthy", time.Second)
	})
	t.Run("silent agent", func(t *testing.T) {
		register(t, "silent")
		unanswered(t, "silent-mem-0")
		// fastConfig's RegisterTimeout is 1 s.
		waitState(t, h, "silent-mem-0", "ok/healthy", 3*time.Second)
	})
}
