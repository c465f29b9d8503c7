// Package mastertest starts masters for other packages' tests: a real
// crescent-master in-process on loopback, and a standby stand-in that
// answers every RPC NOT_LEADER (issue 15, HA) the way a standby master does.
package mastertest

import (
	"context"
	"net"
	"testing"
	"time"

	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
)

// Master is an in-process crescent-master on loopback.
type Master struct {
	M    *masterapp.Master
	Addr string
	stop func()
}

// Start runs a master on addr ("127.0.0.1:0" for any port) with no
// recovery grace; mod, if not nil, adjusts its configuration first. It is
// stopped when the test ends, or earlier with Stop.
func Start(t testing.TB, addr string, mod func(*masterapp.Config)) *Master {
	t.Helper()
	cfg := masterapp.DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = addr, "127.0.0.1:0"
	cfg.RecoveryGrace = 0
	cfg.ShutdownTimeout = 5 * time.Second
	if mod != nil {
		mod(&cfg)
	}
	m, err := masterapp.New(cfg, testutil.Logger())
	if err != nil {
		t.Fatalf("master: %v", err)
	}
	if err := m.Server.Listen(); err != nil {
		t.Fatalf("master listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	rm := &Master{M: m, Addr: m.Server.GRPCAddr()}
	stopped := false
	rm.stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("master run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("master did not stop")
		}
	}
	t.Cleanup(rm.stop)
	return rm
}

// Stop stops the master (idempotent).
func (m *Master) Stop() { m.stop() }

// StartStandby runs a gRPC server answering every RPC, unary or streaming,
// as a standby master does (rpcerr.NotLeader naming leader; "" for none).
// It is lighter than a real standby (internal/master/app with
// --etcd-endpoints), which needs etcd. It is stopped when the test ends,
// or earlier with the returned func.
func StartStandby(t testing.TB, leader string) (addr string, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(tracing.ServerOption(), grpc.UnknownServiceHandler(func(any, grpc.ServerStream) error {
		return rpcerr.Status(rpcerr.NotLeader(leader))
	}))
	go func() { _ = gs.Serve(lis) }()
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			gs.Stop()
		}
	}
	t.Cleanup(stop)
	return lis.Addr().String(), stop
}
