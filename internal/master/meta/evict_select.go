package meta

import (
	"context"
	"math"
	"math/bits"
	"slices"
)

// evict removes victims until each target's need is met (or no candidate
// is left). It returns the number of objects evicted.
//
// The victims are what this greedy pass picks: go over every evictable
// object with a replica on a target, unpinned before soft-pinned, least
// recent access first, and take each one that has a replica on a target
// still in need (subtracting its size from every such target), until no
// target is in need. While a target is in need, every candidate on it is
// taken, so what the pass takes for target p is the shortest prefix, in
// that order, of the candidates on p whose sizes add up to p's need (p's
// run), and the victims are the union of the runs. The candidates offered
// are kept, per target, in a max-heap (evictHeap) holding the run of what
// was offered so far: a candidate after the heap's top is dropped with one
// comparison once the heap holds the need, and one before it goes in and
// pushes out the tops it makes unnecessary. Offering more than the run
// changes nothing, offering less than it does: the pass must offer every
// candidate that precedes the end of each run, and no more than that is
// what keeps it cheap. Ties in access are broken by offer order, the same
// way for every target.
//
// What is offered are prefixes of the shards' recency lists (least recent
// first; see shard), each walked under its shard's lock, so a pass visits
// a small multiple of the objects it evicts (plus the old objects it may
// not evict: hard-pinned, leased, being written), not every object. The
// pass goes in rounds, each walking every shard from its head afresh:
//
//   - By budgets: a shard stops once, for every target, the unpinned
//     candidates on it that this shard offered add up to the target's
//     budget. It then walked every object with an access below tau_S, the
//     last one walked's (infinity when it reached the end). With tau the
//     smallest tau_S, every candidate with an access below tau was offered,
//     and some with access tau, so a target's heap holds its run (under
//     the tie order "offered first") when its top, the run's last
//     candidate, is unpinned with an access up to tau. The first round's
//     budget is twice a shard's share of the need (keys hash evenly over
//     shards); when one round does not do, the next has four times the
//     budget, up to the whole need. That last round needs no check: a
//     candidate on shard S in p's run has the candidates on p before it add
//     up to less than the need, those of S alone too, so S's walk reached
//     it; and a run with a soft-pinned candidate means the unpinned ones on
//     p add up to less than the need, on every shard, whose walks thus went
//     to the end.
//   - Up to a limit (once): when the heaps hold their needs with unpinned
//     tops but tau is too early (the shard that met its budget first,
//     with few victims per shard), the next round walks every shard up to
//     the latest top's access instead, which offers every run whole.
func (s *Store) evict(ctx context.Context, targets []evictTarget) int {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	s.lastPass = evictPassStats{}
	if len(targets) > 64 {
		targets = targets[:64]
	}
	p := s.newEvictPass(targets)
	if p == nil {
		return 0
	}
	p.selectRuns()
	ranks := p.union()
	if len(ranks) == 0 {
		return 0
	}
	n := s.evictVictimsLocked(ctx, p.victimsByShard(ranks))
	if n > 0 {
		s.lg.Debug("evicted objects", "objects", n, "segments", len(targets),
			"walked", s.lastPass.walked, "rounds", s.lastPass.rounds)
	}
	return n
}

// evictPass is one eviction pass's state (see evict): one selection heap
// per target and the candidates the heaps refer to.
type evictPass struct {
	s      *Store
	heaps  []evictHeap
	segs   []uint32       // the targets' segments, by target
	pos    map[uint32]int // segment → target, when a linear search is slower
	active int            // targets in need
	// cands holds, in offer order, every candidate some heap took in; the
	// heaps refer to them by index.
	cands  candList
	budget []int64 // per shard, per round
	got    []int64 // this shard's unpinned bytes, up to budget
}

// newEvictPass sets up a pass over targets (at most 64), or returns nil
// when no target needs anything.
func (s *Store) newEvictPass(targets []evictTarget) *evictPass {
	// A segment named twice counts as its last entry (the earlier one gets
	// no candidates: its need stays unmet and frees nothing).
	heaps := make([]evictHeap, len(targets))
	segs := make([]uint32, len(targets))
	for i, t := range targets {
		segs[i] = t.seg
		heaps[i].need = t.need
		for j := range i {
			if segs[j] == t.seg {
				heaps[j].need = 0
			}
		}
	}
	active := 0
	for i := range heaps {
		if heaps[i].need > 0 {
			active++
		}
	}
	if active == 0 {
		return nil
	}
	var pos map[uint32]int
	if len(targets) > 8 {
		pos = make(map[uint32]int, len(targets))
		for i, sg := range segs {
			pos[sg] = i
		}
	}
	return &evictPass{
		s: s, heaps: heaps, segs: segs, pos: pos, active: active,
		budget: make([]int64, len(targets)),
		got:    make([]int64, len(targets)),
	}
}

// selectRuns offers candidates to the heaps, round after round, until each
// heap holds its target's run (see evict for the rounds).
func (p *evictPass) selectRuns() {
	s := p.s
	shards := int64(len(s.shards))
	scale := int64(2)
	// byLimit: this round walks every shard up to access limit, not by
	// budgets (at most once).
	var byLimit, triedLimit bool
	var limit int64
	for {
		last := !byLimit && scale >= shards
		p.setBudgets(last, scale, shards)
		p.cands.reset()
		tau := int64(math.MaxInt64)
		for sh := range s.shards {
			tau = min(tau, p.walkShard(sh, byLimit, limit))
		}
		s.lastPass.rounds++
		// Every candidate with an access below tau (and some with tau) was
		// offered, so each heap holds its run when its top is unpinned with
		// an access up to tau.
		end, ok := runsEnd(p.heaps)
		if last || tau == math.MaxInt64 || ok && end <= tau {
			break
		}
		if !byLimit {
			scale *= 4 // for the next round by budgets
		}
		if byLimit = ok && !triedLimit; byLimit {
			triedLimit, limit = true, end
			s.lastPass.byLimit = true
		}
	}
}

// setBudgets empties the heaps for a new round and sets each target's
// per-shard budget: the whole need in the last round, else
// ⌈need·scale/shards⌉.
func (p *evictPass) setBudgets(last bool, scale, shards int64) {
	for i := range p.heaps {
		h := &p.heaps[i]
		h.items, h.bytes = h.items[:0], 0
		switch {
		case h.need <= 0:
			p.budget[i] = 0
		case last:
			p.budget[i] = h.need
		default: // ⌈need·scale/shards⌉ without overflow, ≥ 1
			p.budget[i] = h.need/shards*scale + (h.need%shards*scale+shards-1)/shards
		}
	}
}

// walkShard walks shard sh's recency list from its head under its lock,
// offering every evictable object with a replica on a target, until every
// budget is met (or, byLimit, past access limit). It returns the walk's
// tau_S: every access below it was walked (math.MaxInt64 when the walk
// reached the end).
func (p *evictPass) walkShard(sh int, byLimit bool, limit int64) int64 {
	s := p.s
	tau := int64(math.MaxInt64)
	shd := &s.shards[sh]
	shd.mu.Lock()
	now := s.nowMs()
	clear(p.got)
	unmet := p.active
	o := shd.head
	for ; o != nil; o = o.next {
		if byLimit {
			if o.accessMs > limit {
				break
			}
		} else if unmet == 0 {
			break // every budget met
		}
		s.lastPass.walked++
		mask := p.targetMask(o)
		if mask == 0 {
			continue
		}
		ok, pinned := s.evictableLocked(shd, o, now)
		if !ok {
			continue
		}
		r := evictRank{access: o.accessMs, size: o.size, idx: p.cands.n, pinned: pinned}
		took := false
		for ; mask != 0; mask &= mask - 1 {
			i := bits.TrailingZeros64(mask)
			h := &p.heaps[i]
			if h.need <= 0 {
				continue
			}
			if h.offer(r) {
				took = true
			}
			if !pinned && p.got[i] < p.budget[i] {
				if p.got[i] += int64(o.size); p.got[i] >= p.budget[i] {
					unmet--
				}
			}
		}
		if took {
			p.cands.add(evictCand{key: o.key, access: o.accessMs, size: o.size, tenant: o.tenant, shard: uint16(sh), pinned: pinned})
		}
	}
	if o != nil { // stopped early, having walked every access below:
		if byLimit {
			tau = limit
		} else {
			tau = o.prev.accessMs
		}
	}
	shd.mu.Unlock()
	return tau
}

// targetMask returns the set of targets (bit i for target i) o has a
// replica on.
func (p *evictPass) targetMask(o *object) uint64 {
	var mask uint64
	for i := range o.replicas {
		seg := o.replicas[i].seg
		if p.pos != nil {
			if t, ok := p.pos[seg]; ok {
				mask |= 1 << t
			}
			continue
		}
		for t, ts := range p.segs {
			if ts == seg {
				mask |= 1 << t
			}
		}
	}
	return mask
}

// union returns the union of the heaps (a candidate taken for several
// targets once).
func (p *evictPass) union() []evictRank {
	var ranks []evictRank
	if p.active == 1 {
		for i := range p.heaps {
			if p.heaps[i].need > 0 {
				ranks = p.heaps[i].items
			}
		}
		return ranks
	}
	total := 0
	for i := range p.heaps {
		total += len(p.heaps[i].items)
	}
	ranks = make([]evictRank, 0, total)
	seen := make([]bool, p.cands.n)
	for i := range p.heaps {
		for _, r := range p.heaps[i].items {
			if !seen[r.idx] {
				seen[r.idx] = true
				ranks = append(ranks, r)
			}
		}
	}
	return ranks
}

// victimsByShard returns the candidates of ranks in runs of one shard
// each, each run in eviction order.
func (p *evictPass) victimsByShard(ranks []evictRank) [][]evictCand {
	runs := groupByShard(ranks, len(p.s.shards), func(r *evictRank) int { return int(p.cands.at(r.idx).shard) })
	victims := make([]evictCand, 0, len(ranks))
	groups := make([][]evictCand, 0, len(runs))
	for _, run := range runs {
		slices.SortFunc(run, func(a, b evictRank) int {
			switch {
			case a.after(&b):
				return 1
			case b.after(&a):
				return -1
			}
			return 0
		})
		lo := len(victims)
		for _, r := range run {
			victims = append(victims, *p.cands.at(r.idx))
		}
		groups = append(groups, victims[lo:])
	}
	return groups
}

// evictPassStats describes the last eviction pass (guarded by evictMu).
type evictPassStats struct {
	rounds  int  // walks over the shards' list prefixes
	walked  int  // objects visited, over all rounds
	byLimit bool // one round walked up to the runs' end
}

// runsEnd returns the latest access among the heaps' last candidates, when
// every heap in use holds its need with an unpinned last candidate: what
// was offered then covers the needs up to that access, so a walk of every
// shard up to it offers each target's run.
func runsEnd(heaps []evictHeap) (int64, bool) {
	end := int64(math.MinInt64)
	for i := range heaps {
		h := &heaps[i]
		if h.need <= 0 {
			continue
		}
		if h.bytes < h.need || h.items[0].pinned {
			return 0, false
		}
		end = max(end, h.items[0].access)
	}
	return end, true
}
