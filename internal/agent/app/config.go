package app

import (
	"errors"
	"flag"
	"fmt"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/crescent-kv/crescent/internal/agent/dataplane"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// Config is the agent's configuration. Flag names are YAML keys; each flag
// is also read from CRESCENT_<FLAG>.
type Config struct {
	// Master is the master's gRPC host:port, or several comma-separated
	// (issue 15, HA: the agent follows the leader among them).
	Master string
	// Clock is the host's wall clock (time.Now when nil; not a flag: tests
	// set a skewed one). Token expiries are checked against it moved by
	// its measured difference from the master's (clock.go).
	Clock func() time.Time
	// FollowStandbys keeps a Follow stream to every master of a list of
	// several, so a standby holds this agent's table when it is elected
	// and the agent's registration with it skips the table (issue 15,
	// warm standbys).
	FollowStandbys bool
	// TableFeedSize is how many recent table changes the agent keeps for
	// its Follow streams; one that falls further behind sends the whole
	// table again.
	TableFeedSize  int
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
	// ShmSocket is the Unix socket of the same-host shared-memory data
	// path (internal/xfer/shm); "" (the default) leaves it off. With it
	// on, memory segments are memfd-backed and handed to peers that pass
	// the SO_PEERCRED check: the agent's uid or one of ShmAllowUIDs.
	ShmSocket    string
	ShmAllowUIDs string
	// Limits of the shared-memory listener (dataplane.ShmConfig).
	ShmMaxConns        int
	ShmMaxConnsPerPeer int
	// VerifyDisk checks every sealed allocation of a reopened disk
	// segment against its checksum before registering (see
	// segment.VerifySealed); corrupt ones are dropped and so reported
	// lost to the master.
	VerifyDisk bool
	// ScrubInterval is how long after start, and after each pass, the
	// disk segment is verified again while it serves (segment.Scrub), at
	// ScrubRate object bytes per second; 0 turns scrubbing off.
	ScrubInterval time.Duration
	ScrubRate     config.ByteSize

	// Security is TLS, authorization, protected mode and pprof (issue 14);
	// the bulk transfer listener speaks TLS with the same files.
	Security server.Security
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		FollowStandbys:  true,
		TableFeedSize:   segment.DefaultFeedSize,
		GRPCAddr:        ":50052",
		AdminAddr:       ":9004",
		HostID:          host,
		Memory:          1 << 30,
		MemorySegments:  1,
		Prefault:        true,
		VerifyDisk:      true,
		ScrubInterval:   24 * time.Hour,
		ScrubRate:       64 << 20,
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
		ShmMaxConns:            dataplane.DefaultShmMaxConns,
		ShmMaxConnsPerPeer:     dataplane.DefaultShmMaxConnsPerPeer,

		Security: server.DefaultSecurity(),
	}
}

// RegisterFlags binds every field to fs with its current value as default.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Master, "master", c.Master, "master gRPC address (host:port), or several comma-separated (at most 16): the agent registers with the leader, following a standby's NOT_LEADER hint or trying the next address")
	fs.BoolVar(&c.FollowStandbys, "follow-standbys", c.FollowStandbys, "with several --master addresses, keep every standby master's copy of this agent's allocation table current (a Follow stream each), so a failover needs no table upload")
	fs.IntVar(&c.TableFeedSize, "table-feed-size", c.TableFeedSize, "recent allocation table changes kept for the standbys' Follow streams; a stream that falls further behind sends the whole table again")
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
	fs.StringVar(&c.ShmSocket, "shm-socket", c.ShmSocket, "Unix socket of the same-host shared-memory data path (off when empty): memory segments become memfd-backed and same-host clients that pass the peer check map them and move bytes by memcpy; a peer can then read and write every byte of those segments, all tenants' (docs/OPERATIONS.md)")
	fs.StringVar(&c.ShmAllowUIDs, "shm-allow-uids", c.ShmAllowUIDs, "comma-separated uids, besides the agent's own, whose processes may connect to --shm-socket (checked with SO_PEERCRED)")
	fs.IntVar(&c.ShmMaxConns, "shm-max-connections", c.ShmMaxConns, "open shared-memory connections at most")
	fs.IntVar(&c.ShmMaxConnsPerPeer, "shm-max-connections-per-peer", c.ShmMaxConnsPerPeer, "open shared-memory connections of one client process at most")
	fs.DurationVar(&c.TransferIOTimeout, "transfer-io-timeout", c.TransferIOTimeout, "cut a bulk transfer request whose peer takes longer than this to send its header, or any 4MiB of payload, or to take the answer (the minimum progress asked of a peer)")
	fs.StringVar(&c.HostID, "host-id", c.HostID, "host this agent runs on; replicas of one object are spread across hosts")
	fs.StringVar(&c.AgentID, "agent-id", c.AgentID, "stable agent id (default: host-id:port)")
	fs.Var(&c.Memory, "memory", "memory to contribute (e.g. 4GiB); 0 for none")
	fs.IntVar(&c.MemorySegments, "memory-segments", c.MemorySegments, "split --memory into this many segments")
	fs.BoolVar(&c.Prefault, "prefault", c.Prefault, "touch every page of --memory at start, before registering, so puts never pay first-touch page faults (start-up takes longer, memory is committed at once)")
	fs.StringVar(&c.DiskDir, "disk-dir", c.DiskDir, "directory of the disk segment (empty: no disk segment)")
	fs.Var(&c.DiskSize, "disk-size", "size of the disk segment (e.g. 64GiB)")
	fs.DurationVar(&c.ScrubInterval, "scrub-interval", c.ScrubInterval, "while serving, read every sealed object of the disk segment again and check its checksum this long after start and after each pass; a bad one is dropped and reported lost before a client meets it (0 turns it off)")
	fs.Var(&c.ScrubRate, "scrub-rate", "object bytes per second a scrub pass reads at most (e.g. 64MiB), so it leaves the disk to the data plane")
	fs.BoolVar(&c.VerifyDisk, "verify-disk", c.VerifyDisk, "on restart, read every sealed object of the disk segment and check its checksum before registering; corrupt objects are dropped (reported lost) instead of served (start-up reads the whole used part of the segment)")
	fs.DurationVar(&c.ShutdownGrace, "shutdown-grace", c.ShutdownGrace, "after SIGTERM, keep serving reads this long after announcing the unmount")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "graceful gRPC stop limit before a hard stop")
	fs.Var(&c.ReadChunk, "read-chunk", "DataService.Read chunk size when the client does not choose")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	c.Security.RegisterFlags(fs)
}

// Validate reports every invalid field.
func (c *Config) Validate() error {
	var errs []error
	if c.Master == "" {
		errs = append(errs, errors.New("master must be set (the master's gRPC host:port)"))
	} else if err := validMasters(c.Master); err != nil {
		errs = append(errs, err)
	}
	if c.TableFeedSize < minTableFeed || c.TableFeedSize > maxTableFeed {
		errs = append(errs, fmt.Errorf("table-feed-size must be within [%d, %d], got %d", minTableFeed, maxTableFeed, c.TableFeedSize))
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
	if c.ScrubInterval < 0 || (c.ScrubInterval > 0 && c.ScrubRate < 1<<20) {
		errs = append(errs, fmt.Errorf("scrub-interval must be >= 0, and scrub-rate at least 1MiB with it; got %v and %s", c.ScrubInterval, c.ScrubRate.String()))
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
	if _, err := c.ShmUIDs(); err != nil {
		errs = append(errs, err)
	}
	if c.ShmSocket == "" && c.ShmAllowUIDs != "" {
		errs = append(errs, errors.New("shm-allow-uids needs shm-socket"))
	}
	if len(c.ShmSocket) > 100 {
		errs = append(errs, fmt.Errorf("shm-socket: a Unix socket path is at most 100 bytes here, got %d", len(c.ShmSocket)))
	}
	if c.ShmMaxConns < 1 || c.ShmMaxConnsPerPeer < 1 || c.ShmMaxConnsPerPeer > c.ShmMaxConns {
		errs = append(errs, fmt.Errorf("shm-max-connections-per-peer must be within [1, shm-max-connections], got %d and %d", c.ShmMaxConnsPerPeer, c.ShmMaxConns))
	}
	if err := c.Security.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// validMasters checks --master: at most masterlist.MaxMasters host:port entries.
func validMasters(s string) error {
	addrs, err := masterlist.Split(s)
	if err != nil {
		return fmt.Errorf("master: %w", err)
	}
	for _, a := range addrs {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
			return fmt.Errorf("master address %q is not host:port", a)
		}
	}
	return nil
}

// Bounds of --table-feed-size: a ring of fewer changes than a few batches
// makes a standby resync under any load; one of 16M changes holds
// 384 MiB of entries.
const (
	minTableFeed = 1 << 10
	maxTableFeed = 1 << 24
)

// TransferOff as --transfer-addr disables the bulk transfer listener.
const TransferOff = "off"

// ShmUIDs parses --shm-allow-uids.
func (c *Config) ShmUIDs() ([]uint32, error) {
	var uids []uint32
	for _, f := range strings.Split(c.ShmAllowUIDs, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		u, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("shm-allow-uids: %q is not a uid", f)
		}
		if len(uids) == 64 {
			return nil, errors.New("shm-allow-uids: at most 64 uids")
		}
		uids = append(uids, uint32(u))
	}
	return uids, nil
}
