package meta

import (
	"context"
	"errors"
	"sync/atomic"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// drainChunk bounds how many moves one drain step handles at once.
const drainChunk = 256

// drainCopyBytes bounds the object bytes of one Copy call of a drain step
// (a larger object goes alone): at a few hundred MB/s it copies well within
// the session's copy timeout (2 min).
const drainCopyBytes = 4 << 30

// move is one replica moving off a draining segment.
type move struct {
	tenant uint32
	key    string
	// tenantName is the tenant's name as the Reserve sent it; the target's
	// write token binds it.
	tenantName string
	shard      int
	idx        int    // the key's index in a Migrate request
	src        uint32 // replica id on the source (draining) segment
	srcSeg     string // the source's segment id
	srcAgent   string // the source segment's agent, which runs the copy
	srcAlloc   uint64
	size       uint64
	checksum   uint64
	pinMs      int64
	hard       bool
	group      string
	target     *segView
	dst        uint32 // target replica id, 0 when none was placed
	dstAlloc   uint64
	dstOff     uint64
	// access is, for an offload (modeOffload), the victim's access clock
	// when it was chosen: a victim read since is no longer one.
	access int64
	err    error
}

// DrainSegment moves every COMPLETE replica off a segment: it marks the
// segment DRAINING (no new allocations), and for each replica places a
// target on another segment that can allocate, reserves it, has the source
// agent copy the bytes and the target agent seal them, then applies
// COMPLETE(target) before REMOVE(source) — a Move, so readers never lose
// the object. A replica with no room elsewhere (or whose copy fails) is
// removed instead, recording `removed` if it was the last on its medium.
// Each chunk's copies go to the source agent as one batched Copy (issue
// 17), which it runs over the targets' bulk transfer listeners. A replica
// whose target vanished before its copy (its agent stopped) stays, and a
// further pass (at most drainPasses in all) places it again.
// Finally the segment is marked DRAINED. Writes in progress on the segment
// are left to finish (a later drain or the unmount removes them). An
// UndrainSegment meanwhile stops it between chunks with ABORTED /
// SEGMENT_UNAVAILABLE.
func (s *Store) DrainSegment(ctx context.Context, segmentID string) error {
	sv, ok := s.reg.Segment(segmentID)
	if !ok {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", segmentID)
	}
	if sv.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		if err := s.reg.SetLifecycle(segmentID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING); err != nil {
			return asSegmentErr(err, segmentID)
		}
	}
	undrains := s.undrainCount(segmentID)
	gen := undrains.Load()
	if sv, ok := s.reg.Segment(segmentID); !ok || sv.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		return errUndrained(segmentID, 0, 0) // undrained (or gone) before the scan
	}
	src := s.segs.intern(segmentID)
	moved, dropped := 0, 0
	// A move whose target vanished before its copy (the target's agent
	// stopped, its segment unmounted) leaves its source in place: the
	// next pass places it again (elsewhere, or removes it when nothing
	// has room). A pass that finds what the last one found stops.
	for pass, left := 0, -1; pass < drainPasses; pass++ {
		moves := s.drainScan(src)
		if len(moves) == 0 || len(moves) == left {
			break
		}
		left = len(moves)
		if pass > 0 {
			s.lg.Info("drain pass again", "segment_id", segmentID, "pass", pass+1, "replicas", len(moves))
		}
		for start := 0; start < len(moves); start += drainChunk {
			if err := ctx.Err(); err != nil {
				return rpcerr.Status(err)
			}
			if undrains.Load() != gen {
				return errUndrained(segmentID, moved, dropped)
			}
			chunk := moves[start:min(start+drainChunk, len(moves))]
			m, d := s.drainStep(ctx, sv.AgentID, src, chunk)
			moved += m
			dropped += d
		}
	}
	if undrains.Load() != gen {
		return errUndrained(segmentID, moved, dropped)
	}
	if err := s.reg.SetLifecycle(segmentID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED); err != nil {
		return asSegmentErr(err, segmentID)
	}
	s.lg.Info("segment drained", "segment_id", segmentID, "moved", moved, "removed", dropped)
	return nil
}

// drainPasses bounds DrainSegment's passes over the segment.
const drainPasses = 3

// drainScan lists the COMPLETE replicas on segment src of objects with no
// put in progress.
func (s *Store) drainScan(src uint32) []*move {
	var moves []*move
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		for t, objs := range shd.tenants {
			for key, o := range objs.all() {
				if o.put != nil {
					continue
				}
				for _, r := range o.replicas {
					if r.seg == src && r.status == stComplete {
						moves = append(moves, &move{tenant: t, key: key, shard: sh, src: r.id})
					}
				}
			}
		}
		shd.mu.Unlock()
	}
	return moves
}

// UndrainSegment is DrainSegment's inverse: a DRAINING or DRAINED segment
// returns to OK and takes allocations again; replicas already moved stay
// where they are. A drain in progress stops cleanly at its next chunk
// boundary (the chunk in flight completes its moves, so no replica is
// dropped for the undrain's sake) and answers ABORTED. Idempotent on an OK
// segment; SEGMENT_UNAVAILABLE on one that is unmounting or unmounted (its
// agent decides), SEGMENT_NOT_FOUND on an unknown one.
func (s *Store) UndrainSegment(ctx context.Context, segmentID string) error {
	sv, ok := s.reg.Segment(segmentID)
	if !ok {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", segmentID)
	}
	if sv.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK {
		return nil
	}
	if err := s.reg.SetLifecycle(segmentID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK); err != nil {
		return asSegmentErr(err, segmentID)
	}
	s.undrainCount(segmentID).Add(1)
	s.lg.Info("segment undrained", "segment_id", segmentID, "from", sv.Lifecycle.String())
	return nil
}

// undrainCount is the segment's UndrainSegment counter.
func (s *Store) undrainCount(segmentID string) *atomic.Uint64 {
	if v, ok := s.undrains.Load(segmentID); ok {
		return v.(*atomic.Uint64)
	}
	v, _ := s.undrains.LoadOrStore(segmentID, new(atomic.Uint64))
	return v.(*atomic.Uint64)
}

func errUndrained(id string, moved, dropped int) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
		"drain of segment %q stopped: it left DRAINING (UndrainSegment or unmount); %d replicas moved, %d removed", id, moved, dropped)
}

func asSegmentErr(err error, id string) error {
	var e *rpcerr.Error
	if errors.As(err, &e) {
		return err
	}
	return rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, err, "segment %q", id)
}

// drainStep moves one chunk of replicas; it returns (moved, removed).
// Phase 1 (here) places the targets, or removes the sources that have
// nowhere to go; migrateChunk runs the rest, shared with Copy and Move.
func (s *Store) drainStep(ctx context.Context, srcAgent string, src uint32, chunk []*move) (moved, dropped int) {
	p := s.newPlacer(newExclusions())
	rel := &releases{}
	srcID := s.segs.get(src).id
	// Phase 1: place targets (or remove sources that have nowhere to go).
	forShards(chunk, func(mv *move) int { return mv.shard }, func(sh int, group []*move) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, mv := range group {
			o := shd.getLocked(mv.tenant, mv.key)
			if o == nil || o.put != nil {
				mv.err = errNotFound("", mv.key)
				continue
			}
			i := o.replicaIndex(mv.src)
			if i < 0 || o.replicas[i].status != stComplete {
				mv.err = errNotFound("", mv.key)
				continue
			}
			avoid := make([]uint32, 0, len(o.replicas))
			for _, r := range o.replicas {
				avoid = append(avoid, r.seg)
			}
			r := o.replicas[i]
			vs, perr := p.pick(1, masterv1.Medium(r.medium), o.size, "", nil, "", avoid)
			if perr != nil {
				m.remove(o, i, true)
				m.dropIfEmpty(o)
				dropped++
				mv.err = perr.err
				continue
			}
			mv.srcSeg, mv.srcAgent = srcID, srcAgent
			mv.srcAlloc, mv.size, mv.checksum, mv.group = r.allocID, o.size, o.checksum, shd.groupOf(o)
			mv.hard = o.flags&flagHardPin != 0
			if o.flags&flagSoftPin != 0 {
				mv.pinMs = shd.softPinLocked(o)
			}
			mv.target = vs[0]
			mv.dst = m.create(o, vs[0].idx, r.medium, true, 0)
		}
		m.commit()
		shd.mu.Unlock()
	})
	m, d := s.migrateChunk(ctx, chunk, rel, modeDrain)
	return m, dropped + d
}
