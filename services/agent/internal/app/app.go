// Package app wires the agent: configuration, the segments (memory and
// disk), the data plane on the gRPC port and on the bulk transfer listener,
// and the link to the master.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/services/agent/internal/dataplane"
	"github.com/crescent-kv/crescent/services/agent/internal/link"
	"github.com/crescent-kv/crescent/services/agent/internal/segment"
	"github.com/prometheus/client_golang/prometheus"
)

// Version is reported to the master in Register.
var Version = "dev"

// Config is the agent's configuration. Flag names are YAML keys; each flag
// is also read from CRESCENT_<FLAG>.
type Config struct {
	Master         string
	GRPCAddr       string
	AdminAddr      string
	AdvertiseAddr  string
	HostID         string
	AgentID        string
	Memory         config.ByteSize
	MemorySegments int
	// Prefault writes every page of the memory segments at start (see
	// segment.Prefault), so puts never pay first-touch page faults.
	Prefault        bool
	DiskDir         string
	DiskSize        config.ByteSize
	ShutdownGrace   time.Duration
	ShutdownTimeout time.Duration
	ReadChunk       config.ByteSize
	LogLevel        string
	// TransferAddr is the bulk transfer listener's address; "" derives
	// it (the gRPC host, an ephemeral port), "off" disables the listener.
	TransferAddr          string
	AdvertiseTransferAddr string
	// Limits of the bulk transfer listener (dataplane.TransferConfig).
	TransferMaxConns       int
	TransferMaxConnsPerIP  int
	TransferMaxHeaderBytes config.ByteSize
	TransferMaxItems       int
	TransferIdleTimeout    time.Duration
	TransferIOTimeout      time.Duration
	// VerifyDisk checks every sealed allocation of a reopened disk
	// segment against its checksum before registering (see
	// segment.VerifySealed); corrupt ones are dropped and so reported
	// lost to the master.
	VerifyDisk bool
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		GRPCAddr:        ":50052",
		AdminAddr:       ":9004",
		HostID:          host,
		Memory:          1 << 30,
		MemorySegments:  1,
		Prefault:        true,
		VerifyDisk:      true,
		ShutdownGrace:   5 * time.Second,
		ShutdownTimeout: 10 * time.Second,
		ReadChunk:       dataplane.DefaultChunkSize,
		LogLevel:        "info",

		TransferMaxConns:       dataplane.DefaultTransferMaxConns,
		TransferMaxConnsPerIP:  dataplane.DefaultTransferMaxConnsPerIP,
		TransferMaxHeaderBytes: xfer.MaxHeaderBytes,
		TransferMaxItems:       dataplane.DefaultTransferMaxItemsInFlight,
		TransferIdleTimeout:    dataplane.DefaultTransferIdleTimeout,
		TransferIOTimeout:      dataplane.DefaultTransferIOTimeout,
	}
}

// RegisterFlags binds every field to fs with its current value as default.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Master, "master", c.Master, "master gRPC address (host:port)")
	fs.StringVar(&c.GRPCAddr, "grpc-addr", c.GRPCAddr, "gRPC listen address (DataService)")
	fs.StringVar(&c.AdminAddr, "admin-addr", c.AdminAddr, "admin HTTP listen address (/healthz, /readyz, /metrics)")
	fs.StringVar(&c.AdvertiseAddr, "advertise-addr", c.AdvertiseAddr, "host:port clients dial for DataService (default: the bound gRPC address, with the host name for an unspecified IP)")
	fs.StringVar(&c.TransferAddr, "transfer-addr", c.TransferAddr, "bulk transfer listen address (the fast data path beside DataService; default: the gRPC host with an ephemeral port; \"off\" disables it)")
	fs.StringVar(&c.AdvertiseTransferAddr, "advertise-transfer-addr", c.AdvertiseTransferAddr, "host:port clients dial for bulk transfers (default: the host of --advertise-addr if set, else the bound address with the host name for an unspecified IP, with the bound port)")
	fs.IntVar(&c.TransferMaxConns, "transfer-max-connections", c.TransferMaxConns, "open bulk transfer connections at most; one more is refused with RESOURCE_EXHAUSTED LIMIT_EXCEEDED")
	fs.IntVar(&c.TransferMaxConnsPerIP, "transfer-max-connections-per-ip", c.TransferMaxConnsPerIP, "open bulk transfer connections from one remote IP address at most")
	fs.Var(&c.TransferMaxHeaderBytes, "transfer-max-header-bytes", "largest bulk transfer request header (at most 1MiB, the protocol's limit; 4096 items with 100-byte tokens need about 600KiB)")
	fs.IntVar(&c.TransferMaxItems, "transfer-max-items-in-flight", c.TransferMaxItems, "items of the bulk transfer requests served at once, over all connections (at least 4096, one full request); a request past it waits up to --transfer-io-timeout, then is refused with RESOURCE_EXHAUSTED LIMIT_EXCEEDED")
	fs.DurationVar(&c.TransferIdleTimeout, "transfer-idle-timeout", c.TransferIdleTimeout, "close a bulk transfer connection that starts no request for this long")
	fs.DurationVar(&c.TransferIOTimeout, "transfer-io-timeout", c.TransferIOTimeout, "cut a bulk transfer request whose peer takes longer than this to send its header, or any 4MiB of payload, or to take the answer (the minimum progress asked of a peer)")
	fs.StringVar(&c.HostID, "host-id", c.HostID, "host this agent runs on; replicas of one object are spread across hosts")
	fs.StringVar(&c.AgentID, "agent-id", c.AgentID, "stable agent id (default: host-id:port)")
	fs.Var(&c.Memory, "memory", "memory to contribute (e.g. 4GiB); 0 for none")
	fs.IntVar(&c.MemorySegments, "memory-segments", c.MemorySegments, "split --memory into this many segments")
	fs.BoolVar(&c.Prefault, "prefault", c.Prefault, "touch every page of --memory at start, before registering, so puts never pay first-touch page faults (start-up takes longer, memory is committed at once)")
	fs.StringVar(&c.DiskDir, "disk-dir", c.DiskDir, "directory of the disk segment (empty: no disk segment)")
	fs.Var(&c.DiskSize, "disk-size", "size of the disk segment (e.g. 64GiB)")
	fs.BoolVar(&c.VerifyDisk, "verify-disk", c.VerifyDisk, "on restart, read every sealed object of the disk segment and check its checksum before registering; corrupt objects are dropped (reported lost) instead of served (start-up reads the whole used part of the segment)")
	fs.DurationVar(&c.ShutdownGrace, "shutdown-grace", c.ShutdownGrace, "after SIGTERM, keep serving reads this long after announcing the unmount")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "graceful gRPC stop limit before a hard stop")
	fs.Var(&c.ReadChunk, "read-chunk", "DataService.Read chunk size when the client does not choose")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
}

// Validate reports every invalid field.
func (c *Config) Validate() error {
	var errs []error
	if c.Master == "" {
		errs = append(errs, errors.New("master must be set (the master's gRPC host:port)"))
	}
	if c.GRPCAddr == "" {
		errs = append(errs, errors.New("grpc-addr must be set"))
	}
	if c.HostID == "" {
		errs = append(errs, errors.New("host-id must be set (the host name is unknown)"))
	}
	if c.TransferAddr != "" && c.TransferAddr != TransferOff {
		if _, _, err := net.SplitHostPort(c.TransferAddr); err != nil {
			errs = append(errs, fmt.Errorf("transfer-addr %q: %w (or %q to disable)", c.TransferAddr, err, TransferOff))
		}
	}
	if c.AdvertiseTransferAddr != "" {
		if c.TransferAddr == TransferOff {
			errs = append(errs, errors.New("advertise-transfer-addr is set but transfer-addr is off"))
		} else if _, _, err := net.SplitHostPort(c.AdvertiseTransferAddr); err != nil {
			errs = append(errs, fmt.Errorf("advertise-transfer-addr %q: %w", c.AdvertiseTransferAddr, err))
		}
	}
	if c.MemorySegments < 1 {
		errs = append(errs, fmt.Errorf("memory-segments must be >= 1, got %d", c.MemorySegments))
	}
	if c.Memory > 0 && uint64(c.Memory)/uint64(max(c.MemorySegments, 1)) < 1<<20 {
		errs = append(errs, fmt.Errorf("each memory segment must be at least 1MiB (memory %s over %d segments)", c.Memory.String(), c.MemorySegments))
	}
	switch {
	case c.DiskDir != "" && c.DiskSize < 1<<20:
		errs = append(errs, fmt.Errorf("disk-size must be at least 1MiB with disk-dir, got %s", c.DiskSize.String()))
	case c.DiskDir == "" && c.DiskSize > 0:
		errs = append(errs, errors.New("disk-size needs disk-dir"))
	}
	if c.Memory == 0 && c.DiskDir == "" {
		errs = append(errs, errors.New("nothing to contribute: set memory or disk-dir"))
	}
	if c.ShutdownGrace < 0 || c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("shutdown-grace must be >= 0 and shutdown-timeout > 0, got %v and %v", c.ShutdownGrace, c.ShutdownTimeout))
	}
	if c.ReadChunk < 4<<10 || c.ReadChunk > dataplane.MaxChunkSize {
		errs = append(errs, fmt.Errorf("read-chunk must be within [4KiB, 64MiB], got %s", c.ReadChunk.String()))
	}
	if c.TransferMaxConns < 1 || c.TransferMaxConnsPerIP < 1 || c.TransferMaxConnsPerIP > c.TransferMaxConns {
		errs = append(errs, fmt.Errorf("transfer-max-connections-per-ip must be within [1, transfer-max-connections], got %d and %d", c.TransferMaxConnsPerIP, c.TransferMaxConns))
	}
	if c.TransferMaxHeaderBytes < 4<<10 || c.TransferMaxHeaderBytes > xfer.MaxHeaderBytes {
		errs = append(errs, fmt.Errorf("transfer-max-header-bytes must be within [4KiB, 1MiB], got %s", c.TransferMaxHeaderBytes.String()))
	}
	if c.TransferMaxItems < xfer.MaxItems {
		errs = append(errs, fmt.Errorf("transfer-max-items-in-flight must be at least %d (one full request), got %d", xfer.MaxItems, c.TransferMaxItems))
	}
	if c.TransferIdleTimeout <= 0 || c.TransferIOTimeout <= 0 {
		errs = append(errs, fmt.Errorf("transfer-idle-timeout and transfer-io-timeout must be > 0, got %v and %v", c.TransferIdleTimeout, c.TransferIOTimeout))
	}
	return errors.Join(errs...)
}

// TransferOff as --transfer-addr disables the bulk transfer listener.
const TransferOff = "off"

// Agent is one crescent-agent process.
type Agent struct {
	cfg Config
	lg  *slog.Logger
	reg *prometheus.Registry

	ready     chan struct{}
	readyOnce sync.Once
	// mu guards the fields set while starting.
	mu       sync.Mutex
	dataAddr string
	xferAddr string
	admin    string
	segs     *segment.Set
	link     *link.Link
}

// New builds the agent. It does no I/O and starts nothing.
func New(cfg Config, lg *slog.Logger, reg *prometheus.Registry) *Agent {
	return &Agent{cfg: cfg, lg: lg, reg: reg, ready: make(chan struct{})}
}

// Ready is closed once the segments are mounted and the ports bound.
func (a *Agent) Ready() <-chan struct{} { return a.ready }

// DataEndpoint is the advertised DataService address (after Ready).
func (a *Agent) DataEndpoint() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.dataAddr
}

// TransferEndpoint is the advertised bulk transfer address (after Ready),
// or "" when the listener is off.
func (a *Agent) TransferEndpoint() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.xferAddr
}

// AdminAddr is the bound admin HTTP address (after Ready).
func (a *Agent) AdminAddr() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.admin
}

// Segments returns the mounted segments (after Ready).
func (a *Agent) Segments() *segment.Set {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.segs
}

// Link returns the master link (after Ready).
func (a *Agent) Link() *link.Link {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.link
}

// Run mounts the segments, serves DataService and the bulk transfer
// listener, and keeps the master link
// until ctx ends; then it deregisters, keeps serving for the shutdown grace,
// stops the servers and unmounts. It returns nil on a clean shutdown.
func (a *Agent) Run(ctx context.Context) error {
	segs, err := a.mount(ctx)
	if err != nil {
		return err
	}
	defer func() {
		if err := segs.Close(); err != nil {
			a.lg.Error("unmount segments failed", "err", err)
		}
	}()
	a.reg.MustRegister(segment.NewCollector(segs))

	keys := &dataplane.Keyring{}
	srv := server.New(server.Config{GRPCAddr: a.cfg.GRPCAddr, AdminAddr: a.cfg.AdminAddr, ShutdownTimeout: a.cfg.ShutdownTimeout}, a.lg, a.reg, dataplane.ServerOptions()...)
	dp := dataplane.New(dataplane.Config{ChunkSize: int(a.cfg.ReadChunk), Transfer: dataplane.TransferConfig{
		DrainTimeout: a.cfg.ShutdownTimeout, IdleTimeout: a.cfg.TransferIdleTimeout, IOTimeout: a.cfg.TransferIOTimeout,
		MaxConns: a.cfg.TransferMaxConns, MaxConnsPerIP: a.cfg.TransferMaxConnsPerIP, MaxHeaderBytes: int(a.cfg.TransferMaxHeaderBytes),
		MaxItemsInFlight: a.cfg.TransferMaxItems,
	}},
		dataplane.Deps{Segments: segs, Keys: keys, Registerer: a.reg}, a.lg)
	agentv1.RegisterDataServiceServer(srv.GRPC, dp)
	if err := srv.Listen(); err != nil {
		return err
	}
	endpoint, err := advertise(a.cfg.AdvertiseAddr, srv.GRPCAddr())
	if err != nil {
		return err
	}
	var xlis net.Listener // the bulk transfer listener; nil when off
	var xferEndpoint string
	if addr := transferListenAddr(a.cfg.TransferAddr, a.cfg.GRPCAddr); addr != "" {
		if xlis, err = net.Listen("tcp", addr); err != nil {
			return fmt.Errorf("transfer listen %s: %w", addr, err)
		}
		defer xlis.Close()
		if xferEndpoint, err = advertiseTransfer(a.cfg.AdvertiseTransferAddr, a.cfg.AdvertiseAddr, xlis.Addr().String()); err != nil {
			return err
		}
	}
	agentID := a.cfg.AgentID
	if agentID == "" {
		_, port, _ := net.SplitHostPort(srv.GRPCAddr())
		agentID = net.JoinHostPort(a.cfg.HostID, port)
	}
	lk, err := link.New(link.Config{
		MasterAddr: a.cfg.Master, AgentID: agentID, HostID: a.cfg.HostID, DataEndpoint: endpoint, TransferEndpoint: xferEndpoint, Version: Version,
		ShutdownGrace: a.cfg.ShutdownGrace,
	}, link.Deps{
		Segments:        segs,
		OnSettings:      func(s *masterv1.Settings) { keys.Set(s.GetTokenKey()) },
		CopyDialOptions: dataplane.DialOptions(),
		Registerer:      a.reg,
	}, a.lg.With("agent_id", agentID))
	if err != nil {
		return err
	}
	defer lk.Close()
	srv.SetReadiness(func() error {
		if st := lk.State(); st != link.StateConnected {
			return fmt.Errorf("master link %s", st)
		}
		return nil
	})

	a.mu.Lock()
	a.dataAddr, a.xferAddr, a.admin, a.segs, a.link = endpoint, xferEndpoint, srv.AdminAddr(), segs, lk
	a.mu.Unlock()
	a.readyOnce.Do(func() { close(a.ready) })
	a.lg.Info("agent started", "agent_id", agentID, "host_id", a.cfg.HostID, "data_endpoint", endpoint, "transfer_endpoint", xferEndpoint, "master", a.cfg.Master, "segments", segmentNames(segs))

	// The servers outlive ctx: they stop only after the link has
	// deregistered and the shutdown grace has passed (reads keep being
	// served meanwhile, on both data paths).
	srvCtx, stopSrv := context.WithCancel(context.WithoutCancel(ctx))
	defer stopSrv()
	servers := 1
	srvErr := make(chan error, 2)
	go func() { srvErr <- srv.Run(srvCtx) }()
	if xlis != nil {
		servers++
		go func() { srvErr <- dp.ServeTransfer(srvCtx, xlis) }()
	}
	linkCtx, stopLink := context.WithCancel(ctx)
	defer stopLink()
	linkErr := make(chan error, 1)
	go func() { linkErr <- lk.Run(linkCtx) }()

	var runErr error
	select {
	case runErr = <-linkErr:
		stopSrv()
		for range servers {
			runErr = errors.Join(runErr, <-srvErr)
		}
	case runErr = <-srvErr:
		// A server failed: leave the master at once.
		a.lg.Error("agent server failed", "err", runErr)
		stopSrv()
		for range servers - 1 {
			<-srvErr
		}
		stopLink()
		<-linkErr
	}
	a.lg.Info("agent stopped")
	return runErr
}

// mount creates the memory segments and opens the disk segment; a reopened
// one is verified (verifyDisk) before mount returns, so before anything is
// served or registered.
func (a *Agent) mount(ctx context.Context) (*segment.Set, error) {
	var segs []*segment.Segment
	fail := func(err error) (*segment.Set, error) {
		for _, s := range segs {
			_ = s.Close()
		}
		return nil, err
	}
	if a.cfg.Memory > 0 {
		n := uint64(a.cfg.MemorySegments)
		each := uint64(a.cfg.Memory) / n
		for i := range n {
			s, err := segment.NewMemory("mem-"+strconv.FormatUint(i, 10), each)
			if err != nil {
				return fail(err)
			}
			segs = append(segs, s)
			if a.cfg.Prefault {
				start := time.Now()
				if err := s.Prefault(ctx); err != nil {
					return fail(fmt.Errorf("prefault %s: %w", s.Name(), err))
				}
				a.lg.Info("memory segment prefaulted", "segment_id", s.ID(), "name", s.Name(), "bytes", each, "took", time.Since(start).Round(time.Millisecond).String())
			}
		}
	}
	if a.cfg.DiskDir != "" {
		vm := newVerifyMetrics(a.reg)
		s, rec, err := segment.OpenDisk(a.cfg.DiskDir, uint64(a.cfg.DiskSize))
		if err != nil {
			return fail(err)
		}
		segs = append(segs, s)
		if !rec.Existing {
			a.lg.Info("disk segment created", "segment_id", s.ID(), "dir", a.cfg.DiskDir, "size", a.cfg.DiskSize.String())
			return segment.NewSet(segs...), nil
		}
		a.lg.Info("disk segment reopened", "segment_id", s.ID(), "dir", a.cfg.DiskDir, "sealed", rec.Sealed, "truncated_journal_bytes", rec.TruncatedBytes)
		// Before registering: the master must never learn of (and clients
		// never be sent to) an allocation whose bytes went bad while the
		// agent was down.
		if err := a.verifyDisk(ctx, s, vm); err != nil {
			return fail(err)
		}
	}
	return segment.NewSet(segs...), nil
}

// maxCorruptLogLines bounds the WARN lines of one disk verification (a
// failing disk could otherwise log one per object); the summary line counts
// them all.
const maxCorruptLogLines = 100

// verifyMetrics are the disk segment's start-up verification metrics.
type verifyMetrics struct {
	verified, corrupt prometheus.Counter
	took              prometheus.Gauge
}

func newVerifyMetrics(reg prometheus.Registerer) *verifyMetrics {
	m := &verifyMetrics{
		verified: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_disk_verify_bytes_total",
			Help: "Object bytes of sealed disk allocations read and checked against their checksum when the disk segment was reopened."}),
		corrupt: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_disk_corrupt_allocations_total",
			Help: "Sealed disk allocations whose bytes failed their checksum check when the disk segment was reopened (dropped and reported lost)."}),
		took: prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_disk_verify_seconds",
			Help: "How long the disk segment's start-up checksum verification took."}),
	}
	reg.MustRegister(m.verified, m.corrupt, m.took)
	return m
}

// verifyDisk checks every sealed allocation of the reopened disk segment s
// (segment.VerifySealed), dropping corrupt ones, with a progress line every
// few seconds and the crescent_agent_disk_* metrics.
func (a *Agent) verifyDisk(ctx context.Context, s *segment.Segment, m *verifyMetrics) error {
	if !a.cfg.VerifyDisk {
		a.lg.Warn("disk segment not verified: --verify-disk is off; bytes corrupted while the agent was down are served until a client checks the checksum", "segment_id", s.ID())
		return nil
	}
	lg := a.lg.With("segment_id", s.ID(), "dir", s.Name())
	var counted uint64
	rep, err := s.VerifySealed(ctx, segment.VerifyConfig{Progress: func(p segment.VerifyProgress) {
		m.verified.Add(float64(p.VerifiedBytes - counted))
		counted = p.VerifiedBytes
		if p.VerifiedBytes < p.TotalBytes {
			lg.Info("disk segment verify progress", "verified_bytes", p.VerifiedBytes, "total_bytes", p.TotalBytes,
				"allocations", p.Allocations, "corrupt", p.Corrupt, "rate_mib_s", mibPerSecond(p.VerifiedBytes, p.Elapsed))
		}
	}})
	if err != nil {
		return fmt.Errorf("verify disk segment %s: %w", s.Name(), err)
	}
	m.corrupt.Add(float64(rep.CorruptCount))
	m.took.Set(rep.Took.Seconds())
	for i, c := range rep.Corrupt {
		if i == maxCorruptLogLines {
			lg.Warn("more corrupt disk allocations dropped (not logged one by one)", "count", rep.CorruptCount-i)
			break
		}
		attrs := []any{"allocation_id", c.ID, "tenant", c.Tenant, "key", c.Key, "replica_id", c.ReplicaID,
			"offset", c.Offset, "size", c.Size, "want_checksum", fmt.Sprintf("%#x", c.Want)}
		if c.Err != nil {
			attrs = append(attrs, "err", c.Err) // unreadable (EIO)
		} else {
			attrs = append(attrs, "got_checksum", fmt.Sprintf("%#x", c.Got))
		}
		lg.Warn("corrupt disk allocation dropped: reported lost, never served", attrs...)
	}
	lg.Info("disk segment verified", "allocations", rep.Allocations, "bytes", rep.Bytes, "corrupt", rep.CorruptCount,
		"took", rep.Took.Round(time.Millisecond).String(), "rate_mib_s", mibPerSecond(rep.Bytes, rep.Took))
	return nil
}

func mibPerSecond(n uint64, d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(float64(n) / (1 << 20) / d.Seconds())
}

func segmentNames(s *segment.Set) []string {
	var out []string
	for _, sg := range s.All() {
		out = append(out, sg.Name()+"="+sg.ID())
	}
	return out
}

// transferListenAddr is where the bulk transfer listener binds: the
// configured address, "" when off, or by default the gRPC host with an
// ephemeral port.
func transferListenAddr(configured, grpcAddr string) string {
	switch configured {
	case TransferOff:
		return ""
	case "":
		host, _, err := net.SplitHostPort(grpcAddr)
		if err != nil {
			host = ""
		}
		return net.JoinHostPort(host, "0")
	}
	return configured
}

// advertiseTransfer returns the bulk transfer address clients dial: the
// configured one; else, when DataService's advertised address is
// configured, its host with the bound port (both paths reach one host);
// else the bound address as advertise derives it.
func advertiseTransfer(configured, advertiseData, bound string) (string, error) {
	if configured != "" || advertiseData == "" {
		return advertise(configured, bound)
	}
	host, _, err := net.SplitHostPort(advertiseData)
	if err != nil {
		return "", fmt.Errorf("advertise-addr %q: %w", advertiseData, err)
	}
	_, port, err := net.SplitHostPort(bound)
	if err != nil {
		return "", fmt.Errorf("bound transfer address %q: %w", bound, err)
	}
	return net.JoinHostPort(host, port), nil
}

// advertise returns the address clients dial: the configured one, or the
// bound one with an unspecified IP replaced by the host name.
func advertise(configured, bound string) (string, error) {
	if configured != "" {
		if _, _, err := net.SplitHostPort(configured); err != nil {
			return "", fmt.Errorf("advertise-addr %q: %w", configured, err)
		}
		return configured, nil
	}
	host, port, err := net.SplitHostPort(bound)
	if err != nil {
		return "", fmt.Errorf("bound address %q: %w", bound, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("advertise address: no host name for %s: %w", bound, err)
		}
		host = h
	}
	return net.JoinHostPort(host, port), nil
}
