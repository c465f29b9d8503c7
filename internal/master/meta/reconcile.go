package meta

import (
	"cmp"
	"context"
	"slices"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"
)

type allocKey struct {
	seg   uint32
	alloc uint64
}

// Reconcile merges an agent's authoritative allocation table into the
// metadata (see cluster.Metadata). It is BeginReconcile, one Apply of the
// whole table and Finish. The rules:
//
//   - A replica the metadata has on one of the agent's segments is kept when
//     the agent holds an allocation with that id whose tag names the same
//     (tenant, key); otherwise it is removed (the bytes are
//     gone). A COMPLETE replica whose allocation is only RESERVED at the
//     agent is removed too (the bytes were never sealed). Replicas whose
//     reservation is still in flight are left to their PutStart. A blank
//     reservation (Allocation.blank: no object until a write binds it,
//     blank.go) keeps the replica that names it, whose put may bind it
//     after the table was read.
//   - Unclaimed SEALED allocations are adopted as COMPLETE replicas. For one
//     (tenant, key) the newest sealed version wins: when the metadata holds
//     the object with another checksum or size, the version sealed later
//     (sealed_unix_ms; ties keep the metadata's) becomes the object and the
//     other version's allocations are released — returned to this agent,
//     sent as Release to other agents. Allocations of the winning version
//     are adopted, one replica per segment.
//   - Allocations whose release this master could not deliver (the agent
//     was unreachable when their replica was removed) are returned, never
//     adopted, so a removed object does not come back on reconnect.
//   - Allocations for an object with a write in progress are returned (the
//     write replaces them, as an upsert would), as are allocations with an
//     invalid tag or bounds no segment can have (a size or end past the
//     segment's capacity, which would wrap the int64 accounting).
//   - Unclaimed RESERVED allocations, blanks included, are left to the
//     agent's grace.
//   - Spares leased on the agent's segments (spare.go), written or not,
//     are left to their clients' commits: never adopted nor claimed. The
//     leases of those the table does not list end (the agent restarted).
//
// Adopted objects are charged to their tenant without a quota check (the
// bytes exist). Changes are recorded through the mutation path.
func (s *Store) Reconcile(ctx context.Context, agentID string, segments []cluster.Segment, allocs []*masterv1.Allocation) []*masterv1.AllocationRef {
	r := s.BeginReconcile(ctx, agentID, segments, 0)
	out := r.Apply(ctx, allocs)
	return append(out, r.Finish(ctx)...)
}

// BeginReconcile starts a reconcile that takes the agent's table in chunks
// (cluster.ChunkedMetadata), with Reconcile's rules; expected is the
// table's announced size (0 when unknown). Each Apply costs what
// its chunk holds, not what the store holds: a chunk's allocations are
// looked up by their object. Only when the agent's segments held replicas
// before (a reconnect, not a rebuild after a master restart) does the run
// remember the allocations it claimed, so Finish can remove the replicas
// no chunk vouched for; a rebuild's Finish does nothing.
func (s *Store) BeginReconcile(ctx context.Context, agentID string, segments []cluster.Segment, expected uint64) cluster.Reconciler {
	s.owedMu.Lock()
	owed := len(s.owed) > 0
	s.owedMu.Unlock()
	r := &reconcileRun{s: s, agentID: agentID, segs: len(segments), segSet: make(map[uint32]cluster.Segment, len(segments)),
		expected: expected, owedCheck: owed}
	// A trace of its own, linked to the caller's span (the agent's Connect
	// stream, which lives as long as the session): Finish ends it.
	opts := []trace.SpanStartOption{trace.WithNewRoot()}
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
	}
	_, r.span = tracer.Start(ctx, "master.reconcile", opts...)
	r.sc = recorded(r.span)
	for _, sg := range segments {
		idx := s.segs.intern(sg.ID)
		r.segSet[idx] = sg
		e := s.segs.get(idx)
		if e.replicas.Load() > 0 {
			r.claimed = map[allocKey]bool{}
		}
		// The agent's blanks are gone if it restarted, and a registering
		// agent's segments place nothing: forget the pools (a reconnected
		// agent's grace frees their blanks).
		e.emptyBlanks()
	}
	// Spares leased on its segments are left to their clients' commits
	// when the table lists them (neither adopted nor claimed); Finish ends
	// the leases of the others (the agent restarted: they are gone).
	r.leased = s.sparesOn(r.segSet)
	r.owedCheck = r.owedCheck || r.claimed != nil
	return r
}

// reconcileRun is one registration's reconcile. Its methods are called from
// one goroutine.
type reconcileRun struct {
	s       *Store
	agentID string
	segs    int
	segSet  map[uint32]cluster.Segment
	// claimed is nil on a rebuild (the segments held no replicas at the
	// start); otherwise the allocations that vouch for a replica.
	claimed map[allocKey]bool
	// deferred are SEALED allocations for an object that has another,
	// still unclaimed replica on the same segment: adopted by Finish, after
	// that replica's fate is known.
	deferred []*masterv1.Allocation
	// expected is the table's announced size (0: unknown), to size empty
	// shard maps once instead of growing them.
	expected uint64
	// owedCheck: the store owed releases when the run began, or the
	// agent's segments held replicas (whose removal meanwhile owes a
	// release for an allocation still to come). Otherwise a release owed
	// later is for a replica this run adopted, from an allocation already
	// seen, so the run skips the lookup per allocation.
	owedCheck bool
	// skipHeld leaves an allocation that is already a replica as it is
	// (FollowDelta: a delta may repeat what the followed table showed).
	skipHeld bool
	// leased are the spares leased on the agent's segments when the run
	// began (nil: none), and listed those the table showed: a written
	// spare is sealed and names its object, yet its client's commit, not
	// this run, makes it a replica.
	leased, listed map[allocKey]bool

	allocs, removed, adopted, returned int

	// span is the run's span (master.reconcile), ended by Finish; sc its
	// context when it records, named by the records the run commits.
	span trace.Span
	sc   trace.SpanContext
	// items and group are apply's working arrays, kept between chunks
	// (Apply is called for one chunk at a time). Cleared after use: they
	// point into the chunk's decoded allocations.
	items []reconcileItem
	group shardScratch[reconcileItem]
}

// presizeTrust bounds how far a run believes an agent's announced table
// size beyond what it has received (see apply's presize). The shard maps
// are sized when the first chunk arrives, so at 16,384 allocations a chunk
// it must cover a whole agent's table from there: at 64 (1M) the maps of a
// 4M-object rebuild were sized for half of it and every one of them grew by
// splitting, about a sixth of the rebuild's CPU. At 256 an agent that lies
// makes the master size maps for 256 times what it sent (a first chunk of
// 16,384 allocations: maps for 8M keys, about 230 MiB), and no more.
const presizeTrust = 256

// reconcileItem is one allocation of a chunk, located.
type reconcileItem struct {
	a      *masterv1.Allocation
	seg    uint32
	tenant uint32
	shard  int
}

// Apply reconciles one chunk of the agent's table.
func (r *reconcileRun) Apply(ctx context.Context, allocs []*masterv1.Allocation) []*masterv1.AllocationRef {
	r.allocs += len(allocs)
	return r.apply(ctx, allocs, r.claimed != nil)
}

// apply locates each allocation (segment and tenant looked up once per run
// of equal ids: a table comes grouped by segment, mostly one tenant), then
// applies them shard by shard, one object's versions newest first.
func (r *reconcileRun) apply(ctx context.Context, allocs []*masterv1.Allocation, track bool) []*masterv1.AllocationRef {
	s := r.s
	var out []*masterv1.AllocationRef
	ref := func(seg uint32, alloc uint64) {
		out = append(out, &masterv1.AllocationRef{SegmentId: s.segs.get(seg).id, AllocationId: alloc})
	}
	items := r.items[:0]
	var (
		segID          string
		segIdx         uint32
		segMine        bool
		tenantName     string
		tenantID       uint32
		tenantOK       bool
		acquired       []uint32
		haveSeg, haveT bool
	)
	for _, a := range allocs {
		if !haveSeg || a.GetSegmentId() != segID {
			segID, haveSeg = a.GetSegmentId(), true
			idx, ok := s.segs.lookup(segID)
			_, mine := r.segSet[idx]
			segIdx, segMine = idx, ok && mine
		}
		if !segMine {
			continue
		}
		k := allocKey{segIdx, a.GetAllocationId()}
		sealed := a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED
		if r.owedCheck && s.takeOwed(k) {
			// Removed here while the agent was unreachable: release, never adopt.
			ref(k.seg, k.alloc)
			continue
		}
		if sealed && s.tombs.removedSince(k.seg, NormalizeTenant(a.GetTenant()), a.GetKey(), a.GetHardPin()) {
			// Removed by a client while this segment was detached, by key
			// or by pattern (tombstone.go): release, never adopt.
			ref(k.seg, k.alloc)
			continue
		}
		if r.leased[k] {
			if r.listed == nil {
				r.listed = map[allocKey]bool{}
			}
			r.listed[k] = true
			continue
		}
		if a.GetBlank() {
			// A blank reservation no write has bound yet: it names no
			// object, but a put this master handed it to may be writing
			// into it (its write binds it after the table was read), so
			// the replica that names it is kept. One no put holds is left
			// to the agent's grace.
			if track {
				r.claimed[k] = true
			}
			continue
		}
		if !sealed && !track {
			continue // nothing to claim, nothing to adopt
		}
		tn := NormalizeTenant(a.GetTenant())
		if c := r.segSet[k.seg].Capacity; sealed && (ValidateKey(tn, a.GetKey()) != nil || a.GetSize() == 0 ||
			a.GetSize() > c || a.GetOffset() > c-a.GetSize()) {
			ref(k.seg, k.alloc)
			continue
		}
		if !haveT || tn != tenantName {
			tenantName, haveT = tn, true
			t, err := s.tenants.acquire(tn) // released once applied
			tenantID, tenantOK = t, err == nil
			if tenantOK {
				acquired = append(acquired, t)
			}
		}
		if !tenantOK {
			if sealed {
				ref(k.seg, k.alloc)
			}
			continue
		}
		items = append(items, reconcileItem{a: a, seg: segIdx, tenant: tenantID, shard: s.shardIndex(tenantID, a.GetKey())})
	}
	if h := s.hooks.beforeAdopt; h != nil {
		h()
	}
	rel := &releases{}
	// Room in an empty shard map for this table and as much again (the
	// other agents rebuilding at once), so a rebuild does not grow the maps
	// by doubling and rehashing millions of keys.
	//
	// The announced size is the agent's word: it is believed only up to
	// presizeTrust times what the run has received so far, and only the
	// first tenant map of an empty shard is sized by it, so a table that
	// announces 2^34 allocations and sends a few (or one per tenant) makes
	// the master allocate in proportion to what arrived, not to the claim.
	presize := 0
	if exp := min(r.expected, uint64(r.allocs)*presizeTrust); exp > 0 {
		presize = int(min(2*exp/uint64(len(s.shards)), 1<<20)) + 16
	}
	byShard := func(it reconcileItem) int { return it.shard }
	forShardsCounting(items, byShard, &r.group, func(sh int, its []reconcileItem) {
		// One object's versions newest first, as Reconcile always adopted
		// them (the winner is recorded once, the losers never).
		slices.SortStableFunc(its, func(x, y reconcileItem) int {
			return cmp.Or(cmp.Compare(x.tenant, y.tenant), strings.Compare(x.a.GetKey(), y.a.GetKey()),
				cmp.Compare(y.a.GetSealedUnixMs(), x.a.GetSealedUnixMs()))
		})
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(r.sc)
		m.rebuild = &rebuildAlloc{objs: &s.objSlab, reps: &s.repSlab}
		var one [1]*masterv1.Allocation
		for i, it := range its {
			m.rebuildLeft = len(its) - i
			if i == 0 || it.tenant != its[i-1].tenant {
				// The tenant's usage for every object of its run that may
				// be new, charged once (mut.prepay), not per object.
				// Sealed allocations only (the others are never adopted),
				// whose sizes were checked against their segment above;
				// a sum past 2^62 is not prepaid (newObject charges).
				var bytes, n int64
				for _, x := range its[i:] {
					if x.tenant != it.tenant || bytes > 1<<62 {
						break
					}
					if x.a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
						bytes += int64(min(x.a.GetSize(), 1<<62))
						n++
					}
				}
				if bytes <= 1<<62 {
					m.prepay(it.tenant, bytes, n)
				}
			}
			if presize > 0 && len(shd.tenants) == 0 {
				shd.tenants[it.tenant] = newObjMap(presize)
			}
			if track && !r.claimLocked(m, it) || r.skipHeld && r.heldLocked(m, it) {
				continue
			}
			// Checked again under the shard lock, under which a removal
			// records its tombstone: a client removal of the key between
			// the check above and this lock found the object without this
			// replica, and its tombstone is all that is left of it (the
			// soak read a removed key back after its agent returned).
			if s.tombs.removedSince(it.seg, NormalizeTenant(it.a.GetTenant()), it.a.GetKey(), it.a.GetHardPin()) {
				ref(it.seg, it.a.GetAllocationId())
				continue
			}
			one[0] = it.a
			r.adopted += s.adoptLocked(m, it.tenant, it.a.GetKey(), one[:], r.segSet, ref)
			if track {
				r.markAdoptedLocked(m, it)
			}
		}
		m.commit()
		shd.mu.Unlock()
	})
	clear(items)
	clear(r.group.grouped)
	r.items = items[:0]
	for _, t := range acquired {
		s.tenants.release(t)
	}
	s.sendReleasesNow(ctx, rel)
	r.returned += len(out)
	return out
}

// claimLocked claims the replica an allocation vouches for, removes a
// COMPLETE replica whose allocation is only RESERVED, and defers an
// allocation that meets another unclaimed replica on its segment. It
// reports whether the allocation is SEALED and left to adopt.
func (r *reconcileRun) claimLocked(m *mut, it reconcileItem) bool {
	a := it.a
	sealed := a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED
	o := m.sh.getLocked(it.tenant, a.GetKey())
	if o == nil {
		return sealed
	}
	at, other := -1, false
	for i, rp := range o.replicas {
		if rp.seg != it.seg || rp.pending {
			continue
		}
		if rp.allocID == a.GetAllocationId() {
			at = i
		} else if !r.claimed[allocKey{rp.seg, rp.allocID}] {
			other = true
		}
	}
	switch {
	case at >= 0 && o.replicas[at].status == stComplete && !sealed:
		m.remove(o, at, false) // never sealed: the bytes are not there
		r.removed++
		m.dropGone(o)
		return false
	case at >= 0:
		r.claimed[allocKey{it.seg, a.GetAllocationId()}] = true
		return false
	case !sealed:
		return false
	case other:
		r.deferred = append(r.deferred, proto.CloneOf(a)) // a is reused once Apply returns
		return false
	}
	return true
}

// markAdoptedLocked claims the allocation if it became a replica.
func (r *reconcileRun) markAdoptedLocked(m *mut, it reconcileItem) {
	o := m.sh.getLocked(it.tenant, it.a.GetKey())
	if o == nil {
		return
	}
	for _, rp := range o.replicas {
		if rp.seg == it.seg && !rp.pending && rp.allocID == it.a.GetAllocationId() {
			r.claimed[allocKey{it.seg, rp.allocID}] = true
		}
	}
}

// Finish removes the replicas on the agent's segments that no chunk
// claimed (only when they held replicas at the start), adopts the deferred
// allocations, and returns what the agent should release of those.
func (r *reconcileRun) Finish(ctx context.Context) []*masterv1.AllocationRef {
	s := r.s
	var out []*masterv1.AllocationRef
	if r.claimed != nil {
		for sh := range s.shards {
			shd := &s.shards[sh]
			shd.mu.Lock()
			m := s.begin(shd, nil).under(r.sc)
			for _, objs := range shd.tenants {
				for _, o := range objs.all() {
					for i := len(o.replicas) - 1; i >= 0; i-- {
						rp := o.replicas[i]
						if _, mine := r.segSet[rp.seg]; !mine || rp.pending || r.claimed[allocKey{rp.seg, rp.allocID}] {
							continue
						}
						m.remove(o, i, false)
						r.removed++
					}
					m.dropGone(o)
				}
			}
			m.commit()
			shd.mu.Unlock()
		}
		if len(r.deferred) > 0 {
			d := r.deferred
			r.deferred = nil
			out = r.apply(ctx, d, false)
		}
	}
	if len(r.leased) > 0 {
		s.dropSpares(func(k allocKey) bool { return r.leased[k] && !r.listed[k] })
	}
	attached := make(map[uint32]bool, len(r.segSet))
	for idx := range r.segSet {
		attached[idx] = true
	}
	s.attach(r.agentID, attached)
	s.lg.Info("reconciled agent allocations", "agent_id", r.agentID, "segments", r.segs,
		"allocations", r.allocs, "replicas_removed", r.removed, "replicas_adopted", r.adopted, "returned", r.returned)
	if r.span.IsRecording() {
		r.span.SetAttributes(tracectx.Agent.String(r.agentID), attrSegments.Int(r.segs), tracectx.Items.Int(r.allocs),
			attrAdopted.Int(r.adopted), attrRemoved.Int(r.removed), attrReturned.Int(r.returned), attrRebuild.Bool(r.claimed == nil))
	}
	r.span.End()
	return out
}

// adoptLocked adopts one object's sealed allocations (newest first).
func (s *Store) adoptLocked(m *mut, t uint32, key string, allocs []*masterv1.Allocation, segSet map[uint32]cluster.Segment, ref func(uint32, uint64)) int {
	seg := func(a *masterv1.Allocation) uint32 { idx, _ := s.segs.lookup(a.GetSegmentId()); return idx }
	newest := allocs[0]
	o := m.sh.getLocked(t, key)
	if o != nil && o.put != nil {
		for _, a := range allocs {
			ref(seg(a), a.GetAllocationId())
		}
		return 0
	}
	if o != nil && (o.checksum != newest.GetChecksum() || o.size != newest.GetSize()) &&
		(newest.GetSealedUnixMs() > o.sealedMs || newest.GetSealedUnixMs() == o.sealedMs && s.following.Load()) {
		// The newer version wins: drop the current one's replicas. A
		// following store hears of seals as they happen, so on a tie
		// (sealed in the same millisecond) the version it hears of last
		// is the newer: an upsert's new version may arrive from one agent
		// before the old version's release arrives from another.
		for i := len(o.replicas) - 1; i >= 0; i-- {
			r := o.replicas[i]
			if _, mine := segSet[r.seg]; mine && !r.pending {
				ref(r.seg, r.allocID)
				m.remove(o, i, false)
			} else {
				m.remove(o, i, true)
			}
		}
		_ = s.tenants.get(t).charge(int64(newest.GetSize())-int64(o.size), 0, true)
		o.size = newest.GetSize()
		s.initAdopted(m, o, newest)
	}
	if o == nil {
		var err error
		if o, err = m.newObject(t, key, newest.GetSize(), true); err != nil {
			for _, a := range allocs {
				ref(seg(a), a.GetAllocationId())
			}
			return 0
		}
		s.initAdopted(m, o, newest)
	}
	n := 0
	for _, a := range allocs {
		idx := seg(a)
		dup := false
		for _, r := range o.replicas {
			dup = dup || r.seg == idx
		}
		if dup || a.GetChecksum() != o.checksum || a.GetSize() != o.size {
			ref(idx, a.GetAllocationId())
			continue
		}
		m.adopt(o, idx, uint8(segSet[idx].Medium), a.GetAllocationId(), a.GetOffset(), a.GetReplicaId())
		if a.GetHardPin() {
			o.flags |= flagHardPin
		}
		if p := a.GetSoftPinUntilUnixMs(); p > m.sh.softPinLocked(o) {
			m.sh.setSoftPinLocked(o, p)
		}
		n++
	}
	if len(o.replicas) == 0 {
		m.dropIfEmpty(o)
	}
	return n
}

// initAdopted makes o the version of allocation a. Its access clock is the
// sealed time, in no particular order across a registration: o is placed in
// the recency list when m commits, with the rest of the shard's batch.
func (s *Store) initAdopted(m *mut, o *object, a *masterv1.Allocation) {
	o.checksum = a.GetChecksum()
	m.sh.setGroupLocked(o, a.GetGroupId())
	o.sealedMs = a.GetSealedUnixMs()
	m.touchLater(o, max(a.GetSealedUnixMs(), 0))
	m.sh.clearSoftPinLocked(o)
	o.flags = 0
}

// attach ends the detachment of the segments agentID registered (idxs, all
// of them) and forgets its detached memory segments it no longer has, with
// the releases owed on them (tombstone.go).
func (s *Store) attach(agentID string, idxs map[uint32]bool) {
	gone := s.tombs.attach(agentID, idxs)
	if len(gone) == 0 {
		return
	}
	s.owedMu.Lock()
	defer s.owedMu.Unlock()
	for k := range s.owed {
		if slices.Contains(gone, k.seg) {
			delete(s.owed, k)
		}
	}
}

// DropSegments removes every replica on the segments through the mutation
// path (recording `removed` where a medium stops being readable, refunding
// quota) without releasing anything at the agent: the segments are going
// away. Puts in progress that lose all their replicas are dropped; their
// writer's PutEnd answers PUT_EXPIRED.
func (s *Store) DropSegments(ctx context.Context, segmentIDs []string) {
	set := make(map[uint32]bool, len(segmentIDs))
	for _, id := range segmentIDs {
		if idx, ok := s.segs.lookup(id); ok {
			set[idx] = true
		}
	}
	if len(set) == 0 {
		return
	}
	// The segments' allocations may come back with them: a disk segment
	// when its agent mounts it again, a memory segment when its agent was
	// only cut off or stalled and registers again (tombstone.go). The
	// releases still owed on them stay owed, to be returned, not adopted,
	// then (a removed object would come back); those of a memory segment
	// that does not come back go when its agent registers without it. A
	// segment the registry no longer has (its agent registered again
	// without it) is gone for good, and so is what was owed on it.
	nowMs := s.nowMs()
	detached := map[uint32]bool{}
	for _, sg := range s.reg.Segments() {
		if idx, ok := s.segs.lookup(sg.ID); ok && set[idx] {
			s.tombs.detach(idx, nowMs, sg.AgentID, sg.Medium != masterv1.Medium_MEDIUM_DISK)
			detached[idx] = true
		}
	}
	if len(detached) < len(set) {
		s.owedMu.Lock()
		for k := range s.owed {
			if set[k.seg] && !detached[k.seg] {
				delete(s.owed, k)
			}
		}
		s.owedMu.Unlock()
	}
	removed := s.dropReplicasOn(set, nil)
	s.lg.Info("dropped segments", "segments", len(set), "replicas_removed", removed)
}

// dropReplicasOn removes every replica on the segments in set through the
// mutation path, without releasing anything at the agent, one shard at a
// time; each (if not nil) sees every replica removed, under its shard's
// lock. It returns how many it removed.
func (s *Store) dropReplicasOn(set map[uint32]bool, each func(replica)) int {
	removed := 0
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, nil)
		for _, objs := range shd.tenants {
			for _, o := range objs.all() {
				for i := len(o.replicas) - 1; i >= 0; i-- {
					if r := o.replicas[i]; set[r.seg] {
						if each != nil {
							each(r)
						}
						m.remove(o, i, false)
						removed++
					}
				}
				m.dropGone(o)
			}
		}
		m.commit()
		shd.mu.Unlock()
	}
	return removed
}

// SegmentReplicaCounts returns the number of replicas (any status) per
// segment id that holds any.
func (s *Store) SegmentReplicaCounts() map[string]uint64 {
	out := map[string]uint64{}
	for _, e := range s.segs.all() {
		if n := e.replicas.Load(); n > 0 {
			out[e.id] = uint64(n)
		}
	}
	return out
}
