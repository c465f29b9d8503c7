package session

import (
	"fmt"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"
)

var testTracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/master/session_test")

// TestCommandsCarryTraceContext: a traced call to an agent makes one
// master.<kind> span under the caller's, and the command message names
// that span, so the agent's span becomes its child.
func TestCommandsCarryTraceContext(t *testing.T) {
	rec := tracectxtest.Install(t)
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	ctx, caller := testTracer.Start(t.Context(), "caller")
	res, err := h.m.Reserve(ctx, "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 64, Key: "k"}})
	if err != nil {
		t.Fatal(err)
	}
	ref := &masterv1.AllocationRef{SegmentId: "a1-mem-0", AllocationId: res[0].GetAllocationId()}
	if _, err := h.m.Seal(ctx, "a1", []*masterv1.SealItem{{SegmentId: "a1-mem-0", AllocationId: ref.GetAllocationId()}}); err != nil {
		t.Fatal(err)
	}
	if err := h.m.Release(ctx, "a1", []*masterv1.AllocationRef{ref}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.Copy(ctx, "a1", []*masterv1.CopyItem{{Source: ref, TargetEndpoint: "b:1", Target: &masterv1.AllocationRef{SegmentId: "b-mem-0"}}}); err != nil {
		t.Fatal(err)
	}
	caller.End()
	a.mu.Lock()
	got := append([]tracedCmd(nil), a.traced...)
	a.mu.Unlock()
	if len(got) != 4 {
		t.Fatalf("%d commands, want 4", len(got))
	}
	for _, c := range got {
		span := tracectxtest.One(t, rec, "master."+c.kind)
		tracectxtest.ChildOf(t, span, caller.SpanContext())
		if sent := tracectx.ParseCommand(c.tc); !sent.Equal(withRemote(span.SpanContext())) {
			t.Errorf("%s: message names span %v, want the master.%s span %v", c.kind, sent, c.kind, span.SpanContext())
		}
		if len(c.links) != 0 {
			t.Errorf("%s: %d links for one caller", c.kind, len(c.links))
		}
		if agent := tracectxtest.Attr(span, string(tracectx.Agent)); agent != "a1" {
			t.Errorf("%s: agent attribute %q", c.kind, agent)
		}
	}
	// The seal's checksum was 0: the fake agent failed the item.
	if seal := tracectxtest.One(t, rec, "master.seal"); tracectxtest.Attr(seal, string(tracectx.Failed)) != "1" ||
		tracectxtest.Attr(seal, string(tracectx.Reason)) != "CHECKSUM_MISMATCH" {
		t.Errorf("seal span attributes %v", seal.Attributes())
	}
}

func withRemote(sc trace.SpanContext) trace.SpanContext { return sc.WithRemote(true) }

// TestUntracedCommandsCarryNothing: without a recording span the commands
// are byte for byte what they were before tracing existed, and no span
// is made.
func TestUntracedCommandsCarryNothing(t *testing.T) {
	rec := tracectxtest.Install(t)
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	if _, err := h.m.Reserve(t.Context(), "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 64, Key: "k"}}); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	got := a.traced[0]
	a.mu.Unlock()
	if got.tc != nil || got.links != nil {
		t.Fatalf("untraced reserve carried %v, %v", got.tc, got.links)
	}
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans for an untraced call", n)
	}
	// And the encoding of an untraced message has no trace bytes at all.
	plain := &masterv1.ReserveRequest{RequestId: 1, Epoch: 2, Items: []*masterv1.ReserveItem{{SegmentId: "s"}}}
	withNil := proto.CloneOf(plain)
	withNil.TraceContext, withNil.TraceLinks = nil, nil
	if proto.Size(plain) != proto.Size(withNil) {
		t.Fatal("nil trace fields take bytes")
	}
}

// TestCoalescedCallersLink: concurrent callers sharing one message: the
// agent's parent is one caller's span, the others are links, at most
// tracectx.MaxLinks of them.
func TestCoalescedCallersLink(t *testing.T) {
	rec := tracectxtest.Install(t)
	cfg := fastConfig()
	cfg.MaxInFlight = 1
	cfg.BatchWindow = 20 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{})
	a := h.connectAgent("a1")
	a.delay.Store(int64(100 * time.Millisecond)) // the first message holds the only slot while the rest queue
	const callers = 20
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			ctx, span := testTracer.Start(t.Context(), "caller")
			defer span.End()
			if _, err := h.m.Reserve(ctx, "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 64, Key: fmt.Sprint("k", i)}}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	masterSpans := map[trace.SpanID]bool{}
	for _, s := range tracectxtest.Named(rec, "master.reserve") {
		masterSpans[s.SpanContext().SpanID()] = true
	}
	if len(masterSpans) != callers {
		t.Fatalf("%d master.reserve spans for %d callers", len(masterSpans), callers)
	}
	a.mu.Lock()
	got := append([]tracedCmd(nil), a.traced...)
	a.mu.Unlock()
	maxLinks := 0
	for _, c := range got {
		if sc := tracectx.ParseCommand(c.tc); !masterSpans[sc.SpanID()] {
			t.Errorf("message parent %v is no master.reserve span", sc)
		}
		if len(c.links) > tracectx.MaxLinks {
			t.Errorf("%d links, max %d", len(c.links), tracectx.MaxLinks)
		}
		for _, l := range tracectx.ParseLinks(c.links) {
			if !masterSpans[l.SpanID()] {
				t.Errorf("link %v is no master.reserve span", l)
			}
		}
		maxLinks = max(maxLinks, len(c.links))
	}
	if len(got) >= callers || maxLinks == 0 {
		t.Fatalf("%d messages for %d callers, at most %d links: nothing coalesced", len(got), callers, maxLinks)
	}
	t.Logf("%d callers in %d messages, up to %d links", callers, len(got), maxLinks)
}

// TestSampledCallerPassedOn: a master that does not record (tracing off,
// or its caller's span not recording here) still names a sampled caller's
// span in the command, so the trace is not cut in two; no span is made.
func TestSampledCallerPassedOn(t *testing.T) {
	rec := tracectxtest.Install(t)
	h := newHarness(t, fastConfig(), harnessOpts{})
	a := h.connectAgent("a1")
	caller := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{7}, SpanID: trace.SpanID{8}, TraceFlags: trace.FlagsSampled, Remote: true})
	ctx := trace.ContextWithRemoteSpanContext(t.Context(), caller)
	if _, err := h.m.Reserve(ctx, "a1", []*masterv1.ReserveItem{{SegmentId: "a1-mem-0", Size: 64, Key: "k"}}); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	got := a.traced[0]
	a.mu.Unlock()
	if sc := tracectx.ParseCommand(got.tc); !sc.Equal(caller) {
		t.Fatalf("command names %v, want the caller's span %v", sc, caller)
	}
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans under a non-recording caller", n)
	}
}
