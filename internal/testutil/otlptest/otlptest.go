// Package otlptest is an in-process OTLP trace receiver for tests: a real
// gRPC server implementing the collector's TraceService
// (go.opentelemetry.io/proto/otlp) on a loopback port, which keeps every
// span it is sent. Point a process at it with --otlp-endpoint
// http://<Addr()> (or obs.TraceConfig{Endpoint: r.Endpoint()}), then wait
// for the spans and check how they nest:
//
//	r := otlptest.Start(t)
//	// ... run something traced ...
//	s, err := r.WaitForSpan(ctx, otlptest.Named("crescent.master.v1.ObjectService/PutStart"))
//	parent, ok := r.Parent(s)
package otlptest

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	_ "google.golang.org/grpc/encoding/gzip" // OTEL_EXPORTER_OTLP_COMPRESSION=gzip
)

// Span is one received span, flattened with its resource and scope.
type Span struct {
	// TraceID, SpanID and ParentSpanID are lower-case hex, as in logs
	// (trace_id, span_id) and tracing backends; ParentSpanID is "" for a
	// root span.
	TraceID, SpanID, ParentSpanID string
	Name                          string
	Kind                          tracepb.Span_SpanKind
	Start, End                    time.Time
	// StatusCode and StatusMessage are the span's status.
	StatusCode    tracepb.Status_StatusCode
	StatusMessage string
	// Attrs are the span's attributes: string, bool, int64, float64,
	// []byte, []any or map[string]any values.
	Attrs map[string]any
	// Events are the names of the span's events, in order.
	Events []string
	// Links are the span contexts the span links to.
	Links []Link
	// Service is the resource's service.name; Resource all its attributes.
	Service  string
	Resource map[string]any
	// Scope is the instrumentation scope's name (the tracer's name).
	Scope string
}

// Link is a span link.
type Link struct {
	TraceID, SpanID string
	Attrs           map[string]any
}

// Attr returns the attribute key and whether the span has it.
func (s Span) Attr(key string) (any, bool) {
	v, ok := s.Attrs[key]
	return v, ok
}

// Root reports whether s has no parent.
func (s Span) Root() bool { return s.ParentSpanID == "" }

// ChildOf reports whether s is a direct child of p: same trace, parent p.
func (s Span) ChildOf(p Span) bool {
	return s.TraceID == p.TraceID && s.ParentSpanID != "" && s.ParentSpanID == p.SpanID
}

func (s Span) String() string {
	return fmt.Sprintf("%s %q (%s) trace %s span %s parent %s", s.Service, s.Name, s.Kind, s.TraceID, s.SpanID, s.ParentSpanID)
}

// Receiver is a running OTLP trace receiver.
type Receiver struct {
	collectortrace.UnimplementedTraceServiceServer

	lis  net.Listener
	gs   *grpc.Server
	done chan struct{}

	mu sync.Mutex // guards spans, changed, fail, requests
	// spans in the order they arrived.
	spans []Span
	// changed is closed (and replaced) when spans grow.
	changed  chan struct{}
	fail     error
	requests int

	closeOnce sync.Once
}

// New starts a receiver on a loopback port. Close stops it.
func New() (*Receiver, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Receiver{lis: lis, gs: grpc.NewServer(), done: make(chan struct{}), changed: make(chan struct{})}
	collectortrace.RegisterTraceServiceServer(r.gs, r)
	go func() {
		defer close(r.done)
		_ = r.gs.Serve(lis)
	}()
	return r, nil
}

// Start is New for a test: it fails tb if the receiver cannot start and
// closes it when tb ends.
func Start(tb testing.TB) *Receiver {
	tb.Helper()
	r, err := New()
	if err != nil {
		tb.Fatalf("otlptest: %v", err)
	}
	tb.Cleanup(r.Close)
	return r
}

// Close stops the receiver; calls in progress are cut off. Idempotent.
func (r *Receiver) Close() {
	r.closeOnce.Do(func() {
		r.gs.Stop()
		<-r.done
	})
}

// Addr is the receiver's host:port.
func (r *Receiver) Addr() string { return r.lis.Addr().String() }

// Endpoint is the receiver as an OTLP endpoint URL (plaintext):
// http://host:port.
func (r *Receiver) Endpoint() string { return "http://" + r.Addr() }

// Fail makes every following Export fail with err (nil: succeed again).
func (r *Receiver) Fail(err error) {
	r.mu.Lock()
	r.fail = err
	r.mu.Unlock()
}

// Requests is the number of Export calls received (failed ones included).
func (r *Receiver) Requests() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests
}

// Reset forgets the spans received so far.
func (r *Receiver) Reset() {
	r.mu.Lock()
	r.spans = nil
	r.mu.Unlock()
}

// Export implements the collector's TraceService.
func (r *Receiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	var got []Span
	for _, rs := range req.GetResourceSpans() {
		res := attrs(rs.GetResource().GetAttributes())
		service, _ := res["service.name"].(string)
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				got = append(got, convert(sp, service, res, ss.GetScope().GetName()))
			}
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests++
	if r.fail != nil {
		return nil, r.fail
	}
	if len(got) > 0 {
		r.spans = append(r.spans, got...)
		close(r.changed)
		r.changed = make(chan struct{})
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func convert(sp *tracepb.Span, service string, res map[string]any, scope string) Span {
	s := Span{
		TraceID: hexID(sp.GetTraceId()), SpanID: hexID(sp.GetSpanId()), ParentSpanID: hexID(sp.GetParentSpanId()),
		Name: sp.GetName(), Kind: sp.GetKind(),
		Start: time.Unix(0, int64(sp.GetStartTimeUnixNano())), End: time.Unix(0, int64(sp.GetEndTimeUnixNano())),
		StatusCode: sp.GetStatus().GetCode(), StatusMessage: sp.GetStatus().GetMessage(),
		Attrs: attrs(sp.GetAttributes()), Service: service, Resource: res, Scope: scope,
	}
	for _, e := range sp.GetEvents() {
		s.Events = append(s.Events, e.GetName())
	}
	for _, l := range sp.GetLinks() {
		s.Links = append(s.Links, Link{TraceID: hexID(l.GetTraceId()), SpanID: hexID(l.GetSpanId()), Attrs: attrs(l.GetAttributes())})
	}
	return s
}

// hexID is an id in hex, "" for an absent (or all-zero) one.
func hexID(b []byte) string {
	for _, c := range b {
		if c != 0 {
			return hex.EncodeToString(b)
		}
	}
	return ""
}

func attrs(kvs []*commonpb.KeyValue) map[string]any {
	m := make(map[string]any, len(kvs))
	for _, kv := range kvs {
		m[kv.GetKey()] = value(kv.GetValue())
	}
	return m
}

func value(v *commonpb.AnyValue) any {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_BoolValue:
		return x.BoolValue
	case *commonpb.AnyValue_IntValue:
		return x.IntValue
	case *commonpb.AnyValue_DoubleValue:
		return x.DoubleValue
	case *commonpb.AnyValue_BytesValue:
		return x.BytesValue
	case *commonpb.AnyValue_ArrayValue:
		out := make([]any, 0, len(x.ArrayValue.GetValues()))
		for _, e := range x.ArrayValue.GetValues() {
			out = append(out, value(e))
		}
		return out
	case *commonpb.AnyValue_KvlistValue:
		return attrs(x.KvlistValue.GetValues())
	}
	return nil
}

// Spans returns a copy of the spans received so far, in arrival order.
func (r *Receiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}

// ByTrace returns the received spans of one trace (hex id), in arrival
// order.
func (r *Receiver) ByTrace(traceID string) []Span {
	traceID = strings.ToLower(traceID)
	var out []Span
	for _, s := range r.Spans() {
		if s.TraceID == traceID {
			out = append(out, s)
		}
	}
	return out
}

// Parent returns the received span that is s's parent.
func (r *Receiver) Parent(s Span) (Span, bool) {
	if s.Root() {
		return Span{}, false
	}
	for _, p := range r.Spans() {
		if s.ChildOf(p) {
			return p, true
		}
	}
	return Span{}, false
}

// Children returns the received spans whose parent is p.
func (r *Receiver) Children(p Span) []Span {
	var out []Span
	for _, s := range r.Spans() {
		if s.ChildOf(p) {
			out = append(out, s)
		}
	}
	return out
}

// WaitFor waits until pred holds for the spans received so far and
// returns them, or ctx's error with the spans it last saw.
func (r *Receiver) WaitFor(ctx context.Context, pred func([]Span) bool) ([]Span, error) {
	for {
		r.mu.Lock()
		spans, changed := slices.Clone(r.spans), r.changed
		r.mu.Unlock()
		if pred(spans) {
			return spans, nil
		}
		select {
		case <-ctx.Done():
			return spans, fmt.Errorf("otlptest: waiting for spans (%d received): %w", len(spans), ctx.Err())
		case <-changed:
		}
	}
}

// ErrNoSpan is wrapped by WaitForSpan's error when no span matched.
var ErrNoSpan = errors.New("no matching span")

// WaitForSpan waits for the first span that match accepts.
func (r *Receiver) WaitForSpan(ctx context.Context, match func(Span) bool) (Span, error) {
	var found Span
	_, err := r.WaitFor(ctx, func(spans []Span) bool {
		for _, s := range spans {
			if match(s) {
				found = s
				return true
			}
		}
		return false
	})
	if err != nil {
		return Span{}, fmt.Errorf("%w: %w", ErrNoSpan, err)
	}
	return found, nil
}

// Named matches spans called name.
func Named(name string) func(Span) bool {
	return func(s Span) bool { return s.Name == name }
}

// Filter returns the spans match accepts.
func Filter(spans []Span, match func(Span) bool) []Span {
	var out []Span
	for _, s := range spans {
		if match(s) {
			out = append(out, s)
		}
	}
	return out
}

// Service matches spans of the service called name (resource service.name).
func Service(name string) func(Span) bool {
	return func(s Span) bool { return s.Service == name }
}

// And matches spans every one of ms accepts.
func And(ms ...func(Span) bool) func(Span) bool {
	return func(s Span) bool {
		for _, m := range ms {
			if !m(s) {
				return false
			}
		}
		return true
	}
}

// Tree checks that spans, the spans of one trace, form one tree: one root
// (a span whose parent is not among them: the trace's root, or the span a
// traced caller outside the test began with) and every other span's parent
// among them. It returns the root.
func Tree(spans []Span) (Span, error) {
	if len(spans) == 0 {
		return Span{}, errors.New("otlptest: no spans")
	}
	ids := make(map[string]bool, len(spans))
	for _, s := range spans {
		if s.TraceID != spans[0].TraceID {
			return Span{}, fmt.Errorf("otlptest: spans of two traces: %s and %s", spans[0], s)
		}
		ids[s.SpanID] = true
	}
	var roots []Span
	for _, s := range spans {
		if !ids[s.ParentSpanID] {
			roots = append(roots, s)
		}
	}
	if len(roots) != 1 {
		return Span{}, fmt.Errorf("otlptest: %d roots, want 1: %v", len(roots), roots)
	}
	return roots[0], nil
}
