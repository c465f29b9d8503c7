package client

import (
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/types/known/durationpb"
)

// PutOption adjusts one put (it mirrors ReplicateConfig).
type PutOption func(*putOptions)

type putOptions struct {
	cfg      *masterv1.ReplicateConfig
	upsert   bool
	progress func(done, total int64)
}

func newPutOptions(_ *Client, opts []PutOption) *putOptions {
	o := &putOptions{cfg: &masterv1.ReplicateConfig{}}
	for _, f := range opts {
		f(o)
	}
	return o
}

// WithReplicas places n replicas on distinct segments (across hosts when
// possible).
func WithReplicas(n int) PutOption {
	return func(o *putOptions) { o.cfg.ReplicaNum = uint32(n) }
}

// WithMedium chooses memory (the default) or disk segments.
func WithMedium(m masterv1.Medium) PutOption {
	return func(o *putOptions) { o.cfg.Medium = m }
}

// WithPreferredSegments tries these segment ids first.
func WithPreferredSegments(ids ...string) PutOption {
	return func(o *putOptions) { o.cfg.PreferredSegments = append(o.cfg.PreferredSegments, ids...) }
}

// WithPreferLocal places replicas on this client's host first.
func WithPreferLocal(hostID string) PutOption {
	return func(o *putOptions) { o.cfg.PreferLocalHost = hostID }
}

// WithSoftPin soft-pins the object for ttl (0: the master's default, 30 min).
func WithSoftPin(ttl time.Duration) PutOption {
	return func(o *putOptions) {
		o.cfg.SoftPin = true
		if ttl > 0 {
			o.cfg.SoftPinTtl = durationpb.New(ttl)
		}
	}
}

// WithHardPin keeps the object from ever being evicted.
func WithHardPin() PutOption {
	return func(o *putOptions) { o.cfg.HardPin = true }
}

// WithGroup sets the group id carried on KV events.
func WithGroup(id string) PutOption {
	return func(o *putOptions) { o.cfg.GroupId = id }
}

// WithUpsert replaces an existing object (destructively: the old replicas go
// first).
func WithUpsert() PutOption {
	return func(o *putOptions) { o.upsert = true }
}

// WithPutProgress reports bytes written across replicas. f is called by
// one goroutine at a time (replicas are written in parallel), with done
// growing to total, and must not block.
func WithPutProgress(f func(done, total int64)) PutOption {
	return func(o *putOptions) { o.progress = f }
}
