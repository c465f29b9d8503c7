package link

import (
	"context"
	"github.com/crescent-kv/crescent/internal/master/mastertest"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/agent/segment"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

type realMaster = mastertest.Master

func startRealMaster(t *testing.T, addr string) *realMaster {
	return mastertest.Start(t, addr, func(c *masterapp.Config) {
		c.HeartbeatInterval = 200 * time.Millisecond
		c.SuspectAfter, c.UnmountAfter = 5*time.Second, 15*time.Second
	})
}

func startStandby(t *testing.T, leader string) (string, func()) {
	return mastertest.StartStandby(t, leader)
}

// TestFollowLeader: given [standby, leader], the link is redirected by the
// standby and registers with the leader; when that leader is stopped and a
// new master starts at the standby's address (as after a failover), the
// link registers with the new one, within about a second on loopback, with
// the default backoff.
func TestFollowLeader(t *testing.T) {
	leader := startRealMaster(t, "127.0.0.1:0")
	standby, stopStandby := startStandby(t, leader.Addr)

	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	segs := segment.NewSet(mem)
	cfg := Config{MasterAddr: standby + "," + leader.Addr, AgentID: "agent-1", HostID: "host-1", DataEndpoint: "127.0.0.1:1", ShutdownGrace: 50 * time.Millisecond}
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
			return l.State() == StateConnected && l.Epoch() == m.M.Identity.Epoch && l.Master() == m.Addr && len(m.M.Registry.Segments()) == 1
		}
	}
	testutil.Eventually(t, 10*time.Second, registeredWith(leader), "the link to register with the leader %s after the standby's redirect", leader.Addr)
	if got := promtest.ToFloat64(l.met.redirects); got != 1 {
		t.Errorf("redirects = %v, want 1", got)
	}

	// Failover: the leader goes, a new master takes the standby's address.
	stopStandby()
	leader.Stop()
	began := time.Now()
	next := startRealMaster(t, standby)
	testutil.Eventually(t, 10*time.Second, registeredWith(next), "the link to register with the new leader %s", next.Addr)
	t.Logf("re-registered with the new leader %v after the old one stopped", time.Since(began))
	if next.M.Identity.Epoch <= leader.M.Identity.Epoch {
		t.Fatalf("new epoch %d not above the old %d", next.M.Identity.Epoch, leader.M.Identity.Epoch)
	}
}
