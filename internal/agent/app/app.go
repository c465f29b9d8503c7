// Package app wires the agent: configuration, the segments (memory and
// disk), the data plane on the gRPC port and on the bulk transfer listener,
// and the link to the master.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/dataplane"
	"github.com/crescent-kv/crescent/internal/agent/link"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
)

// Version is reported to the master in Register.
var Version = "dev"

// Agent is one crescent-agent process.
type Agent struct {
	cfg Config
	lg  *slog.Logger
	reg *prometheus.Registry
	// srvOpts are New's extra DataService server options.
	srvOpts []grpc.ServerOption

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

// New builds the agent. It does no I/O and starts nothing. opts are added
// to the DataService gRPC server's options (tests install interceptors).
func New(cfg Config, lg *slog.Logger, reg *prometheus.Registry, opts ...grpc.ServerOption) *Agent {
	return &Agent{cfg: cfg, lg: lg, reg: reg, ready: make(chan struct{}), srvOpts: opts}
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
	// The table change feed serves only standbys this agent follows: a
	// single master (or --follow-standbys=false) is never followed, so
	// could never resume a registration, and the put path then records
	// nothing. Attached after mount: start-up (journal replay,
	// VerifySealed) changes nothing a master has followed.
	var feed *segment.Feed
	if masters, _ := masterlist.Split(a.cfg.Master); a.cfg.FollowStandbys && len(slices.Compact(slices.Sorted(slices.Values(masters)))) > 1 {
		feed = segment.NewFeed(a.cfg.TableFeedSize)
		segs.SetFeed(feed)
	}
	creds, err := a.cfg.Security.Load(a.lg)
	if err != nil {
		return err
	}

	keys := &dataplane.Keyring{}
	clock := newMasterClock(a.cfg.Clock, a.reg, a.lg)
	srv := server.New(server.Config{
		GRPCAddr: a.cfg.GRPCAddr, AdminAddr: a.cfg.AdminAddr, ShutdownTimeout: a.cfg.ShutdownTimeout,
		Credentials: creds, Table: authTable(),
	}, a.lg, a.reg, append(dataplane.ServerOptions(), a.srvOpts...)...)
	dp := dataplane.New(dataplane.Config{ChunkSize: int(a.cfg.ReadChunk), Transfer: dataplane.TransferConfig{
		DrainTimeout: a.cfg.ShutdownTimeout, IdleTimeout: a.cfg.TransferIdleTimeout, IOTimeout: a.cfg.TransferIOTimeout,
		MaxConns: a.cfg.TransferMaxConns, MaxConnsPerIP: a.cfg.TransferMaxConnsPerIP, MaxHeaderBytes: int(a.cfg.TransferMaxHeaderBytes),
		MaxItemsInFlight: a.cfg.TransferMaxItems, TrustDomain: creds.TrustDomain,
	}},
		dataplane.Deps{Segments: segs, Keys: keys, Registerer: a.reg, Now: clock.Now}, a.lg)
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
		if err := creds.CheckListen("transfer-addr", xlis.Addr()); err != nil {
			return err
		}
		if creds.Secure() {
			// The same clients as DataService, the same certificates
			// (reloaded per handshake); dataplane reads each connection's
			// principal. xfer's listener batches TLS records into 256 KiB
			// reads and writes (one system call per 16 KiB record with
			// tls.NewListener: gets at about half of plaintext).
			xlis = xfer.TLSListener(xlis, creds.ServerTLS())
		}
		if xferEndpoint, err = advertiseTransfer(a.cfg.AdvertiseTransferAddr, a.cfg.AdvertiseAddr, xlis.Addr().String()); err != nil {
			return err
		}
	}
	var shmLis *net.UnixListener // the shared-memory listener; nil when off
	if a.cfg.ShmSocket != "" {
		if shmLis, err = listenShm(a.cfg.ShmSocket); err != nil {
			return err
		}
		defer shmLis.Close()
		if creds.Secure() {
			a.lg.Warn("the shared-memory socket is on with mutual TLS: its peers are known by uid, not certificate, and map every tenant's bytes of the memory segments", "shm_socket", a.cfg.ShmSocket)
		}
		if mode, ok := shmemTHP(shmemTHPPath); ok && (mode == "never" || mode == "deny") {
			a.lg.Warn("the shared memory segments get 4 KiB pages on this host: prefault and writes into them are slower (docs/OPERATIONS.md); set "+shmemTHPPath+" to advise",
				"shmem_enabled", mode)
		}
	}
	agentID := a.cfg.AgentID
	if agentID == "" {
		_, port, _ := net.SplitHostPort(srv.GRPCAddr())
		agentID = net.JoinHostPort(a.cfg.HostID, port)
	}
	lk, err := link.New(link.Config{
		MasterAddr: a.cfg.Master, AgentID: agentID, HostID: a.cfg.HostID, DataEndpoint: endpoint, TransferEndpoint: xferEndpoint, Version: Version,
		ShutdownGrace: a.cfg.ShutdownGrace, FollowStandbys: a.cfg.FollowStandbys,
		// mTLS with this agent's certificate; the server must be a master.
		Creds: creds.Client(auth.RoleMaster),
	}, link.Deps{
		Segments: segs,
		Feed:     feed,
		OnSettings: func(s *masterv1.Settings) {
			// The clock first: the master makes this agent's segments
			// readable once SettingsApplied, which follows, says so.
			clock.observe(s)
			keys.Set(s.GetTokenKeys())
		},
		// A Copy's target must be an agent: these credentials, given
		// last, replace Creds on those connections.
		CopyDialOptions: append(dataplane.DialOptions(), grpc.WithTransportCredentials(creds.Client(auth.RoleAgent))),
		// The same for the other agents' bulk transfer listeners.
		CopyTLS:    creds.ClientTLS(auth.RoleAgent),
		Registerer: a.reg,
	}, a.lg.With("agent_id", agentID))
	if err != nil {
		return err
	}
	defer lk.Close()
	segs.SetLostSink(a.lostSink(lk))
	// Stopped before the segments close (deferred after their Close).
	stopScrubs := a.startScrubs(ctx, segs)
	defer stopScrubs()
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
	if shmLis != nil {
		uids, _ := a.cfg.ShmUIDs() // checked by Validate
		servers++
		go func() {
			srvErr <- dp.ServeShm(srvCtx, shmLis, dataplane.ShmConfig{AllowUIDs: uids,
				MaxConns: a.cfg.ShmMaxConns, MaxConnsPerPeer: a.cfg.ShmMaxConnsPerPeer})
		}()
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
			newMem := segment.NewMemory
			if a.cfg.ShmSocket != "" {
				// Shared with same-host clients: memfd-backed.
				newMem = segment.NewSharedMemory
			}
			s, err := newMem("mem-"+strconv.FormatUint(i, 10), each)
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
		s.SetLogger(a.lg.With("segment_id", s.ID()))
		if !rec.Existing {
			a.lg.Info("disk segment created", "segment_id", s.ID(), "dir", a.cfg.DiskDir, "size", a.cfg.DiskSize.String())
			return segment.NewSet(segs...), nil
		}
		level := slog.LevelInfo
		if rec.TruncatedBytes > 0 {
			// A torn tail is a crash in the middle of an append, whose
			// seal was never acknowledged; anything more is damage, and
			// the records after it are gone: say so either way.
			level = slog.LevelWarn
		}
		a.lg.Log(ctx, level, "disk segment reopened", "segment_id", s.ID(), "dir", a.cfg.DiskDir, "sealed", rec.Sealed, "truncated_journal_bytes", rec.TruncatedBytes, "rehashed_xxhash64", rec.Rehashed, "rehash_mismatched", rec.Mismatched)
		// Before registering: the master must never learn of (and clients
		// never be sent to) an allocation whose bytes went bad while the
		// agent was down.
		if err := a.verifyDisk(ctx, s, vm); err != nil {
			return fail(err)
		}
	}
	return segment.NewSet(segs...), nil
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

// listenShm listens on the shared-memory socket path. A socket left there
// by an agent that did not stop cleanly is replaced; anything else at the
// path is an error. The socket is made 0660: the peer check (uid) is the
// gate, the mode keeps other users from even connecting.
// shmemTHPPath is where Linux says whether shmem (memfd) mappings may get
// transparent huge pages.
const shmemTHPPath = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"

// shmemTHP reads the mode the kernel applies, the bracketed word of path
// ("always within_size advise [never] deny force"); false when the file
// cannot be read (no THP) or names none.
func shmemTHP(path string) (string, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false
	}
	for w := range strings.FieldsSeq(string(b)) {
		if len(w) > 2 && w[0] == '[' && w[len(w)-1] == ']' {
			return w[1 : len(w)-1], true
		}
	}
	return "", false
}

func listenShm(path string) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("shm-socket %s: exists and is not a socket", path)
		}
		if c, err := net.Dial("unix", path); err == nil {
			_ = c.Close()
			return nil, fmt.Errorf("shm-socket %s: another process listens on it", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("shm-socket %s: remove stale socket: %w", path, err)
		}
	}
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("shm-socket listen %s: %w", path, err)
	}
	lis.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o660); err != nil {
		_ = lis.Close()
		return nil, fmt.Errorf("shm-socket %s: %w", path, err)
	}
	return lis, nil
}
