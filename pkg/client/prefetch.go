package client

import (
	"context"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// PrefetchResult is one key's outcome of Prefetch.
type PrefetchResult struct {
	Key string
	// Err is the key's failure (ErrNotFound, ErrBusy, ...), nil on success.
	Err error
	// State says what was done when Err is nil: QUEUED (without Wait),
	// IN_MEMORY (it already had a memory replica) or COPIED (with Wait).
	State masterv1.PrefetchState
	// Replica is the new memory replica when State is COPIED.
	Replica *masterv1.ReplicaDescriptor
}

// PrefetchOption adjusts Prefetch.
type PrefetchOption func(*prefetchOptions)

type prefetchOptions struct{ wait bool }

// Wait makes Prefetch copy the keys to memory before it returns, instead
// of queueing them for the master's background promotion.
func Wait() PrefetchOption { return func(o *prefetchOptions) { o.wait = true } }

// Prefetch asks for a memory replica of each key (an object held only on
// disk is copied to memory; the disk replica stays). By default the keys
// go on the master's promotion queue and are copied in the background,
// within its byte-rate budget; with Wait they are copied before Prefetch
// returns. Either way the master never evicts for it: a key with no room
// under the memory segments' low watermark fails with ErrNoSpace (Wait)
// or is skipped (queued). It returns one result per key, in order; the
// error is a whole request's failure, and the keys not done by then have
// it as their Err too. Lists beyond 1024 keys go in several requests.
func (c *Client) Prefetch(ctx context.Context, keys []string, opts ...PrefetchOption) ([]PrefetchResult, error) {
	var o prefetchOptions
	for _, f := range opts {
		f(&o)
	}
	out := make([]PrefetchResult, len(keys))
	for i, k := range keys {
		out[i].Key = k
	}
	for lo := 0; lo < len(keys) || lo == 0; lo += maxMigrateKeys {
		hi := min(lo+maxMigrateKeys, len(keys))
		r, err := c.Objects().Prefetch(ctx, &masterv1.PrefetchRequest{Tenant: c.tenant, Keys: keys[lo:hi], Wait: o.wait})
		if err != nil {
			err = rpcerr.FromStatus(err)
		} else if n := len(r.GetResults()); n != hi-lo {
			err = fmt.Errorf("master answered %d results for %d keys", n, hi-lo)
		}
		if err != nil {
			err = fmt.Errorf("prefetch: %w", err)
			for i := lo; i < len(keys); i++ {
				out[i].Err = err
			}
			return out, err
		}
		for i, res := range r.GetResults() {
			p := &out[lo+i]
			p.State, p.Replica = res.GetState(), res.GetReplica()
			if e := rpcerr.FromItem(res.GetStatus()); e != nil {
				p.Err = fmt.Errorf("prefetch %q: %w", p.Key, e)
			}
		}
		if hi == len(keys) {
			break
		}
	}
	return out, nil
}
