// Package tracing is the part of Crescent's OpenTelemetry tracing that code
// on the call paths uses: the otelgrpc options every gRPC server and client
// carries (ServerOption, DialOption), the W3C propagator, and whether spans
// may carry object keys (Keys). It depends on the OpenTelemetry API only;
// the SDK, the exporter and the flags live in internal/obs (SetupTracing),
// which pkg/client does not import.
//
// Spans go to the global TracerProvider: a no-op one until obs.SetupTracing
// installs the SDK, so with tracing off an instrumented call costs a
// propagator extract and a non-recording span, and a trace context a peer
// sent is still passed on to the next hop.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package tracing

import (
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"
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
// checks and reflection.
func ServerOption() grpc.ServerOption {
	return grpc.StatsHandler(otelgrpc.NewServerHandler(options()...))
}

// DialOption instruments a gRPC client connection: a client span per call,
// child of the span in the call's context, whose context is sent to the
// server as a W3C traceparent; health checks and reflection excepted.
func DialOption() grpc.DialOption {
	return grpc.WithStatsHandler(otelgrpc.NewClientHandler(options()...))
}

var keys atomic.Bool

// Keys reports whether spans may carry object keys (--trace-keys; off by
// default: keys may be confidential, and are high-cardinality). Code that
// adds a key attribute asks it each time.
func Keys() bool { return keys.Load() }

// SetKeys sets what Keys reports (obs.SetupTracing calls it).
func SetKeys(on bool) { keys.Store(on) }
