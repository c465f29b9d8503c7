package client

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// ReplicaList is the replica-list lookup a Get makes (GetReplicaList,
// through the coalescer), for the benchmarks of package client_test.
func (c *Client) ReplicaList(ctx context.Context, key string) error {
	_, err := c.replicaList(ctx, key)
	return err
}

// Coalesced is how many batch RPCs the client's coalescers have sent and
// how many single calls they carried, per kind.
func (c *Client) Coalesced() map[string][2]int {
	out := map[string][2]int{}
	for name, f := range map[string]func() (int, int){
		"get": c.s.co.get.sent, "exist": c.s.co.exist.sent, "replicalist": c.s.co.lists.sent,
		"putstart": c.s.co.starts.sent, "putend": c.s.co.ends.sent,
	} {
		b, n := f()
		out[name] = [2]int{b, n}
	}
	return out
}

// Queued is how many calls of a kind wait for a batch.
func (c *Client) Queued(kind string) int {
	return map[string]func() int{
		"get": c.s.co.get.queued, "exist": c.s.co.exist.queued, "replicalist": c.s.co.lists.queued,
		"putstart": c.s.co.starts.queued, "putend": c.s.co.ends.queued,
	}[kind]()
}

// ShmServed is how many items c read and wrote through shared memory.
func ShmServed(c *Client) (reads, writes uint64) {
	for _, sc := range c.s.shm {
		r, w := sc.Served()
		reads, writes = reads+r, writes+w
	}
	return reads, writes
}

// ShmMapped is how many reads c copied straight from a mapping, and how
// many copies did not match their checksum.
func ShmMapped(c *Client) (reads, misses uint64) {
	for _, sc := range c.s.shm {
		r, m := sc.Mapped()
		reads, misses = reads+r, misses+m
	}
	return reads, misses
}

// CopyMapped is the first shared-memory client's AppendMapped into dst's
// own memory: whether it copied len(dst) bytes.
func CopyMapped(c *Client, segment string, off uint64, dst []byte) bool {
	_, ok := c.s.shm[0].AppendMapped(dst[:0], segment, off, uint64(len(dst)))
	return ok
}

// FirstReplica is the segment and offset of key's first replica.
func FirstReplica(c *Client, ctx context.Context, key string) (segment string, offset uint64, err error) {
	rl, err := c.replicaList(ctx, key)
	if err != nil {
		return "", 0, err
	}
	d := rl.GetReplicas()[0]
	return d.GetSegmentId(), d.GetOffset(), nil
}

// ShmReadRequests is how many shared-memory read requests c sent.
func ShmReadRequests(c *Client) (n uint64) {
	for _, sc := range c.s.shm {
		n += sc.ReadRequests()
	}
	return n
}

// ReadPath returns a function that reads key's replicas into buf the way a
// get does once it holds the replica list (the data path and the checksum,
// without the master's lookup). The list is fetched now.
func ReadPath(c *Client, ctx context.Context, key string, buf []byte) (func() error, error) {
	rl, err := c.replicaList(ctx, key)
	if err != nil {
		return nil, err
	}
	return func() error { return c.readAny(ctx, rl, rl.GetReplicas(), buf[:rl.GetSize()]) }, nil
}

// Lookup is the coalesced Gets' BatchGetReplicaList of keys, on the
// master's call stream or as a unary call as the client decides
// (callstream.go): the per-item outcomes, or the call's error.
func (c *Client) Lookup(ctx context.Context, keys ...string) ([]error, error) {
	req := &masterv1.BatchGetReplicaListRequest{}
	for _, k := range keys {
		req.Items = append(req.Items, &masterv1.GetReplicaListRequest{Tenant: c.tenant, Key: k, ClientHost: c.s.cfg.HostID})
	}
	reply := &lookupReply{}
	if err := c.s.masters.Invoke(ctx, masterv1.ObjectService_BatchGetReplicaList_FullMethodName, req, reply); err != nil {
		return nil, err
	}
	errs := make([]error, len(reply.Results))
	for i, r := range reply.Results {
		errs[i] = itemError(r.GetStatus())
	}
	return errs, nil
}

// SparesHeld is how many spares of size c holds.
func SparesHeld(c *Client, size uint64) int { return c.s.spares.held(size) }
