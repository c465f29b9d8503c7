package server

import (
	"context"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) {
		if certsDir != "" {
			_ = os.RemoveAll(certsDir)
		}
	}))
}

func TestRunServesHealthAndAdmin(t *testing.T) {
	lg := testutil.Logger()
	s := New(Config{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", ShutdownTimeout: time.Second}, lg, obs.NewRegistry())
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	cc, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	hctx, hcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer hcancel()
	resp, err := healthpb.NewHealthClient(cc).Check(hctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: got %v, %v; want SERVING", resp.GetStatus(), err)
	}
	for path, want := range map[string]int{"/healthz": 200, "/readyz": 200, "/metrics": 200} {
		r, err := http.Get("http://" + s.AdminAddr() + path)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != want {
			t.Fatalf("%s: got %d, want %d", path, r.StatusCode, want)
		}
	}
	s.SetReadiness(func() error { return context.DeadlineExceeded })
	r, err := http.Get("http://" + s.AdminAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("readyz when not ready: got %d, want 503", r.StatusCode)
	}
	http.DefaultClient.CloseIdleConnections()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
