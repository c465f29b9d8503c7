package link

import (
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
)

var testTracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/agent/link_test")

// TestCommandSpansAreChildren: the agent's span for a command is a child of
// the master span the command names, linked to the other callers' spans,
// with the outcome of its items; an untraced command, or one whose trace
// context is garbage or oversized, runs untraced and is answered all the
// same.
func TestCommandSpansAreChildren(t *testing.T) {
	rec := tracectxtest.Install(t)
	h := newHarness(t, harnessOpts{})
	s := connected(t, h, 3)
	seg := h.mem.ID()

	ctx, master := testTracer.Start(t.Context(), "master.reserve")
	_, other := testTracer.Start(t.Context(), "master.reserve.other")
	other.End()
	master.End()
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 1, Epoch: 3,
		Items:        []*masterv1.ReserveItem{{SegmentId: seg, Size: 10, Key: "a"}, {SegmentId: "missing", Size: 10, Key: "b"}},
		TraceContext: tracectx.Command(ctx), TraceLinks: []*masterv1.TraceContext{tracectx.CommandOf(other.SpanContext())},
	}}}
	if rr := s.next(t).GetReserveResult(); len(rr.GetItems()) != 2 {
		t.Fatalf("ReserveResult = %v", rr)
	}
	span := tracectxtest.One(t, rec, "agent.reserve")
	tracectxtest.ChildOf(t, span, master.SpanContext())
	if l := span.Links(); len(l) != 1 || !l[0].SpanContext.Equal(other.SpanContext().WithRemote(true)) {
		t.Fatalf("links %v, want the other caller's span", l)
	}
	for key, want := range map[string]string{string(tracectx.Items): "2", string(tracectx.Failed): "1", string(tracectx.Reason): "SEGMENT_NOT_FOUND", string(tracectx.Agent): h.link.cfg.AgentID} {
		if got := tracectxtest.Attr(span, key); got != want {
			t.Errorf("attribute %s = %q, want %q", key, got, want)
		}
	}

	// Hostile or absent trace contexts: answered, no span.
	for i, tc := range []*masterv1.TraceContext{
		nil,
		{Traceparent: "garbage"},
		{Traceparent: "00-" + strings.Repeat("a", 32) + "-" + strings.Repeat("b", 16) + "-01" + strings.Repeat("-x", 100)},
		{Traceparent: strings.Repeat("0", tracectx.MaxTraceparent+1)},
		{Tracestate: "a=b"},
	} {
		s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: uint64(10 + i), Epoch: 3,
			Items: []*masterv1.AllocationRef{{SegmentId: seg, AllocationId: 999}}, TraceContext: tc,
		}}}
		if rel := s.next(t).GetReleaseResult(); rel.GetRequestId() != uint64(10+i) {
			t.Fatalf("ReleaseResult = %v", rel)
		}
	}
	if n := len(tracectxtest.Named(rec, "agent.release")); n != 0 {
		t.Fatalf("%d agent.release spans for untraced or hostile commands", n)
	}
}
