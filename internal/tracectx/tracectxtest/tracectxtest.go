// Package tracectxtest installs a recording OpenTelemetry SDK for a test:
// the global TracerProvider with a span recorder, and the W3C propagator,
// both restored when the test ends. Tests that use it must not run in
// parallel with other tests of their binary that trace (the providers are
// process globals).
package tracectxtest

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// Install makes every span of the process recorded (sampler AlwaysSample,
// unless opts say otherwise) until the test ends, and returns the recorder.
func Install(t testing.TB, opts ...sdktrace.TracerProviderOption) *tracetest.SpanRecorder {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(append([]sdktrace.TracerProviderOption{sdktrace.WithSpanProcessor(rec)}, opts...)...)
	prevTP, prevProp := otel.GetTracerProvider(), otel.GetTextMapPropagator()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tp.Shutdown(ctx)
		otel.SetTracerProvider(prevTP)
		otel.SetTextMapPropagator(prevProp)
	})
	return rec
}

// Named returns the ended spans called name, in the order they ended.
func Named(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// One returns the only ended span called name, failing the test when there
// is not exactly one.
func One(t testing.TB, rec *tracetest.SpanRecorder, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	spans := Named(rec, name)
	if len(spans) != 1 {
		t.Fatalf("%d ended spans named %q, want 1 (ended: %v)", len(spans), name, names(rec))
	}
	return spans[0]
}

func names(rec *tracetest.SpanRecorder) []string {
	var out []string
	for _, s := range rec.Ended() {
		out = append(out, s.Name())
	}
	return out
}

// ChildOf fails the test unless child's parent is parent's span context.
func ChildOf(t testing.TB, child sdktrace.ReadOnlySpan, parent trace.SpanContext) {
	t.Helper()
	got := child.Parent()
	if got.TraceID() != parent.TraceID() || got.SpanID() != parent.SpanID() {
		t.Fatalf("span %q: parent %s/%s, want %s/%s", child.Name(), got.TraceID(), got.SpanID(), parent.TraceID(), parent.SpanID())
	}
}

// Attr returns span's attribute key as a string ("" when absent).
func Attr(span sdktrace.ReadOnlySpan, key string) string {
	for _, kv := range span.Attributes() {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}
