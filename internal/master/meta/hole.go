package meta

import (
	"cmp"
	"context"
	"slices"
)

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
			for key, o := range objs.all() {
				ok, pinned := s.evictableLocked(shd, o, now)
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
