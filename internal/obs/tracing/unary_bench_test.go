package tracing_test

import (
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/emptypb"
)

// cpuTime is the process's user and system CPU time: on a machine others
// share, CPU time per call varies less than wall time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkUnaryOff is an empty unary call over loopback with tracing off:
// without stats handlers, with Crescent's (tracing.ServerOption and
// DialOption), and with otelgrpc's alone. It reports CPU time per call
// (both sides, this process) beside wall time.
func BenchmarkUnaryOff(b *testing.B) {
	otel.SetTracerProvider(noop.NewTracerProvider())
	for _, tt := range []struct {
		name string
		srv  []grpc.ServerOption
		cli  []grpc.DialOption
	}{
		{"none", nil, nil},
		{"crescent", []grpc.ServerOption{tracing.ServerOption()}, []grpc.DialOption{tracing.DialOption()}},
		{"otelgrpc", []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler())}, []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler())}},
	} {
		b.Run(tt.name, func(b *testing.B) {
			gs := grpc.NewServer(append(tt.srv, grpc.UnknownServiceHandler(func(_ any, st grpc.ServerStream) error {
				var in emptypb.Empty
				if err := st.RecvMsg(&in); err != nil {
					return err
				}
				return st.SendMsg(&emptypb.Empty{})
			}))...)
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			go func() { _ = gs.Serve(lis) }()
			defer gs.Stop()
			cc, err := grpc.NewClient(lis.Addr().String(), append(tt.cli, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
			if err != nil {
				b.Fatal(err)
			}
			defer cc.Close()
			ctx := b.Context()
			in, out := &emptypb.Empty{}, &emptypb.Empty{}
			if err := cc.Invoke(ctx, method, in, out); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			start := cpuTime()
			for b.Loop() {
				if err := cc.Invoke(ctx, method, in, out); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
		})
	}
}
