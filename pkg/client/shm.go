package client

import (
	"context"
	"errors"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/internal/xfer/shm"
)

// The same-host shared-memory path (internal/xfer/shm). Config's
// SharedMemorySockets names the Unix sockets of the agents on this host
// (crescent-agent --shm-socket). Each socket's agent tells which segments
// it shares (its memory segments, by id) when the client first connects;
// from then on a replica on one of them moves by memcpy through the
// client's mapping of the segment, with the same tokens and checksums, and
// every other replica (a remote agent's, a disk segment's) on the bulk TCP
// path. A socket that is absent or refuses this process is left alone for a
// few seconds (shm.Config.RetryAfter) and its replicas go over TCP, as do
// the items of a shared-memory call that fails for another reason than
// the items themselves.
//
// The sockets are configured rather than advertised by the master: a
// socket path means something only on its own host, so the master would
// have to carry host-local paths in every replica descriptor for the SDK to
// compare against its own host anyway; segment ids (fresh UUIDs for memory
// segments) already say, without any master change, whether a replica
// lives behind a local socket.

// shmClients are the clients of the configured sockets.
type shmClients []*shm.Client

func newShmClients(cfg *Config) shmClients {
	var cs shmClients
	for _, p := range cfg.SharedMemorySockets {
		if p != "" {
			cs = append(cs, shm.New(shm.Config{Path: p, MaxIdle: cfg.MaxConcurrency, StallTimeout: cfg.StallTimeout}))
		}
	}
	return cs
}

func (cs shmClients) close() error {
	var errs []error
	for _, c := range cs {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// shmFor is the client of the local agent sharing segment id, or nil.
func (c *Client) shmFor(ctx context.Context, id string) *shm.Client {
	for _, sc := range c.s.shm {
		if sc.Has(ctx, id) {
			return sc
		}
	}
	return nil
}

// readMapped reads replica d of an object of checksum sum whole into dst
// (len(dst) is its size) straight from this process's mapping of d's
// segment, without asking its agent, and reports whether the bytes it
// copied are the object's (the checksum matches). False leaves the read to
// the request paths; a copy that did not match is counted as a miss.
func (c *Client) readMapped(d *masterv1.ReplicaDescriptor, dst []byte, sum uint64) bool {
	_, ok := c.appendMapped(d, dst[:0], uint64(len(dst)), sum)
	return ok
}

// appendMapped is readMapped of an n-byte object appended to dst: with dst
// nil, into a buffer of its own that nobody zeroed first.
func (c *Client) appendMapped(d *masterv1.ReplicaDescriptor, dst []byte, n, sum uint64) ([]byte, bool) {
	if c.s.cfg.DisableMappedReads {
		return nil, false
	}
	// Only a client holding a mapping of the segment copies; one that has
	// not connected yet does when the request path first uses it.
	for _, sc := range c.s.shm {
		if b, ok := sc.AppendMapped(dst, d.GetSegmentId(), d.GetOffset(), n); ok {
			if checksum.Sum(b[len(dst):]) != sum {
				sc.MappedMiss()
				return nil, false
			}
			return b, true
		}
	}
	return nil, false
}

// shmSplit partitions items between one shared-memory client (the items of
// segments it shares, in order) and the bulk path (the rest). sc is nil
// when no item can use shared memory.
func (c *Client) shmSplit(ctx context.Context, items []*agentv1.TransferItem) (sc *shm.Client, local, remote []int) {
	if len(c.s.shm) == 0 {
		return nil, nil, nil
	}
	for i, it := range items {
		s := c.shmFor(ctx, it.GetSegmentId())
		if s != nil && (sc == nil || s == sc) {
			sc = s
			local = append(local, i)
			continue
		}
		remote = append(remote, i)
	}
	return sc, local, remote
}

func pick[T any](all []T, idx []int) []T {
	out := make([]T, len(idx))
	for k, i := range idx {
		out[k] = all[i]
	}
	return out
}

// xferWrite is c.s.xfer.Write through shared memory where the agent shares
// the items' segments.
func (c *Client) xferWrite(ctx context.Context, ep string, items []*agentv1.TransferItem, src [][]byte) ([]error, error) {
	return viaShm(c, ctx, items, src, (*shm.Client).Write,
		func(items []*agentv1.TransferItem, bufs [][]byte) ([]error, error) {
			return c.s.xfer.Write(ctx, ep, items, bufs)
		})
}

// xferWriteSealed is c.s.xfer.WriteSealed through shared memory where the
// agent shares the items' segments: the agent seals on the release and
// its receipts come with the release's answer. Should that answer be lost
// after the seal, the items go over TCP too, where the agent refuses a
// sealed allocation and the put fails as any failed write does.
func (c *Client) xferWriteSealed(ctx context.Context, ep string, items []*agentv1.TransferItem, src [][]byte) ([]xfer.WriteResult, error) {
	return viaShm(c, ctx, items, src, (*shm.Client).WriteSealed,
		func(items []*agentv1.TransferItem, bufs [][]byte) ([]xfer.WriteResult, error) {
			return c.s.xfer.WriteSealed(ctx, ep, items, bufs)
		})
}

// xferRead is c.s.xfer.Read through shared memory where the agent shares
// the items' segments. The callers verify the checksums, whichever path.
func (c *Client) xferRead(ctx context.Context, ep string, items []*agentv1.TransferItem, dst [][]byte) ([]xfer.ReadResult, error) {
	return viaShm(c, ctx, items, dst, (*shm.Client).Read,
		func(items []*agentv1.TransferItem, bufs [][]byte) ([]xfer.ReadResult, error) {
			return c.s.xfer.Read(ctx, ep, items, bufs)
		})
}

// viaShm moves items (bufs[i] is item i's bytes) through one shared-memory
// client where it shares their segments (local) and over TCP for the rest
// (remote); per-item outcomes come back in item order. When the
// shared-memory path fails as a whole, its items go over TCP too (a read,
// and a write until its seal, are idempotent).
func viaShm[R any](c *Client, ctx context.Context, items []*agentv1.TransferItem, bufs [][]byte,
	local func(*shm.Client, context.Context, []*agentv1.TransferItem, [][]byte) ([]R, error),
	tcp func([]*agentv1.TransferItem, [][]byte) ([]R, error)) ([]R, error) {
	sc, near, remote := c.shmSplit(ctx, items)
	if sc == nil {
		return tcp(items, bufs)
	}
	out := make([]R, len(items))
	lres, err := local(sc, ctx, pick(items, near), pick(bufs, near))
	switch {
	case err == nil:
		for k, i := range near {
			out[i] = lres[k]
		}
	case ctx.Err() != nil:
		return nil, err
	default:
		remote = append(remote, near...)
	}
	if len(remote) > 0 {
		rres, err := tcp(pick(items, remote), pick(bufs, remote))
		if err != nil {
			return nil, err
		}
		for k, i := range remote {
			out[i] = rres[k]
		}
	}
	return out, nil
}
