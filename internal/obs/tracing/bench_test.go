package tracing

import (
	"context"
	"testing"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
)

// BenchmarkHandlerOff is what one unary call costs each side's stats
// handler with tracing off (a no-op global provider, no trace context in
// the call): the gated handler against otelgrpc's alone.
func BenchmarkHandlerOff(b *testing.B) {
	otel.SetTracerProvider(noop.NewTracerProvider())
	info := &stats.RPCTagInfo{FullMethodName: "/crescent.master.v1.ObjectService/GetReplicaList"}
	incoming := metadata.NewIncomingContext(context.Background(), metadata.Pairs(
		":authority", "127.0.0.1:50051", "content-type", "application/grpc", "user-agent", "grpc-go/1.79", "te", "trailers"))
	events := []stats.RPCStats{&stats.Begin{}, &stats.OutHeader{}, &stats.OutPayload{}, &stats.InHeader{}, &stats.InPayload{}, &stats.InTrailer{}, &stats.End{}}
	for _, tt := range []struct {
		name string
		h    stats.Handler
		ctx  context.Context
	}{
		{"server/gated", &gated{inner: otelgrpc.NewServerHandler(options()...), server: true}, incoming},
		{"server/otelgrpc", otelgrpc.NewServerHandler(options()...), incoming},
		{"client/gated", &gated{inner: otelgrpc.NewClientHandler(options()...)}, context.Background()},
		{"client/otelgrpc", otelgrpc.NewClientHandler(options()...), context.Background()},
	} {
		b.Run(tt.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				ctx := tt.h.TagRPC(tt.ctx, info)
				for _, e := range events {
					tt.h.HandleRPC(ctx, e)
				}
			}
		})
	}
}
