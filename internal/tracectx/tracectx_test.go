package tracectx_test

import (
	"context"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var tr = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/tracectx_test")

const validParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// TestRoundTrip: a sampled span's context survives Command and Transfer,
// and the receiver's span is its child.
func TestRoundTrip(t *testing.T) {
	rec := tracectxtest.Install(t)
	ctx, span := tr.Start(t.Context(), "sender")
	tc := tracectx.Command(ctx)
	if tc == nil || tc.GetTraceparent() == "" {
		t.Fatalf("Command of a sampled span = %v", tc)
	}
	xc := tracectx.Transfer(ctx)
	if xc.GetTraceparent() != tc.GetTraceparent() {
		t.Fatalf("Transfer = %q, Command = %q", xc.GetTraceparent(), tc.GetTraceparent())
	}
	_, cmd := tr.Remote(context.Background(), "receiver", tracectx.ParseCommand(tc), nil)
	cmd.End()
	_, xfer := tr.Remote(context.Background(), "transfer", tracectx.ParseTransfer(xc), nil)
	xfer.End()
	span.End()
	for _, name := range []string{"receiver", "transfer"} {
		tracectxtest.ChildOf(t, tracectxtest.One(t, rec, name), span.SpanContext())
	}
}

// TestNothingWhenOff: no span, an unsampled span, or no propagator: no
// field, and the receiver makes no span.
func TestNothingWhenOff(t *testing.T) {
	if tc := tracectx.Command(t.Context()); tc != nil {
		t.Fatalf("Command without a span = %v", tc)
	}
	rec := tracectxtest.Install(t, sdktrace.WithSampler(sdktrace.NeverSample()))
	ctx, span := tr.Start(t.Context(), "unsampled")
	defer span.End()
	if tc := tracectx.Command(ctx); tc != nil {
		t.Fatalf("Command of an unsampled span = %v", tc)
	}
	if xc := tracectx.Transfer(ctx); xc != nil {
		t.Fatalf("Transfer of an unsampled span = %v", xc)
	}
	// An unsampled parent from a peer: no span at all.
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, Remote: true})
	if _, s := tr.Remote(t.Context(), "receiver", unsampled, nil); s.IsRecording() || s.SpanContext().IsValid() {
		t.Fatalf("Remote under an unsampled parent made span %v", s.SpanContext())
	}
	// Child of a non-recording span: none either.
	if _, s := tr.Child(ctx, "child"); s.IsRecording() {
		t.Fatal("Child of an unsampled span records")
	}
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans recorded", n)
	}
	// A sampled span but the default (no-op) propagator: nothing either.
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator())
	sampled := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled}))
	if tc := tracectx.Command(sampled); tc != nil {
		t.Fatalf("Command with no propagator = %v", tc)
	}
}

// TestHostileFields: oversized, malformed and odd fields are ignored
// without harm; a bad tracestate alone keeps the parent.
func TestHostileFields(t *testing.T) {
	tracectxtest.Install(t)
	long := "00-" + strings.Repeat("a", 200)
	for _, tc := range []struct {
		name, parent, state string
		valid               bool
		state0              bool // the trace state was dropped
	}{
		{"valid", validParent, "", true, true},
		{"with state", validParent, "vendor=x", true, false},
		{"empty", "", "", false, true},
		{"oversized parent", long, "", false, true},
		{"oversized state", validParent, "a=" + strings.Repeat("b", tracectx.MaxTracestate), true, true},
		{"garbage", "not a traceparent", "", false, true},
		{"upper hex", strings.ToUpper(validParent), "", false, true},
		{"zero trace id", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "", false, true},
		{"zero span id", "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "", false, true},
		{"version ff", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "", false, true},
		{"version 00 with more", validParent + "-00", "", false, true},
		{"bad state", validParent, "=,,==", true, true},
		{"NUL bytes", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\x00", "\x00", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := tracectx.Parse(tc.parent, tc.state)
			if sc.IsValid() != tc.valid {
				t.Fatalf("Parse(%q, %q) valid = %v, want %v", tc.parent, tc.state, sc.IsValid(), tc.valid)
			}
			if tc.valid && (sc.TraceState().Len() == 0) != tc.state0 {
				t.Fatalf("Parse(%q, %q) trace state %q", tc.parent, tc.state, sc.TraceState())
			}
		})
	}
	// Links: invalid ones skipped, at most MaxLinks used.
	var many []*masterv1.TraceContext
	for range tracectx.MaxLinks + 5 {
		many = append(many, &masterv1.TraceContext{Traceparent: validParent}, &masterv1.TraceContext{Traceparent: "x"}, nil)
	}
	if n := len(tracectx.ParseLinks(many)); n > tracectx.MaxLinks || n == 0 {
		t.Fatalf("ParseLinks of %d entries gave %d", len(many), n)
	}
	if n := len(tracectx.Links(make([]trace.SpanContext, 3))); n != 0 {
		t.Fatalf("Links of invalid contexts = %d", n)
	}
}

// TestEndReason: a failed span carries the reason, never the message.
func TestEndReason(t *testing.T) {
	rec := tracectxtest.Install(t)
	_, span := tr.Start(t.Context(), "fails")
	tracectx.End(span, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "object %q not found", "secret-key"))
	s := tracectxtest.One(t, rec, "fails")
	if got := s.Status().Description; got != "OBJECT_NOT_FOUND" {
		t.Fatalf("status description %q, want the reason alone", got)
	}
	if got := tracectxtest.Attr(s, string(tracectx.Reason)); got != "OBJECT_NOT_FOUND" {
		t.Fatalf("reason attribute %q", got)
	}
	if got := tracectx.ReasonOf(context.Canceled); got != "CANCELLED" {
		t.Fatalf("ReasonOf(context.Canceled) = %q", got)
	}
}

// FuzzParse: whatever a peer sends, Parse neither panics nor accepts an
// oversized traceparent, and what it accepts encodes back to a bounded
// field.
func FuzzParse(f *testing.F) {
	f.Add(validParent, "")
	f.Add(validParent, "a=b,c=d")
	f.Add("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-future", "x")
	f.Add("", "a=b")
	f.Add(strings.Repeat("-", 300), strings.Repeat("=", 600))
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(propagation.TraceContext{})
	f.Cleanup(func() { otel.SetTextMapPropagator(prev) })
	f.Fuzz(func(t *testing.T, parent, state string) {
		sc := tracectx.Parse(parent, state)
		if !sc.IsValid() {
			return
		}
		if len(parent) > tracectx.MaxTraceparent {
			t.Fatalf("accepted a traceparent of %d bytes", len(parent))
		}
		if !sc.IsRemote() {
			t.Fatal("a parsed span context is not remote")
		}
		if tc := tracectx.CommandOf(sc); tc != nil && (len(tc.GetTraceparent()) > tracectx.MaxTraceparent || len(tc.GetTracestate()) > tracectx.MaxTracestate) {
			t.Fatalf("re-encoded to %d+%d bytes", len(tc.GetTraceparent()), len(tc.GetTracestate()))
		}
	})
}
