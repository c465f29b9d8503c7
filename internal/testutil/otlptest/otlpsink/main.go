// Command otlpsink is an OTLP/gRPC trace receiver that counts and drops
// what it is sent: the collector end of the tracing benchmark in
// BENCHMARKS.md (issue 16), where a real collector's own cost would blur
// what tracing costs Crescent. It prints the spans received every
// --every and on SIGINT/SIGTERM.
//
//	go run ./internal/testutil/otlptest/otlpsink --addr 127.0.0.1:4317
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
)

type sink struct {
	collectortrace.UnimplementedTraceServiceServer
	spans, requests atomic.Int64
}

func (s *sink) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	n := 0
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			n += len(ss.GetSpans())
		}
	}
	s.spans.Add(int64(n))
	s.requests.Add(1)
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func main() {
	addr := flag.String("addr", "127.0.0.1:4317", "listen address")
	every := flag.Duration("every", 10*time.Second, "how often to print the counts (0: only at the end)")
	flag.Parse()
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "otlpsink:", err)
		os.Exit(1)
	}
	s := &sink{}
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(64 << 20))
	collectortrace.RegisterTraceServiceServer(gs, s)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() { _ = gs.Serve(lis) }()
	print := func() { fmt.Printf("otlpsink: %d spans in %d requests\n", s.spans.Load(), s.requests.Load()) }
	var tick <-chan time.Time
	if *every > 0 {
		t := time.NewTicker(*every)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-tick:
			print()
		case <-ctx.Done():
			gs.Stop()
			print()
			return
		}
	}
}
