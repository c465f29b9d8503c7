package tracing

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// counting is a stats.Handler that counts the calls reaching it.
type counting struct{ tags, events int }

func (c *counting) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	c.tags++
	return ctx
}
func (c *counting) HandleRPC(context.Context, stats.RPCStats) { c.events++ }
func (c *counting) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (c *counting) HandleConn(context.Context, stats.ConnStats) {}

func TestGated(t *testing.T) {
	info := &stats.RPCTagInfo{FullMethodName: "/crescent.master.v1.ObjectService/PutStart"}
	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	withSpan := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}))
	withParent := metadata.NewIncomingContext(t.Context(), metadata.Pairs("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
	plain := metadata.NewIncomingContext(t.Context(), metadata.Pairs("x", "y"))

	if otel.GetTracerProvider() == defaultProvider && Active() {
		t.Fatal("Active with otel's default provider")
	}
	sdk := sdktrace.NewTracerProvider()
	defer func() { _ = sdk.Shutdown(context.Background()) }()
	defer otel.SetTracerProvider(noop.NewTracerProvider())

	tests := []struct {
		name     string
		provider trace.TracerProvider
		server   bool
		ctx      context.Context
		tagged   bool
		events   int
	}{
		{"off, client, no span", noop.NewTracerProvider(), false, t.Context(), false, 0},
		{"off, server, no traceparent", noop.NewTracerProvider(), true, plain, false, 0},
		{"off, client passes a span context on", noop.NewTracerProvider(), false, withSpan, true, 0},
		{"off, server passes a traceparent on", noop.NewTracerProvider(), true, withParent, true, 0},
		{"sdk provider, client", sdk, false, t.Context(), true, 1},
		{"sdk provider, server", sdk, true, plain, true, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			otel.SetTracerProvider(tt.provider)
			c := &counting{}
			g := &gated{inner: c, server: tt.server}
			ctx := g.TagRPC(tt.ctx, info)
			g.HandleRPC(ctx, &stats.End{})
			if got := c.tags == 1; got != tt.tagged {
				t.Fatalf("inner tagged: got %v, want %v", got, tt.tagged)
			}
			if !tt.tagged && ctx != tt.ctx {
				t.Fatal("an untouched call's context was replaced")
			}
			if c.events != tt.events {
				t.Fatalf("inner events: got %d, want %d", c.events, tt.events)
			}
			// An event of a call tagged while tracing was off never reaches
			// the inner handler, even once tracing is on.
			otel.SetTracerProvider(sdk)
			c.events = 0
			g.HandleRPC(tt.ctx, &stats.End{})
			if c.events != 0 {
				t.Fatal("an untagged call's event reached the inner handler")
			}
		})
	}
}

// lastEnd is a counting handler that keeps the End event it was given.
type lastEnd struct {
	counting
	end *stats.End
}

func (l *lastEnd) HandleRPC(_ context.Context, s stats.RPCStats) {
	if e, ok := s.(*stats.End); ok {
		l.end = e
	}
}

// TestGatedRedactsStatus: a failed call's message (which may name a key)
// reaches otelgrpc, and so the span, as its reason or code, unless keys
// are allowed.
func TestGatedRedactsStatus(t *testing.T) {
	sdk := sdktrace.NewTracerProvider()
	defer func() { _ = sdk.Shutdown(context.Background()) }()
	otel.SetTracerProvider(sdk)
	defer otel.SetTracerProvider(noop.NewTracerProvider())
	defer SetKeys(false)

	info := &stats.RPCTagInfo{FullMethodName: "/crescent.master.v1.ObjectService/GetReplicaList"}
	withReason := rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "object %q not found", "secret/key"))
	plain := status.Error(codes.Unavailable, "agent at secret/key gone")
	for _, tt := range []struct {
		err  error
		keys bool
		want string
	}{
		{withReason, false, "OBJECT_NOT_FOUND"},
		{plain, false, "Unavailable"},
		{plain, true, "agent at secret/key gone"},
	} {
		SetKeys(tt.keys)
		l := &lastEnd{}
		g := &gated{inner: l}
		ctx := g.TagRPC(t.Context(), info)
		g.HandleRPC(ctx, &stats.End{Error: tt.err})
		if l.end == nil {
			t.Fatal("End not passed on")
		}
		st := status.Convert(l.end.Error)
		if st.Message() != tt.want || st.Code() != status.Code(tt.err) {
			t.Fatalf("keys %v: got %v %q, want %v %q", tt.keys, st.Code(), st.Message(), status.Code(tt.err), tt.want)
		}
	}
}
