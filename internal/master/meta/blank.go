package meta

import (
	"context"
	"math"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Blank reservations (issue 18 item 2; ARCHITECTURE §4, "PutStart without
// the agent's Reserve").
//
// A put's PutStart used to wait for one Reserve round trip to each replica's
// agent: at 4 concurrent 1 MiB puts on two cores, a third of PutStart and
// about a seventh of the whole put. The master now keeps, per segment and
// per object size it has placed there, a few blank reservations: allocations
// an agent reserved ahead, in one batched Reserve, with no object identity.
// A PutStart that places a replica on a segment with a blank of its size
// takes the blank instead of reserving; the put's write token names the
// object and replica, and the agent records them when the write opens,
// before any byte lands. A refill goes out in the background when a pool
// runs low.
//
// What keeps it safe:
//   - A blank is RESERVED at the agent: the table feed never carries it, a
//     registration lists it flagged with no object (which keeps the replica
//     of a put the master handed it to, reconcile.go) and nothing adopts
//     it, and the agent's reservation grace frees it if the master forgets
//     it. The master uses a blank within BlankMaxAge (half
//     the grace) or releases it, so the agent never frees one a put holds.
//   - A registration of the agent (it restarted, or reconnected after a
//     loss) drops its segments' pools: an agent that restarted has no
//     RESERVED allocation left.
//   - Blanks count as used when placing (segEntry.used); a refill stops at
//     the low watermark, so blanks never make eviction evict; and a put
//     short of room releases its medium's blanks before it evicts, since
//     they are no object's and sit where a contiguous hole must form.
//   - A size gets blanks from its second put on: a workload of assorted
//     sizes keeps none.
//   - A following store (a standby) keeps no blanks; it is promoted with
//     none.

// maxBlankSizes bounds the object sizes a segment keeps blanks of: an
// engine writes one block size per model, so a few cover a cluster, and
// sizes beyond them are reserved per put as before.
const maxBlankSizes = 4

// blankShare bounds one pool's bytes to 1/64 of its segment (all of a
// segment's pools to 1/16): a pool holds min(BlankPool, capacity/64/size)
// blanks, and sizes that would get fewer than 2 are not pooled (a 512 MiB
// segment pools 8 blanks of 1 MiB, 2 of 4 MiB, none of 8 MiB).
const blankShare = 64

// blankDepth is how many blanks of size a segment of capacity bytes keeps;
// below 2, none.
func (s *Store) blankDepth(capacity, size uint64) int {
	if s.cfg.BlankPool <= 0 || size == 0 {
		return 0
	}
	n := min(uint64(s.cfg.BlankPool), capacity/blankShare/size)
	if n < 2 {
		return 0
	}
	return int(n)
}

// blank is one allocation reserved ahead.
type blank struct {
	alloc, offset uint64
	madeMs        int64 // when its Reserve was sent (master clock)
}

// blankPool is one segment's blanks of one object size, oldest first.
type blankPool struct {
	blanks []blank
	// usedMs is when a put last took a blank or wanted one (created the
	// pool); a pool unused for BlankMaxAge is dropped.
	usedMs int64
	// uses counts the puts that came for a blank; a pool is filled from
	// the second on, so sizes put once (a workload of assorted sizes)
	// hold no space.
	uses      int
	refilling bool
}

// blankPools are one segment's pools by object size. Leaf lock.
type blankPools struct {
	mu     sync.Mutex
	bySize map[uint64]*blankPool
}

// takeBlank gives a replica of size bytes on v's segment one of its blanks,
// the oldest fresh one (younger than BlankMaxAge; older ones wait for the
// sweep to release them). A miss creates the pool when the segment has a
// slot for its size (roomLocked), and a pool that puts came to twice and
// that is at or below half its depth asks for a refill.
func (s *Store) takeBlank(v *segView, size uint64, nowMs int64) (b blank, ok bool) {
	return s.takeBlankAs(v, size, nowMs, false)
}

// takeBlankAs is takeBlank; a lease (LeaseSpares) takes only from a pool
// that exists and is not a put's use of the size: a size still gets blanks
// only from its second put on the segment.
func (s *Store) takeBlankAs(v *segView, size uint64, nowMs int64, lease bool) (b blank, ok bool) {
	depth := s.blankDepth(v.seg.Capacity, size)
	if depth == 0 || s.following.Load() {
		return blank{}, false
	}
	ps := &v.e.blanks
	ps.mu.Lock()
	p := ps.bySize[size]
	if p == nil && lease {
		ps.mu.Unlock()
		return blank{}, false
	}
	if p == nil {
		if !ps.roomLocked() {
			ps.mu.Unlock()
			return blank{}, false
		}
		p = &blankPool{}
		ps.bySize[size] = p
	}
	p.usedMs = nowMs
	if !lease {
		p.uses = min(p.uses+1, 2)
	}
	oldest := nowMs - s.cfg.BlankMaxAge.Milliseconds()
	// Blanks are in the order their refills were sent, so the head is
	// the oldest: take it when fresh, else the tail when that is.
	switch n := len(p.blanks); {
	case n > 0 && p.blanks[0].madeMs > oldest:
		b, ok = p.blanks[0], true
		p.blanks = p.blanks[1:]
	case n > 0 && p.blanks[n-1].madeMs > oldest:
		b, ok = p.blanks[n-1], true
		p.blanks = p.blanks[:n-1]
	}
	refill := !p.refilling && p.uses >= 2 && len(p.blanks) <= depth/2
	ps.mu.Unlock()
	if ok {
		v.e.blankBytes.Add(-int64(size))
		s.blanksTaken.Add(1)
	}
	if refill {
		s.kickBlanks()
	}
	return b, ok
}

// roomLocked makes room for one more size's pool: under maxBlankSizes, or
// by dropping a pool of a size put only once that holds nothing. ps.mu is
// held.
func (ps *blankPools) roomLocked() bool {
	if ps.bySize == nil {
		ps.bySize = make(map[uint64]*blankPool, maxBlankSizes)
	}
	if len(ps.bySize) < maxBlankSizes {
		return true
	}
	for size, p := range ps.bySize {
		if p.uses < 2 && len(p.blanks) == 0 && !p.refilling {
			delete(ps.bySize, size)
			return true
		}
	}
	return false
}

func (s *Store) kickBlanks() {
	select {
	case s.blankKick <- struct{}{}:
	default:
	}
}

// blankLoop refills the pools that ran low when kicked, and every
// BlankMaxAge/4 releases the blanks that reached BlankMaxAge and drops the
// pools nobody used for that long. It returns when ctx ends.
func (s *Store) blankLoop(ctx context.Context) {
	t := time.NewTicker(max(s.cfg.BlankMaxAge/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.closed:
			return
		case <-t.C:
			s.sweepBlanks(ctx)
		case <-s.blankKick:
		}
		s.refillBlanks(ctx)
	}
}

// refillReq is one pool's refill.
type refillReq struct {
	seg  uint32
	size uint64
	n    int
}

// refillBlanks tops up every pool at or below half its depth that puts
// came to at least twice and last within BlankMaxAge, on segments that can
// allocate, without taking a segment past the low watermark (blanks are
// for a segment with room; past it eviction is near, and a put short of
// room releases them, releaseBlanksOf): one batched Reserve per agent,
// agents in parallel.
func (s *Store) refillBlanks(ctx context.Context) {
	if s.following.Load() || s.cfg.BlankPool <= 0 {
		return
	}
	nowMs := s.nowMs()
	type batch struct {
		items []*masterv1.ReserveItem
		reqs  []refillReq
	}
	per := map[string]*batch{}
	for idx, e := range s.segs.all() {
		sg, ok := s.reg.Segment(e.id)
		if !ok || !sg.CanAllocate() {
			continue
		}
		room := int64(s.cfg.LowWatermark*float64(sg.Capacity)) - e.placed.Load() - e.blankBytes.Load()
		e.blanks.mu.Lock()
		for size, p := range e.blanks.bySize {
			depth := s.blankDepth(sg.Capacity, size)
			if p.refilling || p.uses < 2 || len(p.blanks) > depth/2 || nowMs-p.usedMs >= s.cfg.BlankMaxAge.Milliseconds() {
				continue
			}
			n := min(depth-len(p.blanks), int(max(room, 0)/int64(size)))
			if n <= 0 {
				continue
			}
			room -= int64(n) * int64(size)
			p.refilling = true
			b := per[sg.AgentID]
			if b == nil {
				b = &batch{}
				per[sg.AgentID] = b
			}
			for range n {
				b.items = append(b.items, &masterv1.ReserveItem{SegmentId: e.id, Size: size, Blank: true})
			}
			b.reqs = append(b.reqs, refillReq{seg: uint32(idx), size: size, n: n})
		}
		e.blanks.mu.Unlock()
	}
	if len(per) == 0 {
		return
	}
	rctx, cancel := cleanupCtx(ctx)
	defer cancel()
	fanOut(per, func(agent string, b *batch) {
		out, err := s.agents.Reserve(rctx, agent, b.items)
		if err == nil && len(out) != len(b.items) {
			err = errInternal("agent %s answered %d reservations for %d items", agent, len(out), len(b.items))
		}
		if err != nil {
			s.lg.Debug("blank refill failed", "agent_id", agent, "items", len(b.items), "err", err)
		}
		var orphans []*masterv1.AllocationRef
		k := 0
		for _, r := range b.reqs {
			e := s.segs.get(r.seg)
			got := make([]blank, 0, r.n)
			for range r.n {
				if err == nil && out[k].GetStatus().GetCode() == 0 {
					got = append(got, blank{alloc: out[k].GetAllocationId(), offset: out[k].GetOffset(), madeMs: nowMs})
				}
				k++
			}
			e.blanks.mu.Lock()
			if p := e.blanks.bySize[r.size]; p != nil && p.refilling {
				p.refilling = false
				p.blanks = append(p.blanks, got...)
				e.blankBytes.Add(int64(len(got)) * int64(r.size))
				got = nil
			}
			e.blanks.mu.Unlock()
			for _, g := range got { // the pool was dropped meanwhile
				orphans = append(orphans, &masterv1.AllocationRef{SegmentId: e.id, AllocationId: g.alloc})
			}
		}
		s.releaseBlanks(rctx, agent, orphans)
	})
}

// sweepBlanks releases the blanks that reached BlankMaxAge and those of
// segments that can no longer allocate, and drops empty pools nobody used
// for BlankMaxAge.
func (s *Store) sweepBlanks(ctx context.Context) {
	nowMs := s.nowMs()
	oldest := nowMs - s.cfg.BlankMaxAge.Milliseconds()
	per := map[string][]*masterv1.AllocationRef{}
	for _, e := range s.segs.all() {
		sg, ok := s.reg.Segment(e.id)
		all := !ok || !sg.CanAllocate()
		e.blanks.mu.Lock()
		for size, p := range e.blanks.bySize {
			i := 0
			for ; i < len(p.blanks) && (all || p.blanks[i].madeMs <= oldest); i++ {
				if ok {
					per[sg.AgentID] = append(per[sg.AgentID], &masterv1.AllocationRef{SegmentId: e.id, AllocationId: p.blanks[i].alloc})
				}
			}
			p.blanks = p.blanks[i:]
			e.blankBytes.Add(-int64(i) * int64(size))
			if len(p.blanks) == 0 && !p.refilling && p.usedMs <= oldest {
				delete(e.blanks.bySize, size)
			}
		}
		e.blanks.mu.Unlock()
	}
	s.sweepSpares(nowMs, per)
	s.releaseBlanksAt(ctx, per)
}

// releaseBlanksOf releases every blank of the segments of medium at their
// agents and drops their pools: a put found no room, and blanks are the
// first room to give back (they also sit where eviction's contiguous hole
// must form). Waits for the releases, so the room is there for the retry.
func (s *Store) releaseBlanksOf(ctx context.Context, medium masterv1.Medium) {
	per := map[string][]*masterv1.AllocationRef{}
	for _, sg := range s.reg.Segments() {
		if sg.Medium != medium {
			continue
		}
		if idx, ok := s.segs.lookup(sg.ID); ok {
			for _, id := range s.segs.get(idx).emptyBlanks() {
				per[sg.AgentID] = append(per[sg.AgentID], &masterv1.AllocationRef{SegmentId: sg.ID, AllocationId: id})
			}
		}
	}
	if medium == masterv1.Medium_MEDIUM_MEMORY {
		// Spares too: a client's commit of one is then PUT_EXPIRED and
		// its put goes through PutStart.
		s.sweepSpares(math.MaxInt64, per)
	}
	s.releaseBlanksAt(ctx, per)
}

// dropBlanksOfUnsealable gives back the blanks of the segments (indices,
// by agent) whose agent answered a seal SEGMENT_UNAVAILABLE: a disk
// segment whose journal cannot be written (a full filesystem, an I/O
// error). The puts its blanks went to would fail the same way; without
// them the next PutStarts reserve, which such a segment refuses until it
// can seal again, and are placed elsewhere.
func (s *Store) dropBlanksOfUnsealable(ctx context.Context, segs map[string][]uint32) {
	per := map[string][]*masterv1.AllocationRef{}
	for agent, idxs := range segs {
		for _, idx := range idxs {
			e := s.segs.get(idx)
			for _, id := range e.emptyBlanks() {
				per[agent] = append(per[agent], &masterv1.AllocationRef{SegmentId: e.id, AllocationId: id})
			}
		}
	}
	s.releaseBlanksAt(ctx, per)
}

// emptyBlanks drops every pool of the segment and returns the ids of the
// blanks they held: releaseBlanksOf releases them; a registration of the
// segment's agent (BeginReconcile) and Promote only forget them. A refill
// in flight then lands in no pool and is released.
func (e *segEntry) emptyBlanks() (ids []uint64) {
	e.blanks.mu.Lock()
	defer e.blanks.mu.Unlock()
	for size, p := range e.blanks.bySize {
		for _, b := range p.blanks {
			ids = append(ids, b.alloc)
		}
		e.blankBytes.Add(-int64(len(p.blanks)) * int64(size))
		delete(e.blanks.bySize, size)
	}
	return ids
}

// releaseBlanksAt releases each agent's blanks in per, agents in parallel,
// under the cleanup timeout, and waits for them.
func (s *Store) releaseBlanksAt(ctx context.Context, per map[string][]*masterv1.AllocationRef) {
	if len(per) == 0 {
		return
	}
	rctx, cancel := cleanupCtx(ctx)
	defer cancel()
	fanOut(per, func(agent string, refs []*masterv1.AllocationRef) { s.releaseBlanks(rctx, agent, refs) })
}

// releaseBlanks releases blanks at their agent, best effort: one that
// cannot be released is freed by the agent's reservation grace (a blank is
// no object's, so nothing is owed).
func (s *Store) releaseBlanks(ctx context.Context, agent string, refs []*masterv1.AllocationRef) {
	if len(refs) == 0 {
		return
	}
	if err := s.agents.Release(ctx, agent, refs); err != nil {
		s.lg.Debug("blank release failed; the agent's grace frees them", "agent_id", agent, "allocations", len(refs), "err", err)
		return
	}
	now := s.nowMs()
	for _, r := range refs {
		if idx, ok := s.segs.lookup(r.SegmentId); ok {
			s.segs.get(idx).freedMs.Store(now)
		}
	}
}

// BlankStats reports the blanks held and their bytes, over all segments.
func (s *Store) BlankStats() (n int, bytes int64) {
	for _, e := range s.segs.all() {
		e.blanks.mu.Lock()
		for _, p := range e.blanks.bySize {
			n += len(p.blanks)
		}
		e.blanks.mu.Unlock()
		bytes += e.blankBytes.Load()
	}
	return n, bytes
}

// PutReservations reports the replicas PutStart placed on a blank
// reservation and those it reserved at the agent
// (crescent_master_put_reservations_total).
func (s *Store) PutReservations() (blank, reserve uint64) {
	return s.blanksTaken.Load(), s.reservesSent.Load()
}
