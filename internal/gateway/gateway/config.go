package gateway

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"time"

	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/gateway/publisher"
	"github.com/crescent-kv/crescent/internal/gateway/snapshot"
	"github.com/crescent-kv/crescent/internal/gateway/source"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"google.golang.org/grpc/credentials"
)

// Config is the gateway's configuration. Flag names are YAML keys; each
// flag is also read from CRESCENT_<FLAG>.
type Config struct {
	// Master is the master's gRPC host:port, or several comma-separated
	// (issue 15, HA: the gateway follows the leader among them).
	Master string
	// MasterCreds secure the connection to the master (issue 14: the
	// gateway's certificate, from internal/auth's Source.ClientCredentials).
	// Nil is plaintext. Not a flag: the app builds it from the TLS files.
	MasterCreds credentials.TransportCredentials

	Pub       string
	Replay    string
	AdminAddr string
	GRPCAddr  string
	LogLevel  string

	BackendID      string
	ModelName      string
	BlockSize      uint
	AdditionalSalt string
	LoraName       string
	DPRank         uint

	EmitLegacyCompat bool
	EmitObjectKey    bool

	QueueCapacity     int
	MaxBatch          int
	FlushInterval     time.Duration
	ReplayBuffer      int
	ReplayBufferBytes config.ByteSize
	ReplayLegacy      bool
	SubQueueBatches   int
	SubQueueBytes     config.ByteSize
	MaxSubscribers    int
	SubWriteTimeout   time.Duration

	ReplayMaxConnsPerPeer int
	ReplayIdleTimeout     time.Duration

	ReconnectMin    time.Duration
	ReconnectMax    time.Duration
	ShutdownTimeout time.Duration

	// Restarts and snapshots (docs/gateway-state.md).
	StateDir           string
	StateSyncInterval  time.Duration
	CheckpointInterval time.Duration
	ResumeHold         time.Duration
	StreamFormat       string
	Topic              string
	HeartbeatInterval  time.Duration
	Snapshot           string
	SnapshotMaxWaiting int
	SnapshotMaxBytes   config.ByteSize
	RecorderQueue      int

	// Security is TLS, authorization, protected mode and pprof of the
	// gRPC and admin ports (issue 14); the ZMQ endpoints stay plaintext.
	Security server.Security
}

// DefaultConfig returns the defaults (Mooncake's where it has one).
func DefaultConfig() Config {
	p := publisher.DefaultConfig()
	s := source.DefaultConfig()
	r := snapshot.DefaultConfig()
	return Config{
		Master:            "localhost:50051",
		Pub:               p.PubEndpoint,
		Replay:            p.ReplayEndpoint,
		AdminAddr:         ":9005",
		GRPCAddr:          ":50053",
		LogLevel:          "info",
		EmitLegacyCompat:  true,
		EmitObjectKey:     true,
		QueueCapacity:     p.QueueCapacity,
		MaxBatch:          p.MaxBatch,
		FlushInterval:     p.FlushInterval,
		ReplayBuffer:      p.ReplayBuffer,
		ReplayBufferBytes: config.ByteSize(p.ReplayBufferBytes),
		SubQueueBatches:   p.SubQueueBatches,
		SubQueueBytes:     config.ByteSize(p.SubQueueBytes),
		MaxSubscribers:    p.MaxSubscribers,
		ReconnectMin:      s.BackoffMin,
		ReconnectMax:      s.BackoffMax,
		ShutdownTimeout:   10 * time.Second,

		ReplayMaxConnsPerPeer: p.ReplayMaxConnsPerPeer,
		ReplayIdleTimeout:     p.ReplayIdleTimeout,

		StateSyncInterval:  statedir.DefaultSyncInterval,
		CheckpointInterval: r.CheckpointInterval,
		ResumeHold:         p.ResumeHold,
		StreamFormat:       publisher.FormatMooncake.String(),
		HeartbeatInterval:  p.HeartbeatInterval,
		Snapshot:           "tcp://*:5559",
		SnapshotMaxWaiting: r.MaxWaiting,
		// 1M objects take about 317 MB with the default envelope.
		SnapshotMaxBytes: 1 << 30,
		RecorderQueue:    r.QueueBatches,

		Security: server.DefaultSecurity(),
	}
}

// RegisterFlags binds every field to fs with its current value as default.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Master, "master", c.Master, "master gRPC address (ChangeService, host:port), or several comma-separated (at most 16): the gateway follows the leader, going where a standby's NOT_LEADER points or to the next address")
	fs.StringVar(&c.Pub, "pub", c.Pub, "ZMQ PUB bind endpoint for KV events")
	fs.StringVar(&c.Replay, "replay", c.Replay, "ZMQ ROUTER bind endpoint for replay (empty disables)")
	fs.StringVar(&c.AdminAddr, "admin-addr", c.AdminAddr, "admin HTTP listen address (/kv_events/status, /metrics, /healthz, /readyz)")
	fs.StringVar(&c.GRPCAddr, "grpc-addr", c.GRPCAddr, "gRPC listen address (GatewayService)")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log level: debug, info, warn, error")
	fs.StringVar(&c.BackendID, "backend-id", c.BackendID, "backend_id of every event (required)")
	fs.StringVar(&c.ModelName, "model-name", c.ModelName, "model_name of every event (empty: nil)")
	fs.UintVar(&c.BlockSize, "block-size", c.BlockSize, "block_size of every event (0: nil)")
	fs.StringVar(&c.AdditionalSalt, "additional-salt", c.AdditionalSalt, "additional_salt of every event (empty: nil)")
	fs.StringVar(&c.LoraName, "lora-name", c.LoraName, "lora_name of every event (empty: nil)")
	fs.UintVar(&c.DPRank, "dp-rank", c.DPRank, "dp_rank of every event and batch")
	fs.BoolVar(&c.EmitLegacyCompat, "emit-legacy-compat", c.EmitLegacyCompat, "also emit type, block_hashes and parent_block_hash")
	fs.BoolVar(&c.EmitObjectKey, "emit-object-key", c.EmitObjectKey, "publish stored/removed events (false: only cleared; the rest are counted as skipped)")
	fs.IntVar(&c.QueueCapacity, "queue-capacity", c.QueueCapacity, "events queued before the oldest are dropped")
	fs.IntVar(&c.MaxBatch, "max-batch", c.MaxBatch, "events per message (1..64)")
	fs.DurationVar(&c.FlushInterval, "flush-interval", c.FlushInterval, "how long a partial batch waits for more events (0: publish as soon as the publisher is free; batches still fill under load)")
	fs.IntVar(&c.ReplayBuffer, "replay-buffer", c.ReplayBuffer, "batches retained for replay")
	fs.Var(&c.ReplayBufferBytes, "replay-buffer-bytes", "bytes retained for replay")
	fs.BoolVar(&c.ReplayLegacy, "replay-legacy", c.ReplayLegacy, "answer replays as [b\"\", seq, payload] (older vLLM) instead of [b\"\", topic, seq, payload]")
	fs.IntVar(&c.SubQueueBatches, "sub-queue-batches", c.SubQueueBatches, "messages queued per subscriber before its oldest are dropped")
	fs.Var(&c.SubQueueBytes, "sub-queue-bytes", "bytes queued per subscriber before its oldest messages are dropped")
	fs.IntVar(&c.MaxSubscribers, "max-subscribers", c.MaxSubscribers, "PUB (and replay) connections accepted")
	fs.DurationVar(&c.SubWriteTimeout, "sub-write-timeout", c.SubWriteTimeout, "disconnect a subscriber whose socket accepts nothing for this long (0: never)")
	fs.IntVar(&c.ReplayMaxConnsPerPeer, "replay-max-conns-per-peer", c.ReplayMaxConnsPerPeer, "replay connections accepted from one remote IP")
	fs.DurationVar(&c.ReplayIdleTimeout, "replay-idle-timeout", c.ReplayIdleTimeout, "close a replay connection that sends no request for this long")
	fs.DurationVar(&c.ReconnectMin, "reconnect-min", c.ReconnectMin, "first backoff before reconnecting to the master")
	fs.DurationVar(&c.ReconnectMax, "reconnect-max", c.ReconnectMax, "longest backoff before reconnecting to the master")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "graceful shutdown limit before a hard stop")
	fs.StringVar(&c.StateDir, "state-dir", c.StateDir, "directory of the publisher's persisted state (epoch, sequence, announced set, journal), so a restart continues the stream; empty: every start is a new publisher")
	fs.DurationVar(&c.StateSyncInterval, "state-sync-interval", c.StateSyncInterval, "fsync the journal at most this often (0: every batch); a machine crash loses at most this much")
	fs.DurationVar(&c.CheckpointInterval, "checkpoint-interval", c.CheckpointInterval, "write a checkpoint of the announced set this often if it changed (0: only at stop and after large changes; a checkpoint is also written once 100k changes, at least half the set, were folded)")
	fs.DurationVar(&c.ResumeHold, "resume-hold", c.ResumeHold, "after a restart with state, publish nothing until the previous number of subscribers reconnected or this long passed")
	fs.StringVar(&c.StreamFormat, "stream-format", c.StreamFormat, "PUB stream format: mooncake (the contract's 8-byte sequence) or snapshot (vLLM #57789: sequence+epoch frame, idle heartbeats)")
	fs.StringVar(&c.Topic, "topic", c.Topic, "snapshot format only: the topic frame of every PUB and replay message, at most 255 bytes of printable ASCII (llm-d's snapshot consumer wants kv@<address:port>@<model>); empty by default, and always in the mooncake format")
	fs.DurationVar(&c.HeartbeatInterval, "heartbeat-interval", c.HeartbeatInterval, "snapshot format: publish an empty batch when nothing was published for this long")
	fs.StringVar(&c.Snapshot, "snapshot-endpoint", c.Snapshot, "ZMQ ROUTER bind endpoint answering snapshot requests (empty disables)")
	fs.IntVar(&c.SnapshotMaxWaiting, "snapshot-max-waiting", c.SnapshotMaxWaiting, "snapshot requests waiting at once; more are answered unavailable")
	fs.Var(&c.SnapshotMaxBytes, "snapshot-max-bytes", "largest snapshot reply; a larger one is answered unavailable")
	fs.IntVar(&c.RecorderQueue, "recorder-queue", c.RecorderQueue, "published batches the snapshot recorder may fall behind before it stops (snapshots then answer unavailable)")
	c.Security.RegisterFlags(fs)
}

// format parses StreamFormat.
func (c *Config) format() (publisher.Format, error) { return publisher.ParseFormat(c.StreamFormat) }

// recorderConfig is the snapshot recorder's configuration (its epoch is
// set when the state is known).
func (c *Config) recorderConfig() snapshot.Config {
	r := snapshot.DefaultConfig()
	r.QueueBatches = c.RecorderQueue
	r.MaxWaiting = c.SnapshotMaxWaiting
	r.MaxReplyBytes = int(min(c.SnapshotMaxBytes, math.MaxInt))
	r.CheckpointInterval = c.CheckpointInterval
	r.Encoder = c.publisherConfig().Encoder
	return r
}

// Validate reports every invalid field.
func (c *Config) Validate() error {
	var errs []error
	if _, err := source.SplitMasters(c.Master); err != nil {
		errs = append(errs, err)
	}
	if c.BlockSize > math.MaxUint32 {
		errs = append(errs, fmt.Errorf("block-size %d exceeds u32", c.BlockSize))
	}
	if c.DPRank > math.MaxUint32 {
		errs = append(errs, fmt.Errorf("dp-rank %d exceeds u32", c.DPRank))
	}
	if c.ReconnectMin <= 0 || c.ReconnectMax < c.ReconnectMin {
		errs = append(errs, fmt.Errorf("want 0 < reconnect-min (%v) <= reconnect-max (%v)", c.ReconnectMin, c.ReconnectMax))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("shutdown-timeout must be > 0, got %v", c.ShutdownTimeout))
	}
	if c.ReplayBufferBytes > math.MaxInt32*1024 || c.SubQueueBytes > math.MaxInt32*1024 {
		errs = append(errs, errors.New("replay-buffer-bytes and sub-queue-bytes must be below 2 TiB"))
	}
	if _, err := c.format(); err != nil {
		errs = append(errs, err)
	}
	if c.StateSyncInterval < 0 || c.CheckpointInterval < 0 || c.ResumeHold < 0 {
		errs = append(errs, errors.New("state-sync-interval, checkpoint-interval and resume-hold must be >= 0"))
	}
	if err := c.publisherConfig().Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.recorderConfig().Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Security.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (c *Config) publisherConfig() publisher.Config {
	p := publisher.DefaultConfig()
	p.PubEndpoint = c.Pub
	p.ReplayEndpoint = c.Replay
	p.ReplayLegacy = c.ReplayLegacy
	p.QueueCapacity = c.QueueCapacity
	p.MaxBatch = c.MaxBatch
	p.FlushInterval = c.FlushInterval
	p.ReplayBuffer = c.ReplayBuffer
	p.ReplayBufferBytes = int(c.ReplayBufferBytes)
	p.SubQueueBatches = c.SubQueueBatches
	p.SubQueueBytes = int(c.SubQueueBytes)
	p.MaxSubscribers = c.MaxSubscribers
	p.SubWriteTimeout = c.SubWriteTimeout
	p.ReplayMaxConnsPerPeer = c.ReplayMaxConnsPerPeer
	p.ReplayIdleTimeout = c.ReplayIdleTimeout
	p.Format, _ = c.format()
	p.Topic = c.Topic
	p.HeartbeatInterval = c.HeartbeatInterval
	p.ResumeHold = c.ResumeHold
	p.SnapshotEndpoint = c.Snapshot
	p.Encoder = kvevent.EncoderOptions{
		Envelope: kvevent.Envelope{
			BackendID: c.BackendID, ModelName: c.ModelName, AdditionalSalt: c.AdditionalSalt,
			LoraName: c.LoraName, BlockSize: uint32(c.BlockSize), DPRank: uint32(c.DPRank),
		},
		LegacyCompat: c.EmitLegacyCompat,
		ObjectKey:    c.EmitObjectKey,
	}
	return p
}
