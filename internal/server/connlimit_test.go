package server

import (
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// TestConnectionCaps: each port admits MaxConns connections, MaxConnsPerIP
// from one address; one more is closed as it is accepted and counted,
// and a place freed by a closed connection is taken again. Before the
// caps, any peer could open connections until the process ran out of
// memory or descriptors (each idle gRPC connection holds buffers and
// goroutines).
func TestConnectionCaps(t *testing.T) {
	sec := DefaultSecurity()
	sec.MaxConns, sec.MaxConnsPerIP = 3, 2
	s := New(Config{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", ShutdownTimeout: time.Second, Credentials: &Credentials{Security: sec}},
		testutil.Logger(), obs.NewRegistry())
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	// dial connects from local address from (any 127.x.y.z is loopback).
	dial := func(t *testing.T, addr, from string) net.Conn {
		t.Helper()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	// closed reports whether the server closed c (as it refuses one).
	closed := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		return err == io.EOF
	}
	refused := func(port, limit string) float64 {
		return promtest.ToFloat64(s.conns.refused.WithLabelValues(port, limit))
	}

	for _, port := range []struct{ name, addr string }{{"grpc", s.GRPCAddr()}, {"admin", s.AdminAddr()}} {
		t.Run(port.name, func(t *testing.T) {
			a1, _ := dial(t, port.addr, "127.0.0.1"), dial(t, port.addr, "127.0.0.1")
			if a3 := dial(t, port.addr, "127.0.0.1"); !closed(a3) {
				t.Fatal("a third connection from 127.0.0.1 was admitted (MaxConnsPerIP 2)")
			}
			if got := refused(port.name, "max_connections_per_ip"); got != 1 {
				t.Fatalf("refused{limit=max_connections_per_ip} = %v, want 1", got)
			}
			b1 := dial(t, port.addr, "127.0.0.2")
			if b2 := dial(t, port.addr, "127.0.0.2"); !closed(b2) {
				t.Fatal("a fourth connection was admitted (MaxConns 3)")
			}
			if got := refused(port.name, "max_connections"); got != 1 {
				t.Fatalf("refused{limit=max_connections} = %v, want 1", got)
			}
			if closed(b1) {
				t.Fatal("an admitted connection was closed")
			}
			// A place freed is taken again.
			_ = a1.Close()
			testutil.Eventually(t, 5*time.Second, func() bool {
				return promtest.ToFloat64(s.conns.open.WithLabelValues(port.name)) == 2
			}, "the closed connection's place to be freed")
			switch port.name {
			case "grpc":
				cc, err := grpc.NewClient(port.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
				if err != nil {
					t.Fatal(err)
				}
				defer cc.Close()
				hctx, hcancel := context.WithTimeout(t.Context(), 5*time.Second)
				defer hcancel()
				if _, err := healthpb.NewHealthClient(cc).Check(hctx, &healthpb.HealthCheckRequest{}); err != nil {
					t.Fatalf("health check in the freed place: %v", err)
				}
			case "admin":
				hc := &http.Client{Transport: &http.Transport{}}
				defer hc.CloseIdleConnections()
				r, err := hc.Get("http://" + port.addr + "/healthz")
				if err != nil {
					t.Fatalf("healthz in the freed place: %v", err)
				}
				_ = r.Body.Close()
			}
		})
	}
}
