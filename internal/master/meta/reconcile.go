package meta

import (
	"cmp"
	"context"
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
)

type allocKey struct {
	seg   uint32
	alloc uint64
}

// Reconcile merges an agent's authoritative allocation table into the
// metadata (see cluster.Metadata). The rules:
//
//   - A replica the metadata has on one of the agent's segments is kept when
//     the agent holds an allocation with that id whose tag names the same
//     (tenant, key); otherwise it is removed (the bytes are
//     gone). A COMPLETE replica whose allocation is only RESERVED at the
//     agent is removed too (the bytes were never sealed). Replicas whose
//     reservation is still in flight are left to their PutStart.
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
//   - Unclaimed RESERVED allocations are left to the agent's grace.
//
// Adopted objects are charged to their tenant without a quota check (the
// bytes exist). Changes are recorded through the mutation path.
func (s *Store) Reconcile(ctx context.Context, agentID string, segments []cluster.Segment, allocs []*masterv1.Allocation) []*masterv1.AllocationRef {
	segSet := make(map[uint32]cluster.Segment, len(segments))
	for _, sg := range segments {
		segSet[s.segs.intern(sg.ID)] = sg
	}
	have := make(map[allocKey]*masterv1.Allocation, len(allocs))
	for _, a := range allocs {
		idx, ok := s.segs.lookup(a.GetSegmentId())
		if _, mine := segSet[idx]; !ok || !mine {
			continue
		}
		have[allocKey{idx, a.GetAllocationId()}] = a
	}
	claimed := make(map[allocKey]bool)
	var out []*masterv1.AllocationRef
	rel := &releases{}
	ref := func(seg uint32, alloc uint64) {
		out = append(out, &masterv1.AllocationRef{SegmentId: s.segs.get(seg).id, AllocationId: alloc})
	}

	// Pass A: check what the metadata has on the agent's segments.
	removed := 0
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for t, objs := range shd.tenants {
			tname := s.tenants.get(t).name
			for key, o := range objs {
				for i := len(o.replicas) - 1; i >= 0; i-- {
					r := o.replicas[i]
					if _, mine := segSet[r.seg]; !mine || r.pending {
						continue
					}
					k := allocKey{r.seg, r.allocID}
					a := have[k]
					tagOK := a != nil && NormalizeTenant(a.GetTenant()) == tname && a.GetKey() == key
					if !tagOK || (r.status == stComplete && a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED) {
						m.remove(o, i, false)
						removed++
						continue
					}
					claimed[k] = true
				}
				if len(o.replicas) == 0 {
					m.sh.endPutLocked(o)
					m.dropIfEmpty(o)
				}
			}
		}
		m.commit()
		shd.mu.Unlock()
	}

	// Pass B: adopt unclaimed SEALED allocations, grouped by object.
	type group struct {
		ref    ObjectRef
		tenant uint32
		shard  int
		allocs []*masterv1.Allocation
	}
	groups := map[ObjectRef]*group{}
	for k, a := range have {
		if claimed[k] {
			continue
		}
		if s.takeOwed(k) {
			// Removed here while the agent was unreachable: release, never adopt.
			ref(k.seg, k.alloc)
			continue
		}
		if a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			continue
		}
		r := ObjectRef{Tenant: NormalizeTenant(a.GetTenant()), Key: a.GetKey()}
		if c := segSet[k.seg].Capacity; ValidateKey(r.Tenant, r.Key) != nil || a.GetSize() == 0 ||
			a.GetSize() > c || a.GetOffset() > c-a.GetSize() {
			ref(k.seg, k.alloc)
			continue
		}
		g := groups[r]
		if g == nil {
			t, err := s.tenants.acquire(r.Tenant) // released once adopted
			if err != nil {
				ref(k.seg, k.alloc)
				continue
			}
			g = &group{ref: r, tenant: t, shard: s.shardIndex(t, r.Key)}
			groups[r] = g
		}
		g.allocs = append(g.allocs, a)
	}
	list := make([]*group, 0, len(groups))
	for _, g := range groups {
		slices.SortFunc(g.allocs, func(a, b *masterv1.Allocation) int {
			return cmp.Compare(b.GetSealedUnixMs(), a.GetSealedUnixMs()) // newest first
		})
		list = append(list, g)
	}
	adopted := 0
	forShards(list, func(g *group) int { return g.shard }, func(sh int, gs []*group) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, g := range gs {
			adopted += s.adoptLocked(m, g.tenant, g.ref.Key, g.allocs, segSet, ref)
		}
		m.commit()
		shd.mu.Unlock()
	})
	for _, g := range list {
		s.tenants.release(g.tenant)
	}
	cctx, cancel := cleanupCtx(ctx)
	defer cancel()
	s.sendReleases(cctx, rel)
	s.lg.Info("reconciled agent allocations", "agent_id", agentID, "segments", len(segments),
		"allocations", len(allocs), "replicas_removed", removed, "replicas_adopted", adopted, "returned", len(out))
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
	if o != nil && (o.checksum != newest.GetChecksum() || o.size != newest.GetSize()) && newest.GetSealedUnixMs() > o.sealedMs {
		// The newer version wins: drop the current one's replicas.
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
		if p := a.GetSoftPinUntilUnixMs(); p > o.softPinMs {
			o.flags |= flagSoftPin
			o.softPinMs = p
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
	o.checksum, o.group = a.GetChecksum(), a.GetGroupId()
	o.sealedMs = a.GetSealedUnixMs()
	m.touchLater(o, max(a.GetSealedUnixMs(), 0))
	o.flags, o.softPinMs = 0, 0
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
	s.owedMu.Lock()
	for k := range s.owed {
		if set[k.seg] {
			delete(s.owed, k) // the segment's allocations go with it
		}
	}
	s.owedMu.Unlock()
	removed := 0
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, nil)
		for _, objs := range shd.tenants {
			for _, o := range objs {
				for i := len(o.replicas) - 1; i >= 0; i-- {
					if set[o.replicas[i].seg] {
						m.remove(o, i, false)
						removed++
					}
				}
				if len(o.replicas) == 0 {
					m.sh.endPutLocked(o)
					m.dropIfEmpty(o)
				}
			}
		}
		m.commit()
		shd.mu.Unlock()
	}
	s.lg.Info("dropped segments", "segments", len(set), "replicas_removed", removed)
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
