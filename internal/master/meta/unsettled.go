package meta

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Unsettled segments: removals a failover must not undo.
//
// A removal this leader could not carry out at an agent leaves the
// allocation in the agent's table: a release owed (the agent unreachable,
// or refusing), or a tombstone (the segment detached, tombstone.go). Both
// live only in this process. The standbys follow the agents' tables, so
// they still hold such an allocation, and a new leader would serve the
// object again: a removed object back after a failover.
//
// So a segment is unsettled once a client's removal left a release owed
// on it, or recorded a tombstone while it was detached; a leader with a
// Ledger (HA: its etcd term) records it there before it answers the
// removal (settleRemoval: one writer at a time, so a burst of removals
// shares one write; nothing to write once the segment is recorded, the
// common case). Other releases owed (a failed put's, an evicted object's)
// and detachments alone mark nothing: they undo no client's removal, and
// a record costs the cache the segment's contents at the next failover.
// The sweep removes the records of segments settled again, nothing owed on
// them and not detached (syncUnsettled). A new leader reads the records
// before it serves and distrusts those segments (Distrust): it owes the
// release of every replica it holds there and returns, never adopts, any
// other sealed allocation their agent lists, until the agent registers.
// Objects whose removal the old leader may have acknowledged are lost
// to the cache rather than served again.

// UnsettledSegment names a segment that may hold allocations of objects
// a leader removed (ha's record).
type UnsettledSegment struct {
	ID     string
	Agent  string
	Memory bool
}

// Ledger keeps the unsettled segments outside the process (a leader's
// etcd term). Both calls write only while the caller leads.
type Ledger interface {
	Record(ctx context.Context, segs []UnsettledSegment) error
	Forget(ctx context.Context, ids []string) error
}

// settleTimeout bounds one write to the ledger.
const settleTimeout = 5 * time.Second

type unsettled struct {
	ledger Ledger // set once before the leader serves (SetLedger)
	// on is set with ledger: removals mark and settle.
	on atomic.Bool
	// dirty is set while pending is not empty: settle has work.
	dirty atomic.Bool
	// writeMu: one ledger write at a time. A caller that waited for it
	// finds its segments written by the one before.
	writeMu sync.Mutex
	// mu guards recorded and pending (a leaf lock).
	mu       sync.Mutex
	recorded map[uint32]bool // in the ledger
	pending  map[uint32]bool // unsettled, not in the ledger yet
	// distrusted counts the segments Distrust was given.
	distrusted atomic.Uint64
}

// count returns the segments recorded or about to be.
func (u *unsettled) count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.recorded) + len(u.pending)
}

// SetLedger makes the store record unsettled segments in l, those of
// recorded being there already (Distrust's, until they settle). Call it
// once, before the leader serves.
func (s *Store) SetLedger(l Ledger, recorded []UnsettledSegment) {
	u := &s.unset
	u.mu.Lock()
	defer u.mu.Unlock()
	u.ledger = l
	u.recorded = make(map[uint32]bool, len(recorded))
	for _, sg := range recorded {
		if idx, ok := s.segs.lookup(sg.ID); ok {
			u.recorded[idx] = true
		}
	}
	u.on.Store(true)
}

// markUnsettled notes that segment idx is unsettled: the next settle
// records it. Call it after what makes it unsettled (the owe, the
// detachment) is visible: syncUnsettled checks those again after it
// stops trusting a record.
func (s *Store) markUnsettled(idx uint32) {
	u := &s.unset
	if !u.on.Load() {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.recorded[idx] {
		u.markLocked(idx)
	}
}

// markUnsettledRefs marks the segments of refs.
func (s *Store) markUnsettledRefs(refs []*masterv1.AllocationRef) {
	if !s.unset.on.Load() {
		return
	}
	for _, ref := range refs {
		if idx, ok := s.segs.lookup(ref.GetSegmentId()); ok {
			s.markUnsettled(idx)
		}
	}
}

func (u *unsettled) markLocked(idx uint32) {
	if u.pending == nil {
		u.pending = map[uint32]bool{}
	}
	u.pending[idx] = true
	u.dirty.Store(true)
}

// settleRemoval is called by a client's removal before it answers, after
// its releases were sent or owed (and the segments they are owed on
// marked): while a segment is detached the removal recorded a tombstone,
// which only this process holds, so every detached segment is unsettled
// too. Then it settles. An error means the removal may not survive a
// failover, and is answered NOT_LEADER (the ledger refuses a leader whose
// term ended, and one that cannot reach etcd loses its term soon).
func (s *Store) settleRemoval(ctx context.Context) error {
	if !s.unset.on.Load() {
		return nil
	}
	if s.tombs.active.Load() {
		for idx := range s.tombs.detachedSet() {
			s.markUnsettled(idx)
		}
	}
	return s.settle(ctx)
}

// settle records the unsettled segments not yet in the ledger.
func (s *Store) settle(ctx context.Context) error {
	u := &s.unset
	if !u.dirty.Load() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	u.writeMu.Lock()
	defer u.writeMu.Unlock()
	u.mu.Lock()
	idxs := make([]uint32, 0, len(u.pending))
	for idx := range u.pending {
		idxs = append(idxs, idx)
	}
	u.mu.Unlock()
	if len(idxs) == 0 {
		return nil
	}
	// A segment gone meanwhile (neither registered nor detached) needs
	// no record: nothing of it can come back.
	segs := make([]UnsettledSegment, 0, len(idxs))
	kept := make([]uint32, 0, len(idxs)) // segs' indexes
	for _, idx := range idxs {
		if sg, ok := s.unsettledInfo(idx); ok {
			segs = append(segs, sg)
			kept = append(kept, idx)
		}
	}
	if len(segs) > 0 {
		if err := u.ledger.Record(ctx, segs); err != nil {
			if rpcerr.Reason(err) != "" {
				return err // the ledger chose (a single master's file: INTERNAL)
			}
			return rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, err,
				"the removal is done here but not recorded in etcd, and a new leader could serve the object again: %v", err)
		}
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, idx := range idxs {
		delete(u.pending, idx)
	}
	for _, idx := range kept {
		u.recorded[idx] = true
	}
	u.dirty.Store(len(u.pending) > 0)
	return nil
}

// settleInto settles a removal before it answers, unless *err is set
// already: defer s.settleInto(ctx, &err).
func (s *Store) settleInto(ctx context.Context, err *error) {
	if *err == nil {
		*err = s.settleRemoval(ctx)
	}
}

// unsettledInfo describes segment idx for its record; false once it is
// gone (neither registered nor detached: nothing of it can come back).
func (s *Store) unsettledInfo(idx uint32) (UnsettledSegment, bool) {
	id := s.segs.get(idx).id
	if sv, ok := s.reg.Segment(id); ok && sv.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
		return UnsettledSegment{ID: id, Agent: sv.AgentID, Memory: sv.Medium != masterv1.Medium_MEDIUM_DISK}, true
	}
	if d, ok := s.tombs.detachedInfo(idx); ok {
		return UnsettledSegment{ID: id, Agent: d.agent, Memory: d.memory}, true
	}
	return UnsettledSegment{}, false
}

// unsettledNow returns the segments on which a release is owed or that are
// detached: a record stays while either holds (a superset of what made
// the segments unsettled, which is not kept).
func (s *Store) unsettledNow() map[uint32]bool {
	now := s.tombs.detachedSet()
	s.owedMu.Lock()
	for k := range s.owed {
		now[k.seg] = true
	}
	s.owedMu.Unlock()
	return now
}

// syncUnsettled brings the ledger up to date, in the leader's sweep:
// records what is pending, and removes the records of segments settled
// again. A record stops counting (recorded cleared) before the segments
// are checked again and before it is removed, so an owe or a detachment
// racing the sweep either shows in the check (the record stays) or
// finds the segment unrecorded and records it again (after this write,
// which holds writeMu).
func (s *Store) syncUnsettled(ctx context.Context) {
	u := &s.unset
	if !u.on.Load() || s.following.Load() {
		return
	}
	if err := s.settle(ctx); err != nil {
		s.lg.Warn("unsettled segments not recorded in etcd; removals wait for it", "err", err)
		return
	}
	u.writeMu.Lock()
	defer u.writeMu.Unlock()
	now := s.unsettledNow()
	u.mu.Lock()
	var cands []uint32
	for idx := range u.recorded {
		if !now[idx] {
			cands = append(cands, idx)
			delete(u.recorded, idx)
		}
	}
	u.mu.Unlock()
	if len(cands) == 0 {
		return
	}
	now = s.unsettledNow()
	var ids []string
	var settled []uint32
	u.mu.Lock()
	for _, idx := range cands {
		if now[idx] {
			u.recorded[idx] = true // unsettled again meanwhile: keep the record
			continue
		}
		ids = append(ids, s.segs.get(idx).id)
		settled = append(settled, idx)
	}
	u.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	fctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	if err := u.ledger.Forget(fctx, ids); err != nil {
		// Whether the records went is unknown: write them again, and
		// remove them at a later sweep.
		s.lg.Warn("settled segments not removed from etcd; tried again", "segments", len(ids), "err", err)
		u.mu.Lock()
		for _, idx := range settled {
			u.markLocked(idx)
		}
		u.mu.Unlock()
		return
	}
	s.lg.Info("segments settled: their unsettled records removed", "segment_ids", ids)
}

// Distrust makes a newly elected leader's store (a following store, before
// Promote), or a single master's before it serves after a restart, trust
// nothing sealed on the segments an earlier master recorded as unsettled:
// each may hold allocations of objects that master removed and
// acknowledged. Every replica held there is dropped and its release
// owed (sent when the agent registers), and the segments are detached with
// every key removed (tombstones.distrust): a registration returns, never
// adopts, their other sealed allocations. Once the agent has registered
// and taken what was owed the segment is settled again.
func (s *Store) Distrust(segs []UnsettledSegment) {
	if len(segs) == 0 {
		return
	}
	nowMs := s.nowMs()
	set := make(map[uint32]bool, len(segs))
	for _, sg := range segs {
		idx := s.segs.intern(sg.ID)
		agent, memory := sg.Agent, sg.Memory
		if sv, ok := s.reg.Segment(sg.ID); ok {
			agent, memory = sv.AgentID, sv.Medium != masterv1.Medium_MEDIUM_DISK
		}
		s.tombs.distrust(idx, nowMs, agent, memory)
		set[idx] = true
	}
	s.unset.distrusted.Add(uint64(len(set)))
	owed := map[uint32][]uint64{}
	dropped := s.dropReplicasOn(set, func(r replica) {
		if !r.pending {
			owed[r.seg] = append(owed[r.seg], r.allocID)
		}
	})
	for idx, allocs := range owed {
		s.owe(idx, allocs)
	}
	s.lg.Warn("segments an earlier master left unsettled are distrusted: their replicas dropped, their objects lost to the cache",
		"segments", len(set), "replicas_dropped", dropped)
}
