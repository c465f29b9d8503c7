package otlptest_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func str(k, v string) *commonpb.KeyValue {
	return &commonpb.KeyValue{Key: k, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: v}}}
}

func client(t *testing.T, r *otlptest.Receiver) collectortrace.TraceServiceClient {
	t.Helper()
	cc, err := grpc.NewClient(r.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return collectortrace.NewTraceServiceClient(cc)
}

func id(n byte, size int) []byte {
	b := make([]byte, size)
	b[size-1] = n
	return b
}

// request is one trace of three spans from two services: root (client)
// → child (master) → grandchild (master).
func request() *collectortrace.ExportTraceServiceRequest {
	tid := id(7, 16)
	span := func(sid, parent byte, name string, a ...*commonpb.KeyValue) *tracepb.Span {
		s := &tracepb.Span{TraceId: tid, SpanId: id(sid, 8), Name: name, Kind: tracepb.Span_SPAN_KIND_INTERNAL,
			StartTimeUnixNano: 1e9, EndTimeUnixNano: 2e9, Attributes: a,
			Status: &tracepb.Status{Code: tracepb.Status_STATUS_CODE_ERROR, Message: "boom"}}
		if parent != 0 {
			s.ParentSpanId = id(parent, 8)
		}
		return s
	}
	res := func(service string) *resourcepb.Resource {
		return &resourcepb.Resource{Attributes: []*commonpb.KeyValue{str("service.name", service), str("service.instance.id", service+"-1")}}
	}
	return &collectortrace.ExportTraceServiceRequest{ResourceSpans: []*tracepb.ResourceSpans{
		{Resource: res("client"), ScopeSpans: []*tracepb.ScopeSpans{{
			Scope: &commonpb.InstrumentationScope{Name: "scope-a"},
			Spans: []*tracepb.Span{span(1, 0, "root")},
		}}},
		{Resource: res("master"), ScopeSpans: []*tracepb.ScopeSpans{{
			Scope: &commonpb.InstrumentationScope{Name: "scope-b"},
			Spans: []*tracepb.Span{
				span(2, 1, "child", str("tenant", "t1"),
					&commonpb.KeyValue{Key: "n", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_IntValue{IntValue: 128}}},
					&commonpb.KeyValue{Key: "ok", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_BoolValue{BoolValue: true}}},
					&commonpb.KeyValue{Key: "ratio", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_DoubleValue{DoubleValue: 0.5}}},
					&commonpb.KeyValue{Key: "list", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_ArrayValue{ArrayValue: &commonpb.ArrayValue{
						Values: []*commonpb.AnyValue{{Value: &commonpb.AnyValue_StringValue{StringValue: "a"}}}}}}},
					&commonpb.KeyValue{Key: "nil"}),
				span(3, 2, "grandchild"),
			},
		}}},
	}}
}

func TestReceiverCollectsSpans(t *testing.T) {
	r := otlptest.Start(t)
	if _, err := client(t, r).Export(t.Context(), request()); err != nil {
		t.Fatal(err)
	}
	spans, err := r.WaitFor(t.Context(), func(s []otlptest.Span) bool { return len(s) == 3 })
	if err != nil {
		t.Fatal(err)
	}
	if got, want := r.Requests(), 1; got != want {
		t.Fatalf("requests: got %d, want %d", got, want)
	}
	const trace = "00000000000000000000000000000007"
	root, child, grand := spans[0], spans[1], spans[2]
	if root.TraceID != trace || root.SpanID != "0000000000000001" || !root.Root() || root.Service != "client" || root.Scope != "scope-a" {
		t.Fatalf("root: got %+v", root)
	}
	if !child.ChildOf(root) || !grand.ChildOf(child) || grand.ChildOf(root) || root.ChildOf(child) {
		t.Fatalf("parentage wrong: %v / %v / %v", root, child, grand)
	}
	if child.Service != "master" || child.Resource["service.instance.id"] != "master-1" {
		t.Fatalf("child resource: got %q %v", child.Service, child.Resource)
	}
	if child.Attrs["tenant"] != "t1" || child.Attrs["n"] != int64(128) || child.Attrs["ok"] != true || child.Attrs["ratio"] != 0.5 {
		t.Fatalf("child attrs: got %v", child.Attrs)
	}
	if l, _ := child.Attr("list"); !slices.Equal(l.([]any), []any{"a"}) {
		t.Fatalf("list attr: got %v", l)
	}
	if v, ok := child.Attr("nil"); !ok || v != nil {
		t.Fatalf("empty attr: got %v, %v", v, ok)
	}
	if child.StatusCode != tracepb.Status_STATUS_CODE_ERROR || child.StatusMessage != "boom" || !child.End.Equal(time.Unix(2, 0)) {
		t.Fatalf("child status/time: got %+v", child)
	}
	if p, ok := r.Parent(grand); !ok || p.SpanID != child.SpanID {
		t.Fatalf("Parent(grandchild): got %v, %v", p, ok)
	}
	if _, ok := r.Parent(root); ok {
		t.Fatal("Parent(root) found one")
	}
	if c := r.Children(root); len(c) != 1 || c[0].Name != "child" {
		t.Fatalf("Children(root): got %v", c)
	}
	if got := r.ByTrace(trace); len(got) != 3 {
		t.Fatalf("ByTrace: got %d spans, want 3", len(got))
	}
	if got := r.ByTrace("0000000000000000000000000000000f"); len(got) != 0 {
		t.Fatalf("ByTrace(other): got %v", got)
	}
	if top, err := otlptest.Tree(spans); err != nil || top.Name != "root" {
		t.Fatalf("Tree: got %v, %v", top, err)
	}
	if top, err := otlptest.Tree(spans[1:]); err != nil || top.Name != "child" {
		t.Fatalf("Tree(subtree): got %v, %v", top, err)
	}
	if _, err := otlptest.Tree([]otlptest.Span{root, grand}); err == nil {
		t.Fatal("Tree of a root and a detached grandchild: no error")
	}
	s, err := r.WaitForSpan(t.Context(), otlptest.And(otlptest.Service("master"), otlptest.Named("grandchild")))
	if err != nil || s.SpanID != "0000000000000003" {
		t.Fatalf("WaitForSpan: got %v, %v", s, err)
	}
	if got := otlptest.Filter(spans, otlptest.Service("master")); len(got) != 2 {
		t.Fatalf("Filter: got %d, want 2", len(got))
	}
	r.Reset()
	if got := r.Spans(); len(got) != 0 {
		t.Fatalf("after Reset: %d spans", len(got))
	}
}

func TestReceiverWaitTimesOut(t *testing.T) {
	r := otlptest.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err := r.WaitForSpan(ctx, otlptest.Named("never"))
	if !errors.Is(err, otlptest.ErrNoSpan) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want ErrNoSpan and DeadlineExceeded", err)
	}
}

// TestReceiverWakesWaiter: a waiter blocked before the spans arrive sees
// them.
func TestReceiverWakesWaiter(t *testing.T) {
	r := otlptest.Start(t)
	found := make(chan error, 1)
	go func() {
		_, err := r.WaitForSpan(t.Context(), otlptest.Named("grandchild"))
		found <- err
	}()
	if _, err := client(t, r).Export(t.Context(), request()); err != nil {
		t.Fatal(err)
	}
	if err := <-found; err != nil {
		t.Fatal(err)
	}
}

func TestReceiverFail(t *testing.T) {
	r := otlptest.Start(t)
	c := client(t, r)
	r.Fail(status.Error(codes.Unavailable, "down"))
	if _, err := c.Export(t.Context(), request()); status.Code(err) != codes.Unavailable {
		t.Fatalf("got %v, want Unavailable", err)
	}
	if got := len(r.Spans()); got != 0 {
		t.Fatalf("failed export kept %d spans", got)
	}
	r.Fail(nil)
	if _, err := c.Export(t.Context(), request()); err != nil {
		t.Fatal(err)
	}
	if got, want := r.Requests(), 2; got != want {
		t.Fatalf("requests: got %d, want %d", got, want)
	}
	// Hostile: empty and nil-laden requests are accepted and add nothing.
	if _, err := c.Export(t.Context(), &collectortrace.ExportTraceServiceRequest{ResourceSpans: []*tracepb.ResourceSpans{{}, {ScopeSpans: []*tracepb.ScopeSpans{{Spans: []*tracepb.Span{{}}}}}}}); err != nil {
		t.Fatal(err)
	}
	if got := len(r.Spans()); got != 4 {
		t.Fatalf("spans: got %d, want 4 (3 + one empty)", got)
	}
}

func TestReceiverCloseIdempotent(t *testing.T) {
	r, err := otlptest.New()
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	r.Close()
}
