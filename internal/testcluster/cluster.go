// Package testcluster starts a real Crescent cluster inside the test
// process: the master, agents and (optionally) the gateway are the same
// app packages the binaries run (internal/master/app, internal/agent/app,
// internal/gateway/gateway), wired on loopback ports, with real memory
// segments, real disk files and real sockets. Tests of the SDK, the CLI,
// the gateway and e2e start one with Start; nothing in it is a fake.
//
// Each component runs under its own context, so a test can stop (cleanly)
// or restart an agent, the gateway or the master while the rest keeps
// running. Everything still running is stopped by t.Cleanup, and Start
// fails the test if a component does not stop within its shutdown timeout.
//
// Import it only from tests inside this module.
package testcluster

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/agent/link"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/gateway/gateway"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
)

// Options shape the cluster. The zero value is one master and two agents
// with 32 MiB of memory each, no disk and no gateway.
type Options struct {
	// Agents is the number of agents (default 2; -1 for none).
	Agents int
	// AgentMemory is each agent's memory (default 32 MiB).
	AgentMemory uint64
	// AgentDisk gives each agent a disk segment of this size in a
	// per-agent directory under t.TempDir (default none).
	AgentDisk uint64
	// Gateway starts the event gateway, bound to loopback ZMQ ports.
	Gateway bool
	// TLS runs every link with mTLS (issue 14): a development CA and
	// certificates in t.TempDir (see tls.go for the principals), each
	// component with its role's certificate, Conn as the admin and Client
	// as tenant "default" unless told otherwise.
	TLS bool
	// Tenants adds tenant certificates with Options.TLS.
	Tenants []string

	// Master, Agent and GatewayConfig adjust a component's configuration
	// after the harness has filled in addresses and test-friendly
	// timings, before it starts.
	Master        func(*masterapp.Config)
	Agent         func(i int, c *agentapp.Config)
	GatewayConfig func(*gateway.Config)

	// Logger receives every component's log (default: discarded).
	Logger *slog.Logger
}

// Cluster is a running in-process cluster.
type Cluster struct {
	t    testing.TB
	opts Options
	lg   *slog.Logger

	master  *component[*masterapp.Master]
	agents  []*component[*agentapp.Agent]
	gateway *component[*gateway.Gateway]

	hooks      hooks
	masterAddr string
	diskRoot   string // parent of the agents' disk directories, kept across restarts
	certDir    string // CA and certificates with Options.TLS
	ccOnce     sync.Once
	cc         *grpc.ClientConn
}

// component is one app running under its own context.
type component[T any] struct {
	name   string
	app    T
	cancel context.CancelFunc
	done   chan error
}

// stop cancels the component and waits for Run to return.
func (c *component[T]) stop(t testing.TB, within time.Duration) {
	t.Helper()
	if c == nil || c.cancel == nil {
		return
	}
	c.cancel()
	select {
	case err := <-c.done:
		if err != nil {
			t.Errorf("%s stopped with error: %v", c.name, err)
		}
	case <-time.After(within):
		t.Errorf("%s did not stop within %v", c.name, within)
	}
	c.cancel = nil
}

func run[T any](name string, app T, fn func(context.Context) error) *component[T] {
	ctx, cancel := context.WithCancel(context.Background())
	c := &component[T]{name: name, app: app, cancel: cancel, done: make(chan error, 1)}
	go func() { c.done <- fn(ctx) }()
	return c
}

// stopWithin bounds every component's shutdown; the harness shortens the
// components' own timeouts well below it.
const stopWithin = 20 * time.Second

// Start starts the cluster and waits until every agent's segments are
// registered with the master (and, with a gateway, until the gateway has
// taken its first snapshot from the master).
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if opts.Agents == 0 {
		opts.Agents = 2
	}
	if opts.Agents < 0 {
		opts.Agents = 0
	}
	if opts.AgentMemory == 0 {
		opts.AgentMemory = 32 << 20
	}
	lg := opts.Logger
	if lg == nil {
		lg = testutil.Logger()
	}
	c := &Cluster{t: t, opts: opts, lg: lg}
	if opts.AgentDisk > 0 {
		c.diskRoot = t.TempDir()
	}
	if opts.TLS {
		c.initCerts()
	}
	t.Cleanup(c.stopAll)
	c.startMaster()
	for i := range opts.Agents {
		c.agents = append(c.agents, nil)
		c.StartAgent(i)
	}
	c.WaitSegments(len(c.agents) * c.segmentsPerAgent())
	if opts.Gateway {
		c.StartGateway()
	}
	return c
}

func (c *Cluster) stopAll() {
	if c.gateway != nil {
		c.gateway.stop(c.t, stopWithin)
	}
	for _, a := range c.agents {
		a.stop(c.t, stopWithin)
	}
	c.master.stop(c.t, stopWithin)
	if c.cc != nil {
		_ = c.cc.Close()
	}
}

func (c *Cluster) startMaster() {
	c.t.Helper()
	cfg := masterapp.DefaultConfig()
	addr := c.masterAddr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	cfg.GRPCAddr, cfg.AdminAddr = addr, "127.0.0.1:0"
	// Liveness timings that survive a loaded 2-core machine running -race
	// (heartbeats arrived over 3 s late there); a test of agent loss
	// shortens them through Options.Master.
	cfg.HeartbeatInterval = 200 * time.Millisecond
	cfg.SuspectAfter = 5 * time.Second
	cfg.UnmountAfter = 15 * time.Second
	cfg.RecoveryGrace = 0
	cfg.ShutdownTimeout = 5 * time.Second
	cfg.Security = c.security(auth.RoleMaster, "master-1")
	if c.opts.Master != nil {
		c.opts.Master(&cfg)
	}
	m, err := masterapp.New(cfg, c.lg.With("component", "master"), c.hooks.masterOptions()...)
	if err != nil {
		c.t.Fatalf("master: %v", err)
	}
	if err := m.Server.Listen(); err != nil {
		c.t.Fatalf("master listen: %v", err)
	}
	c.masterAddr = m.Server.GRPCAddr()
	c.master = run("master", m, m.Run)
}

// StartAgent starts agent i (again, after StopAgent); its disk directory,
// if any, is kept across restarts.
func (c *Cluster) StartAgent(i int) {
	c.t.Helper()
	cfg := agentapp.DefaultConfig()
	cfg.Master = c.masterAddr
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.HostID = hostID(i)
	cfg.AgentID = fmt.Sprintf("agent-%d", i)
	cfg.Memory = config.ByteSize(c.opts.AgentMemory)
	cfg.Prefault = false
	cfg.ShutdownGrace = 100 * time.Millisecond
	cfg.ShutdownTimeout = 5 * time.Second
	if c.opts.AgentDisk > 0 {
		cfg.DiskDir = filepath.Join(c.diskRoot, fmt.Sprintf("agent-%d", i))
		cfg.DiskSize = config.ByteSize(c.opts.AgentDisk)
	}
	cfg.Security = c.security(auth.RoleAgent, cfg.HostID)
	if c.opts.Agent != nil {
		c.opts.Agent(i, &cfg)
	}
	if err := cfg.Validate(); err != nil {
		c.t.Fatalf("agent %d: %v", i, err)
	}
	a := agentapp.New(cfg, c.lg.With("component", cfg.AgentID), obs.NewRegistry(), c.hooks.agentOptions(i)...)
	c.agents[i] = run(cfg.AgentID, a, a.Run)
	select {
	case <-a.Ready():
	case err := <-c.agents[i].done:
		c.t.Fatalf("agent %d: %v", i, err)
	case <-time.After(stopWithin):
		c.t.Fatalf("agent %d did not mount its segments", i)
	}
	testutil.Eventually(c.t, stopWithin, func() bool { return a.Link().State() == link.StateConnected },
		"agent %d connected to the master", i)
}

// StopAgent stops agent i cleanly (it deregisters, as on SIGTERM).
func (c *Cluster) StopAgent(i int) {
	c.t.Helper()
	c.agents[i].stop(c.t, stopWithin)
}

// StartGateway starts the gateway (again, after StopGateway) and waits until
// it holds a master position (its first snapshot, or its restored state).
func (c *Cluster) StartGateway() {
	c.t.Helper()
	cfg := gateway.DefaultConfig()
	cfg.Master = c.masterAddr
	cfg.Pub, cfg.Replay, cfg.Snapshot = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
	cfg.AdminAddr, cfg.GRPCAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.BackendID = "testcluster"
	cfg.ReconnectMin, cfg.ReconnectMax = 20*time.Millisecond, 200*time.Millisecond
	cfg.ShutdownTimeout = 5 * time.Second
	cfg.Security = c.security(auth.RoleGateway, "gateway-1")
	if c.opts.GatewayConfig != nil {
		c.opts.GatewayConfig(&cfg)
	}
	g, err := gateway.New(cfg, gateway.Deps{}, c.lg.With("component", "gateway"))
	if err != nil {
		c.t.Fatalf("gateway: %v", err)
	}
	if err := g.Listen(); err != nil {
		c.t.Fatalf("gateway listen: %v", err)
	}
	c.gateway = run("gateway", g, g.Run)
	// Ready as /readyz means it: a master position, from a first snapshot
	// or restored from a state directory.
	testutil.Eventually(c.t, stopWithin, func() bool { return g.Status().MasterEpoch != 0 }, "the gateway to hold a master position")
}

// StopGateway stops the gateway cleanly.
func (c *Cluster) StopGateway() {
	c.t.Helper()
	c.gateway.stop(c.t, stopWithin)
}

// RestartMaster stops the master and starts a new one on the same address
// (a new epoch with an empty store, as after a process restart); agents
// re-register with it on their own. It waits for every running agent's
// segments to be registered again.
func (c *Cluster) RestartMaster() {
	c.t.Helper()
	c.master.stop(c.t, stopWithin)
	c.startMaster()
	running := 0
	for _, a := range c.agents {
		if a.cancel != nil {
			running++
		}
	}
	c.WaitSegments(running * c.segmentsPerAgent())
}

// segmentsPerAgent is each agent's segment count: memory, and a disk
// segment with Options.AgentDisk.
func (c *Cluster) segmentsPerAgent() int {
	if c.opts.AgentDisk > 0 {
		return 2
	}
	return 1
}

// WaitSegments waits until at least n segments are OK and healthy at the
// master: registered and their objects adopted (a segment is marked
// healthy only after its agent's allocation table was reconciled).
func (c *Cluster) WaitSegments(n int) {
	c.t.Helper()
	admin := masterv1.NewAdminServiceClient(c.Conn())
	testutil.EventuallyNoError(c.t, stopWithin, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		resp, err := admin.ListSegments(ctx, &masterv1.ListSegmentsRequest{})
		if err != nil {
			return err
		}
		ok := 0
		for _, s := range resp.GetSegments() {
			if s.GetLifecycle() == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK && s.GetHealth() == masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY {
				ok++
			}
		}
		if ok < n {
			return fmt.Errorf("%d of %d segments OK", ok, n)
		}
		return nil
	})
}

// Master is the running master app (its Store, Sessions and Registry are
// the real ones).
func (c *Cluster) Master() *masterapp.Master { return c.master.app }

// MasterAddr is the master's gRPC host:port.
func (c *Cluster) MasterAddr() string { return c.masterAddr }

// MasterAdminAddr is the master's admin HTTP host:port.
func (c *Cluster) MasterAdminAddr() string { return c.master.app.Server.AdminAddr() }

// Agent is agent i's app.
func (c *Cluster) Agent(i int) *agentapp.Agent { return c.agents[i].app }

// Agents is the number of agents (running or stopped).
func (c *Cluster) Agents() int { return len(c.agents) }

// Gateway is the gateway app; nil without Options.Gateway.
func (c *Cluster) Gateway() *gateway.Gateway {
	if c.gateway == nil {
		return nil
	}
	return c.gateway.app
}

// Conn is a shared gRPC connection to the master (as the admin with
// Options.TLS), closed with the cluster.
func (c *Cluster) Conn() *grpc.ClientConn {
	c.ccOnce.Do(func() { c.cc = c.DialAs(auth.RoleAdmin, Admin) })
	return c.cc
}

// Client returns an SDK client of the master, closed at the end of the
// test. mod, if given, adjusts its configuration.
func (c *Cluster) Client(t testing.TB, mod ...func(*client.Config)) *client.Client {
	t.Helper()
	cfg := client.Config{Master: c.masterAddr, TLS: c.ClientTLS(auth.RoleTenant, "default")}
	for _, m := range mod {
		m(&cfg)
	}
	cl, err := client.New(t.Context(), cfg)
	if err != nil {
		t.Fatalf("client: %v", err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}
