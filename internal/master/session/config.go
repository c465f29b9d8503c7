package session

import (
	"errors"
	"fmt"
	"time"
)

// Config tunes the agent sessions. Zero fields take the defaults of
// DefaultConfig; Validate checks the result.
type Config struct {
	// HeartbeatInterval is how often agents heartbeat (sent in Settings).
	HeartbeatInterval time.Duration
	// SuspectAfter without a heartbeat makes an agent's segments SUSPECTED.
	SuspectAfter time.Duration
	// UnmountAfter without a heartbeat unmounts them and drops their replicas.
	UnmountAfter time.Duration
	// ReservedGrace is how long an agent keeps an unclaimed RESERVED
	// allocation (sent in Settings).
	ReservedGrace time.Duration
	// RegisterTimeout bounds the wait for a new stream's first message and,
	// in a chunked registration, for each RegisterChunk after the one
	// before: a large table that keeps arriving is never cut short.
	RegisterTimeout time.Duration
	// RequestTimeout bounds one Reserve, Seal or Release call, queueing
	// included.
	RequestTimeout time.Duration
	// CopyTimeout bounds one Copy call (a copy moves a whole object).
	CopyTimeout time.Duration
	// BatchWindow is how long the batcher collects concurrent calls for one
	// agent before it sends them as one message.
	BatchWindow time.Duration
	// MaxBatchItems sends a batch at once when it holds this many items.
	MaxBatchItems int
	// MaxInFlight is the number of command messages one agent may have
	// unanswered; further calls accumulate into larger batches.
	MaxInFlight int
	// SendQueue is the capacity of each session's outgoing queue.
	SendQueue int
	// SweepInterval is how often liveness is checked. Default SuspectAfter/6.
	SweepInterval time.Duration
	// MaxSegmentsPerAgent caps the segments one agent may register or
	// mount (default 256); more fail with LIMIT_EXCEEDED.
	MaxSegmentsPerAgent int
	// TokenKeyRotation is how often Run rotates the token keys
	// (Identity.Keys) and re-sends Settings to every agent; 0 never rotates.
	// The master's config keeps it well above the token lifetimes.
	TokenKeyRotation time.Duration
}

// DefaultConfig returns the defaults of ARCHITECTURE.md §4.
func DefaultConfig() Config {
	return Config{
		HeartbeatInterval: time.Second,
		SuspectAfter:      3 * time.Second,
		UnmountAfter:      30 * time.Second,
		ReservedGrace:     60 * time.Second,
		RegisterTimeout:   10 * time.Second,
		RequestTimeout:    5 * time.Second,
		CopyTimeout:       2 * time.Minute,
		BatchWindow:       200 * time.Microsecond,
		MaxBatchItems:     512,
		MaxInFlight:       16,
		SendQueue:         256,

		MaxSegmentsPerAgent: DefaultMaxSegmentsPerAgent,
	}
}

// withDefaults fills zero fields from DefaultConfig.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	set := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	set(&c.HeartbeatInterval, d.HeartbeatInterval)
	set(&c.SuspectAfter, d.SuspectAfter)
	set(&c.UnmountAfter, d.UnmountAfter)
	set(&c.ReservedGrace, d.ReservedGrace)
	set(&c.RegisterTimeout, d.RegisterTimeout)
	set(&c.RequestTimeout, d.RequestTimeout)
	set(&c.CopyTimeout, d.CopyTimeout)
	set(&c.BatchWindow, d.BatchWindow)
	if c.MaxBatchItems == 0 {
		c.MaxBatchItems = d.MaxBatchItems
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	if c.SendQueue == 0 {
		c.SendQueue = d.SendQueue
	}
	if c.MaxSegmentsPerAgent == 0 {
		c.MaxSegmentsPerAgent = d.MaxSegmentsPerAgent
	}
	if c.SweepInterval == 0 {
		c.SweepInterval = max(c.SuspectAfter/6, time.Millisecond)
	}
	return c
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	for name, d := range map[string]time.Duration{
		"heartbeat interval": c.HeartbeatInterval, "suspect after": c.SuspectAfter, "unmount after": c.UnmountAfter,
		"reserved grace": c.ReservedGrace, "register timeout": c.RegisterTimeout, "request timeout": c.RequestTimeout,
		"copy timeout": c.CopyTimeout, "batch window": c.BatchWindow, "sweep interval": c.SweepInterval,
	} {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("%s must be > 0, got %v", name, d))
		}
	}
	if c.SuspectAfter <= c.HeartbeatInterval {
		errs = append(errs, fmt.Errorf("suspect after (%v) must exceed heartbeat interval (%v)", c.SuspectAfter, c.HeartbeatInterval))
	}
	if c.UnmountAfter <= c.SuspectAfter {
		errs = append(errs, fmt.Errorf("unmount after (%v) must exceed suspect after (%v)", c.UnmountAfter, c.SuspectAfter))
	}
	if c.TokenKeyRotation < 0 {
		errs = append(errs, fmt.Errorf("token key rotation must be >= 0, got %v", c.TokenKeyRotation))
	}
	if c.MaxSegmentsPerAgent < 1 {
		errs = append(errs, fmt.Errorf("max segments per agent must be >= 1, got %d", c.MaxSegmentsPerAgent))
	}
	if c.MaxBatchItems < 1 || c.MaxInFlight < 1 || c.SendQueue < 1 {
		errs = append(errs, fmt.Errorf("max batch items (%d), max in flight (%d) and send queue (%d) must be >= 1",
			c.MaxBatchItems, c.MaxInFlight, c.SendQueue))
	}
	return errors.Join(errs...)
}
