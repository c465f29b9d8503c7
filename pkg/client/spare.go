package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Spares: put leases (ARCHITECTURE §4, "A put in one master round trip").
//
// A single-replica Put asks the master, in its PutStart, for spares of its
// size: blank reservations leased to this client, each with a write token
// that names no key. The next Put of that size writes into a spare over the
// bulk transfer path, naming its key, and ends with one PutEnd that names
// the spare (and asks for one more): no PutStart. A spare the master no
// longer holds for the client (expired, its agent registered again, a new
// leader) fails that PutEnd with PUT_EXPIRED, or its write fails at the
// agent; the Put then goes through PutStart as usual, and on PUT_EXPIRED
// or a token of unknown keys the client drops its other spares too.

const (
	// sparesHeld is how many spares of a size the client keeps leased.
	sparesHeld = 2
	// spareMargin: a spare whose token expires sooner is not written.
	spareMargin = 2 * time.Second
	// maxSpareSizes bounds the sizes the cache keeps spares of.
	maxSpareSizes = 8
	// maxSpareKey is the longest key an agent binds to a spare
	// (dataplane.MaxSpareKeyLen); longer keys go through PutStart.
	maxSpareKey = 1024
)

// spareCache holds the client's leased spares by object size.
type spareCache struct {
	mu sync.Mutex
	by map[uint64][]*masterv1.ReplicaDescriptor
}

// take returns a spare of size to write now, or nil; expired ones are
// dropped.
func (sc *spareCache) take(size uint64, now time.Time) *masterv1.ReplicaDescriptor {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	l := sc.by[size]
	for len(l) > 0 {
		d := l[len(l)-1]
		l = l[:len(l)-1]
		if now.Add(spareMargin).UnixMilli() < d.GetTokenExpiryUnixMs() {
			sc.by[size] = l
			return d
		}
	}
	delete(sc.by, size)
	return nil
}

// drop forgets every spare: the master that leased them no longer holds
// them (a commit answered PUT_EXPIRED: they lapsed, or a new master or
// leader knows no such lease), so the others are most likely gone too,
// and each would cost a write into it before its put fell back.
func (sc *spareCache) drop() {
	sc.mu.Lock()
	clear(sc.by)
	sc.mu.Unlock()
}

// held is how many spares of size the client holds.
func (sc *spareCache) held(size uint64) int {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return len(sc.by[size])
}

// want is how many more spares of size the client would like.
func (sc *spareCache) want(size uint64) uint32 {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if _, ok := sc.by[size]; !ok && len(sc.by) >= maxSpareSizes {
		return 0
	}
	return uint32(max(sparesHeld-len(sc.by[size]), 0))
}

// keep adds spares the master leased.
func (sc *spareCache) keep(ds []*masterv1.ReplicaDescriptor) {
	if len(ds) == 0 {
		return
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.by == nil {
		sc.by = map[uint64][]*masterv1.ReplicaDescriptor{}
	}
	for _, d := range ds {
		size := d.GetSize()
		if _, ok := sc.by[size]; !ok && len(sc.by) >= maxSpareSizes {
			continue
		}
		if len(sc.by[size]) < 2*sparesHeld {
			sc.by[size] = append(sc.by[size], d)
		}
	}
}

// spareEligible says whether a put of size bytes with o may use spares:
// one memory replica without group, hard pin or placement preferences,
// sealed on write over the bulk path in one request. A client given
// shared-memory sockets keeps PutStart and the shared-memory path: a spare
// is written over TCP (the socket names no key), which for 1 MiB puts on
// one host measured no faster than the memcpy (BENCHMARKS, "Spares").
func (c *Client) spareEligible(key string, size int64, o *putOptions) bool {
	cfg := o.cfg
	return !c.s.cfg.DisableSpares && !c.s.cfg.DisableSealOnWrite && c.s.xfer != nil && len(key) <= maxSpareKey &&
		len(c.s.cfg.SharedMemorySockets) == 0 &&
		size > 0 && size <= xferChunk &&
		cfg.GetReplicaNum() <= 1 && cfg.GetGroupId() == "" && !cfg.GetHardPin() &&
		len(cfg.GetPreferredSegments()) == 0 && cfg.GetPreferLocalHost() == "" &&
		(cfg.GetMedium() == masterv1.Medium_MEDIUM_UNSPECIFIED || cfg.GetMedium() == masterv1.Medium_MEDIUM_MEMORY)
}

// errSpareGone marks a put on a spare that can go through PutStart instead:
// nothing of it was committed.
type errSpareGone struct{ err error }

func (e *errSpareGone) Error() string { return e.err.Error() }
func (e *errSpareGone) Unwrap() error { return e.err }

// putOnSpare writes the object into spare d and commits it with one PutEnd.
// An *errSpareGone error means the put may go through PutStart.
func (c *Client) putOnSpare(ctx context.Context, key string, size int64, src source, objSum *objectSum, o *putOptions, d *masterv1.ReplicaDescriptor) error {
	ep := c.transferEndpoint(d)
	if ep == "" {
		return &errSpareGone{errors.New("spare has no transfer endpoint")}
	}
	data, err := src(0, int(size), nil)
	if err != nil {
		return err
	}
	sum := objSum.get()
	it := transferItem(d, 0)
	it.Key, it.SealChecksum = key, &sum
	// Over TCP even on the agent's host: the shared-memory socket takes no
	// key, so it refuses a spare.
	res, err := c.s.xfer.WriteSealed(ctx, ep, []*agentv1.TransferItem{it}, [][]byte{data})
	if err == nil {
		err = res[0].Err
	}
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		if rpcerr.Reason(err) == "INVALID_TOKEN" {
			// Signed by keys the agent no longer knows (a new master): so
			// are the others.
			c.s.spares.drop()
		}
		return &errSpareGone{fmt.Errorf("write spare: %w", err)}
	}
	if len(res[0].Receipt) == 0 {
		// Written but not sealed (the agent has no key to vouch with yet,
		// or could not seal): the master commits a spare only on a
		// receipt, and its sweep releases this one.
		return &errSpareGone{errors.New("the agent sealed the spare without a receipt")}
	}
	if o.progress != nil {
		o.progress(size, size)
	}
	resp, err := c.putEnd(ctx, &masterv1.PutEndRequest{
		Tenant: c.tenant, Key: key, ClientId: c.s.cfg.ClientID, Checksum: sum, SealReceipts: [][]byte{res[0].Receipt},
		Spare:  &masterv1.SpareCommit{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Size: uint64(size), Config: o.cfg, Upsert: o.upsert},
		Spares: c.s.spares.want(uint64(size)),
	})
	if err != nil {
		switch rpcerr.Reason(err) {
		case "PUT_EXPIRED":
			c.s.spares.drop()
			return &errSpareGone{err}
		case "SEGMENT_UNAVAILABLE":
			return &errSpareGone{err}
		}
		return err
	}
	c.s.spares.keep(resp.GetSpares())
	return nil
}
