// Package tracing is the part of Crescent's OpenTelemetry tracing that code
// on the call paths uses: the otelgrpc options every gRPC server and client
// carries (ServerOption, DialOption), the W3C propagator, and whether spans
// may carry object keys (Keys). It depends on the OpenTelemetry API only;
// the SDK, the exporter and the flags live in internal/obs (SetupTracing),
// which pkg/client does not import.
//
// Spans go to the global TracerProvider. While it is the default or a
// no-op one (tracing off: obs.SetupTracing was not called, or found no
// endpoint, or was shut down) a call costs a look at the global provider
// and, on a server, one at the call's metadata: otelgrpc runs only for a
// call that carries a trace context, so that it is still passed on to the
// next hop (a non-recording span holding it), and no span is made.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package tracing

import (
	"context"
	"strings"
	"sync/atomic"

	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// Propagator is the W3C trace context and baggage propagator: what
// obs.SetupTracing installs globally and what the gRPC options below use
// whatever the global one is, so a context passes through a process
// (or a test) that never set tracing up.
var Propagator propagation.TextMapPropagator = propagation.NewCompositeTextMapPropagator(
	propagation.TraceContext{}, propagation.Baggage{})

// untraced are the method prefixes that get no span: health probes (load
// balancers, Kubernetes, crescent-* healthcheck) and reflection (grpcurl)
// would otherwise fill a backend with noise.
var untraced = []string{
	"/grpc.health.v1.Health/",
	"/grpc.reflection.",
}

// traced is the otelgrpc filter: false for the untraced methods.
func traced(info *stats.RPCTagInfo) bool {
	for _, p := range untraced {
		if strings.HasPrefix(info.FullMethodName, p) {
			return false
		}
	}
	return true
}

func options() []otelgrpc.Option {
	return []otelgrpc.Option{
		otelgrpc.WithFilter(traced),
		otelgrpc.WithPropagators(Propagator),
		// Crescent's RPC metrics are Prometheus (internal/server); otelgrpc's
		// would be a second, unexported copy of them.
		otelgrpc.WithMeterProvider(metricnoop.NewMeterProvider()),
	}
}

// ServerOption instruments a gRPC server: a server span per call (child of
// the caller's span when the call carries a W3C traceparent), except health
// checks and reflection. Unless Keys, a failed call's span says its reason
// (ErrorInfo) or code, never its message, which may name a key; so do
// DialOption's.
func ServerOption() grpc.ServerOption {
	return grpc.StatsHandler(&gated{inner: otelgrpc.NewServerHandler(options()...), server: true})
}

// DialOption instruments a gRPC client connection: a client span per call,
// child of the span in the call's context, whose context is sent to the
// server as a W3C traceparent; health checks and reflection excepted.
func DialOption() grpc.DialOption {
	return grpc.WithStatsHandler(&gated{inner: otelgrpc.NewClientHandler(options()...)})
}

// defaultProvider is the global TracerProvider before anything set one.
var defaultProvider = otel.GetTracerProvider()

// Active reports whether spans are recorded: the global TracerProvider is
// neither otel's default nor a no-op one (nor obs's, turned off).
func Active() bool {
	tp := otel.GetTracerProvider()
	if tp == defaultProvider {
		return false
	}
	switch p := tp.(type) {
	case noop.TracerProvider:
		return false
	case interface{ TracingEnabled() bool }:
		return p.TracingEnabled()
	}
	return true
}

// gated runs otelgrpc's handler for a call only when it has something to
// do: tracing is Active, or the call carries a trace context to pass on.
// Otherwise the call goes untouched (otelgrpc would otherwise spend some
// 25 allocations a call on each side on attributes, contexts and
// metadata for a span nobody records).
type gated struct {
	inner  stats.Handler
	server bool
}

// taggedKey marks the context of a call the inner handler tagged, so that
// only its events reach it (never those of a call that began while
// tracing was off: the inner handler would take the caller's span for the
// call's and end it).
type taggedKey struct{}

func (g *gated) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	if !Active() && !g.carries(ctx) {
		return ctx
	}
	return context.WithValue(g.inner.TagRPC(ctx, info), taggedKey{}, true)
}

// carries reports whether the call has a trace context to pass on: on a
// server, a traceparent from the caller; on a client, a valid span
// context in the call's context.
func (g *gated) carries(ctx context.Context) bool {
	if g.server {
		return len(metadata.ValueFromIncomingContext(ctx, "traceparent")) > 0
	}
	return trace.SpanContextFromContext(ctx).IsValid()
}

func (g *gated) HandleRPC(ctx context.Context, s stats.RPCStats) {
	// Off, the inner handler has nothing to record (and a span begun
	// before tracing was turned off is dropped unended).
	if !Active() || ctx.Value(taggedKey{}) == nil {
		return
	}
	if e, ok := s.(*stats.End); ok && e.Error != nil && !Keys() {
		// otelgrpc makes a failed call's status message the span's status
		// description, and Crescent's messages name keys.
		redacted := *e
		redacted.Error = redact(e.Error)
		s = &redacted
	}
	g.inner.HandleRPC(ctx, s)
}

// redact is err with its message replaced by its reason (ErrorInfo) or,
// without one, its code's name.
func redact(err error) error {
	c := status.Code(err)
	msg := rpcerr.Reason(err)
	if msg == "" {
		msg = c.String()
	}
	return status.Error(c, msg)
}

func (g *gated) TagConn(ctx context.Context, info *stats.ConnTagInfo) context.Context {
	return g.inner.TagConn(ctx, info)
}

func (g *gated) HandleConn(ctx context.Context, s stats.ConnStats) { g.inner.HandleConn(ctx, s) }

var keys atomic.Bool

// Keys reports whether spans may carry object keys (--trace-keys; off by
// default: keys may be confidential, and are high-cardinality). Code that
// adds a key attribute asks it each time.
func Keys() bool { return keys.Load() }

// SetKeys sets what Keys reports (obs.SetupTracing calls it).
func SetKeys(on bool) { keys.Store(on) }
