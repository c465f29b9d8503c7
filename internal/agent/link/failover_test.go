package link

import (
	"context"
	"net"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
)

// realMaster is an in-process crescent-master on loopback.
type realMaster struct {
	m    *masterapp.Master
	addr string
	stop func()
}

// startRealMaster runs a master on addr ("127.0.0.1:0" for any port), as
// internal/testcluster does.
func startRealMaster(t *testing.T, addr string) *realMaster {
	t.Helper()
	cfg := masterapp.DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = addr, "127.0.0.1:0"
	cfg.HeartbeatInterval = 200 * time.Millisecond
	cfg.SuspectAfter, cfg.UnmountAfter = 5*time.Second, 15*time.Second
	cfg.RecoveryGrace = 0
	cfg.ShutdownTimeout = 5 * time.Second
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
	rm := &realMaster{m: m, addr: m.Server.GRPCAddr()}
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

// startStandby stands in for a master in standby mode (issue 15, HA; being
// written concurrently): a gRPC server that answers every RPC, unary or
// streaming, with the contract's UNAVAILABLE NOT_LEADER status naming
// leader.
func startStandby(t *testing.T, leader string) (addr string, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.UnknownServiceHandler(func(any, grpc.ServerStream) error {
		e := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "not the leader")
		if leader != "" {
			e.Metadata = map[string]string{"leader": leader}
		}
		return rpcerr.Status(e)
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

// TestFollowLeader: given [standby, leader], the link is redirected by the
// standby and registers with the leader; when that leader is stopped and a
// new master starts at the standby's address (as after a failover), the
// link registers with the new one, within about a second on loopback, with
// the default backoff.
func TestFollowLeader(t *testing.T) {
	leader := startRealMaster(t, "127.0.0.1:0")
	standby, stopStandby := startStandby(t, leader.addr)

	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	segs := segment.NewSet(mem)
	cfg := Config{MasterAddr: standby + "," + leader.addr, AgentID: "agent-1", HostID: "host-1", DataEndpoint: "127.0.0.1:1", ShutdownGrace: 50 * time.Millisecond}
	reg := prometheus.NewRegistry()
	l, err := New(cfg, Deps{Segments: segs, Registerer: reg}, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	}()

	registeredWith := func(m *realMaster) func() bool {
		return func() bool {
			return l.State() == StateConnected && l.Epoch() == m.m.Identity.Epoch && l.Master() == m.addr && len(m.m.Registry.Segments()) == 1
		}
	}
	testutil.Eventually(t, 10*time.Second, registeredWith(leader), "the link to register with the leader %s after the standby's redirect", leader.addr)
	if got := promtest.ToFloat64(l.met.redirects); got != 1 {
		t.Errorf("redirects = %v, want 1", got)
	}

	// Failover: the leader goes, a new master takes the standby's address.
	stopStandby()
	leader.stop()
	began := time.Now()
	next := startRealMaster(t, standby)
	testutil.Eventually(t, 10*time.Second, registeredWith(next), "the link to register with the new leader %s", next.addr)
	t.Logf("re-registered with the new leader %v after the old one stopped", time.Since(began))
	if next.m.Identity.Epoch <= leader.m.Identity.Epoch {
		t.Fatalf("new epoch %d not above the old %d", next.m.Identity.Epoch, leader.m.Identity.Epoch)
	}
}
