package session

import (
	"fmt"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// segmentIDs names n segments of one agent.
func segmentIDs(agent string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-mem-%d", agent, i)
	}
	return ids
}

// TestRegisterSegmentCap: a registration claiming more segments than
// MaxSegmentsPerAgent is refused with RESOURCE_EXHAUSTED / LIMIT_EXCEEDED
// before the registry takes any of them; a mount that would pass the cap
// ends the stream the same way; an agent within the cap registers normally
// afterwards.
func TestRegisterSegmentCap(t *testing.T) {
	cfg := fastConfig()
	cfg.MaxSegmentsPerAgent = 4
	h := newHarness(t, cfg, harnessOpts{tcp: true})

	t.Run("register", func(t *testing.T) {
		for _, n := range []int{5, 5000} {
			conn, stream, cancel := h.open(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("greedy", withSegments(segmentIDs("greedy", n)...))}})
			_, err := stream.Recv()
			cancel()
			_ = conn.Close()
			if got := status.Code(err); got != codes.ResourceExhausted {
				t.Fatalf("%d segments: code: got %v, want ResourceExhausted (%v)", n, got, err)
			}
			if got := rpcerr.Reason(err); got != "LIMIT_EXCEEDED" {
				t.Fatalf("%d segments: reason: got %q, want LIMIT_EXCEEDED", n, got)
			}
			if msg := status.Convert(err).Message(); !strings.Contains(msg, "max 4 per agent") {
				t.Fatalf("message: got %q, want it to name the cap", msg)
			}
		}
		if got := len(h.reg.Segments()); got != 0 {
			t.Fatalf("registry segments after refused registrations: got %d, want 0", got)
		}
		if got := promtest.ToFloat64(h.m.met.registrations.WithLabelValues("rejected")); got != 2 {
			t.Fatalf("rejected registrations: got %v, want 2", got)
		}
	})

	t.Run("mount past the cap", func(t *testing.T) {
		a := h.connectAgent("mounter", withSegments(segmentIDs("mounter", 3)...))
		defer a.stop()
		// Re-announcing a held segment and adding one reaches the cap: fine.
		ok := &masterv1.SegmentInfo{SegmentId: "mounter-mem-3", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 20}
		held := &masterv1.SegmentInfo{SegmentId: "mounter-mem-0", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 30}
		a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{Mounted: []*masterv1.SegmentInfo{held, ok}}}})
		testutil.Eventually(t, time.Second, func() bool { _, found := h.reg.Segment("mounter-mem-3"); return found }, "fourth segment mounted")
		one := &masterv1.SegmentInfo{SegmentId: "mounter-mem-4", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 20}
		a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{Mounted: []*masterv1.SegmentInfo{one}}}})
		err := a.waitEnded(2 * time.Second)
		if got := rpcerr.Reason(err); got != "LIMIT_EXCEEDED" {
			t.Fatalf("reason: got %q, want LIMIT_EXCEEDED (%v)", got, err)
		}
		if _, found := h.reg.Segment("mounter-mem-4"); found {
			t.Fatal("segment past the cap was mounted")
		}
	})

	t.Run("within the cap afterwards", func(t *testing.T) {
		a := h.connectAgent("modest", withSegments(segmentIDs("modest", 4)...))
		defer a.stop()
		waitState(t, h, "modest-mem-3", "ok/healthy", time.Second)
		if !h.m.Connected("modest") {
			t.Fatal("Connected(modest): got false, want true")
		}
	})
}

// TestRegisterStringLimits: every string of a registration that the
// registry keeps is bounded; past its limit the registration is refused
// with INVALID_PARAMS and nothing is registered.
func TestRegisterStringLimits(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{tcp: true})
	long := strings.Repeat("x", maxNameLen+1)
	for name, opt := range map[string]agentOpt{
		"agent_id":          func(r *masterv1.Register) { r.AgentId = long },
		"host_id":           func(r *masterv1.Register) { r.HostId = long },
		"data_endpoint":     func(r *masterv1.Register) { r.DataEndpoint = long },
		"transfer_endpoint": func(r *masterv1.Register) { r.TransferEndpoint = long },
		"version":           func(r *masterv1.Register) { r.Version = long },
		"segment_id":        func(r *masterv1.Register) { r.Segments[0].SegmentId = long },
		"segment name":      func(r *masterv1.Register) { r.Segments[0].Name = long },
		"capacity 2^63":     func(r *masterv1.Register) { r.Segments[0].Capacity = 1 << 63 },
	} {
		t.Run(name, func(t *testing.T) {
			conn, stream, cancel := h.open(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("s", opt)}})
			defer conn.Close()
			defer cancel()
			_, err := stream.Recv()
			if status.Code(err) != codes.InvalidArgument || rpcerr.Reason(err) != "INVALID_PARAMS" {
				t.Fatalf("got %v, want INVALID_ARGUMENT / INVALID_PARAMS", err)
			}
		})
	}
	if got := len(h.reg.Segments()); got != 0 {
		t.Fatalf("registry segments after refused registrations: got %d, want 0", got)
	}
	a := h.connectAgent("fine")
	defer a.stop()
	waitState(t, h, "fine-mem-0", "ok/healthy", time.Second)
}
