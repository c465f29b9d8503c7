package meta

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/retry"
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

// objectLocked fills in what the copy needs of o and its source replica r:
// the allocation, size, checksum, group, hard pin, and the soft pin's
// expiry when pinned says it travels with the object (the callers differ:
// a drain passes any soft pin on, the others only one not yet expired).
// shd is o's shard, locked.
func (mv *move) objectLocked(shd *shard, o *object, r replica, pinned bool) {
	mv.srcAlloc, mv.size, mv.checksum, mv.group = r.allocID, o.size, o.checksum, shd.groupOf(o)
	mv.hard = o.flags&flagHardPin != 0
	if pinned {
		mv.pinMs = shd.softPinLocked(o)
	}
}

// DrainOptions are a drain's choices.
type DrainOptions struct {
	// NoEvict never evicts other objects to make room: a replica that finds
	// no segment with room below the high watermark stops the drain with
	// NO_AVAILABLE_HANDLE, its source kept.
	NoEvict bool
	// WriteWait bounds the wait for writes in progress on the segment,
	// from the drain's start by the store's clock: 0 means the put timeout
	// (PutPreemptAfter, plus two sweep intervals for the sweep to expire
	// them); < 0 does not wait (they are left, and counted in left).
	WriteWait time.Duration
}

// DrainSegmentCounts is Drain in the AdminService's terms.
func (s *Store) DrainSegmentCounts(ctx context.Context, segmentID string, noEvict bool) (*masterv1.DrainCounts, error) {
	return s.Drain(ctx, segmentID, DrainOptions{NoEvict: noEvict})
}

// DrainSegment is Drain with default options, for callers that want only
// whether it stopped early (tests, the property test): it does not report
// replicas left behind by failed copies (Drain's counts do).
func (s *Store) DrainSegment(ctx context.Context, segmentID string) error {
	_, err := s.Drain(ctx, segmentID, DrainOptions{})
	return err
}

// Drain moves every replica off a segment. It marks the segment DRAINING
// (no new allocations), and for each COMPLETE replica places a target on
// another segment of its medium, reserves it, has the source agent copy the
// bytes (each chunk's copies as one batched Copy, issue 17) and the target
// agent seal them, then applies COMPLETE(target) before REMOVE(source) — a
// Move, so readers never lose the object.
//
// Room: a target is a segment that stays below the high watermark with the
// replica (so the background check evicts nothing for the drain's sake).
// When none is, Drain evicts other objects itself, down to the low
// watermark, counting them (DrainCounts.evicted), and places again; then it
// takes any segment with room; a replica that still finds none is removed
// (dropped, recording `removed` if it was the last on its medium). With
// opts.NoEvict it neither evicts nor drops: it finishes the chunk it is on
// and stops with NO_AVAILABLE_HANDLE (RESOURCE_EXHAUSTED), the counts so far
// in the error's metadata, the segment still DRAINING.
//
// Writes in progress on the segment (their allocations were made before
// DRAINING) are waited for after the first pass, until they end or expire
// (at most the put timeout from the drain's start), and what sealed is
// moved by the next pass. A copy or seal that fails keeps its source
// (only its target is removed), and a later pass (at most drainPasses in
// all, one that moves nothing ends them) places it again. When replicas
// are left after the last pass the segment stays DRAINING and the counts
// say how many (left); otherwise it is marked DRAINED.
//
// One drain of a segment runs at a time: a second call while it runs waits
// for it and returns its outcome. Its counts are visible meanwhile through
// DrainProgress. An UndrainSegment stops it between chunks with
// SEGMENT_UNAVAILABLE, as does an unmount; the counts are returned with
// every error after the drain started.
func (s *Store) Drain(ctx context.Context, segmentID string, opts DrainOptions) (*masterv1.DrainCounts, error) {
	sv, ok := s.reg.Segment(segmentID)
	if !ok {
		return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", segmentID)
	}
	sd := s.segDrain(segmentID)
	sd.mu.Lock()
	if r := sd.run; r != nil && r.finishedMs.Load() == 0 {
		sd.mu.Unlock()
		select {
		case <-r.done:
			return r.counts(), r.err
		case <-ctx.Done():
			return nil, rpcerr.Status(ctx.Err())
		}
	}
	if sv.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		if err := s.reg.SetLifecycle(segmentID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING); err != nil {
			sd.mu.Unlock()
			return nil, asSegmentErr(err, segmentID)
		}
	}
	r := &drainRun{noEvict: opts.NoEvict, startMs: s.nowMs(), done: make(chan struct{})}
	sd.run = r
	sd.mu.Unlock()
	state, err := s.drain(ctx, sd, r, sv, opts)
	c := r.counts() // final: only drain wrote them
	if err != nil {
		var e *rpcerr.Error
		if errors.As(err, &e) {
			e.Metadata = countsMetadata(c)
		}
	}
	r.finish(state, err, s.nowMs())
	s.lg.Info("segment drain ended", "segment_id", segmentID, "state", state.String(), "total", c.Total, "moved", c.Moved,
		"evicted", c.Evicted, "offloaded", c.Offloaded, "dropped", c.Dropped, "failed", c.Failed, "left", c.Left, "err", err)
	return c, err
}

// drain is Drain's work once the run is registered: it returns the run's
// final state and error.
func (s *Store) drain(ctx context.Context, sd *segDrain, r *drainRun, sv cluster.Segment, opts DrainOptions) (masterv1.DrainState, error) {
	segmentID := sv.ID
	gen := sd.undrains.Load()
	stopped := masterv1.DrainState_DRAIN_STATE_STOPPED
	if sv, ok := s.reg.Segment(segmentID); !ok || sv.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		return stopped, errUndrained(segmentID, 0, 0) // undrained (or gone) before the scan
	}
	src := s.segs.intern(segmentID)
	// The put timeout bounds the wait for writes in progress: they were
	// all allocated before DRAINING, so by then each ended or expired (the
	// sweep may lag by its interval).
	wait := opts.WriteWait
	if wait == 0 {
		wait = s.cfg.PutPreemptAfter + 2*s.cfg.PutSweepInterval
	}
	writesDeadline := s.now().Add(wait)
	moves, writes := s.drainScan(src)
	r.total.Store(uint64(len(moves) + writes))
	r.writes.Store(uint64(writes))
	failedBefore := uint64(0) // r.failed before the last pass
	for pass := 0; pass < drainPasses; pass++ {
		if pass > 0 {
			if writes > 0 {
				if err := s.drainWaitWrites(ctx, src, writesDeadline, func() bool { return sd.undrains.Load() != gen }); err != nil {
					r.left.Store(uint64(s.drainLeft(src)))
					return stopped, err
				}
			} else if failedBefore < r.failed.Load() {
				// Let a target that failed (an agent stopping) leave the
				// registry before placing again.
				if err := retry.Sleep(ctx, drainRetryDelay); err != nil {
					r.left.Store(uint64(s.drainLeft(src)))
					return stopped, rpcerr.Status(err)
				}
			}
			moves, writes = s.drainScan(src)
		}
		if len(moves) == 0 {
			if writes > 0 && pass == 0 {
				continue // wait for them, then scan again
			}
			break
		}
		if pass > 0 {
			s.lg.Info("drain pass again", "segment_id", segmentID, "pass", pass+1, "replicas", len(moves))
		}
		failedBefore = r.failed.Load()
		progress, err := s.drainChunks(ctx, sd, gen, r, sv, src, moves, opts.NoEvict)
		if err != nil {
			r.left.Store(uint64(s.drainLeft(src)))
			if errors.Is(err, errDrainFull) {
				return stopped, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE,
					"drain of segment %q stopped: no other %s segment has room below the high watermark and no_evict is set; %d replicas moved, %d left",
					segmentID, sv.Medium, r.moved.Load(), r.left.Load())
			}
			return stopped, err
		}
		if progress == 0 && writes == 0 {
			break // the same failures again
		}
	}
	if sd.undrains.Load() != gen {
		r.left.Store(uint64(s.drainLeft(src)))
		return stopped, errUndrained(segmentID, int(r.moved.Load()), int(r.dropped.Load()))
	}
	if left := s.drainLeft(src); left > 0 {
		r.left.Store(uint64(left))
		s.lg.Warn("segment drain incomplete", "segment_id", segmentID, "left", left, "failed", r.failed.Load())
		return masterv1.DrainState_DRAIN_STATE_INCOMPLETE, nil
	}
	if err := s.reg.SetLifecycle(segmentID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED); err != nil {
		return stopped, asSegmentErr(err, segmentID)
	}
	return masterv1.DrainState_DRAIN_STATE_DONE, nil
}

// drainInFlight is how many chunks a drain moves at once: while one
// chunk's bytes are copied, the next is placed and reserved, so the copy
// path (one batched Copy per chunk, one agent at a time) is not idle
// between chunks.
const drainInFlight = 2

// errDrainFull is drainChunks' stop for NoEvict with no room.
var errDrainFull = errors.New("no room and no_evict")

// drainChunks runs one pass's moves through drainStep, chunk by chunk,
// drainInFlight chunks at once, adding what each did to r. It returns how
// many replicas left the segment (moved or dropped) and, when it stopped
// early, why: ctx's end, an undrain, or errDrainFull (NoEvict found no
// room). It returns only once every chunk it started has finished.
func (s *Store) drainChunks(ctx context.Context, sd *segDrain, gen uint64, r *drainRun, sv cluster.Segment, src uint32, moves []*move, noEvict bool) (int, error) {
	var (
		wg       sync.WaitGroup
		progress atomic.Int64
		pipe     drainPipe
		slots    = make(chan struct{}, drainInFlight)
		stop     error
	)
	for start := 0; start < len(moves); start += drainChunk {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
		}
		if err := ctx.Err(); err != nil {
			stop = rpcerr.Status(err)
			break
		}
		if sd.undrains.Load() != gen {
			stop = errUndrained(sv.ID, int(r.moved.Load()), int(r.dropped.Load()))
			break
		}
		if pipe.full.Load() {
			stop = errDrainFull
			break
		}
		chunk := moves[start:min(start+drainChunk, len(moves))]
		wg.Go(func() {
			defer func() { <-slots }()
			st := s.drainStep(ctx, &pipe, sv.AgentID, src, chunk, noEvict)
			r.moved.Add(uint64(st.moved))
			r.dropped.Add(uint64(st.dropped))
			r.evicted.Add(uint64(st.evicted))
			r.offloaded.Add(uint64(st.offloaded))
			r.failed.Add(uint64(st.failed))
			progress.Add(int64(st.moved + st.dropped))
		})
	}
	wg.Wait()
	if stop == nil && pipe.full.Load() {
		stop = errDrainFull
	}
	return int(progress.Load()), stop
}

// drainPasses bounds Drain's passes over the segment: the first, one after
// the wait for writes in progress, and retries of failed copies.
const drainPasses = 4

// drainRetryDelay is the pause before a pass that retries failed copies.
const drainRetryDelay = 200 * time.Millisecond

// drainWaitPoll is how often a drain looks again at the writes in
// progress it waits for.
const drainWaitPoll = 20 * time.Millisecond

// drainScan lists the COMPLETE replicas on segment src of objects with no
// put in progress, and counts the writes in progress with a replica there.
func (s *Store) drainScan(src uint32) (moves []*move, writes int) {
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		for t, objs := range shd.tenants {
			for key, o := range objs.all() {
				if o.put != nil {
					if o.hasReplicaOn(src) {
						writes++
					}
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
	return moves, writes
}

// hasReplicaOn reports whether o has a replica (any status) on seg.
func (o *object) hasReplicaOn(seg uint32) bool {
	for i := range o.replicas {
		if o.replicas[i].seg == seg {
			return true
		}
	}
	return false
}

// drainLeft counts the replicas still on segment src (any status).
func (s *Store) drainLeft(src uint32) int {
	return int(s.segs.get(src).replicas.Load())
}

// drainWritesLeft counts the puts in progress with a replica on src,
// walking only the shards' lists of puts in progress.
func (s *Store) drainWritesLeft(src uint32) int {
	n := 0
	for sh := range s.shards {
		shd := &s.shards[sh]
		shd.mu.Lock()
		for ps := shd.puts.head; ps != nil; ps = ps.next {
			if ps.obj != nil && ps.obj.put == ps && ps.obj.hasReplicaOn(src) {
				n++
			}
		}
		shd.mu.Unlock()
	}
	return n
}

// drainWaitWrites waits until no put in progress has a replica on src, or
// the store's clock passes deadline (those left count as left over), or
// stop reports an undrain (SEGMENT_UNAVAILABLE), or ctx ends.
func (s *Store) drainWaitWrites(ctx context.Context, src uint32, deadline time.Time, stop func() bool) error {
	t := time.NewTicker(drainWaitPoll)
	defer t.Stop()
	for {
		if s.drainWritesLeft(src) == 0 || !s.now().Before(deadline) {
			return nil
		}
		if stop() {
			return errUndrained(s.segs.get(src).id, 0, 0)
		}
		select {
		case <-ctx.Done():
			return rpcerr.Status(ctx.Err())
		case <-t.C:
		}
	}
}

// UndrainSegment is DrainSegment's inverse: a DRAINING or DRAINED segment
// returns to OK and takes allocations again; replicas already moved stay
// where they are. A drain in progress stops cleanly at its next chunk
// boundary (the chunk in flight completes its moves, so no replica is
// dropped for the undrain's sake) and answers SEGMENT_UNAVAILABLE.
// Idempotent on an OK segment; SEGMENT_UNAVAILABLE on one that is
// unmounting or unmounted (its agent decides), SEGMENT_NOT_FOUND on an
// unknown one.
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
	s.segDrain(segmentID).undrains.Add(1)
	s.lg.Info("segment undrained", "segment_id", segmentID, "from", sv.Lifecycle.String())
	return nil
}

// segDrain is a segment's drain bookkeeping (the values of Store.undrains).
type segDrain struct {
	// undrains counts UndrainSegment calls; a running drain stops when it
	// changes.
	undrains atomic.Uint64
	// mu guards run: the running or last drain (nil before the first).
	mu  sync.Mutex
	run *drainRun
}

// drainRun is one drain of a segment. Its counts are atomics, so the
// segments listing reads them while it runs; state, err and finishedMs are
// written once, before done is closed.
type drainRun struct {
	noEvict bool
	startMs int64
	done    chan struct{}

	total, moved, evicted, offloaded, dropped, failed, left, writes atomic.Uint64

	finishedMs atomic.Int64 // 0 while running
	state      masterv1.DrainState
	err        error
}

func (r *drainRun) finish(state masterv1.DrainState, err error, nowMs int64) {
	r.state, r.err = state, err
	r.finishedMs.Store(max(nowMs, 1))
	close(r.done)
}

func (r *drainRun) counts() *masterv1.DrainCounts {
	return &masterv1.DrainCounts{
		Total: r.total.Load(), Moved: r.moved.Load(), Evicted: r.evicted.Load(), Offloaded: r.offloaded.Load(), Dropped: r.dropped.Load(),
		Failed: r.failed.Load(), Left: r.left.Load(), WritesWaited: r.writes.Load(),
	}
}

// segDrain is the segment's drain bookkeeping, created on first use.
func (s *Store) segDrain(segmentID string) *segDrain {
	if v, ok := s.undrains.Load(segmentID); ok {
		return v.(*segDrain)
	}
	v, _ := s.undrains.LoadOrStore(segmentID, new(segDrain))
	return v.(*segDrain)
}

// DrainProgress is the running or last drain of each segment this master
// drained, by segment id, in the segments listing's terms.
func (s *Store) DrainProgress() map[string]*masterv1.DrainProgress {
	out := map[string]*masterv1.DrainProgress{}
	s.undrains.Range(func(k, v any) bool {
		sd := v.(*segDrain)
		sd.mu.Lock()
		r := sd.run
		sd.mu.Unlock()
		if r == nil {
			return true
		}
		p := &masterv1.DrainProgress{State: masterv1.DrainState_DRAIN_STATE_RUNNING, Counts: r.counts(), NoEvict: r.noEvict, StartedUnixMs: r.startMs}
		if fin := r.finishedMs.Load(); fin != 0 {
			<-r.done // state and err are written before done closes
			p.State, p.FinishedUnixMs = r.state, fin
			if r.err != nil {
				p.Error = r.err.Error()
			}
		}
		out[k.(string)] = p
		return true
	})
	return out
}

// countsMetadata is a drain's counts as ErrorInfo metadata.
func countsMetadata(c *masterv1.DrainCounts) map[string]string {
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	return map[string]string{
		"total": u(c.Total), "moved": u(c.Moved), "evicted": u(c.Evicted), "offloaded": u(c.Offloaded), "dropped": u(c.Dropped),
		"failed": u(c.Failed), "left": u(c.Left), "writes_waited": u(c.WritesWaited),
	}
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

// drainStepResult is what one drain step did.
type drainStepResult struct {
	moved, dropped, evicted, offloaded, failed int
	// full: NoEvict and some replica found no room (its source kept).
	full bool
}

// drainStep moves one chunk of replicas. Phase 1 (here) places the
// targets — evicting, or dropping sources that have nowhere to go, or with
// noEvict leaving them — and migrateChunk runs the rest, shared with Copy
// and Move.
func (s *Store) drainStep(ctx context.Context, pipe *drainPipe, srcAgent string, src uint32, chunk []*move, noEvict bool) drainStepResult {
	var res drainStepResult
	p := s.newPlacer(newExclusions())
	rel := &releases{}
	srcID := s.segs.get(src).id
	// Phase 1 is one chunk at a time (pipe.placeMu), so chunks in flight
	// place as one would after the other: each sees the room the one
	// before it took, and none starts after one found no room with
	// noEvict. Only the copies overlap.
	pipe.placeMu.Lock()
	if pipe.full.Load() {
		pipe.placeMu.Unlock()
		return res
	}
	res = s.drainPlaceChunk(ctx, p, rel, srcID, srcAgent, chunk, noEvict)
	if res.full {
		pipe.full.Store(true)
	}
	pipe.placeMu.Unlock()
	placed := 0
	for _, mv := range chunk {
		if mv.dst != 0 {
			placed++
		}
	}
	res.moved, _ = s.migrateChunk(ctx, chunk, rel, modeDrain)
	res.failed = placed - res.moved
	return res
}

// drainPipe is what a pass's chunks in flight share (drainChunks).
type drainPipe struct {
	placeMu sync.Mutex
	// full: a chunk found no room with NoEvict; no later chunk places.
	full atomic.Bool
}

// drainPlaceChunk is drainStep's phase 1: it places the chunk's targets,
// evicting (or offloading) for room unless noEvict, and dropping the
// sources that find none even then.
func (s *Store) drainPlaceChunk(ctx context.Context, p *placer, rel *releases, srcID, srcAgent string, chunk []*move, noEvict bool) drainStepResult {
	var res drainStepResult
	// Room below the high watermark first.
	noRoom := s.drainPlace(p, chunk, rel, srcID, srcAgent, drainBelowHigh)
	if len(noRoom) > 0 && noEvict {
		res.full = true
	} else if len(noRoom) > 0 {
		// Evict and place again while eviction frees something (it
		// usually takes one round: drainEvict asks for the moves' bytes).
		for round := 0; round < drainEvictRounds && len(noRoom) > 0; round++ {
			evicted, offloaded := s.drainEvict(ctx, noRoom)
			if evicted+offloaded == 0 {
				break
			}
			res.evicted += evicted
			res.offloaded += offloaded
			noRoom = s.drainPlace(p, noRoom, rel, srcID, srcAgent, drainBelowHigh)
		}
		if len(noRoom) > 0 {
			noRoom = s.drainPlace(p, noRoom, rel, srcID, srcAgent, drainAnyRoom)
		}
		res.dropped = len(noRoom)
	}
	return res
}

// drainEvictRounds bounds the evictions of one drain step.
const drainEvictRounds = 4

// drainRoom says which targets drainPlace takes, and what it does with a
// replica that finds none.
type drainRoom uint8

const (
	// drainBelowHigh: segments that stay below the high watermark with the
	// replica; without one the move is returned for another try.
	drainBelowHigh drainRoom = iota
	// drainAnyRoom: any segment with room; without one the source is
	// removed (dropped) and the move returned.
	drainAnyRoom
)

// drainPlace is drain's phase 1 for moves: per object, check the source is
// still a COMPLETE replica with no put in progress (else the move is done,
// with err set), and place a pending PROCESSING target of its medium on
// another segment. It returns the moves that found no room.
func (s *Store) drainPlace(p *placer, moves []*move, rel *releases, srcID, srcAgent string, room drainRoom) []*move {
	var noRoom []*move
	forShards(moves, func(mv *move) int { return mv.shard }, func(sh int, group []*move) {
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
			var vs []*segView
			var perr *placeErr
			if room == drainBelowHigh {
				vs, perr = s.pickBelowHigh(p, masterv1.Medium(r.medium), o.size, avoid)
			} else {
				vs, perr = p.pick(1, masterv1.Medium(r.medium), o.size, "", nil, "", avoid)
			}
			if perr != nil {
				if room == drainAnyRoom {
					m.remove(o, i, true)
					m.dropIfEmpty(o)
					mv.err = perr.err
				}
				noRoom = append(noRoom, mv)
				continue
			}
			mv.srcSeg, mv.srcAgent = srcID, srcAgent
			mv.objectLocked(shd, o, r, o.flags&flagSoftPin != 0)
			mv.target = vs[0]
			mv.dst = m.create(o, vs[0].idx, r.medium, true, 0)
		}
		m.commit()
		shd.mu.Unlock()
	})
	return noRoom
}

// pickBelowHigh is the segment of medium, not in avoid, with the most free
// space that has room for size and stays below the high watermark with it
// (so the background check does not evict for it).
func (s *Store) pickBelowHigh(p *placer, medium masterv1.Medium, size uint64, avoid []uint32) ([]*segView, *placeErr) {
	var best *segView
	all := p.alloc[medium]
	for i := range all {
		v := &all[i]
		if slices.Contains(avoid, v.idx) || !v.fits(int64(size)) {
			continue
		}
		if float64(v.e.placed.Load()+int64(size)) >= s.cfg.HighWatermark*float64(v.seg.Capacity) {
			continue
		}
		if best == nil || v.free() > best.free() {
			best = v
		}
	}
	if best == nil {
		return nil, errNoSpace(true, "no %s segment has %d free bytes below the high watermark", medium, size)
	}
	return []*segView{best}, nil
}

// drainEvict evicts other objects to make room for moves that found none:
// per medium, every segment that could take one of them and holds more than
// the low watermark is evicted down to it, and further so that its share of the
// moves' bytes fits below the high watermark (if none holds more than the
// low watermark, the fullest is asked for the moves' bytes). Memory
// segments' victims are offloaded to disk when the policy and a disk
// segment allow (as the background check does, offload.go), the others
// dropped. It returns how many objects it dropped and how many it
// offloaded.
func (s *Store) drainEvict(ctx context.Context, moves []*move) (evicted, offloaded int) {
	need := map[masterv1.Medium]int64{}
	// A segment is evicted only if it could take one of the moves: of its
	// medium, large enough, and not already holding a replica of the
	// object (placement avoids those).
	type want struct {
		medium masterv1.Medium
		size   uint64
		avoid  []uint32
	}
	var wants []want
	for _, mv := range moves {
		if mv.err != nil {
			continue
		}
		shd := &s.shards[mv.shard]
		shd.mu.Lock()
		if o := shd.getLocked(mv.tenant, mv.key); o != nil {
			if i := o.replicaIndex(mv.src); i >= 0 {
				w := want{medium: masterv1.Medium(o.replicas[i].medium), size: o.size}
				for _, r := range o.replicas {
					w.avoid = append(w.avoid, r.seg)
				}
				wants = append(wants, w)
				need[w.medium] += int64(o.size)
			}
		}
		shd.mu.Unlock()
	}
	if len(need) == 0 {
		return 0, 0
	}
	var segs []cluster.Segment
	all := s.reg.Segments()
	for _, sg := range all {
		if !sg.CanAllocate() || sg.Capacity == 0 {
			continue
		}
		idx := s.segs.intern(sg.ID)
		for _, w := range wants {
			if w.medium == sg.Medium && w.size <= sg.Capacity && !slices.Contains(w.avoid, idx) {
				segs = append(segs, sg)
				break
			}
		}
	}
	over := map[masterv1.Medium]int64{} // segments above the low watermark
	for _, sg := range segs {
		if s.segs.get(s.segs.intern(sg.ID)).placed.Load() > int64(s.cfg.LowWatermark*float64(sg.Capacity)) {
			over[sg.Medium]++
		}
	}
	var targets []evictTarget
	fullest := map[masterv1.Medium]evictTarget{}
	fullestUsed := map[masterv1.Medium]int64{}
	for _, sg := range segs {
		n := need[sg.Medium]
		idx := s.segs.intern(sg.ID)
		used := s.segs.get(idx).placed.Load()
		if low := int64(s.cfg.LowWatermark * float64(sg.Capacity)); used > low {
			share := (n + over[sg.Medium] - 1) / over[sg.Medium]
			high := int64(s.cfg.HighWatermark * float64(sg.Capacity))
			targets = append(targets, evictTarget{seg: idx, need: max(used-low, used+share-high+1)})
		} else if u, seen := fullestUsed[sg.Medium]; !seen || used > u {
			fullest[sg.Medium], fullestUsed[sg.Medium] = evictTarget{seg: idx, need: n}, used
		}
	}
	if len(targets) == 0 {
		for _, t := range fullest {
			targets = append(targets, t)
		}
	}
	if len(targets) == 0 {
		return 0, 0
	}
	var off []evictTarget
	if s.canOffload(all) {
		targets = slices.DeleteFunc(targets, func(t evictTarget) bool {
			if idx := slices.IndexFunc(segs, func(sg cluster.Segment) bool { return s.segs.intern(sg.ID) == t.seg }); idx >= 0 &&
				segs[idx].Medium == masterv1.Medium_MEDIUM_MEMORY {
				off = append(off, t)
				return true
			}
			return false
		})
	}
	if len(off) > 0 {
		ctx, span := tracer.Child(ctx, "master.offload")
		s.offloadMu.Lock()
		r := s.offloadCounted(ctx, off)
		s.offloadMu.Unlock()
		span.End()
		offloaded, evicted = r.offloaded, r.dropped
	}
	if len(targets) > 0 {
		ctx, span := tracer.Child(ctx, "master.evict")
		n := s.evict(ctx, targets)
		endEvict(span, "drain", targets, n)
		evicted += n
	}
	return evicted, offloaded
}
