package meta

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
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
// With EvictOffload and a disk segment that can allocate, memory segments'
// victims are offloaded to disk instead of dropped (offload.go), after the
// drops of this check (disk segments' victims, whose room an offload may
// use); a memory segment whose offload pass was cut short by its bounds
// goes on down to the low watermark at the next check.
func (s *Store) evictOverHigh(ctx context.Context) {
	s.offloadMu.Lock()
	defer s.offloadMu.Unlock()
	segs := s.reg.Segments()
	offload := s.canOffload(segs)
	var drop, off []evictTarget
	for _, sg := range segs {
		idx, ok := s.segs.lookup(sg.ID)
		if !ok || sg.Capacity == 0 {
			continue
		}
		used := s.segs.get(idx).placed.Load()
		low := int64(s.cfg.LowWatermark * float64(sg.Capacity))
		over := float64(used) >= s.cfg.HighWatermark*float64(sg.Capacity)
		if offload && sg.Medium == masterv1.Medium_MEDIUM_MEMORY {
			if over || s.offloadMore[idx] && used > low {
				off = append(off, evictTarget{seg: idx, need: used - low})
			}
			continue
		}
		if over {
			drop = append(drop, evictTarget{seg: idx, need: used - low})
		}
	}
	clear(s.offloadMore)
	if len(drop) > 0 {
		// A pass of its own: a root span (the store's loop has none).
		ctx, span := tracer.Start(ctx, "master.evict")
		n := s.evict(ctx, drop)
		endEvict(span, "watermark", drop, n)
	}
	if len(off) > 0 {
		s.offloadPass(ctx, off)
	}
}

// endEvict ends an eviction span: why, how many segments needed room and
// how many bytes, how many objects went.
func endEvict(span trace.Span, why string, targets []evictTarget, evicted int) {
	if span.IsRecording() {
		var need int64
		for _, t := range targets {
			need += max(t.need, 0)
		}
		span.SetAttributes(attrEvictWhy.String(why), attrSegments.Int(len(targets)), attrNeedBytes.Int64(need), attrEvicted.Int(evicted))
	}
	span.End()
}

// overHighLocked reports whether seg crossed the high watermark (PutStart
// kicks the background check when it did).
func (s *Store) overHigh(v *segView) bool {
	return float64(v.e.placed.Load()) >= s.cfg.HighWatermark*float64(v.seg.Capacity)
}

// evictFor makes room for PutStarts that found none: need is their total
// size, maxSize the largest of them. It drops its victims whatever the
// evict policy: the put needs the room now, and an offload would free it
// only after copying the victims to disk, inside the put's latency (the
// background check offloads from the high watermark on, so that puts seldom
// get here; see offload.go). Every allocatable segment of medium
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
	ctx, span := tracer.Child(ctx, "master.evict")
	evicted := 0
	if len(targets) > 0 {
		evicted = s.evict(ctx, targets)
	}
	endEvict(span, "put", targets, evicted)
	if len(segs) == 0 || maxSize == 0 {
		return ""
	}
	ctx, span = tracer.Child(ctx, "master.make_hole")
	hole := s.makeHole(ctx, segs, maxSize)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Bytes.Int64(int64(maxSize)), attrSegments.Int(len(segs)))
		if hole != "" {
			span.SetAttributes(tracectx.Segment.String(hole))
		}
	}
	span.End()
	return hole
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
func (s *Store) evictableLocked(sh *shard, o *object, nowMs int64) (ok, pinned bool) {
	if o.put != nil || o.flags&flagHardPin != 0 || o.leased(nowMs, s.cfg.LeaseTTL) {
		return false, false
	}
	for i := range o.replicas {
		if o.replicas[i].status != stComplete {
			return false, false
		}
	}
	return true, sh.softPinnedLocked(o, nowMs)
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
	sc := sampled(ctx)
	for _, run := range runs {
		shd := &s.shards[run[0].shard]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(sc)
		for _, c := range run {
			o := shd.getLocked(c.tenant, c.key)
			if o == nil {
				continue
			}
			// Re-check: it may have been read, pinned or rewritten since.
			if ok, _ := s.evictableLocked(shd, o, m.nowMs); !ok || o.accessMs != c.access {
				continue
			}
			m.removeAll(o, true)
			n++
		}
		m.commit()
		shd.mu.Unlock()
	}
	s.evicted.Add(float64(n))
	s.sendReleasesNow(ctx, rel)
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
