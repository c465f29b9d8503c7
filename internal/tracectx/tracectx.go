// Package tracectx carries OpenTelemetry trace context where gRPC metadata
// does not reach, and holds the span conventions Crescent's own spans share
// (issue 16). gRPC calls are traced by otelgrpc (internal/obs/tracing);
// three paths are not gRPC calls and carry a W3C Trace Context field of
// their own:
//
//   - master commands on an agent's Connect stream (ReserveRequest,
//     SealRequest, ReleaseRequest, CopyRequest: trace_context and
//     trace_links), so an agent's work for a command is a child of the
//     master span that sent it;
//   - the bulk transfer protocol's request header (TransferRequest
//     .trace_context), so the agent's read or write is a child of the
//     client's;
//   - the master's change stream (WatchResponse.links), so the gateway's
//     publish span links to the spans that recorded the changes it
//     announces.
//
// Only the global API is used: otel.GetTextMapPropagator() encodes and
// decodes the fields (the W3C propagator once obs.SetupTracing ran; a
// no-op before, which sends nothing), and spans go to the global
// TracerProvider.
//
// # Cost with tracing off
//
// A field is written only for a sampled span (Command, Transfer), so with
// tracing off, and for the unsampled calls when sampling, nothing more
// goes on the wire. A process that does not trace still passes on a
// sampled caller's context (Carried), as its gRPC instrumentation does, so
// it does not cut a trace in two. Work done for a caller gets a span only when the
// caller's span is recording (Tracer.Child) or the peer's is sampled
// (Tracer.Remote): otherwise no tracer is looked up and no span is made.
// Attributes are built only for a recording span.
//
// # Untrusted input
//
// A peer's fields are bounded before they are parsed: a traceparent longer
// than MaxTraceparent bytes, or one the W3C parser refuses, is ignored (the
// work is not traced); a tracestate longer than MaxTracestate is dropped;
// at most MaxLinks links are used. Values are copied before parsing, so a
// span never keeps a peer's buffer (the transfer header's strings point
// into a reused one).
//
// Internal to the Crescent module.
package tracectx

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Bounds on what a peer may send.
const (
	// MaxTraceparent bounds a traceparent value. Version 00 is 55 bytes;
	// the rest leaves room for a future version's extra fields.
	MaxTraceparent = 128
	// MaxTracestate bounds a tracestate value: the 512 bytes the W3C
	// recommendation asks vendors to propagate at least.
	MaxTracestate = 512
	// MaxLinks bounds the links a span gets from one message (a batch of
	// several callers' commands, a change batch).
	MaxLinks = 8
)

// The two W3C Trace Context fields.
const (
	traceparentKey = "traceparent"
	tracestateKey  = "tracestate"
)

// carrier is a propagation.TextMapCarrier that holds the two W3C fields and
// nothing else: another propagator's fields (baggage) are not carried.
type carrier struct{ parent, state string }

func (c *carrier) Get(key string) string {
	switch key {
	case traceparentKey:
		return c.parent
	case tracestateKey:
		return c.state
	}
	return ""
}

func (c *carrier) Set(key, value string) {
	switch key {
	case traceparentKey:
		c.parent = value
	case tracestateKey:
		c.state = value
	}
}

func (c *carrier) Keys() []string { return []string{traceparentKey, tracestateKey} }

// fields encodes sc with the global propagator; ok is false when sc is not
// sampled (nothing worth sending) or the propagator wrote no traceparent.
func fields(sc trace.SpanContext) (carrier, bool) {
	if !sc.IsValid() || !sc.IsSampled() {
		return carrier{}, false
	}
	// Declared here, not as a result: the propagator takes its address,
	// which puts it on the heap, and only a sampled span should pay that.
	var c carrier
	otel.GetTextMapPropagator().Inject(trace.ContextWithSpanContext(context.Background(), sc), &c)
	if c.parent == "" || len(c.parent) > MaxTraceparent {
		return carrier{}, false
	}
	if len(c.state) > MaxTracestate {
		c.state = ""
	}
	return c, true
}

// Command is the field a master command (or a change batch link) carries for ctx's span: nil unless
// that span is sampled.
func Command(ctx context.Context) *masterv1.TraceContext {
	return CommandOf(trace.SpanContextFromContext(ctx))
}

// CommandOf is Command for a span context.
func CommandOf(sc trace.SpanContext) *masterv1.TraceContext {
	c, ok := fields(sc)
	if !ok {
		return nil
	}
	return &masterv1.TraceContext{Traceparent: c.parent, Tracestate: c.state}
}

// Transfer is the field a transfer request carries for ctx's span: nil unless
// that span is sampled.
func Transfer(ctx context.Context) *agentv1.TraceContext {
	c, ok := fields(trace.SpanContextFromContext(ctx))
	if !ok {
		return nil
	}
	return &agentv1.TraceContext{Traceparent: c.parent, Tracestate: c.state}
}

// Parse decodes a peer's fields with the global propagator: the zero
// SpanContext when they are empty, oversized or invalid. The result is
// marked remote.
func Parse(traceparent, tracestate string) trace.SpanContext {
	if traceparent == "" || len(traceparent) > MaxTraceparent {
		return trace.SpanContext{}
	}
	if len(tracestate) > MaxTracestate {
		tracestate = ""
	}
	// The parsed trace state keeps substrings of its input: copy it, so
	// the span does not pin (or see the reuse of) the message's buffer.
	c := carrier{parent: traceparent, state: strings.Clone(tracestate)}
	sc := trace.SpanContextFromContext(otel.GetTextMapPropagator().Extract(context.Background(), &c))
	if !sc.IsValid() || !sc.IsRemote() {
		return trace.SpanContext{}
	}
	return sc
}

// ParseCommand parses a master command's field (nil: none).
func ParseCommand(tc *masterv1.TraceContext) trace.SpanContext {
	if tc == nil {
		return trace.SpanContext{}
	}
	return Parse(tc.GetTraceparent(), tc.GetTracestate())
}

// ParseTransfer parses a transfer request's field (nil: none).
func ParseTransfer(tc *agentv1.TraceContext) trace.SpanContext {
	if tc == nil {
		return trace.SpanContext{}
	}
	return Parse(tc.GetTraceparent(), tc.GetTracestate())
}

// ParseLinks parses at most MaxLinks of a message's links, skipping
// the invalid ones; nil when none is valid.
func ParseLinks(tcs []*masterv1.TraceContext) []trace.SpanContext {
	var out []trace.SpanContext
	for _, tc := range tcs[:min(len(tcs), MaxLinks)] {
		if sc := ParseCommand(tc); sc.IsValid() {
			out = append(out, sc)
		}
	}
	return out
}

// Tracer starts Crescent's spans under one instrumentation scope (the
// package's import path). It asks the global TracerProvider for its tracer
// again whenever the provider changed (a test installs its own), and only
// when a span is to be made. While no provider was ever installed (tracing
// off: obs.SetupTracing installs none) it makes no span at all, not even a
// non-recording one: a span costs an atomic load and a comparison.
type Tracer struct {
	scope  string
	cached atomic.Pointer[bound]
}

type bound struct {
	tp trace.TracerProvider
	t  trace.Tracer
}

// NewTracer returns a Tracer for scope, for example
// "github.com/crescent-kv/crescent/internal/master/meta".
func NewTracer(scope string) *Tracer { return &Tracer{scope: scope} }

// unset is the global TracerProvider before any is installed: the API's
// default, whose spans never record. (OpenTelemetry's eBPF
// auto-instrumentation, which hooks that default, sees none of Crescent's
// spans; the SDK is the way to trace Crescent.)
var unset = otel.GetTracerProvider()

// tracer is the scope's tracer from the global provider; false while none
// was installed.
func (t *Tracer) tracer() (trace.Tracer, bool) {
	tp := otel.GetTracerProvider()
	if tp == unset {
		return nil, false
	}
	if b := t.cached.Load(); b != nil && b.tp == tp {
		return b.t, true
	}
	b := &bound{tp: tp, t: tp.Tracer(t.scope)}
	t.cached.Store(b)
	return b.t, true
}

// noSpan is the span of untraced work: it records nothing.
var noSpan = trace.SpanFromContext(context.Background())

// Start starts a span under ctx's span, or a root span: for work that is
// traced on its own account (an eviction pass, a gateway batch) or that
// users call directly (the SDK's calls).
func (t *Tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	tr, ok := t.tracer()
	if !ok {
		return ctx, noSpan
	}
	return tr.Start(ctx, name, opts...)
}

// Child starts a span under ctx's span when that span is recording, and
// otherwise returns ctx and a span that records nothing: work done for an
// untraced or unsampled call costs no span.
func (t *Tracer) Child(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, noSpan
	}
	return t.Start(ctx, name, opts...)
}

// Remote starts the span of work a peer asked for, as a child of the
// peer's span parent, linked to links (at most MaxLinks used), when parent
// is sampled; otherwise it returns ctx and a span that records nothing, so
// an agent makes no root span of its own for a command nobody traces.
func (t *Tracer) Remote(ctx context.Context, name string, parent trace.SpanContext, links []trace.SpanContext, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if !parent.IsValid() || !parent.IsSampled() {
		return ctx, noSpan
	}
	ctx = trace.ContextWithRemoteSpanContext(ctx, parent) // passed on even untraced
	tr, ok := t.tracer()
	if !ok {
		return ctx, noSpan
	}
	if len(links) > 0 {
		opts = append(opts[:len(opts):len(opts)], trace.WithLinks(Links(links)...))
	}
	return tr.Start(ctx, name, opts...)
}

// Carried is the span context work done for ctx's caller names to its
// peers (a command's or a change record's): span's when it records, else
// the caller's when that is sampled — a process that does not trace passes
// a sampled trace on rather than cutting it — else the zero one.
func Carried(ctx context.Context, span trace.Span) trace.SpanContext {
	if span.IsRecording() {
		return span.SpanContext()
	}
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		return sc
	}
	return trace.SpanContext{}
}

// Span kind options, made once: a variadic option built at each call
// escapes to the heap even when no span is made.
var (
	ClientKind   = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindClient)}
	ServerKind   = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer)}
	ProducerKind = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer)}
)

// Links turns span contexts into links, at most MaxLinks, skipping invalid
// ones.
func Links(scs []trace.SpanContext) []trace.Link {
	var out []trace.Link
	for _, sc := range scs {
		if len(out) == MaxLinks {
			break
		}
		if sc.IsValid() {
			out = append(out, trace.Link{SpanContext: sc})
		}
	}
	return out
}

// Attribute keys of Crescent's spans. None carries an object key or a
// payload: a key is added (Key) only with --trace-keys.
const (
	// Tenant is the tenant of a single-tenant call or batch.
	Tenant = attribute.Key("crescent.tenant")
	// Agent is the agent id a command went to or came from.
	Agent = attribute.Key("crescent.agent")
	// Segment is a segment id.
	Segment = attribute.Key("crescent.segment")
	// Endpoint is the transfer endpoint (host:port) a client talked to.
	Endpoint = attribute.Key("crescent.endpoint")
	// Items is the number of items (objects, allocations, events) a span
	// handled.
	Items = attribute.Key("crescent.items")
	// Failed is how many of Items failed.
	Failed = attribute.Key("crescent.items.failed")
	// Bytes is the payload bytes a span moved or asked for.
	Bytes = attribute.Key("crescent.bytes")
	// Reason is the error reason (an ErrorReason name without prefix) of a
	// failed span, or of the first failed item.
	Reason = attribute.Key("crescent.reason")
	// Key is an object key: set only when the process traces keys.
	Key = attribute.Key("crescent.key")
)

// End ends span, marking it failed when err is not nil. The status
// description is the error's reason only: messages may name object keys.
func End(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		reason := ReasonOf(err)
		span.SetAttributes(Reason.String(reason))
		span.SetStatus(codes.Error, reason)
	}
	span.End()
}

// ReasonOf is err's ErrorReason name, CANCELLED or DEADLINE_EXCEEDED for a
// context's error, else UNKNOWN; "" for nil.
func ReasonOf(err error) string {
	if err == nil {
		return ""
	}
	if r := rpcerr.Reason(err); r != "" {
		return r
	}
	switch {
	case errors.Is(err, context.Canceled):
		return "CANCELLED"
	case errors.Is(err, context.DeadlineExceeded):
		return "DEADLINE_EXCEEDED"
	}
	return "UNKNOWN"
}

// Outcome sets the failed-item count and the first failure's reason on a
// recording span of a batch.
func Outcome(span trace.Span, failed int, firstReason string) {
	if failed == 0 || !span.IsRecording() {
		return
	}
	span.SetAttributes(Failed.Int(failed))
	if firstReason != "" {
		span.SetAttributes(Reason.String(firstReason))
	}
}
