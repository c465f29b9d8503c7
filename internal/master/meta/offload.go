package meta

import (
	"context"
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.opentelemetry.io/otel/trace"
)

// Offload on eviction (issue 17 item 3, docs/tiering.md §3). With
// EvictOffload and a disk segment that can allocate, the background check
// (evictOverHigh) does not drop a memory segment's victims: it moves them
// to disk through the migration machinery (migrateChunk, modeOffload).
// The victims are the ones eviction would drop (evict's selection: least
// recently used first, soft-pinned last; never leased, hard-pinned or
// being written). Each gets a pending PROCESSING replica on a disk segment
// (pickOffload: same host as its memory replica first, then the most free
// space; only where it fits below that segment's high watermark, so an
// offload never evicts anything on disk, now or at the disk's next check),
// is reserved, copied by its memory replica's agent, sealed, and then, in
// one mutation, COMPLETE(disk) before every memory replica is removed: the
// change log reads stored(disk) before removed(cpu). A victim that already
// has a disk replica just loses its memory replicas. A victim that finds
// no disk room, or whose reserve, copy or seal fails, is dropped as
// eviction drops it. A victim read, pinned or rewritten while its copy ran
// is no longer one: its target is removed and it stays in memory.
//
// The synchronous path, evictFor (a PutStart that found no room), drops as
// before: the put needs room now, and an offload frees its memory only
// after the copy, at disk speed, inside the put's latency. The background
// check starts at the high watermark and offloads down to the low one, so
// puts reach a full segment only when they outrun it.
//
// A pass is bounded: at most offloadPassObjects victims and
// offloadPassBytes of them, in chunks of drainChunk, each chunk's placement under
// shard locks and its agent I/O outside them. A segment whose pass was cut
// short is remembered (offloadMore) and the check runs again at once,
// carrying on down to the low watermark, so Run's other work (the put
// sweep) and ctx are served between passes.

// Bounds of one offload pass (Store.offloadObjects and offloadBytes, which
// tests lower).
const (
	offloadPassObjects = 16 * drainChunk
	offloadPassBytes   = 512 << 20
)

// offloadResult is what an offload pass did.
type offloadResult struct {
	offloaded int   // victims demoted: now on disk, no longer in memory
	bytes     int64 // their bytes
	dropped   int   // victims dropped: no disk room, or their copy failed
	more      bool  // the pass was cut short by its bounds
}

// canOffload reports whether the background check offloads memory
// victims: the policy says so and some disk segment can allocate.
func (s *Store) canOffload(segs []cluster.Segment) bool {
	if s.cfg.EvictPolicy != EvictOffload {
		return false
	}
	for i := range segs {
		if segs[i].Medium == masterv1.Medium_MEDIUM_DISK && segs[i].CanAllocate() {
			return true
		}
	}
	return false
}

// offloadPass is evictOverHigh's pass over memory targets (offloadMu held):
// a root span of its own, the counters, and the carry-on state.
func (s *Store) offloadPass(ctx context.Context, targets []evictTarget) {
	ctx, span := tracer.Start(ctx, "master.offload")
	r := s.offloadCounted(ctx, targets)
	span.End()
	// Carry on at once, unless the pass achieved nothing (every candidate
	// held by a lease or pin, say): the next tick tries again.
	if r.more && r.offloaded+r.dropped > 0 && ctx.Err() == nil {
		for _, t := range targets {
			s.offloadMore[t.seg] = true
		}
		s.kickEviction()
	}
}

// offloadCounted is offload with its span attributes, counters and log
// line (offloadMu held): the background pass's and a drain's.
func (s *Store) offloadCounted(ctx context.Context, targets []evictTarget) offloadResult {
	span := trace.SpanFromContext(ctx)
	r := s.offload(ctx, targets)
	if span.IsRecording() {
		var need int64
		for _, t := range targets {
			need += max(t.need, 0)
		}
		span.SetAttributes(attrSegments.Int(len(targets)), attrNeedBytes.Int64(need),
			attrOffloaded.Int(r.offloaded), attrEvicted.Int(r.dropped))
	}
	s.offloaded.Add(float64(r.offloaded))
	s.offloadedBytes.Add(float64(r.bytes))
	s.evicted.Add(float64(r.dropped))
	if r.offloaded+r.dropped > 0 {
		s.lg.Debug("offloaded objects", "objects", r.offloaded, "bytes", r.bytes, "dropped", r.dropped,
			"segments", len(targets), "more", r.more)
	}
	return r
}

// offload demotes the victims of targets (memory segments) to disk, within
// the pass's bounds (see the top of this file).
func (s *Store) offload(ctx context.Context, targets []evictTarget) offloadResult {
	var r offloadResult
	victims, more := s.offloadVictims(targets)
	r.more = more
	tset := make(map[uint32]bool, len(targets))
	for _, t := range targets {
		tset[t.seg] = true
	}
	for start := 0; start < len(victims); start += drainChunk {
		if ctx.Err() != nil {
			r.more = false
			break
		}
		chunk := victims[start:min(start+drainChunk, len(victims))]
		rel := &releases{}
		unlock := s.freeingMemory(modeOffload)
		moves := s.offloadPlace(ctx, chunk, tset, rel, &r)
		s.sendReleasesNow(ctx, rel) // the victims on disk already, and those dropped
		unlock()
		moved, dropped := s.migrateChunk(ctx, moves, rel, modeOffload)
		r.offloaded += moved
		r.dropped += dropped
		for _, mv := range moves {
			if mv.err == nil && mv.dst != 0 {
				r.bytes += int64(mv.size)
			}
		}
	}
	return r
}

// freeingMemory serialises an offload's removals of memory replicas, from
// their commit to their releases' answer, with makeHole and eviction
// (evictMu), and returns the unlock; other modes lock nothing. makeHole
// judges a memory segment's free extents from the metadata: between an
// offload's removal and its release at the agent it would see room the
// agent has not freed yet, and a PutStart's second round would fail
// NO_AVAILABLE_HANDLE there ("largest free extent" below the hole it was
// promised). Eviction already holds evictMu that way.
func (s *Store) freeingMemory(mode migrateMode) (unlock func()) {
	if mode != modeOffload {
		return func() {}
	}
	s.evictMu.Lock()
	return s.evictMu.Unlock
}

// offloadVictims chooses a pass's victims, in eviction order: evict's
// selection with each target's need bounded to about offloadPassObjects
// of its average replica size (and offloadPassBytes), then at most
// offloadPassObjects victims and offloadPassBytes. more says a bound cut
// the selection short.
func (s *Store) offloadVictims(targets []evictTarget) (victims []evictCand, more bool) {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	s.lastPass = evictPassStats{}
	if len(targets) > 64 {
		targets, more = targets[:64], true
	}
	targets = slices.Clone(targets)
	for i := range targets {
		t := &targets[i]
		lim := s.offloadBytes
		e := s.segs.get(t.seg)
		if n := e.replicas.Load(); n > 0 {
			lim = min(lim, max(e.placed.Load()/n, 1)*int64(s.offloadObjects))
		}
		if t.need > lim {
			t.need, more = lim, true
		}
	}
	p := s.newEvictPass(targets)
	if p == nil {
		return nil, false
	}
	p.selectRuns()
	ranks := p.union()
	slices.SortFunc(ranks, func(a, b evictRank) int {
		switch {
		case a.after(&b):
			return 1
		case b.after(&a):
			return -1
		}
		return 0
	})
	var bytes int64
	for _, rk := range ranks {
		if len(victims) == s.offloadObjects || bytes >= s.offloadBytes {
			more = true
			break
		}
		victims = append(victims, *p.cands.at(rk.idx))
		bytes += int64(rk.size)
	}
	return victims, more
}

// offloadPlace is an offload's phase 1 for one chunk of victims: per
// victim still evictable and unchanged, under its shard's lock, either
// remove its memory replicas (it has a disk replica already), place a
// pending PROCESSING target on disk (a move for migrateChunk), or drop it
// (no disk room). It counts the first and the last in r and returns the
// moves.
func (s *Store) offloadPlace(ctx context.Context, chunk []evictCand, tset map[uint32]bool, rel *releases, r *offloadResult) []*move {
	p := s.newPlacer(newExclusions())
	sc := sampled(ctx)
	moves := make([]*move, 0, len(chunk))
	disk := uint8(masterv1.Medium_MEDIUM_DISK)
	for _, run := range groupByShard(slices.Clone(chunk), len(s.shards), func(c *evictCand) int { return int(c.shard) }) {
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
			si, onDisk := -1, false
			for i := range o.replicas {
				if o.replicas[i].medium == disk {
					onDisk = true
				} else if si < 0 && tset[o.replicas[i].seg] {
					si = i
				}
			}
			if si < 0 {
				continue // no longer on a target
			}
			if onDisk { // readable from disk already: memory lets go
				for i := len(o.replicas) - 1; i >= 0; i-- {
					if o.replicas[i].medium != disk {
						m.remove(o, i, true)
					}
				}
				r.offloaded++
				r.bytes += int64(o.size)
				continue
			}
			src := o.replicas[si]
			sv, ok := s.reg.Segment(s.segs.get(src.seg).id)
			var tg *segView
			if ok && sv.CanServeRead() {
				avoid := make([]uint32, 0, len(o.replicas))
				for i := range o.replicas {
					avoid = append(avoid, o.replicas[i].seg)
				}
				tg = s.pickOffload(p, sv.HostID, o.size, avoid)
			}
			if tg == nil { // no disk room (or an unreadable source): dropped
				m.removeAll(o, true)
				r.dropped++
				continue
			}
			mv := &move{tenant: c.tenant, key: c.key, shard: int(c.shard), src: src.id,
				srcSeg: sv.ID, srcAgent: sv.AgentID, access: c.access, target: tg}
			// The soft pin travels with the object (a victim is never hard
			// pinned).
			mv.objectLocked(shd, o, src, shd.softPinnedLocked(o, m.nowMs))
			mv.dst = m.create(o, tg.idx, disk, true, 0)
			moves = append(moves, mv)
		}
		m.commit()
		shd.mu.Unlock()
	}
	return moves
}

// pickOffload is the disk segment an offloaded object of size bytes goes
// to: one that can allocate and has room for it below its high watermark
// (so that the offload does not make the disk's own check evict), on host
// first, then the one with the most free space; nil when none. avoid lists
// the segments that hold a replica of the object.
func (s *Store) pickOffload(p *placer, host string, size uint64, avoid []uint32) *segView {
	var best *segView
	var bestLocal bool
	var bestFree int64
	all := p.alloc[masterv1.Medium_MEDIUM_DISK]
	for i := range all {
		v := &all[i]
		if slices.Contains(avoid, v.idx) || !v.fits(int64(size)) ||
			float64(v.e.used(v.seg)+int64(size)) >= s.cfg.HighWatermark*float64(v.seg.Capacity) {
			continue
		}
		local, f := v.seg.HostID == host, v.free()
		if best == nil || local && !bestLocal || local == bestLocal && f > bestFree {
			best, bestLocal, bestFree = v, local, f
		}
	}
	return best
}

// stillVictimLocked reports whether an offload's object o is still the
// victim it was chosen as: no write in progress, not hard-pinned, its
// access clock unchanged (so it was not read, and holds no newer lease),
// not leased, and every replica but its target (index di) COMPLETE.
func (s *Store) stillVictimLocked(o *object, mv *move, di int, nowMs int64) bool {
	if o.put != nil || o.flags&flagHardPin != 0 || o.accessMs != mv.access || o.leased(nowMs, s.cfg.LeaseTTL) {
		return false
	}
	for i := range o.replicas {
		if i != di && o.replicas[i].status != stComplete {
			return false
		}
	}
	return true
}

// errOffloadStale is an offload's outcome for a victim that changed while
// its copy ran (read, pinned, rewritten): it stays where it is.
func errOffloadStale(key string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
		"object %q changed while it was offloaded and stays in memory", key)
}
