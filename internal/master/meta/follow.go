package meta

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
)

// A warm standby (issue 15) keeps a Store built from the agents' Follow
// streams: each agent's table arrives as in a registration (BeginReconcile,
// chunk by chunk), then as TableDeltas that FollowDelta applies. While the
// store follows it decides nothing on its own (Run is not running, no
// RPC reaches it) and sends nothing to agents: the releases its reconciles
// would send are owed instead, and handed to each agent in the Settings of
// its resumed registration once this master leads (TakeOwed). Promote
// turns it into the leader's store under the term's identity.

// SetFollowing puts the store in (or out of) following mode: releases are
// owed to the agents instead of sent. Set before any follow stream is
// served; Promote clears it.
func (s *Store) SetFollowing(on bool) { s.following.Store(on) }

// Promote makes a following store the leader's: its identity becomes id
// (the term's epoch, the same token key ring) and the change log starts
// over at id.Epoch, empty (a subscriber resyncs from a Snapshot after a
// leader change anyway; the records made while following were never
// served). Call it while nothing else uses the store: after the follow
// streams ended, before the leader serves.
func (s *Store) Promote(id cluster.Identity) {
	s.id = id
	// No replica may live on a segment that is not mounted. A delta the
	// standby applied after the segment was unmounted (its agent found
	// lost while the follow stream went on; the stream now ends first,
	// session.endFollowOf) would leave objects the leader lists and never
	// serves, on a segment no registration drops again.
	var ghosts []string
	for _, e := range s.segs.all() {
		if e.replicas.Load() == 0 {
			continue
		}
		if sv, ok := s.reg.Segment(e.id); !ok || sv.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
			ghosts = append(ghosts, e.id)
		}
	}
	if len(ghosts) > 0 {
		s.lg.Warn("replicas on unmounted segments dropped at promotion", "segment_ids", ghosts)
		s.DropSegments(context.Background(), ghosts)
	}
	// A following store keeps no blanks (takeBlank, refillBlanks); none
	// made under another term may survive into this one.
	for _, e := range s.segs.all() {
		e.emptyBlanks()
	}
	s.dropSpares(func(allocKey) bool { return true })
	s.log.Reset(id.Epoch)
	s.following.Store(false)
}

// FollowDelta applies one TableDelta of agentID, whose segments are
// segments: the replicas of released allocations are removed, then sealed
// ones are adopted as a registration would adopt them (an allocation
// already held as a replica is left as it is: a delta may repeat what the
// table showed; on a tie of sealed times the version heard of last wins). Nothing is sent to any agent: what a registration would have
// returned for release is owed.
func (s *Store) FollowDelta(ctx context.Context, agentID string, segments []cluster.Segment, sealed, released []*masterv1.Allocation) {
	r := &reconcileRun{s: s, agentID: agentID, segs: len(segments), segSet: make(map[uint32]cluster.Segment, len(segments)),
		skipHeld: true, owedCheck: true}
	for _, sg := range segments {
		r.segSet[s.segs.intern(sg.ID)] = sg
	}
	// Releases first: an upsert releases the old version before it seals
	// the new one. An allocation sealed and released within the delta is
	// skipped (it came and went).
	var gone map[allocID]bool
	if len(released) > 0 {
		gone = make(map[allocID]bool, len(released))
		for _, a := range released {
			gone[allocID{a.GetSegmentId(), a.GetAllocationId()}] = true
		}
		s.dropAllocs(r.segSet, released)
	}
	if len(gone) > 0 {
		kept := make([]*masterv1.Allocation, 0, len(sealed))
		for _, a := range sealed {
			if !gone[allocID{a.GetSegmentId(), a.GetAllocationId()}] {
				kept = append(kept, a)
			}
		}
		sealed = kept
	}
	if len(sealed) > 0 {
		s.Owe(r.apply(ctx, sealed, false))
	}
}

// allocID names an allocation by its segment id.
type allocID struct {
	seg string
	id  uint64
}

// heldLocked reports whether the allocation is already one of its object's
// replicas (m's shard locked).
func (r *reconcileRun) heldLocked(m *mut, it reconcileItem) bool {
	o := m.sh.getLocked(it.tenant, it.a.GetKey())
	return o != nil && o.allocIndex(it.seg, it.a.GetAllocationId()) >= 0
}

// Owe remembers allocations to release at their agents later: a following
// store's reconciles return what they will not adopt, which only the
// leader may release (TakeOwed).
func (s *Store) Owe(refs []*masterv1.AllocationRef) {
	for _, ref := range refs {
		if idx, ok := s.segs.lookup(ref.GetSegmentId()); ok {
			s.owe(idx, []uint64{ref.GetAllocationId()})
		}
	}
}

// TakeOwed returns and forgets the releases owed on the segments, for the
// Settings of their agent's resumed registration (which has no reconcile
// to return them). The registration lists all of agentID's segments: as a
// reconcile does, it ends their detachment and forgets the agent's
// detached memory segments it no longer has (tombstone.go).
func (s *Store) TakeOwed(agentID string, segmentIDs []string) []*masterv1.AllocationRef {
	set := make(map[uint32]bool, len(segmentIDs))
	for _, id := range segmentIDs {
		if idx, ok := s.segs.lookup(id); ok {
			set[idx] = true
		}
	}
	s.attach(agentID, set)
	s.owedMu.Lock()
	defer s.owedMu.Unlock()
	var out []*masterv1.AllocationRef
	for k := range s.owed {
		if set[k.seg] {
			out = append(out, &masterv1.AllocationRef{SegmentId: s.segs.get(k.seg).id, AllocationId: k.alloc})
			delete(s.owed, k)
		}
	}
	return out
}
