package tracing_test

import (
	"context"
	"net"
	"testing"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/emptypb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const method = "/crescent.test.v1.Echo/Call"

// echo serves method (any unknown method) on an instrumented server,
// reporting the span context each call's handler sees, and returns an
// instrumented connection to it, and stop, which stops the server
// gracefully (its RPCs' server spans have ended when it returns).
func echo(t *testing.T) (cc *grpc.ClientConn, seen <-chan trace.SpanContext, stop func()) {
	t.Helper()
	seenC := make(chan trace.SpanContext, 16)
	seen = seenC
	gs := grpc.NewServer(tracing.ServerOption(), grpc.UnknownServiceHandler(func(_ any, st grpc.ServerStream) error {
		seenC <- trace.SpanContextFromContext(st.Context())
		var in emptypb.Empty
		if err := st.RecvMsg(&in); err != nil {
			return err
		}
		return st.SendMsg(&emptypb.Empty{})
	}))
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	cc, err = grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), tracing.DialOption())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		gs.Stop()
		<-done
	})
	stop = func() {
		gs.GracefulStop()
		<-done
	}
	return cc, seen, stop
}

func setup(t *testing.T, r *otlptest.Receiver) func() {
	t.Helper()
	t.Setenv("OTEL_TRACES_SAMPLER", "")
	shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Endpoint: r.Endpoint()}, "crescent-test", "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = shutdown(context.Background()) })
	return func() {
		if err := shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	}
}

func TestClientAndServerSpans(t *testing.T) {
	r := otlptest.Start(t)
	flush := setup(t, r)
	cc, seen, stop := echo(t)

	ctx, root := otel.Tracer("test").Start(t.Context(), "root")
	if err := cc.Invoke(ctx, method, &emptypb.Empty{}, &emptypb.Empty{}); err != nil {
		t.Fatal(err)
	}
	if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	root.End()
	handler := <-seen
	// The server span ends after the client has its answer: stop the
	// server (which waits for its RPCs) before flushing, or it may end
	// after the exporter shut down and never arrive.
	cc.Close()
	stop()
	flush()

	spans := r.ByTrace(root.SpanContext().TraceID().String())
	if len(spans) != 3 {
		t.Fatalf("got %d spans, want root, client and server (health checks untraced): %v", len(spans), spans)
	}
	top, err := otlptest.Tree(spans)
	if err != nil || top.Name != "root" {
		t.Fatalf("Tree: got %v, %v", top, err)
	}
	cl := otlptest.Filter(spans, otlptest.Named("crescent.test.v1.Echo/Call"))
	if len(cl) != 2 {
		t.Fatalf("got %d call spans, want 2: %v", len(cl), cl)
	}
	client, server := cl[0], cl[1]
	if client.Kind != tracepb.Span_SPAN_KIND_CLIENT {
		client, server = server, client
	}
	if !client.ChildOf(top) || !server.ChildOf(client) {
		t.Fatalf("parentage: root %v, client %v, server %v", top, client, server)
	}
	if handler.SpanID().String() != server.SpanID {
		t.Fatalf("handler's span: got %s, want the server span %s", handler.SpanID(), server.SpanID)
	}
	if server.Service != "crescent-test" || server.Attrs["rpc.system.name"] != "grpc" {
		t.Fatalf("server span: got %v %v", server.Service, server.Attrs)
	}
}

// TestPassThroughWhenOff: with tracing off, a server still hands its
// handler the caller's trace context, and a client sends the context it is
// given: a process without tracing does not break a trace across it.
func TestPassThroughWhenOff(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{}, "s", "")
	if err != nil {
		t.Fatal(err)
	}
	defer shutdown(t.Context())
	cc, seen, _ := echo(t)
	ctx := tracing.Propagator.Extract(t.Context(), propagation.MapCarrier{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	if err := cc.Invoke(ctx, method, &emptypb.Empty{}, &emptypb.Empty{}); err != nil {
		t.Fatal(err)
	}
	got := <-seen
	if got.TraceID().String() != "0af7651916cd43dd8448eb211c80319c" || got.SpanID().String() != "b7ad6b7169203331" || !got.IsSampled() {
		t.Fatalf("handler saw %v, want the caller's context", got)
	}
}
