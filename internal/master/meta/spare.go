package meta

import (
	"context"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

// Spares: put leases (issue 18 item 2; ARCHITECTURE §4, "A put in one
// master round trip").
//
// With blank reservations a single-replica put is still three round trips:
// PutStart, the WRITE, PutEnd. A spare takes PutStart off the path: the
// master leases a client a few blanks of a size it puts (asked for in a
// PutStart or PutEnd, answered beside it), each with a write token that
// carries the spare flag and names the tenant but no key. The client's next
// put of that size writes into a spare, naming its key in the transfer item;
// the agent binds the token's tenant and that key before any byte lands and
// signs a version 2 seal receipt that covers them. One PutEnd naming the
// spare then does what PutStart and PutEnd would (BatchPutEnd →
// startSpares): the lease is checked and ended, the put is placed on the
// spare's segment and allocation (placeLocked with PutSpec.spare), and ended
// with the receipt.
//
// What keeps it safe:
//   - A lease is this master's soft state, held by one client id and
//     tenant, for one size. It ends when the spare is committed, when it
//     expires (the token's expiry, at most the blank's BlankMaxAge, then
//     released by the blank sweep), when the segment's agent registers with
//     a table that does not list it (the agent restarted), and on Promote.
//     A registration whose table lists it keeps it: reconcile neither
//     adopts nor claims a leased spare, written or not, so its client's
//     commit still places it (while the agent registers, its segments take
//     no put: a commit then is SEGMENT_UNAVAILABLE and releases it). A
//     commit of a lease that ended is PUT_EXPIRED and touches nothing: the
//     client puts again through PutStart.
//   - Whatever a commit refuses after it took the lease (the key exists,
//     quota, a receipt that does not hold) releases the allocation.
//   - A spare's bytes count as the segment's blanks (blankBytes) until the
//     put is committed (then as the replica's) or the lease ends.
//   - A client holds at most maxSparesHeld leases, the store maxSparesAll.

const (
	// maxSparesAsked bounds the spares one PutStart or PutEnd leases.
	maxSparesAsked = 2
	// maxSparesHeld bounds the leases of one client id.
	maxSparesHeld = 4
	// maxSparesAll bounds the leases of the store, whatever the client ids.
	maxSparesAll = 4096
)

// spareLease is one blank leased to a client.
type spareLease struct {
	client, tenant string
	size, offset   uint64
	rid            uint32
	useByMs        int64 // the token's expiry
}

// spareLeases are the store's leases by allocation. Leaf lock (taken
// without any shard lock, and never with a segment's blanks lock).
type spareLeases struct {
	mu     sync.Mutex
	by     map[allocKey]spareLease
	held   map[string]int // leases per client id
	leased uint64         // counters: leases made, committed, expired
	used   uint64
	lapsed uint64
}

// SpareSpec names the spare a PutEnd commits (masterv1.SpareCommit): the
// put's other parameters are Put's, which must be a single-replica memory
// put without group, hard pin or preferred segments.
type SpareSpec struct {
	SegmentID    string
	AllocationID uint64
	Put          PutSpec
}

// spareRef is a spare placeLocked puts its replica on.
type spareRef struct {
	seg           uint32
	alloc, offset uint64
	rid           uint32
}

// createSpare is create for a spare's replica, numbered as its token named
// it (the agent recorded that id) unless the object numbered past it
// meanwhile (an upsert of an object created after the lease: the agent's
// id is then renumbered if a rebuild adopts it).
func (m *mut) createSpare(o *object, seg uint32, rid uint32) uint32 {
	fits := rid >= o.nextRID
	id := m.create(o, seg, uint8(masterv1.Medium_MEDIUM_MEMORY), true, 0)
	if !fits {
		return id
	}
	o.replicas[len(o.replicas)-1].id = rid
	return rid
}

// LeaseSpares leases client up to n (at most maxSparesAsked) spares of size
// bytes for tenant's puts: blanks of fresh pools on the segments the placer
// picks, each with a spare write token. Fewer or none when the size is not
// pooled, the client or the store holds its share, or this store follows.
func (s *Store) LeaseSpares(client, tenant string, size uint64, n int) []*masterv1.ReplicaDescriptor {
	n = min(n, maxSparesAsked)
	if n <= 0 || s.cfg.BlankPool <= 0 || s.following.Load() || size == 0 || ValidateClientID(client) != nil || client == "" {
		return nil
	}
	tenant = NormalizeTenant(tenant)
	sl := &s.spares
	sl.mu.Lock()
	n = min(n, maxSparesHeld-sl.held[client], maxSparesAll-len(sl.by))
	sl.mu.Unlock()
	if n <= 0 {
		return nil
	}
	now := s.now()
	nowMs := now.UnixMilli()
	p := s.newPlacerFrom(s.reg.Segments(), newExclusions())
	signer := s.keys.Signer(now)
	var out []*masterv1.ReplicaDescriptor
	for range n {
		vs, perr := p.pick(1, masterv1.Medium_MEDIUM_MEMORY, size, "", nil, "", nil)
		if perr != nil {
			break
		}
		v := vs[0]
		b, ok := s.takeBlankAs(v, size, nowMs, true)
		if !ok {
			break
		}
		// Still the segment's room until committed or released.
		v.e.blankBytes.Add(int64(size))
		useBy := min(b.madeMs+s.cfg.BlankMaxAge.Milliseconds(), now.Add(s.cfg.WriteTokenTTL).UnixMilli())
		l := spareLease{client: client, tenant: tenant, size: size, offset: b.offset, rid: s.ridSeq.Add(1), useByMs: useBy}
		sl.mu.Lock()
		if sl.by == nil {
			sl.by, sl.held = map[allocKey]spareLease{}, map[string]int{}
		}
		sl.by[allocKey{v.idx, b.alloc}] = l
		sl.held[client]++
		sl.leased++
		sl.mu.Unlock()
		exp := time.UnixMilli(useBy)
		out = append(out, &masterv1.ReplicaDescriptor{
			ReplicaId:        l.rid,
			SegmentId:        v.seg.ID,
			AgentId:          v.seg.AgentID,
			HostId:           v.seg.HostID,
			DataEndpoint:     v.seg.DataEndpoint,
			TransferEndpoint: v.seg.TransferEndpoint,
			AllocationId:     b.alloc,
			Offset:           b.offset,
			Size:             size,
			Medium:           masterv1.Medium_MEDIUM_MEMORY,
			Status:           masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING,
			Token: signer.Sign(token.Claims{Mode: token.Write, Tenant: tenant, SegmentID: v.seg.ID,
				AllocationID: b.alloc, Expiry: exp, ReplicaID: l.rid, Spare: true}),
			TokenExpiryUnixMs: useBy,
		})
	}
	return out
}

// takeSpare ends the lease sp names for its commit: held by this client
// and tenant, for this size, not expired. ok false: PUT_EXPIRED, nothing
// to release (the lease is not this commit's).
func (s *Store) takeSpare(sp *SpareSpec, nowMs int64) (ref spareRef, err error) {
	idx, ok := s.segs.lookup(sp.SegmentID)
	errGone := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_PUT_EXPIRED,
		"spare %d of segment %s is not leased to client %q for %q (expired, committed, or its agent registered again): put through PutStart",
		sp.AllocationID, sp.SegmentID, sp.Put.ClientID, sp.Put.Tenant)
	if !ok {
		return spareRef{}, errGone
	}
	k := allocKey{idx, sp.AllocationID}
	sl := &s.spares
	sl.mu.Lock()
	defer sl.mu.Unlock()
	l, ok := sl.by[k]
	if !ok || l.client != sp.Put.ClientID || l.tenant != sp.Put.Tenant || nowMs > l.useByMs {
		return spareRef{}, errGone
	}
	if l.size != sp.Put.Size {
		return spareRef{}, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"spare %d of segment %s holds %d bytes; the put is %d", sp.AllocationID, sp.SegmentID, l.size, sp.Put.Size)
	}
	s.endLeaseLocked(k, l)
	sl.used++
	return spareRef{seg: idx, alloc: sp.AllocationID, offset: l.offset, rid: l.rid}, nil
}

// endLeaseLocked forgets lease l of k; s.spares.mu is held. Its bytes are
// no longer the segment's blanks: a commit places them as a replica, or
// the allocation is released.
func (s *Store) endLeaseLocked(k allocKey, l spareLease) {
	sl := &s.spares
	delete(sl.by, k)
	if sl.held[l.client]--; sl.held[l.client] <= 0 {
		delete(sl.held, l.client)
	}
	s.segs.get(k.seg).blankBytes.Add(-int64(l.size))
}

// sweepSpares ends the leases that expired before nowMs (a write that
// began just before its token expired has had BlankMaxAge/4 since: the
// sweep's period; math.MaxInt64 ends them all, for releaseBlanksOf) and
// adds their allocations to per, by agent, for release.
func (s *Store) sweepSpares(nowMs int64, per map[string][]*masterv1.AllocationRef) {
	sl := &s.spares
	sl.mu.Lock()
	defer sl.mu.Unlock()
	for k, l := range sl.by {
		if nowMs <= l.useByMs {
			continue
		}
		s.endLeaseLocked(k, l)
		sl.lapsed++
		e := s.segs.get(k.seg)
		if sg, ok := s.reg.Segment(e.id); ok {
			per[sg.AgentID] = append(per[sg.AgentID], &masterv1.AllocationRef{SegmentId: e.id, AllocationId: k.alloc})
		}
	}
}

// dropSpares forgets the leases drop selects, releasing nothing: those of
// a registering agent whose table did not list them (it restarted: they
// are gone), and on Promote all (a promoted store holds no lease of
// another term; the agents' grace frees the unwritten ones, and a written
// one is adopted when its agent next registers).
func (s *Store) dropSpares(drop func(k allocKey) bool) {
	sl := &s.spares
	sl.mu.Lock()
	defer sl.mu.Unlock()
	for k, l := range sl.by {
		if drop(k) {
			s.endLeaseLocked(k, l)
			sl.lapsed++
		}
	}
}

// sparesOn returns the spares leased on segs' segments; nil when none (a
// registration's reconcile then checks nothing per allocation).
func (s *Store) sparesOn(segs map[uint32]cluster.Segment) map[allocKey]bool {
	sl := &s.spares
	sl.mu.Lock()
	defer sl.mu.Unlock()
	var out map[allocKey]bool
	for k := range sl.by {
		if _, mine := segs[k.seg]; mine {
			if out == nil {
				out = map[allocKey]bool{}
			}
			out[k] = true
		}
	}
	return out
}

// SpareStats reports the leases held and the counts of leases made,
// committed and ended otherwise (expired, or dropped on a registration or
// Promote): crescent_master_spares and crescent_master_spares_total.
func (s *Store) SpareStats() (held int, leased, committed, lapsed uint64) {
	sl := &s.spares
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return len(sl.by), sl.leased, sl.used, sl.lapsed
}

// checkSpareSpec refuses a commit of a spare by a put it cannot carry.
func checkSpareSpec(sp *PutSpec) error {
	if sp.ReplicaNum > 1 || sp.Group != "" || sp.HardPin || len(sp.Preferred) > 0 || sp.PreferLocalHost != "" ||
		(sp.Medium != masterv1.Medium_MEDIUM_UNSPECIFIED && sp.Medium != masterv1.Medium_MEDIUM_MEMORY) {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"a spare carries a single-replica memory put without group, hard pin or preferred segments: put %q through PutStart", sp.Key)
	}
	return nil
}

// startSpares starts the puts of the specs that commit a spare: each lease
// is taken, then the puts are placed on their spares through BatchPutStart
// (no reservation). res gets the error of each that failed (its allocation
// released if its lease was taken); the others are then open puts that
// BatchPutEnd ends like any.
func (s *Store) startSpares(ctx context.Context, specs []PutEndSpec, res []error) {
	var starts []PutSpec
	var at []int
	var refs []spareRef
	nowMs := s.nowMs()
	per := map[string][]*masterv1.AllocationRef{}
	for i := range specs {
		sp := specs[i].Spare
		if sp == nil {
			continue
		}
		ps := sp.Put
		ps.Tenant, ps.Key, ps.ClientID = NormalizeTenant(specs[i].Tenant), specs[i].Key, specs[i].ClientID
		sp.Put = ps
		if err := checkSpareSpec(&ps); err != nil {
			res[i] = err
			continue
		}
		if len(specs[i].Receipts) != 1 {
			res[i] = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
				"a PutEnd that commits a spare carries its write's seal receipt, exactly one (got %d)", len(specs[i].Receipts))
			continue
		}
		ref, err := s.takeSpare(sp, nowMs)
		if err != nil {
			res[i] = err
			continue
		}
		ps.spare = &ref
		ps.ReplicaNum, ps.Medium = 1, masterv1.Medium_MEDIUM_MEMORY
		starts = append(starts, ps)
		at = append(at, i)
		refs = append(refs, ref)
	}
	if len(starts) == 0 {
		return
	}
	for j, r := range s.BatchPutStart(ctx, starts) {
		if r.Err != nil {
			res[at[j]] = r.Err
			if !starts[j].spareAttached {
				e := s.segs.get(refs[j].seg)
				if sg, ok := s.reg.Segment(e.id); ok {
					per[sg.AgentID] = append(per[sg.AgentID], &masterv1.AllocationRef{SegmentId: e.id, AllocationId: refs[j].alloc})
				}
			}
		}
	}
	s.releaseBlanksAt(ctx, per)
}

// spareView is the placer's view of the spare's segment (nil when it can
// no longer allocate: the put fails, SEGMENT_UNAVAILABLE).
func (p *placer) spareView(ref *spareRef) *segView {
	all := p.alloc[masterv1.Medium_MEDIUM_MEMORY]
	for i := range all {
		if all[i].idx == ref.seg {
			return &all[i]
		}
	}
	return nil
}
