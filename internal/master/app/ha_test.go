package app

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// haMaster is one master process of an HA test: app.Run with etcd.
type haMaster struct {
	addr   string
	cancel context.CancelFunc
	done   chan error
	cli    masterv1.AdminServiceClient
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func startHAMaster(t *testing.T, etcd string, opts ...any) *haMaster {
	t.Helper()
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = freePort(t), "127.0.0.1:0"
	cfg.RecoveryGrace = 200 * time.Millisecond
	for _, o := range opts {
		switch o := o.(type) {
		case time.Duration:
			cfg.RecoveryGrace = o
		case func(*Config):
			o(&cfg)
		}
	}
	cfg.HA.EtcdEndpoints, cfg.HA.EtcdPrefix, cfg.HA.EtcdLeaseTTL = etcd, "/t/master/", 2*time.Second
	cfg.HA.AdvertiseAddr = cfg.GRPCAddr
	ctx, cancel := context.WithCancel(context.Background())
	m := &haMaster{addr: cfg.GRPCAddr, cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- Run(ctx, cfg, testutil.Logger()) }()
	cc, err := grpc.NewClient(m.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	m.cli = masterv1.NewAdminServiceClient(cc)
	t.Cleanup(func() {
		cc.Close()
		m.stop(t)
	})
	return m
}

func (m *haMaster) stop(t *testing.T) {
	t.Helper()
	if m.cancel == nil {
		return
	}
	m.cancel()
	m.cancel = nil
	select {
	case err := <-m.done:
		if err != nil {
			t.Errorf("master %s: %v", m.addr, err)
		}
	case <-time.After(15 * time.Second):
		t.Errorf("master %s did not stop 15s after cancel", m.addr)
	}
}

// status asks m for the cluster status: its epoch if it leads, else the
// NOT_LEADER hint.
func (m *haMaster) status(t *testing.T) (epoch uint64, leader string, err error) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	st, err := m.cli.GetClusterStatus(ctx, &masterv1.GetClusterStatusRequest{}, grpc.WaitForReady(true))
	if err != nil {
		if rpcerr.Reason(err) == "NOT_LEADER" {
			return 0, rpcerr.Metadata(err)["leader"], nil
		}
		return 0, "", err
	}
	return st.GetEpoch(), "", nil
}

// leaderOf waits until exactly one of ms leads and the others name it.
func leaderOf(t *testing.T, ms []*haMaster) (*haMaster, uint64) {
	t.Helper()
	var lead *haMaster
	var epoch uint64
	testutil.Eventually(t, 20*time.Second, func() bool {
		lead, epoch = nil, 0
		for _, m := range ms {
			e, _, err := m.status(t)
			switch {
			case err != nil:
				return false
			case e != 0 && lead != nil:
				t.Fatalf("two leaders: %s and %s", lead.addr, m.addr)
			case e != 0:
				lead, epoch = m, e
			}
		}
		if lead == nil {
			return false
		}
		for _, m := range ms {
			if m == lead {
				continue
			}
			if _, hint, _ := m.status(t); hint != lead.addr {
				return false
			}
		}
		return true
	}, "one leader, named by the standbys")
	return lead, epoch
}

// TestHAFailover: three masters on a real (embedded) etcd elect one
// leader; the standbys answer NOT_LEADER naming it; when it stops (and
// resigns) another takes over under a higher epoch, and again.
func TestHAFailover(t *testing.T) {
	etcd := etcdtest.Start(t)
	ms := []*haMaster{startHAMaster(t, etcd.Endpoint), startHAMaster(t, etcd.Endpoint), startHAMaster(t, etcd.Endpoint)}
	lead, epoch := leaderOf(t, ms)
	for range 2 {
		start := time.Now()
		lead.stop(t)
		var rest []*haMaster
		for _, m := range ms {
			if m != lead {
				rest = append(rest, m)
			}
		}
		ms = rest
		next, e := leaderOf(t, ms)
		t.Logf("leader %s (epoch %d) stopped; %s leads (epoch %d) after %v", lead.addr, epoch, next.addr, e, time.Since(start))
		if e <= epoch {
			t.Fatalf("new epoch %d not above %d", e, epoch)
		}
		lead, epoch = next, e
	}
}

// TestHANewLeaderRecovering: a newly elected leader answers ObjectService
// MASTER_RECOVERING while an agent the earlier leaders recorded has not
// re-registered (not OBJECT_NOT_FOUND for objects about to come back),
// until unmount-after; one that knows of no agent serves at once, without
// waiting out its recovery grace: every agent that may hold an object is
// recorded before its registration is acknowledged.
func TestHANewLeaderRecovering(t *testing.T) {
	etcd := etcdtest.Start(t)
	exist := func(addr string) error {
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		_, err = masterv1.NewObjectServiceClient(cc).Exist(t.Context(), &masterv1.ExistRequest{Key: "k"})
		return err
	}

	fresh := startHAMaster(t, etcd.Endpoint, 30*time.Second)
	leaderOf(t, []*haMaster{fresh})
	if err := exist(fresh.addr); err != nil {
		t.Fatalf("Exist on a new leader of no known agent (grace 30s): %v, want an answer at once", err)
	}
	fresh.stop(t)

	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{etcd.Endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(t.Context(), "/t/master/agents/agent-x", ""); err != nil {
		t.Fatal(err)
	}
	const unmountAfter = 3 * time.Second
	a := startHAMaster(t, etcd.Endpoint, 30*time.Second, func(c *Config) {
		c.HeartbeatInterval, c.SuspectAfter, c.UnmountAfter = 200*time.Millisecond, time.Second, unmountAfter
	})
	leaderOf(t, []*haMaster{a})
	began := time.Now()
	if err := exist(a.addr); rpcerr.Reason(err) != "MASTER_RECOVERING" {
		t.Fatalf("Exist on a new leader whose agent-x is not back: %v, want MASTER_RECOVERING", err)
	}
	testutil.Eventually(t, 15*time.Second, func() bool {
		err := exist(a.addr)
		if err != nil && rpcerr.Reason(err) != "MASTER_RECOVERING" {
			t.Fatalf("Exist on a new leader: %v", err)
		}
		return err == nil
	}, "the new leader to serve ObjectService")
	if took := time.Since(began); took > unmountAfter+2*time.Second {
		t.Fatalf("served %v after election; want about unmount-after (%v), not the 30s grace", took, unmountAfter)
	}
}

// TestHALeaderPartitioned: the leader's etcd traffic is blackholed. It
// stops acknowledging (NOT_LEADER) within the lease TTL, before a standby
// can be elected, and a standby takes over under a higher epoch.
func TestHALeaderPartitioned(t *testing.T) {
	etcd := etcdtest.Start(t)
	proxy := etcdtest.NewProxy(t, etcd.Endpoint)
	a := startHAMaster(t, proxy.Addr)
	_, ea := leaderOf(t, []*haMaster{a})
	b := startHAMaster(t, etcd.Endpoint)
	leaderOf(t, []*haMaster{a, b})

	cut := time.Now()
	proxy.Blackhole()
	var refusedAfter time.Duration
	testutil.Eventually(t, 10*time.Second, func() bool {
		e, _, err := a.status(t)
		if err == nil && e == 0 {
			refusedAfter = time.Since(cut)
			return true
		}
		return false
	}, "the cut-off leader to refuse")
	_, eb := leaderOf(t, []*haMaster{b})
	tookOver := time.Since(cut)
	t.Logf("cut-off leader refused after %v; the standby led after %v (TTL 2s)", refusedAfter, tookOver)
	if refusedAfter >= tookOver {
		t.Fatalf("the old leader answered until %v, the new one led at %v", refusedAfter, tookOver)
	}
	if eb <= ea {
		t.Fatalf("new epoch %d not above %d", eb, ea)
	}
	proxy.Restore()
}

// TestHAStandbyLeaseExpired: a standby cut off from etcd long enough for
// its campaign's lease to expire (a loaded machine can do that to a 2 s
// lease) campaigns again once etcd is back, instead of exiting, and takes
// over when the leader stops.
func TestHAStandbyLeaseExpired(t *testing.T) {
	etcd := etcdtest.Start(t)
	proxy := etcdtest.NewProxy(t, etcd.Endpoint)
	a := startHAMaster(t, etcd.Endpoint)
	leaderOf(t, []*haMaster{a})
	b := startHAMaster(t, proxy.Addr)
	leaderOf(t, []*haMaster{a, b})

	proxy.Blackhole()
	time.Sleep(4 * time.Second) // the 2 s lease expires in etcd
	proxy.Restore()
	a.stop(t)
	select {
	case err := <-b.done:
		t.Fatalf("the standby stopped after its lease expired: %v", err)
	default:
	}
	leaderOf(t, []*haMaster{b})
}

// TestHAEtcdTLS: with etcd requiring client certificates, a master given
// the CA and a client certificate (--etcd-tls-*) leads; wrong flag sets
// are refused at start.
func TestHAEtcdTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := devcerts.NewCA("crescent.local", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caFile := write("ca.pem", ca.CertPEM)
	sc, sk, err := ca.Issue(devcerts.Leaf{CommonName: "etcd", Hosts: []string{"127.0.0.1"}, ServerAuth: true})
	if err != nil {
		t.Fatal(err)
	}
	cc, ck, err := ca.Issue(devcerts.Leaf{CommonName: "master", ClientAuth: true})
	if err != nil {
		t.Fatal(err)
	}
	etcd := etcdtest.StartTLS(t, write("etcd.pem", sc), write("etcd-key.pem", sk), caFile)
	certFile, keyFile := write("master.pem", cc), write("master-key.pem", ck)

	cfg := DefaultConfig()
	cfg.HA = HA{EtcdEndpoints: etcd.Endpoint, EtcdPrefix: "/t/", EtcdLeaseTTL: 2 * time.Second, AdvertiseAddr: "a:1",
		EtcdTLSCA: caFile, EtcdTLSCert: certFile}
	if err := cfg.Validate(); err == nil {
		t.Fatal("a certificate without its key was accepted")
	}
	cfg.HA.EtcdTLSKey = keyFile
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	// Without a client certificate etcd refuses the master: it stands by.
	intruder := startHAMaster(t, etcd.Endpoint, func(c *Config) { c.HA.EtcdTLSCA = caFile })
	time.Sleep(3 * time.Second)
	if e, _, err := intruder.status(t); err != nil || e != 0 {
		t.Fatalf("a master without a client certificate: epoch %d, err %v; want a standby", e, err)
	}
	m := startHAMaster(t, etcd.Endpoint, func(c *Config) { c.HA.EtcdTLSCA, c.HA.EtcdTLSCert, c.HA.EtcdTLSKey = caFile, certFile, keyFile })
	leaderOf(t, []*haMaster{m})
}
