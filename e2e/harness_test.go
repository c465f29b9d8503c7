// Package e2e drives the real binaries (bin/ built by `make build`, or
// $CRESCENT_BIN) as processes on free loopback ports: one master, agents,
// and a gateway, exactly as `make run` starts them.
//
// With CRESCENT_E2E_TLS=1 (`make test-e2e` runs the suite once without and
// once with it) every cluster runs with mTLS on every link, as `make
// run-secure` starts it (issue 14): the harness makes a development CA and
// certificates per cluster (internal/auth/devcerts), every process gets
// --tls-ca/--tls-cert/--tls-key, SDK clients and crescentctl present a
// tenant's certificate (the admin's where a test needs admin RPCs), and the
// admin HTTP ports are read over HTTPS with the admin's certificate. The
// gateway's ZMQ endpoints (PUB, replay, snapshot) stay plaintext in both
// modes: go-zeromq/zmq4 has no CURVE (docs/OPERATIONS.md).
package e2e

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// tlsEnv selects the TLS mode of the whole suite.
const tlsEnv = "CRESCENT_E2E_TLS"

// tlsMode reports whether clusters run with mTLS ($CRESCENT_E2E_TLS true).
func tlsMode(t testing.TB) bool {
	t.Helper()
	v := os.Getenv(tlsEnv)
	if v == "" {
		return false
	}
	on, err := strconv.ParseBool(v)
	if err != nil {
		t.Fatalf("%s=%q: want a boolean (1 or 0)", tlsEnv, v)
	}
	return on
}

// Principals a cluster in TLS mode holds certificates for, besides its own
// processes (master-1, gateway-1, one agent per host id): the admin and
// the tenants the tests use.
const (
	masterName  = "master-1"
	gatewayName = "gateway-1"
	adminName   = "admin"
)

var certTenants = []string{"default", "tenant-a", "tenant-b", "t1", "t2", "t3", "tier"}

// binDir finds the binaries: $CRESCENT_BIN, else ../bin.
func binDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("CRESCENT_BIN")
	if dir == "" {
		dir, _ = filepath.Abs("../bin")
	}
	for _, b := range []string{"crescent-master", "crescent-agent", "crescentctl"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			t.Fatalf("binary %s missing in %s: run 'make build' (or 'make test', which builds first)", b, dir)
		}
	}
	return dir
}

// freeAddr returns a loopback address with a free port.
//
// The port is free when it is picked but closed again for the process to
// bind, so something else could take it before then. freeAddr picks ports
// below the kernel's ephemeral range (net.ipv4.ip_local_port_range), which
// the kernel never hands out by itself — not to a :0 listener, not as the
// source port of an outgoing connection — so only another freeAddr could
// take one, and freeAddr never returns an address it returned before in
// this test binary (a gateway once got the same port for --pub and
// --grpc-addr; a restarted master once found its port taken, "bind:
// address already in use", most likely as a reconnecting client's source
// port). Where the range leaves too few ports below it, it falls back to
// ports the kernel picks.
func freeAddr(t testing.TB) string {
	t.Helper()
	handedOut.Lock()
	defer handedOut.Unlock()
	lo, hi := 20000, ephemeralLow()
	for range 200 {
		addr := "127.0.0.1:0"
		if hi-lo >= 1000 {
			addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(lo+rand.IntN(hi-lo)))
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			continue // in use
		}
		addr = l.Addr().String()
		l.Close()
		if !handedOut.addrs[addr] {
			handedOut.addrs[addr] = true
			return addr
		}
	}
	t.Fatal("freeAddr: no fresh loopback port in 200 tries")
	return ""
}

// ephemeralLow is the first port of the kernel's ephemeral range, or 0
// when it cannot be read.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return n
}

// handedOut are the addresses freeAddr has returned.
var handedOut = struct {
	sync.Mutex
	addrs map[string]bool
}{addrs: map[string]bool{}}

// Proc is one running binary.
type Proc struct {
	t     testing.TB
	Name  string
	bin   string
	args  []string
	log   string
	admin string
	// http reads the admin port: plain HTTP, or HTTPS with the admin's
	// certificate in TLS mode (scheme says which).
	http   *http.Client
	scheme string

	mu   sync.Mutex // guards cmd, done
	cmd  *exec.Cmd
	done chan struct{}
}

// start launches the process (again, after a Kill or Stop).
func (p *Proc) start() {
	p.t.Helper()
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	fmt.Fprintf(f, "==== start %s %s\n", p.bin, strings.Join(p.args, " "))
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		p.t.Fatalf("start %s: %v", p.Name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
}

func (p *Proc) signal(sig syscall.Signal, wait time.Duration) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(wait):
		_ = cmd.Process.Kill()
		<-done
	}
}

// Kill stops the process with SIGKILL (a crash).
func (p *Proc) Kill() { p.signal(syscall.SIGKILL, 5*time.Second) }

// Stop stops the process with SIGTERM (a clean shutdown) and waits.
func (p *Proc) Stop() { p.signal(syscall.SIGTERM, 20*time.Second) }

// Restart starts the process again with the same arguments and waits for
// its /readyz.
func (p *Proc) Restart() {
	p.t.Helper()
	p.start()
	waitReady(p.t, p)
}

// Logs returns the process's output so far.
func (p *Proc) Logs() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// get fetches path from the process's admin port (over HTTPS with the
// admin's certificate in TLS mode).
func (p *Proc) get(path string) (*http.Response, error) {
	return p.http.Get(p.scheme + "://" + p.admin + path)
}

func waitReady(t testing.TB, p *Proc) {
	t.Helper()
	err := testutil.Poll(t, 20*time.Second, func() error {
		resp, err := p.get("/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz = %d", resp.StatusCode)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s not ready after 20s; logs:\n%s", p.Name, tail(p.Logs(), 40))
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Cluster is a running master, agents and (optionally) gateway.
type Cluster struct {
	t      testing.TB
	bin    string
	dir    string
	Master *Proc
	// Masters are all the masters with Options.Masters > 1 (Master is the
	// first); the leader is the one whose /readyz answers 200.
	Masters []*Proc
	Agents  []*Proc
	Gateway *Proc

	MasterAddr  string
	AgentAddrs  []string
	GatewayPub  string
	GatewayRepl string
	GatewaySnap string
	GatewayHTTP string
	// GatewayState is the gateway's --state-dir (kept across its restarts).
	GatewayState string

	// certDir holds the CA and every certificate in TLS mode ("" in
	// plaintext); the layout is devcerts'.
	certDir string
	// adminHTTP reads admin ports (HTTPS with the admin's certificate in
	// TLS mode).
	adminHTTP *http.Client

	// adminMu guards adminCl, the SDK client of the harness's own polls
	// (Segments, readable): one, not one per poll. The master caps the
	// connections of one address (--max-connections-per-ip, 1024), and a
	// client per poll, each kept to the end of the test, passed it.
	adminMu sync.Mutex
	adminCl *client.Client
}

// admin is the harness's own admin client of tenant "default", made once
// and closed at cleanup.
func (c *Cluster) admin() *client.Client {
	c.adminMu.Lock()
	defer c.adminMu.Unlock()
	if c.adminCl == nil {
		c.adminCl = c.AdminClient("default")
	}
	return c.adminCl
}

// Options shape a test cluster.
type Options struct {
	Agents      int
	AgentMemory string
	Disk        bool
	// DiskSize is each agent's --disk-size with Disk (default 64MiB).
	DiskSize string
	// DiskMount, when set, is called with each agent's disk directory
	// before the agent first starts (to mount a filesystem there).
	DiskMount func(agent int, dir string)
	Gateway   bool
	// GatewayStateMount, when set, is called with the gateway's
	// --state-dir before the gateway first starts.
	GatewayStateMount func(dir string)
	MasterFlags       []string
	AgentFlags        []string
	GatewayFlags      []string // "{pub}" in one is replaced by the gateway's PUB address (host:port)
	SuspectAfter      time.Duration
	UnmountAfter      time.Duration
	// Masters > 1 starts that many masters electing a leader on an etcd
	// server run in the test's process (issue 15, HA); MasterAddr is then
	// their comma-separated list, which every client takes.
	Masters int
	// OTLPEndpoint, when set (host:port), has every master, agent and
	// gateway send all its spans there in plaintext (issue 16).
	OTLPEndpoint string
}

// traceFlags are the tracing flags of every process: none unless
// OTLPEndpoint is set.
func (o Options) traceFlags() []string {
	if o.OTLPEndpoint == "" {
		return nil
	}
	return []string{"--otlp-endpoint", o.OTLPEndpoint, "--otlp-insecure", "--trace-sample-ratio", "1"}
}

// StartCluster starts a cluster and waits until every agent's segments are
// registered and healthy. Everything is stopped at test cleanup, and the
// processes' logs are printed when the test failed.
func StartCluster(t testing.TB, o Options) *Cluster {
	t.Helper()
	if o.Agents == 0 {
		o.Agents = 2
	}
	if o.AgentMemory == "" {
		o.AgentMemory = "64MiB"
	}
	if o.SuspectAfter == 0 {
		o.SuspectAfter = 600 * time.Millisecond
	}
	if o.UnmountAfter == 0 {
		o.UnmountAfter = 3 * time.Second
	}
	c := &Cluster{t: t, bin: binDir(t), dir: clusterDir(t), adminHTTP: &http.Client{Timeout: 10 * time.Second}}
	if tlsMode(t) {
		c.initCerts(o.Agents)
	}
	masterArgs := append([]string{
		"--log-level", "debug",
		"--heartbeat-interval", "100ms", "--suspect-after", o.SuspectAfter.String(), "--unmount-after", o.UnmountAfter.String(),
	}, append(o.traceFlags(), o.MasterFlags...)...)
	if o.Masters > 1 {
		endpoint := c.startEtcd()
		var addrs []string
		for i := range o.Masters {
			addr := freeAddr(t)
			addrs = append(addrs, addr)
			p := c.proc(fmt.Sprintf("master-%d", i), "crescent-master", auth.RoleMaster, masterName, append([]string{
				"--grpc-addr", addr, "--etcd-endpoints", endpoint, "--advertise-addr", addr, "--master-id", fmt.Sprintf("master-%d", i),
			}, masterArgs...))
			p.start()
			c.Masters = append(c.Masters, p)
		}
		c.Master, c.MasterAddr = c.Masters[0], strings.Join(addrs, ",")
		c.WaitLeader()
	} else {
		c.MasterAddr = freeAddr(t)
		c.Master = c.proc("master", "crescent-master", auth.RoleMaster, masterName, append([]string{"--grpc-addr", c.MasterAddr}, masterArgs...))
		c.Master.start()
		waitReady(t, c.Master)
	}
	for i := 0; i < o.Agents; i++ {
		addr := freeAddr(t)
		name := fmt.Sprintf("agent-%c", 'a'+i)
		args := []string{"--master", c.MasterAddr, "--grpc-addr", addr, "--host-id", hostID(i),
			"--agent-id", name, "--memory", o.AgentMemory, "--log-level", "debug", "--shutdown-grace", "200ms"}
		if o.Disk {
			dd := filepath.Join(c.dir, name+"-disk")
			if err := os.MkdirAll(dd, 0o755); err != nil {
				t.Fatal(err)
			}
			if o.DiskMount != nil {
				o.DiskMount(i, dd)
			}
			args = append(args, "--disk-dir", dd, "--disk-size", cmp.Or(o.DiskSize, "64MiB"))
		}
		args = append(args, o.traceFlags()...)
		p := c.proc(name, "crescent-agent", auth.RoleAgent, hostID(i), append(args, o.AgentFlags...))
		p.start()
		c.Agents = append(c.Agents, p)
		c.AgentAddrs = append(c.AgentAddrs, addr)
	}
	for _, p := range c.Agents {
		waitReady(t, p)
	}
	want := o.Agents
	if o.Disk {
		want *= 2
	}
	c.WaitSegments(want)
	if o.Gateway {
		c.GatewayPub = "tcp://" + freeAddr(t)
		c.GatewayRepl = "tcp://" + freeAddr(t)
		c.GatewaySnap = "tcp://" + freeAddr(t)
		c.GatewayState = filepath.Join(c.dir, "gateway-state")
		if o.GatewayStateMount != nil {
			o.GatewayStateMount(c.GatewayState)
		}
		// "{pub}" in a gateway flag is the PUB address (host:port), chosen
		// only now: --topic kv@{pub}@model is vLLM's topic form.
		flags := make([]string, len(o.GatewayFlags))
		for i, f := range o.GatewayFlags {
			flags[i] = strings.ReplaceAll(f, "{pub}", strings.TrimPrefix(c.GatewayPub, "tcp://"))
		}
		// As `make run` starts it: with a state directory, so a restart
		// continues the sequence (docs/gateway-state.md).
		c.Gateway = c.proc("gateway", "crescent-gateway", auth.RoleGateway, gatewayName, append([]string{
			"--master", c.MasterAddr, "--pub", c.GatewayPub, "--replay", c.GatewayRepl, "--grpc-addr", freeAddr(t),
			"--snapshot-endpoint", c.GatewaySnap, "--state-dir", c.GatewayState,
			"--backend-id", "e2e", "--log-level", "debug",
		}, append(o.traceFlags(), flags...)...))
		c.GatewayHTTP = c.Gateway.admin
		c.Gateway.start()
		waitReady(t, c.Gateway)
	}
	t.Cleanup(func() {
		procs := append([]*Proc{c.Gateway}, c.Agents...)
		if len(c.Masters) > 0 {
			procs = append(procs, c.Masters...)
		} else {
			procs = append(procs, c.Master)
		}
		for _, p := range procs {
			if p != nil {
				p.Stop()
			}
		}
		if t.Failed() {
			dir := os.Getenv("CRESCENT_E2E_LOGS") // keep every process's whole log there
			for _, p := range procs {
				if p != nil {
					t.Logf("==== %s log (tail)\n%s", p.Name, tail(p.Logs(), 60))
					if dir != "" {
						if err := os.WriteFile(filepath.Join(dir, p.Name+".log"), []byte(p.Logs()), 0o644); err != nil {
							t.Logf("keep %s's log: %v", p.Name, err)
						}
					}
				}
			}
		}
	})
	return c
}

// startEtcd starts the masters' etcd and returns its client endpoint:
// embedded in the test's process (go.etcd.io/etcd/server/v3/embed), or,
// with CRESCENT_E2E_ETCD naming etcd's binary (make bin/etcd), as its own
// process, so a test process busy with millions of objects cannot starve
// it and make the masters' 2 s leases expire.
func (c *Cluster) startEtcd() string {
	bin := os.Getenv("CRESCENT_E2E_ETCD")
	if bin == "" {
		return etcdtest.Start(c.t).Endpoint
	}
	client, peer := freeAddr(c.t), freeAddr(c.t)
	p := &Proc{t: c.t, Name: "etcd", bin: bin, log: filepath.Join(c.dir, "etcd.log"), http: c.adminHTTP, scheme: "http", args: []string{
		"--name", "e2e", "--data-dir", filepath.Join(c.dir, "etcd"), "--log-level", "warn",
		"--listen-client-urls", "http://" + client, "--advertise-client-urls", "http://" + client,
		"--listen-peer-urls", "http://" + peer, "--initial-advertise-peer-urls", "http://" + peer,
		"--initial-cluster", "e2e=http://" + peer,
	}}
	p.start()
	c.t.Cleanup(p.Stop)
	return client
}

// clusterDir is the cluster's directory (logs, disk segments, gateway
// state): a temporary one, or CRESCENT_E2E_KEEP/<test name>, emptied
// first and kept afterwards, to read every process's whole log.
func clusterDir(t testing.TB) string {
	keep := os.Getenv("CRESCENT_E2E_KEEP")
	if keep == "" {
		return t.TempDir()
	}
	dir := filepath.Join(keep, strings.ReplaceAll(t.Name(), "/", "_"))
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("cluster directory (kept): %s", dir)
	return dir
}

// proc prepares a process that runs as principal role/name in TLS mode.
func (c *Cluster) proc(name, bin string, role auth.Role, principal string, args []string) *Proc {
	admin := freeAddr(c.t)
	args = append(args, "--admin-addr", admin)
	args = append(args, c.tlsFlags(role, principal)...)
	return &Proc{t: c.t, Name: name, bin: filepath.Join(c.bin, bin), args: args,
		log: filepath.Join(c.dir, name+".log"), admin: admin, http: c.adminHTTP, scheme: c.scheme()}
}

// hostID is agent i's --host-id, and its certificate's name in TLS mode.
func hostID(i int) string { return "host-" + string(rune('a'+i)) }

// initCerts makes the cluster's development CA and the certificates of its
// processes (agents named by their host ids), the admin and certTenants,
// for 127.0.0.1 and localhost, and points adminHTTP at the admin's.
func (c *Cluster) initCerts(agents int) {
	c.t.Helper()
	c.certDir = filepath.Join(c.dir, "certs")
	hosts := make([]string, agents)
	for i := range hosts {
		hosts[i] = hostID(i)
	}
	err := devcerts.Init(c.certDir, devcerts.Options{
		Hosts: []string{"127.0.0.1", "localhost"}, Agents: hosts, Tenants: certTenants,
		Admins: []string{adminName}, Gateways: []string{gatewayName}, Masters: []string{masterName},
	})
	if err != nil {
		c.t.Fatalf("certificates: %v", err)
	}
	src, err := auth.NewSource(c.Files(auth.RoleAdmin, adminName), nil)
	if err != nil {
		c.t.Fatalf("admin certificate: %v", err)
	}
	// Admin ports are on 127.0.0.1: verify the server's certificate for it.
	c.adminHTTP.Transport = &http.Transport{TLSClientConfig: src.ClientTLS("127.0.0.1")}
	c.t.Cleanup(c.adminHTTP.CloseIdleConnections)
}

// Secure reports whether the cluster runs with mTLS (TLS mode).
func (c *Cluster) Secure() bool { return c.certDir != "" }

func (c *Cluster) scheme() string {
	if c.Secure() {
		return "https"
	}
	return "http"
}

// Files names the CA, certificate and key of principal role/name (TLS
// mode); a principal the cluster has no certificate for fails the test.
func (c *Cluster) Files(role auth.Role, name string) auth.Files {
	c.t.Helper()
	f := devcerts.FilesFor(c.certDir, role, name)
	if _, err := os.Stat(f.Cert); err != nil {
		c.t.Fatalf("no certificate for %s %q in TLS mode (tenants: add it to certTenants): %v", role, name, err)
	}
	return f
}

// tlsFlags are the TLS flags of a process or crescentctl running as
// role/name: none in plaintext.
func (c *Cluster) tlsFlags(role auth.Role, name string) []string {
	c.t.Helper()
	if !c.Secure() {
		return nil
	}
	f := c.Files(role, name)
	return []string{"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
}

// clientTLS is the SDK's TLS configuration as role/name; nil in plaintext.
func (c *Cluster) clientTLS(role auth.Role, name string) *tls.Config {
	c.t.Helper()
	if !c.Secure() {
		return nil
	}
	f := c.Files(role, name)
	cfg, err := client.TLSFromFiles(f.CA, f.Cert, f.Key)
	if err != nil {
		c.t.Fatalf("client TLS of %s %s: %v", role, name, err)
	}
	return cfg
}

// dialAgent is a gRPC connection to an agent's DataService as tenant
// (plaintext, or mTLS requiring an agent's certificate), closed at cleanup.
func (c *Cluster) dialAgent(addr, tenant string) *grpc.ClientConn {
	c.t.Helper()
	creds := insecure.NewCredentials()
	if c.Secure() {
		src, err := auth.NewSource(c.Files(auth.RoleTenant, tenant), nil)
		if err != nil {
			c.t.Fatal(err)
		}
		creds = src.ClientCredentials("", auth.ServerIdentity{TrustDomain: devcerts.DefaultTrustDomain, Roles: []auth.Role{auth.RoleAgent}})
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Client returns an SDK client for tenant (with the tenant's certificate in
// TLS mode), closed at cleanup.
func (c *Cluster) Client(tenant string) *client.Client {
	c.t.Helper()
	return c.ClientWith(client.Config{Tenant: tenant})
}

// AdminClient returns an SDK client for tenant that holds the admin's
// certificate in TLS mode, for AdminService, ChangeService and a forced
// RemoveAll; closed at cleanup. In plaintext it is Client(tenant).
func (c *Cluster) AdminClient(tenant string) *client.Client {
	c.t.Helper()
	return c.ClientWith(client.Config{Tenant: tenant, TLS: c.clientTLS(auth.RoleAdmin, adminName)})
}

// GRPCDataClient returns a client for tenant that moves bytes through the
// agents' gRPC DataService only, never their bulk transfer listeners.
func (c *Cluster) GRPCDataClient(tenant string) *client.Client {
	c.t.Helper()
	return c.ClientWith(client.Config{Tenant: tenant, DisableTransfer: true})
}

// ClientWith returns an SDK client with cfg (Master and HostID filled in;
// in TLS mode, TLS too when nil: the certificate of cfg.Tenant), closed at
// cleanup.
func (c *Cluster) ClientWith(cfg client.Config) *client.Client {
	c.t.Helper()
	cfg.Master, cfg.HostID = c.MasterAddr, "host-test"
	if cfg.TLS == nil && c.Secure() {
		tenant := cfg.Tenant
		if tenant == "" {
			tenant = auth.DefaultTenant
		}
		cfg.TLS = c.clientTLS(auth.RoleTenant, tenant)
	}
	cl, err := client.New(context.Background(), cfg)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

// Leader returns the master whose /readyz answers 200 (with several
// masters, only the leader's does), or nil.
func (c *Cluster) Leader() *Proc {
	for _, p := range c.Masters {
		resp, err := p.get("/readyz")
		if err != nil {
			continue
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return p
		}
	}
	return nil
}

// WaitLeader waits until one of the masters leads and returns it.
func (c *Cluster) WaitLeader() *Proc {
	c.t.Helper()
	var lead *Proc
	testutil.Eventually(c.t, 30*time.Second, func() bool { lead = c.Leader(); return lead != nil }, "a master to lead")
	return lead
}

// Segments lists the master's segments.
func (c *Cluster) Segments() []*masterv1.Segment {
	c.t.Helper()
	cl := c.admin()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := cl.Admin().ListSegments(ctx, &masterv1.ListSegmentsRequest{})
	if err != nil {
		c.t.Fatalf("ListSegments: %v", err)
	}
	return r.GetSegments()
}

// WaitSegments waits until n segments can allocate.
func (c *Cluster) WaitSegments(n int) {
	c.t.Helper()
	testutil.EventuallyNoError(c.t, 20*time.Second, func() error {
		ok := 0
		for _, s := range c.Segments() {
			if s.GetCanAllocate() {
				ok++
			}
		}
		if ok < n {
			return fmt.Errorf("%d of %d segments can allocate", ok, n)
		}
		return nil
	})
}

// Ctl runs crescentctl against the cluster (as tenant default in TLS
// mode) and returns stdout, stderr and the exit code.
func (c *Cluster) Ctl(stdin []byte, args ...string) (string, string, int) {
	c.t.Helper()
	return c.CtlAs(auth.RoleTenant, auth.DefaultTenant, stdin, args...)
}

// CtlAs is Ctl with the certificate of role/name in TLS mode (plain Ctl in
// plaintext).
func (c *Cluster) CtlAs(role auth.Role, name string, stdin []byte, args ...string) (string, string, int) {
	c.t.Helper()
	args = append(append([]string{"--master", c.MasterAddr}, c.tlsFlags(role, name)...), args...)
	cmd := exec.Command(filepath.Join(c.bin, "crescentctl"), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		c.t.Fatalf("crescentctl: %v", err)
	}
	return out.String(), errb.String(), code
}

// metric returns the value of a counter or gauge from a process's
// /metrics, summed over its series when it has labels (0 when absent).
func (c *Cluster) metric(t testing.TB, p *Proc, name string) float64 {
	t.Helper()
	resp, err := p.get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		v, ok := strings.CutPrefix(line, name+" ")
		if rest, labelled := strings.CutPrefix(line, name+"{"); labelled {
			_, v, ok = strings.Cut(rest, "} ")
		}
		if ok {
			var f float64
			fmt.Sscan(v, &f)
			sum += f
		}
	}
	return sum
}
