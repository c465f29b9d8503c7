// Package app wires the master: configuration, the metadata core, the agent
// sessions and segment registry, and the gRPC services on one port.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/crescent-kv/crescent/pkg/obs"
	"github.com/crescent-kv/crescent/pkg/server"
)

// Config is the master's configuration. Flag names are YAML keys; each flag
// is also read from CRESCENT_<FLAG>.
type Config struct {
	GRPCAddr        string
	AdminAddr       string
	LogLevel        string
	MasterID        string
	ShutdownTimeout time.Duration

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
}

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
		ChangelogRetention: 1 << 20,
		HighWatermark:      0.90,
		LowWatermark:       0.80,
	}
}

// RegisterFlags binds every field to fs with its current value as default.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.GRPCAddr, "grpc-addr", c.GRPCAddr, "gRPC listen address (ObjectService, ChangeService, AdminService, SegmentService)")
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
	fs.DurationVar(&c.PutTimeout, "put-timeout", c.PutTimeout, "a PutStart older than this may be preempted")
	fs.IntVar(&c.ChangelogRetention, "changelog-retention", c.ChangelogRetention, "change records retained for Watch resumption")
	fs.Float64Var(&c.HighWatermark, "high-watermark", c.HighWatermark, "segment use fraction that starts eviction")
	fs.Float64Var(&c.LowWatermark, "low-watermark", c.LowWatermark, "segment use fraction eviction stops at")
}

// Validate reports every invalid field.
func (c *Config) Validate() error {
	var errs []error
	if c.GRPCAddr == "" {
		errs = append(errs, errors.New("grpc-addr must be set"))
	}
	pos := map[string]time.Duration{
		"heartbeat-interval": c.HeartbeatInterval, "suspect-after": c.SuspectAfter, "unmount-after": c.UnmountAfter,
		"reserved-grace": c.ReservedGrace, "agent-timeout": c.AgentTimeout, "lease-ttl": c.LeaseTTL, "put-timeout": c.PutTimeout,
		"shutdown-timeout": c.ShutdownTimeout,
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
	if c.ChangelogRetention < 1024 {
		errs = append(errs, fmt.Errorf("changelog-retention must be >= 1024, got %d", c.ChangelogRetention))
	}
	if !(c.LowWatermark > 0 && c.LowWatermark < c.HighWatermark && c.HighWatermark <= 1) {
		errs = append(errs, fmt.Errorf("want 0 < low-watermark (%v) < high-watermark (%v) <= 1", c.LowWatermark, c.HighWatermark))
	}
	return errors.Join(errs...)
}

// Run builds the master and serves until ctx ends.
func Run(ctx context.Context, cfg Config, lg *slog.Logger) error {
	srv := server.New(server.Config{GRPCAddr: cfg.GRPCAddr, AdminAddr: cfg.AdminAddr, ShutdownTimeout: cfg.ShutdownTimeout}, lg, obs.NewRegistry())
	return srv.Run(ctx)
}
