package server

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	"go.opentelemetry.io/otel"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/emptypb"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestServerTraces: every call but health checks gets a server span, child
// of the caller's, and the logging interceptor's line for it carries its
// trace_id and span_id.
func TestServerTraces(t *testing.T) {
	for _, k := range []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"} {
		t.Setenv(k, "")
	}
	r := otlptest.Start(t)
	shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Endpoint: r.Endpoint()}, "crescent-test", "")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = shutdown(context.Background()) }() // a second call does nothing

	var logs lockedBuffer
	lg, err := obs.NewLogger(&logs, "debug", "test")
	if err != nil {
		t.Fatal(err)
	}
	s := New(Config{GRPCAddr: "127.0.0.1:0", ShutdownTimeout: time.Second}, lg, obs.NewRegistry(),
		grpc.UnknownServiceHandler(func(_ any, st grpc.ServerStream) error {
			var in emptypb.Empty
			if err := st.RecvMsg(&in); err != nil {
				return err
			}
			return st.SendMsg(&emptypb.Empty{})
		}))
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	stop := sync.OnceValue(func() error {
		cancel()
		return <-done
	})
	defer func() { _ = stop() }()
	cc, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()), tracing.DialOption())
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()

	callCtx, root := otel.Tracer("test").Start(t.Context(), "root")
	if _, err := healthpb.NewHealthClient(cc).Check(callCtx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatal(err)
	}
	if err := cc.Invoke(callCtx, "/crescent.test.v1.Echo/Call", &emptypb.Empty{}, &emptypb.Empty{}); err != nil {
		t.Fatal(err)
	}
	root.End()
	// The server ends its span in a deferred stats event after it has sent
	// the response, so the client can get here first. GracefulStop waits
	// for every handler, the span's end included, before Run returns.
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if err := shutdown(t.Context()); err != nil { // flushes
		t.Fatal(err)
	}
	traceID := root.SpanContext().TraceID().String()
	spans := r.ByTrace(traceID)
	if len(spans) != 3 {
		t.Fatalf("got %d spans, want root, client and server (no health check): %v", len(spans), spans)
	}
	servers := otlptest.Filter(spans, func(s otlptest.Span) bool { return s.Kind == tracepb.Span_SPAN_KIND_SERVER })
	if len(servers) != 1 || servers[0].Name != "crescent.test.v1.Echo/Call" {
		t.Fatalf("server spans: got %v", servers)
	}
	server := servers[0]
	if p, ok := r.Parent(server); !ok || p.Kind != tracepb.Span_SPAN_KIND_CLIENT {
		t.Fatalf("server span's parent: got %v, %v; want the client span", p, ok)
	}
	var line string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `"grpc.method":"Call"`) {
			line = l
		}
	}
	if !strings.Contains(line, `"trace_id":"`+traceID+`"`) || !strings.Contains(line, `"span_id":"`+server.SpanID+`"`) {
		t.Fatalf("call's log line lacks trace %s span %s: %q\nall logs: %s", traceID, server.SpanID, line, logs.String())
	}
}
