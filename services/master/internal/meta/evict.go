package meta

import (
	"cmp"
	"context"
	"math"
	"math/bits"
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Eviction frees space on segments whose placed bytes crossed the high
// watermark, down to the low watermark. Victims are whole objects, least
// recently used first (the access clock is the last read lease grant or the
// completion time). Never evicted: objects with a write in progress or a
// move in flight (a PROCESSING replica), leased objects, hard-pinned
// objects. Soft-pinned objects go only after every unpinned candidate.
//
// Each shard keeps its objects in access order (the recency list, see
// shard), so a pass (evict) reads only the lists' least recent ends, about
// as many objects as it evicts. Making a contiguous hole (makeHole) needs
// every extent of a segment by offset and still scans every object; only
// PutStarts that found no room get there.

// evictTarget is a segment that needs room and how many bytes.
type evictTarget struct {
	seg  uint32
	need int64
}

// evictOverHigh is the background check: every segment at or above the
// high watermark is evicted down to the low watermark. It counts what the
// metadata has placed, not the agent's last reported use: that report lags
// by a heartbeat and would make every tick evict again what the previous
// one already freed. (A put that finds no room uses both; see evictFor.)
func (s *Store) evictOverHigh(ctx context.Context) {
	var targets []evictTarget
	for _, sg := range s.reg.Segments() {
		idx, ok := s.segs.lookup(sg.ID)
		if !ok || sg.Capacity == 0 {
			continue
		}
		used := s.segs.get(idx).placed.Load()
		if float64(used) >= s.cfg.HighWatermark*float64(sg.Capacity) {
			targets = append(targets, evictTarget{seg: idx, need: used - int64(s.cfg.LowWatermark*float64(sg.Capacity))})
		}
	}
	if len(targets) > 0 {
		s.evict(ctx, targets)
	}
}

// overHighLocked reports whether seg crossed the high watermark (PutStart
// kicks the background check when it did).
func (s *Store) overHigh(v *segView) bool {
	return float64(v.e.placed.Load()) >= s.cfg.HighWatermark*float64(v.seg.Capacity)
}

// evictFor makes room for PutStarts that found none: need is their total
// size, maxSize the largest of them. Every allocatable segment of medium
// above the low watermark is evicted down to it (and if none is, the
// fullest one is asked for need bytes, least recently used first). Then,
// because free bytes are not free extents, it makes sure some segment has a
// contiguous hole of maxSize (evicting the cheapest run of neighbouring
// objects when none has) and returns that segment's id for the retry to
// prefer ("" when there is none).
func (s *Store) evictFor(ctx context.Context, medium masterv1.Medium, need, maxSize uint64) string {
	var targets []evictTarget
	var fullest *evictTarget
	var fullestUsed int64
	var segs []holeSeg
	for _, sg := range s.reg.Segments() {
		if sg.Medium != medium || !sg.CanAllocate() || sg.Capacity == 0 {
			continue
		}
		idx := s.segs.intern(sg.ID)
		segs = append(segs, holeSeg{idx: idx, capacity: sg.Capacity})
		used := s.segs.get(idx).used(sg)
		low := int64(s.cfg.LowWatermark * float64(sg.Capacity))
		if used > low {
			targets = append(targets, evictTarget{seg: idx, need: max(used-low, int64(need))})
		} else if fullest == nil || used > fullestUsed {
			fullest, fullestUsed = &evictTarget{seg: idx, need: int64(need)}, used
		}
	}
	if len(targets) == 0 && fullest != nil {
		targets = append(targets, *fullest)
	}
	if len(targets) > 0 {
		s.evict(ctx, targets)
	}
	if len(segs) == 0 || maxSize == 0 {
		return ""
	}
	return s.makeHole(ctx, segs, maxSize)
}

// evictCand is an object chosen for eviction: what evictVictimsLocked
// needs to find it again and check that it did not change meanwhile.
type evictCand struct {
	key    string
	access int64
	size   uint64
	tenant uint32
	shard  uint16
	pinned bool
}

// evictableLocked reports whether o may be evicted now, and whether it is
// soft-pinned (second choice).
func (s *Store) evictableLocked(o *object, nowMs int64) (ok, pinned bool) {
	if o.put != nil || o.flags&flagHardPin != 0 || o.leased(nowMs, s.cfg.LeaseTTL) {
		return false, false
	}
	for i := range o.replicas {
		if o.replicas[i].status != stComplete {
			return false, false
		}
	}
	return true, o.softPinned(nowMs)
}

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
		ok, pinned := s.evictableLocked(o, now)
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

// candList is an append-only list of candidates in blocks (growing it
// copies nothing).
type candList struct {
	blocks [][]evictCand
	n      uint32
}

const candBlock = 4096

func (l *candList) add(c evictCand) {
	if l.n%candBlock == 0 {
		if len(l.blocks) < cap(l.blocks) { // a block of an earlier round
			l.blocks = l.blocks[:len(l.blocks)+1]
			l.blocks[len(l.blocks)-1] = l.blocks[len(l.blocks)-1][:0]
		} else {
			l.blocks = append(l.blocks, make([]evictCand, 0, candBlock))
		}
	}
	b := &l.blocks[len(l.blocks)-1]
	*b = append(*b, c)
	l.n++
}

// reset empties the list, keeping its blocks.
func (l *candList) reset() {
	for _, b := range l.blocks {
		clear(b) // drop the keys
	}
	l.blocks, l.n = l.blocks[:0], 0
}

func (l *candList) at(i uint32) *evictCand { return &l.blocks[i/candBlock][i%candBlock] }

// evictRank is a candidate's place in the eviction order, which is what a
// selection heap holds (24 bytes; the candidate is cands[idx]).
type evictRank struct {
	access int64
	size   uint64
	idx    uint32 // in scan order
	pinned bool
}

// after reports whether a comes after b in eviction order: soft-pinned
// after unpinned, then more recent access after less, then later in the
// scan after earlier.
func (a *evictRank) after(b *evictRank) bool {
	if a.pinned != b.pinned {
		return a.pinned
	}
	if a.access != b.access {
		return a.access > b.access
	}
	return a.idx > b.idx
}

// evictHeap is one target's selection: the shortest eviction-order prefix
// of the candidates offered so far whose sizes add up to need (all of them
// while they add up to less), as a max-heap: the last of them in eviction
// order is items[0].
type evictHeap struct {
	items []evictRank
	bytes int64 // total size of items
	need  int64 // > 0 for a heap in use
}

// offer adds r to the selection if it belongs to the prefix, and drops
// whatever that makes unnecessary. It reports whether it took r.
func (h *evictHeap) offer(r evictRank) bool {
	if h.bytes >= h.need && r.after(&h.items[0]) {
		return false // after every selected candidate, which suffice
	}
	h.items = append(h.items, r)
	h.bytes += int64(r.size)
	h.up(len(h.items) - 1)
	// Drop the last one while the others still meet the need (need > 0,
	// so one stays).
	for h.bytes-int64(h.items[0].size) >= h.need {
		h.bytes -= int64(h.items[0].size)
		last := len(h.items) - 1
		h.items[0] = h.items[last]
		h.items = h.items[:last]
		h.down(0)
	}
	return true
}

func (h *evictHeap) up(i int) {
	x := h.items[i]
	for i > 0 {
		parent := (i - 1) / 2
		if !x.after(&h.items[parent]) {
			break
		}
		h.items[i] = h.items[parent]
		i = parent
	}
	h.items[i] = x
}

func (h *evictHeap) down(i int) {
	n := len(h.items)
	if n == 0 {
		return
	}
	x := h.items[i]
	for {
		child := 2*i + 1
		if child >= n {
			break
		}
		if r := child + 1; r < n && h.items[r].after(&h.items[child]) {
			child = r
		}
		if !h.items[child].after(&x) {
			break
		}
		h.items[i] = h.items[child]
		i = child
	}
	h.items[i] = x
}

// evictVictims removes the chosen objects (serialised with other evictions).
func (s *Store) evictVictims(ctx context.Context, victims []evictCand) int {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	return s.evictVictimsLocked(ctx, groupByShard(victims, len(s.shards), func(c *evictCand) int { return int(c.shard) }))
}

// evictVictimsLocked removes each victim that is still evictable and
// unchanged (same access clock) and releases their allocations. Victims
// come in runs of one shard each (one lock per run), removed in order. It
// returns how many it removed. evictMu must be held.
func (s *Store) evictVictimsLocked(ctx context.Context, runs [][]evictCand) int {
	rel := &releases{}
	n := 0
	for _, run := range runs {
		shd := &s.shards[run[0].shard]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, c := range run {
			o := shd.getLocked(c.tenant, c.key)
			if o == nil {
				continue
			}
			// Re-check: it may have been read, pinned or rewritten since.
			if ok, _ := s.evictableLocked(o, m.nowMs); !ok || o.accessMs != c.access {
				continue
			}
			m.removeAll(o, true)
			n++
		}
		m.commit()
		shd.mu.Unlock()
	}
	s.evicted.Add(float64(n))
	cctx, cancel := cleanupCtx(ctx)
	defer cancel()
	s.sendReleases(cctx, rel)
	return n
}

// groupByShard returns xs in runs of one shard each, in shard order, each
// run in the order of xs (a counting sort: one pass to count, one to
// place). shardOf must be < shards.
func groupByShard[T any](xs []T, shards int, shardOf func(*T) int) [][]T {
	if len(xs) == 0 {
		return nil
	}
	next := make([]int, shards+1) // start of each shard's run, then its end
	for i := range xs {
		next[shardOf(&xs[i])+1]++
	}
	groups := 0
	for sh := 1; sh <= shards; sh++ {
		if next[sh] > 0 {
			groups++
		}
		next[sh] += next[sh-1]
	}
	out := make([]T, len(xs))
	for i := range xs {
		sh := shardOf(&xs[i])
		out[next[sh]] = xs[i]
		next[sh]++
	}
	runs := make([][]T, 0, groups)
	lo := 0
	for sh := range shards {
		if hi := next[sh]; hi > lo {
			runs = append(runs, out[lo:hi:hi])
			lo = hi
		}
	}
	return runs
}

// holeSlack is added to a wanted hole: the agent rounds extents up to its
// alignment (64 B for memory, 4 KiB for disk), which the metadata does not
// track, so each neighbour may end up to that much later than its size says.
const holeSlack = 8192

type holeSeg struct {
	idx      uint32
	capacity uint64
}

// extent is one replica's bytes on a segment, as the metadata knows them.
type extent struct {
	off, end uint64
	evictCand
	ok bool // evictable now
}

// makeHole finds, over segs, the cheapest way to get a contiguous free
// range of size bytes — an existing gap costs nothing; otherwise a run of
// neighbouring evictable objects whose removal joins the gaps around it,
// preferring runs without soft-pinned objects, then the least recently used
// — evicts that run, and returns the segment id ("" when no run exists).
func (s *Store) makeHole(ctx context.Context, segs []holeSeg, size uint64) string {
	s.evictMu.Lock()
	pos := make(map[uint32]int, len(segs))
	for i, sg := range segs {
		pos[sg.idx] = i
	}
	exts := make([][]extent, len(segs))
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		now := s.nowMs()
		for t, objs := range shd.tenants {
			for key, o := range objs {
				ok, pinned := s.evictableLocked(o, now)
				for _, r := range o.replicas {
					p, hit := pos[r.seg]
					if !hit || r.pending {
						continue
					}
					exts[p] = append(exts[p], extent{off: r.offset, end: r.offset + o.size, ok: ok,
						evictCand: evictCand{key: key, access: o.accessMs, size: o.size, tenant: t, shard: uint16(sh), pinned: pinned}})
				}
			}
		}
		shd.mu.Unlock()
	}
	want := size + holeSlack
	best, bestSeg := holeCost{pinned: -1}, -1
	var bestRun []extent
	for p, xs := range exts {
		slices.SortFunc(xs, func(a, b extent) int { return cmp.Compare(a.off, b.off) })
		c, run := cheapestRun(xs, segs[p].capacity, want)
		if c.pinned < 0 {
			continue
		}
		if bestSeg < 0 || c.less(best) {
			best, bestSeg, bestRun = c, p, run
		}
	}
	s.evictMu.Unlock()
	if bestSeg < 0 {
		return ""
	}
	if len(bestRun) > 0 {
		victims := make([]evictCand, len(bestRun))
		for i := range bestRun {
			victims[i] = bestRun[i].evictCand
		}
		if n := s.evictVictims(ctx, victims); n < len(victims) {
			return "" // something changed meanwhile; the retry will tell
		}
	}
	return s.segs.get(segs[bestSeg].idx).id
}

// holeCost orders candidate runs: fewer soft-pinned objects, then older
// newest access, then fewer bytes. pinned < 0 means no run.
type holeCost struct {
	pinned int
	access int64
	bytes  uint64
}

func (a holeCost) less(b holeCost) bool {
	if a.pinned != b.pinned {
		return a.pinned < b.pinned
	}
	if a.access != b.access {
		return a.access < b.access
	}
	return a.bytes < b.bytes
}

// cheapestRun returns the cheapest run of consecutive extents (sorted by
// offset) whose removal leaves want contiguous free bytes in [0, capacity);
// an existing gap is an empty run at zero cost.
func cheapestRun(xs []extent, capacity, want uint64) (holeCost, []extent) {
	endBefore := func(i int) uint64 { // end of the extent before index i
		if i == 0 {
			return 0
		}
		return xs[i-1].end
	}
	startAt := func(j int) uint64 { // start of extent j (capacity past the end)
		if j >= len(xs) {
			return capacity
		}
		return xs[j].off
	}
	for i := 0; i <= len(xs); i++ {
		if a, b := endBefore(i), startAt(i); b > a && b-a >= want {
			return holeCost{}, nil
		}
	}
	best := holeCost{pinned: -1}
	var run []extent
	// Window xs[i..j] (inclusive), all evictable; grow j until the range
	// from endBefore(i) to startAt(j+1) holds want bytes.
	for i := 0; i < len(xs); i++ {
		if !xs[i].ok {
			continue
		}
		c := holeCost{}
		for j := i; j < len(xs) && xs[j].ok; j++ {
			if xs[j].pinned {
				c.pinned++
			}
			c.access = max(c.access, xs[j].access)
			c.bytes += xs[j].size
			if best.pinned >= 0 && best.less(c) {
				break // only gets worse
			}
			if a, b := endBefore(i), startAt(j+1); b > a && b-a >= want {
				if best.pinned < 0 || c.less(best) {
					best, run = c, xs[i:j+1]
				}
				break
			}
		}
	}
	return best, run
}
