package meta

import (
	"cmp"
	"context"
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Eviction frees space on segments whose placed bytes crossed the high
// watermark, down to the low watermark. Victims are whole objects, least
// recently used first (the access clock is the last read lease grant or the
// completion time). Never evicted: objects with a write in progress or a
// move in flight (a PROCESSING replica), leased objects, hard-pinned
// objects. Soft-pinned objects go only after every unpinned candidate.

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

type evictCand struct {
	key    string
	access int64
	size   uint64
	mask   uint64 // which targets (by position, first 64) it has replicas on
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
func (s *Store) evict(ctx context.Context, targets []evictTarget) int {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	if len(targets) > 64 {
		targets = targets[:64]
	}
	pos := make(map[uint32]int, len(targets))
	for i, t := range targets {
		pos[t.seg] = i
	}
	var cands []evictCand
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		now := s.nowMs()
		for t, objs := range shd.tenants {
			for key, o := range objs {
				var mask uint64
				for _, r := range o.replicas {
					if p, ok := pos[r.seg]; ok {
						mask |= 1 << p
					}
				}
				if mask == 0 {
					continue
				}
				ok, pinned := s.evictableLocked(o, now)
				if !ok {
					continue
				}
				cands = append(cands, evictCand{key: key, access: o.accessMs, size: o.size, mask: mask, tenant: t, shard: uint16(sh), pinned: pinned})
			}
		}
		shd.mu.Unlock()
	}
	slices.SortFunc(cands, func(a, b evictCand) int {
		if a.pinned != b.pinned {
			if a.pinned {
				return 1
			}
			return -1
		}
		return cmp.Compare(a.access, b.access)
	})
	need := make([]int64, len(targets))
	left := 0
	for i, t := range targets {
		need[i] = t.need
		if t.need > 0 {
			left++
		}
	}
	var victims []evictCand
	for _, c := range cands {
		if left == 0 {
			break
		}
		useful := false
		for p := range targets {
			if c.mask&(1<<p) != 0 && need[p] > 0 {
				useful = true
			}
		}
		if !useful {
			continue
		}
		victims = append(victims, c)
		for p := range targets {
			if c.mask&(1<<p) != 0 && need[p] > 0 {
				need[p] -= int64(c.size)
				if need[p] <= 0 {
					left--
				}
			}
		}
	}
	if len(victims) == 0 {
		return 0
	}
	n := s.evictVictimsLocked(ctx, victims)
	if n > 0 {
		s.lg.Debug("evicted objects", "objects", n, "segments", len(targets))
	}
	return n
}

// evictVictims removes the chosen objects (serialised with other evictions).
func (s *Store) evictVictims(ctx context.Context, victims []evictCand) int {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	return s.evictVictimsLocked(ctx, victims)
}

// evictVictimsLocked removes each victim that is still evictable and
// unchanged (same access clock), one lock per shard, and releases their
// allocations. It returns how many it removed. evictMu must be held.
func (s *Store) evictVictimsLocked(ctx context.Context, victims []evictCand) int {
	rel := &releases{}
	n := 0
	forShards(victims, func(c evictCand) int { return int(c.shard) }, func(sh int, group []evictCand) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, c := range group {
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
	})
	s.evicted.Add(float64(n))
	cctx, cancel := cleanupCtx(ctx)
	defer cancel()
	s.sendReleases(cctx, rel)
	return n
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
