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
// high watermark is evicted down to the low watermark.
func (s *Store) evictOverHigh(ctx context.Context) {
	var targets []evictTarget
	for _, sg := range s.reg.Segments() {
		idx, ok := s.segs.lookup(sg.ID)
		if !ok || sg.Capacity == 0 {
			continue
		}
		used := max(s.segs.get(idx).placed.Load(), int64(sg.Used))
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

// evictFor makes room for a PutStart that found none: every allocatable
// segment of medium above the low watermark is evicted down to it, and if
// none is, the fullest one is asked for need bytes.
func (s *Store) evictFor(ctx context.Context, medium masterv1.Medium, need uint64) {
	var targets []evictTarget
	var fullest *evictTarget
	var fullestUsed int64
	for _, sg := range s.reg.Segments() {
		if sg.Medium != medium || !sg.CanAllocate() || sg.Capacity == 0 {
			continue
		}
		idx := s.segs.intern(sg.ID)
		used := max(s.segs.get(idx).placed.Load(), int64(sg.Used))
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
	if n > 0 {
		s.lg.Debug("evicted objects", "objects", n, "segments", len(targets))
	}
	return n
}
