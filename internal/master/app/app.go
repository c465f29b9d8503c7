// Package app wires the master: configuration, the metadata core, the agent
// sessions and segment registry, and the gRPC services on one port.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/fastcall"
	"github.com/crescent-kv/crescent/internal/master/adminsvc"
	"github.com/crescent-kv/crescent/internal/master/changesvc"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/objectsvc"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/master/session"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
)

// Config is the master's configuration. Flag names are YAML keys; each flag
// is also read from CRESCENT_<FLAG>.
type Config struct {
	GRPCAddr string
	// LookupAddr is the lookup listener's address (internal/fastcall): ""
	// is a free port on the gRPC address's host, LookupOff none.
	// AdvertiseLookupAddr is what CallStream tells clients to dial: ""
	// names the bound port on the host the client dialed.
	LookupAddr          string
	AdvertiseLookupAddr string
	AdminAddr           string
	LogLevel            string
	MasterID            string
	ShutdownTimeout     time.Duration

	HeartbeatInterval time.Duration
	SuspectAfter      time.Duration
	UnmountAfter      time.Duration
	ReservedGrace     time.Duration
	AgentTimeout      time.Duration

	LeaseTTL           time.Duration
	PutTimeout         time.Duration
	ChangelogRetention int
	HighWatermark      float64
	LowWatermark       float64
	// EvictPolicy is what the background eviction does with a memory
	// segment's victims: "offload" (to a disk segment with room; the
	// default, which drops when there is no disk segment) or "drop".
	EvictPolicy string

	// Promotion (issue 17 item 3): PromoteThreshold counted reads of an
	// object with no memory replica queue it for a copy to memory (0
	// disables the counting; Prefetch still works); PromoteRate is the
	// background promotion's budget in bytes per second; PromoteQueue
	// bounds its queue (a key that finds it full is dropped).
	PromoteThreshold int
	PromoteRate      config.ByteSize
	PromoteQueue     int
	// BlankPool is how many blank reservations the master keeps per
	// segment and object size, so that a PutStart skips the agent's
	// Reserve (issue 18 item 2); 0 disables them.
	BlankPool int

	// WriteTokenTTL is how long PutStart's (and a drain's) write tokens last.
	WriteTokenTTL time.Duration
	// TokenKeyRotation is how often the data-plane token key is replaced
	// (agents are sent the current and previous keys). It must be at least
	// twice the longest token lifetime plus the new key's activation delay
	// (TokenKeyActivation), so no live token outlives its key.
	TokenKeyRotation time.Duration

	// MaxObjectSize is the largest object a PutStart may ask for; 0 means
	// the largest registered segment. Never above meta.MaxObjectSizeCap.
	MaxObjectSize config.ByteSize

	// Table and scan limits (issue 11): tenants held at once, segments one
	// agent may register, keys one RemoveByPrefix/Regex call examines,
	// Snapshot streams served at once.
	MaxTenants          int
	MaxSegmentsPerAgent int
	ScanBudget          int
	MaxSnapshots        int

	// RecoveryGrace is the least time after start ChangeService refuses
	// with MASTER_RECOVERING: a restarted master starts empty and rebuilds
	// its objects as agents re-register, and a gateway that resynced in
	// that window would publish `removed` for objects that are about to
	// come back, then `stored` again. Recovery lasts past it while any
	// agent is still registering (its table streaming in), up to
	// RecoveryMax. It should cover the agents' reconnect backoff (at most
	// 5 s by default) so that every agent has started registering by then.
	RecoveryGrace time.Duration
	// RecoveryMax bounds the recovery whatever the registrations do.
	RecoveryMax time.Duration

	// GCPercent is the Go GC target (debug.SetGCPercent). The master's heap
	// is mostly long-lived metadata and short-lived RPC garbage; collecting
	// at 100 % growth spends a third of the CPU of a batch get in the GC.
	// Bound memory with GOMEMLIMIT instead.
	GCPercent int

	// StateDir keeps a single master's unsettled segments across its
	// restarts (statefile.go); "" keeps nothing. Not used with HA.
	StateDir string

	// Security is TLS, authorization, protected mode and pprof (issue 14).
	Security server.Security

	// HA is leader election on etcd (issue 15).
	HA HA
}

// LookupOff is Config.LookupAddr for no lookup listener.
const LookupOff = "off"

// DefaultConfig returns the defaults of ARCHITECTURE.md.
func DefaultConfig() Config {
	return Config{
		GRPCAddr:           ":50051",
		AdminAddr:          ":9003",
		LogLevel:           "info",
		ShutdownTimeout:    10 * time.Second,
		HeartbeatInterval:  time.Second,
		SuspectAfter:       3 * time.Second,
		UnmountAfter:       30 * time.Second,
		ReservedGrace:      60 * time.Second,
		AgentTimeout:       5 * time.Second,
		LeaseTTL:           10 * time.Second,
		PutTimeout:         30 * time.Second,
		WriteTokenTTL:      5 * time.Minute,
		TokenKeyRotation:   time.Hour,
		ChangelogRetention: 1 << 20,
		HighWatermark:      0.90,
		LowWatermark:       0.80,
		EvictPolicy:        string(meta.EvictOffload),
		PromoteThreshold:   meta.DefaultPromoteThreshold,
		PromoteRate:        128 << 20,
		PromoteQueue:       4096,
		BlankPool:          8,
		GCPercent:          400,
		RecoveryGrace:      3 * time.Second,
		RecoveryMax:        2 * time.Minute,

		MaxTenants:          1 << 16,
		MaxSegmentsPerAgent: session.DefaultMaxSegmentsPerAgent,
		ScanBudget:          meta.DefaultScanBudget,
		MaxSnapshots:        changesvc.DefaultMaxSnapshots,

		Security: server.DefaultSecurity(),
		HA:       HA{EtcdPrefix: "/crescent/master/", EtcdLeaseTTL: 5 * time.Second},
	}
}

// RegisterFlags binds every field to fs with its current value as default.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.GRPCAddr, "grpc-addr", c.GRPCAddr, "gRPC listen address (ObjectService, ChangeService, AdminService, SegmentService)")
	fs.StringVar(&c.LookupAddr, "lookup-addr", c.LookupAddr, "lookup listener address: the SDK's lookups (GetReplicaList, Exist and their batches) framed on plain TCP, TLS with the gRPC listener's certificates, the same authorization; empty: a free port on the grpc-addr host; off: none")
	fs.StringVar(&c.AdvertiseLookupAddr, "advertise-lookup-addr", c.AdvertiseLookupAddr, "host:port clients dial for lookup-addr (default: the bound port on the host they dialed the master at)")
	fs.StringVar(&c.AdminAddr, "admin-addr", c.AdminAddr, "admin HTTP listen address (/healthz, /readyz, /metrics)")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	fs.StringVar(&c.MasterID, "master-id", c.MasterID, "name of this master (default: the gRPC address)")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "graceful shutdown limit before a hard stop")
	fs.DurationVar(&c.HeartbeatInterval, "heartbeat-interval", c.HeartbeatInterval, "how often agents heartbeat")
	fs.DurationVar(&c.SuspectAfter, "suspect-after", c.SuspectAfter, "missed heartbeats for this long mark an agent's segments SUSPECTED")
	fs.DurationVar(&c.UnmountAfter, "unmount-after", c.UnmountAfter, "missed heartbeats for this long unmount an agent's segments and remove their replicas")
	fs.DurationVar(&c.ReservedGrace, "reserved-grace", c.ReservedGrace, "agents free RESERVED allocations nobody sealed after this long")
	fs.DurationVar(&c.AgentTimeout, "agent-timeout", c.AgentTimeout, "timeout of one reserve/seal/release request to an agent")
	fs.DurationVar(&c.LeaseTTL, "lease-ttl", c.LeaseTTL, "read lease granted by GetReplicaList and Exist")
	fs.DurationVar(&c.PutTimeout, "put-timeout", c.PutTimeout, "a PutStart not ended within this is expired (its reservations released, its quota refunded) and may be preempted; below reserved-grace")
	fs.DurationVar(&c.WriteTokenTTL, "write-token-ttl", c.WriteTokenTTL, "lifetime of the write tokens PutStart hands out")
	fs.DurationVar(&c.TokenKeyRotation, "token-key-rotation", c.TokenKeyRotation,
		"how often the data-plane token signing key is rotated; at least 2 x (max(lease-ttl, write-token-ttl) + its activation delay, 1/20 of it up to 10s)")
	fs.Var(&c.MaxObjectSize, "max-object-size", "largest object a PutStart may ask for (e.g. 1GiB), larger ones fail with OBJECT_TOO_LARGE; 0 = the largest registered segment; at most 64GiB")
	fs.IntVar(&c.MaxTenants, "max-tenants", c.MaxTenants, "tenants held at once (those with objects or a quota); a new one beyond this fails with LIMIT_EXCEEDED")
	fs.IntVar(&c.MaxSegmentsPerAgent, "max-segments-per-agent", c.MaxSegmentsPerAgent, "segments one agent may register or mount; more are refused with LIMIT_EXCEEDED")
	fs.IntVar(&c.ScanBudget, "scan-budget", c.ScanBudget, "keys one RemoveByPrefix/RemoveByRegex call examines before it returns a page token")
	fs.IntVar(&c.MaxSnapshots, "max-snapshots", c.MaxSnapshots, "ChangeService Snapshot streams served at once; more fail with LIMIT_EXCEEDED")
	fs.IntVar(&c.ChangelogRetention, "changelog-retention", c.ChangelogRetention, "change records retained for Watch resumption")
	fs.Float64Var(&c.HighWatermark, "high-watermark", c.HighWatermark, "segment use fraction that starts eviction")
	fs.Float64Var(&c.LowWatermark, "low-watermark", c.LowWatermark, "segment use fraction eviction stops at")
	fs.StringVar(&c.EvictPolicy, "evict-policy", c.EvictPolicy,
		"what the background eviction does with a memory segment's victims: offload (move them to a disk segment with room below its high watermark, same host first; dropped when none has room or when there is no disk segment) or drop; disk victims and those of a put that found no room are always dropped")
	fs.IntVar(&c.PromoteThreshold, "promote-threshold", c.PromoteThreshold, "reads of an object with no memory replica (a decaying count) that queue it for a copy to memory; 0 disables promotion on reads (Prefetch still works); at most 255")
	fs.Var(&c.PromoteRate, "promote-rate", "bytes per second the background promotion may copy to memory (e.g. 128MiB); it never fills a memory segment past low-watermark")
	fs.IntVar(&c.BlankPool, "blank-pool", c.BlankPool, "blank reservations kept at agents per segment and object size, so that a PutStart needs no Reserve round trip; used within half of reserved-grace or released; 0 disables them; at most 64")
	fs.IntVar(&c.PromoteQueue, "promote-queue", c.PromoteQueue, "keys waiting for promotion at most; more are dropped (crescent_master_promotion_drops_total)")
	fs.DurationVar(&c.RecoveryGrace, "recovery-grace", c.RecoveryGrace, "after start, ChangeService waits at least this long for agents to re-register before serving, and then while any agent is still registering (0 disables)")
	fs.DurationVar(&c.RecoveryMax, "recovery-max", c.RecoveryMax, "the longest ChangeService waits for agents to finish registering after start")
	fs.StringVar(&c.StateDir, "state-dir", c.StateDir, "directory for what a single master's restart must keep: the segments where a client's removal is not yet carried out at the agent (unsettled.json), distrusted after the restart so that those objects are not served again; empty: nothing kept; not used with --etcd-endpoints (etcd keeps them)")
	fs.IntVar(&c.GCPercent, "gc-percent", c.GCPercent, "Go GC target percentage (GOGC); bound memory with the GOMEMLIMIT environment variable")
	c.Security.RegisterFlags(fs)
	fs.StringVar(&c.HA.EtcdEndpoints, "etcd-endpoints", c.HA.EtcdEndpoints, "comma-separated etcd client addresses: masters elect a leader there and the others stand by, answering NOT_LEADER with the leader's address (empty: a single master)")
	fs.StringVar(&c.HA.EtcdPrefix, "etcd-prefix", c.HA.EtcdPrefix, "etcd key prefix of this cluster's masters (ends in /)")
	fs.DurationVar(&c.HA.EtcdLeaseTTL, "etcd-lease-ttl", c.HA.EtcdLeaseTTL, "leader lease in whole seconds: a dead leader is replaced after about this long; a leader cut off from etcd stops acknowledging before it ends")
	fs.StringVar(&c.HA.EtcdTLSCA, "etcd-tls-ca", c.HA.EtcdTLSCA, "CA certificate (PEM) that signed etcd's server certificate; any etcd-tls-* flag turns TLS on for etcd")
	fs.StringVar(&c.HA.EtcdTLSCert, "etcd-tls-cert", c.HA.EtcdTLSCert, "this master's client certificate (PEM) for etcd's --client-cert-auth, with etcd-tls-key")
	fs.StringVar(&c.HA.EtcdTLSKey, "etcd-tls-key", c.HA.EtcdTLSKey, "the key of etcd-tls-cert (PEM)")
	fs.StringVar(&c.HA.AdvertiseAddr, "advertise-addr", c.HA.AdvertiseAddr, "gRPC host:port clients are redirected to while this master leads (default: the host name and the grpc-addr port)")
}

// Validate reports every invalid field.
func (c *Config) Validate() error {
	var errs []error
	if c.GRPCAddr == "" {
		errs = append(errs, errors.New("grpc-addr must be set"))
	}
	if c.LookupAddr != "" && c.LookupAddr != LookupOff {
		if _, _, err := net.SplitHostPort(c.LookupAddr); err != nil {
			errs = append(errs, fmt.Errorf("lookup-addr %q: %w", c.LookupAddr, err))
		}
	}
	if c.AdvertiseLookupAddr != "" {
		if _, _, err := net.SplitHostPort(c.AdvertiseLookupAddr); err != nil {
			errs = append(errs, fmt.Errorf("advertise-lookup-addr %q: %w", c.AdvertiseLookupAddr, err))
		}
		if c.LookupAddr == LookupOff {
			errs = append(errs, errors.New("advertise-lookup-addr is set while lookup-addr is off"))
		}
	}
	pos := map[string]time.Duration{
		"heartbeat-interval": c.HeartbeatInterval, "suspect-after": c.SuspectAfter, "unmount-after": c.UnmountAfter,
		"reserved-grace": c.ReservedGrace, "agent-timeout": c.AgentTimeout, "lease-ttl": c.LeaseTTL, "put-timeout": c.PutTimeout,
		"shutdown-timeout": c.ShutdownTimeout, "write-token-ttl": c.WriteTokenTTL, "token-key-rotation": c.TokenKeyRotation,
	}
	for name, d := range pos {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("%s must be > 0, got %v", name, d))
		}
	}
	if c.SuspectAfter <= c.HeartbeatInterval {
		errs = append(errs, fmt.Errorf("suspect-after (%v) must exceed heartbeat-interval (%v)", c.SuspectAfter, c.HeartbeatInterval))
	}
	if c.UnmountAfter <= c.SuspectAfter {
		errs = append(errs, fmt.Errorf("unmount-after (%v) must exceed suspect-after (%v)", c.UnmountAfter, c.SuspectAfter))
	}
	if c.PutTimeout >= c.ReservedGrace {
		// The master must release an abandoned put's reservations (and
		// refund its quota) before agents reclaim them on their own.
		errs = append(errs, fmt.Errorf("put-timeout (%v) must be below reserved-grace (%v)", c.PutTimeout, c.ReservedGrace))
	}
	if ttl, least := max(c.LeaseTTL, c.WriteTokenTTL), minTokenKeyRotation(c.LeaseTTL, c.WriteTokenTTL); c.TokenKeyRotation < least {
		// A token signed just before a rotation's key activates lives its
		// TTL under the previous key, which agents drop one rotation later.
		errs = append(errs, fmt.Errorf("token-key-rotation (%v) must be at least %v: twice the longest token lifetime (max of lease-ttl and write-token-ttl: %v) plus the new key's activation delay",
			c.TokenKeyRotation, least, ttl))
	}
	if c.MaxObjectSize > meta.MaxObjectSizeCap {
		errs = append(errs, fmt.Errorf("max-object-size (%d) must be at most %d (64GiB)", uint64(c.MaxObjectSize), uint64(meta.MaxObjectSizeCap)))
	}
	if c.MaxTenants < 1 || c.MaxTenants > meta.MaxTenantsLimit {
		errs = append(errs, fmt.Errorf("max-tenants must be 1..%d, got %d", meta.MaxTenantsLimit, c.MaxTenants))
	}
	for name, v := range map[string]int{"max-segments-per-agent": c.MaxSegmentsPerAgent, "scan-budget": c.ScanBudget, "max-snapshots": c.MaxSnapshots} {
		if v < 1 {
			errs = append(errs, fmt.Errorf("%s must be >= 1, got %d", name, v))
		}
	}
	if c.RecoveryGrace < 0 {
		errs = append(errs, fmt.Errorf("recovery-grace must be >= 0, got %v", c.RecoveryGrace))
	}
	if c.RecoveryMax < c.RecoveryGrace {
		errs = append(errs, fmt.Errorf("recovery-max (%v) must be at least recovery-grace (%v)", c.RecoveryMax, c.RecoveryGrace))
	}
	if c.GCPercent < 25 {
		errs = append(errs, fmt.Errorf("gc-percent must be >= 25, got %d", c.GCPercent))
	}
	if c.ChangelogRetention < 1024 {
		errs = append(errs, fmt.Errorf("changelog-retention must be >= 1024, got %d", c.ChangelogRetention))
	}
	if !(c.LowWatermark > 0 && c.LowWatermark < c.HighWatermark && c.HighWatermark <= 1) {
		errs = append(errs, fmt.Errorf("want 0 < low-watermark (%v) < high-watermark (%v) <= 1", c.LowWatermark, c.HighWatermark))
	}
	if _, err := meta.ParseEvictPolicy(c.EvictPolicy); err != nil {
		errs = append(errs, err)
	}
	if c.BlankPool < 0 || c.BlankPool > 64 {
		errs = append(errs, fmt.Errorf("blank-pool must be 0..64, got %d", c.BlankPool))
	}
	if c.PromoteThreshold < 0 || c.PromoteThreshold > 255 {
		errs = append(errs, fmt.Errorf("promote-threshold must be 0..255, got %d", c.PromoteThreshold))
	}
	if c.PromoteRate == 0 {
		errs = append(errs, errors.New("promote-rate must be > 0"))
	}
	if c.PromoteQueue < 1 {
		errs = append(errs, fmt.Errorf("promote-queue must be >= 1, got %d", c.PromoteQueue))
	}
	if err := c.Security.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.HA.enabled() {
		if hc, err := c.HA.haConfig(c.GRPCAddr); err != nil {
			errs = append(errs, err)
		} else if err := hc.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// promoteThreshold maps the flag (0 disables) to meta's (negative
// disables, 0 is the default).
// blankPool maps the flag (0 disables) to meta.Config's (0 is the
// default, negative disables).
func blankPool(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

func promoteThreshold(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// TokenKeyActivation is how long after a rotation the new token key starts
// signing: the time the re-sent Settings have to reach every agent (the
// previous key signs meanwhile). 1/20 of the rotation interval, at most 10 s.
func TokenKeyActivation(rotation time.Duration) time.Duration {
	return min(rotation/20, 10*time.Second)
}

// minTokenKeyRotation is the shortest rotation interval Validate accepts for
// the token lifetimes: 2 x (longest TTL + activation delay), solved for the
// rotation (the activation delay is a twentieth of it, up to 10 s).
func minTokenKeyRotation(leaseTTL, writeTTL time.Duration) time.Duration {
	ttl := max(leaseTTL, writeTTL)
	if r := 2 * (ttl + 10*time.Second); TokenKeyActivation(r) == 10*time.Second {
		return r
	}
	return 20 * ttl / 9 // r >= 2(ttl + r/20)  <=>  r >= 20 ttl / 9
}

// Master is a wired master: the metadata store, the segment registry and
// agent sessions, and the gRPC services, on one server.
type Master struct {
	cfg      Config
	lg       *slog.Logger
	Server   *server.Server
	Store    *meta.Store
	Sessions *session.Manager
	Registry *registry.Registry
	Identity cluster.Identity

	rec     *recovery
	changes *changesvc.Service
	objects *objectsvc.Service
	creds   *server.Credentials
	// lookupAddr is the lookup listener's bound address while it serves;
	// lookup the listener, once started.
	lookupAddr atomic.Pointer[string]
	lookup     atomic.Pointer[fastcall.Server]
}

// LookupStats are the lookup listener's counters (zero before it starts).
func (m *Master) LookupStats() fastcall.Stats {
	if s := m.lookup.Load(); s != nil {
		return s.Stats()
	}
	return fastcall.Stats{}
}

// LookupAddr is the bound address of the lookup listener, "" while it
// does not serve.
func (m *Master) LookupAddr() string {
	if a := m.lookupAddr.Load(); a != nil {
		return *a
	}
	return ""
}

// lookupMetrics export the lookup listener's counters.
func lookupMetrics(stats func() fastcall.Stats) []prometheus.Collector {
	counter := func(name, help string, v func(fastcall.Stats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(v(stats())) })
	}
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_lookup_connections",
			Help: "Connections open on the lookup listener (--lookup-addr).",
		}, func() float64 { return float64(stats().Conns) }),
		counter("crescent_master_lookup_calls_total", "Calls answered on the lookup listener (each also counted under its method, as a unary call).",
			func(s fastcall.Stats) uint64 { return s.Calls }),
		counter("crescent_master_lookup_refused_total", "Connections to the lookup listener closed at once: over its connection caps.",
			func(s fastcall.Stats) uint64 { return s.Refused }),
		counter("crescent_master_lookup_dropped_total", "Connections to the lookup listener ended for breaking its protocol.",
			func(s fastcall.Stats) uint64 { return s.Dropped }),
	}
}

// listenLookup opens the lookup listener (internal/fastcall) and returns
// it with the address CallStream advertises; nil when it is off.
func (m *Master) listenLookup() (net.Listener, string, error) {
	addr := m.cfg.LookupAddr
	switch addr {
	case LookupOff:
		return nil, "", nil
	case "":
		host, _, err := net.SplitHostPort(m.Server.GRPCAddr())
		if err != nil {
			host = ""
		}
		addr = net.JoinHostPort(host, "0")
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("lookup listen %s: %w", addr, err)
	}
	if err := m.creds.CheckListen("lookup-addr", lis.Addr()); err != nil {
		lis.Close()
		return nil, "", err
	}
	adv := m.cfg.AdvertiseLookupAddr
	if adv == "" {
		_, port, _ := net.SplitHostPort(lis.Addr().String())
		adv = ":" + port
	}
	if m.creds.Secure() {
		// The gRPC listener's certificates, reloaded per handshake; each
		// call is authorized from the connection's certificate.
		lis = xfer.TLSListener(lis, m.creds.ServerTLS())
	}
	return lis, adv, nil
}

// New builds the master. It starts nothing; its only I/O is reading the
// TLS and token files cfg.Security names. opts are added to the gRPC
// server's options (tests install interceptors); they run after the
// authorization interceptor.
func New(cfg Config, lg *slog.Logger, opts ...grpc.ServerOption) (*Master, error) {
	// A fresh epoch per process lifetime: agents fence older masters'
	// commands by it and the change log's revisions restart under it.
	return newMaster(cfg, lg, uint64(time.Now().UnixNano()), opts...)
}

// newMaster is New under a given epoch (an elected leader's term's).
func newMaster(cfg Config, lg *slog.Logger, epoch uint64, opts ...grpc.ServerOption) (*Master, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	creds, err := cfg.Security.Load(lg)
	if err != nil {
		return nil, err
	}
	reg := obs.NewRegistry()
	m := &Master{}
	reg.MustRegister(lookupMetrics(m.LookupStats)...)
	id := cluster.Identity{
		MasterID: cfg.MasterID,
		Epoch:    epoch,
		Keys:     token.NewRing(TokenKeyActivation(cfg.TokenKeyRotation), nil),
	}
	if id.MasterID == "" {
		id.MasterID = cfg.GRPCAddr
	}
	segReg, err := registry.New(registry.Config{}, registry.Deps{Metrics: reg}, lg.With("part", "registry"))
	if err != nil {
		return nil, err
	}
	sessions, err := session.New(session.Config{
		HeartbeatInterval: cfg.HeartbeatInterval,
		SuspectAfter:      cfg.SuspectAfter,
		UnmountAfter:      cfg.UnmountAfter,
		ReservedGrace:     cfg.ReservedGrace,
		RequestTimeout:    cfg.AgentTimeout,
		TokenKeyRotation:  cfg.TokenKeyRotation,

		MaxSegmentsPerAgent: cfg.MaxSegmentsPerAgent,
	}, session.Deps{Identity: id, Registry: segReg, Metrics: reg}, lg.With("part", "sessions"))
	if err != nil {
		return nil, err
	}
	store, err := meta.New(meta.Config{
		LeaseTTL:        cfg.LeaseTTL,
		WriteTokenTTL:   cfg.WriteTokenTTL,
		PutPreemptAfter: cfg.PutTimeout,
		MaxObjectSize:   uint64(cfg.MaxObjectSize),
		HighWatermark:   cfg.HighWatermark,
		LowWatermark:    cfg.LowWatermark,
		EvictPolicy:     meta.EvictPolicy(cfg.EvictPolicy),
		ChangeRetention: cfg.ChangelogRetention,
		MaxTenants:      cfg.MaxTenants,
		ScanBudget:      cfg.ScanBudget,

		PromoteThreshold:   promoteThreshold(cfg.PromoteThreshold),
		PromoteBytesPerSec: uint64(cfg.PromoteRate),
		PromoteQueue:       cfg.PromoteQueue,

		BlankPool:   blankPool(cfg.BlankPool),
		BlankMaxAge: cfg.ReservedGrace / 2,
	}, meta.Deps{Registry: segReg, Agents: sessions, Identity: id, Metrics: reg}, lg.With("part", "meta"))
	if err != nil {
		return nil, err
	}
	// The sessions call back into the metadata on registration; the
	// metadata needs the sessions to reach agents. Close the cycle before
	// anything runs.
	sessions.SetMetadata(store)
	admin, err := adminsvc.New(adminsvc.Deps{Identity: id, Registry: segReg, Meta: store, Epoch: store.Epoch}, lg.With("part", "admin"))
	if err != nil {
		return nil, err
	}
	rec, err := newRecovery(cfg.RecoveryGrace, cfg.RecoveryMax, sessions.Registering, reg, lg)
	if err != nil {
		return nil, err
	}
	srv := server.New(server.Config{
		GRPCAddr: cfg.GRPCAddr, AdminAddr: cfg.AdminAddr, ShutdownTimeout: cfg.ShutdownTimeout,
		Credentials: creds, Table: authTable(),
		// Refusals while the agents re-register are expected (every
		// gateway and client retries them): debug, not warnings.
		QuietReasons: []string{rpcerr.ReasonName(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING)},
	}, lg, reg, append([]grpc.ServerOption{
		grpc.ChainStreamInterceptor(rec.streamInterceptor),
		// server.UnaryInterceptors, not grpc.ChainUnaryInterceptor: the calls
		// carried on CallStream must meet these too (objectsvc.Config.Unary).
		server.UnaryInterceptors(rec.unaryInterceptor, removeAllForce),
		// Calls run on long-lived worker goroutines, whose stacks have
		// grown to what the handlers need, instead of a new goroutine
		// each that grows its stack anew (runtime.newstack was 5 % of the
		// CPU of BenchmarkLargeObjects' puts, 2 % with workers; issue 18
		// item 2). A call that finds every worker busy (agent sessions
		// and gateway watches hold theirs) gets a goroutine as before.
		// The workers live until the server stops: Run and discard stop
		// it on every path.
		grpc.NumStreamWorkers(uint32(streamWorkersPerCPU * runtime.GOMAXPROCS(0))),
	}, opts...)...)
	// The services authTable covers (authServices).
	objects := objectsvc.New(objectsvc.Config{Unary: srv.Unary()}, store)
	objects.Register(srv.GRPC)
	changes := changesvc.New(changesvc.Config{MaxSnapshots: cfg.MaxSnapshots}, store)
	changes.Register(srv.GRPC)
	masterv1.RegisterAdminServiceServer(srv.GRPC, admin)
	masterv1.RegisterSegmentServiceServer(srv.GRPC, sessions)
	m.cfg, m.lg, m.Server, m.Store, m.Sessions, m.Registry, m.Identity = cfg, lg, srv, store, sessions, segReg, id
	m.rec, m.changes, m.objects, m.creds = rec, changes, objects, creds
	return m, nil
}

// promote makes a standby's master the leader's under the term's epoch:
// the store keeps the objects it followed, but none on the segments an
// earlier leader left unsettled (meta.Store.Distrust), and starts its
// change log over in that epoch; the sessions stamp the epoch on Settings
// and commands.
func (m *Master) promote(epoch uint64, unsettled []meta.UnsettledSegment) {
	m.Identity.Epoch = epoch
	m.Store.Distrust(unsettled)
	m.Store.Promote(m.Identity)
	m.Sessions.SetEpoch(epoch)
}

// discard releases a master that will not run (a standby's, when the
// process stops before it was elected).
func (m *Master) discard() {
	m.Server.GRPC.Stop() // never served: this ends its stream workers
	_ = m.Sessions.Close()
	_ = m.Store.Close()
}

// streamWorkersPerCPU sizes the master's gRPC stream workers.
const streamWorkersPerCPU = 4

// Run serves until ctx ends, then stops the server (which ends the agent
// sessions), the sessions and the store.
func (m *Master) Run(ctx context.Context) error {
	if err := m.Server.Listen(); err != nil {
		m.Server.GRPC.Stop() // never served: this ends its stream workers
		return err
	}
	return m.run(ctx)
}

// run is Run on a server already listening.
func (m *Master) run(ctx context.Context) error {
	debug.SetGCPercent(m.cfg.GCPercent)
	m.rec.start(time.Now())
	m.lg.Info("master starting", "master_id", m.Identity.MasterID, "epoch", m.Identity.Epoch, "grpc", m.Server.GRPCAddr())
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, 4)
	runs := map[string]func(context.Context) error{"store": m.Store.Run, "sessions": m.Sessions.Run, "recovery": m.rec.run}
	lis, adv, err := m.listenLookup()
	if err != nil {
		return err
	}
	if lis != nil {
		bound := lis.Addr().String()
		m.lookupAddr.Store(&bound)
		m.objects.SetLookupAddr(adv)
		m.lg.Info("lookup listener serving", "addr", bound, "advertised", adv)
		fc := fastcall.NewServer(fastcall.Config{}, m.objects.Answer, m.lg.With("part", "lookup"))
		m.lookup.Store(fc)
		runs["lookup"] = func(ctx context.Context) error {
			defer func() {
				m.objects.SetLookupAddr("")
				m.lookupAddr.Store(nil)
			}()
			return fc.Serve(ctx, lis)
		}
	}
	for name, run := range runs {
		wg.Go(func() {
			if err := run(ctx); err != nil && ctx.Err() == nil {
				errc <- fmt.Errorf("%s: %w", name, err)
				cancel()
			}
		})
	}
	// Agent Connect streams, gateway Watch streams and clients'
	// CallStreams never end on their own, so GracefulStop would wait them
	// out until its hard-stop timer. End them first, then stop the server.
	srvCtx, srvCancel := context.WithCancel(context.WithoutCancel(ctx))
	defer srvCancel()
	go func() {
		<-ctx.Done()
		m.changes.Close()
		m.objects.Close()
		_ = m.Sessions.Close()
		srvCancel()
	}()
	err = m.Server.Run(srvCtx)
	cancel()
	wg.Wait()
	_ = m.Sessions.Close()
	_ = m.Store.Close()
	if err == nil {
		select {
		case err = <-errc:
		default:
		}
	}
	return err
}

// Run builds the master and serves until ctx ends; with etcd endpoints
// configured it campaigns for leadership and serves only while it leads
// (runHA).
func Run(ctx context.Context, cfg Config, lg *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if cfg.HA.enabled() {
		return runHA(ctx, cfg, lg)
	}
	m, err := New(cfg, lg)
	if err != nil {
		return err
	}
	if cfg.StateDir != "" {
		l, unsettled, err := openFileLedger(cfg.StateDir)
		if err != nil {
			m.discard()
			return err
		}
		m.Store.Distrust(unsettled)
		m.Store.SetLedger(l, unsettled)
	}
	return m.Run(ctx)
}
