package meta

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

// MaxMigrateKeys bounds the keys of one Copy or Move request: each key is a
// copy between agents, run in chunks of drainChunk, so the bound keeps one
// RPC's work (and the time it holds its caller) in proportion.
const MaxMigrateKeys = 1024

// MigrateTarget is where Copy and Move put the new replica: exactly one of
// a segment, a host or a medium.
type MigrateTarget struct {
	SegmentID string
	HostID    string
	Medium    masterv1.Medium
}

// MigrateSpec is one Copy or Move request.
type MigrateSpec struct {
	Tenant string
	Keys   []string
	Target MigrateTarget
	// Move removes the source replica once the target is COMPLETE.
	Move bool
	// FromSegment names the source replica by its segment; "" chooses the
	// object's first COMPLETE replica that is not on the target.
	FromSegment string
}

// MigrateResult is one key's outcome, in request order.
type MigrateResult struct {
	Key string
	Err error
	// Replica is the new COMPLETE replica (no token) when Err is nil.
	Replica *masterv1.ReplicaDescriptor
	// Source is the segment the bytes came from (for a move, the removed
	// replica's).
	Source string
}

// migrateMode says how migrateChunk settles its moves.
type migrateMode uint8

const (
	// modeDrain: success removes the source; a failure removes the
	// target and keeps the source, for the drain's next pass.
	modeDrain migrateMode = iota
	// modeCopy: success keeps the source; a failure removes the target.
	modeCopy
	// modeMove: success removes the source; a failure removes the target.
	modeMove
	// modeOffload (offload.go): an eviction victim demoted to disk.
	// Success completes the target and removes every replica of the
	// source's medium, if the object is still the victim it was (see
	// stillVictimLocked; else the target is removed and the object stays
	// as it is). A failure removes the target and drops the object, as
	// eviction would have, if it is still the victim (and the pass was
	// not cancelled).
	modeOffload
)

// ValidateMigrate checks a Copy or Move request's envelope: 1..MaxMigrateKeys
// distinct valid keys, exactly one target, ids within MaxHostLen. Errors
// are INVALID_PARAMS for the whole request.
func ValidateMigrate(sp *MigrateSpec) error {
	if len(sp.Keys) == 0 {
		return errInvalid("no keys")
	}
	if len(sp.Keys) > MaxMigrateKeys {
		return errInvalid("%d keys, max %d", len(sp.Keys), MaxMigrateKeys)
	}
	seen := make(map[string]struct{}, len(sp.Keys))
	for i, k := range sp.Keys {
		if err := ValidateKey(sp.Tenant, k); err != nil {
			return errInvalid("keys[%d]: %v", i, err)
		}
		if _, dup := seen[k]; dup {
			return errInvalid("keys[%d]: key %q repeated", i, k)
		}
		seen[k] = struct{}{}
	}
	t := sp.Target
	n := 0
	if t.SegmentID != "" {
		n++
	}
	if t.HostID != "" {
		n++
	}
	if t.Medium != masterv1.Medium_MEDIUM_UNSPECIFIED {
		n++
		if _, ok := masterv1.Medium_name[int32(t.Medium)]; !ok {
			return errInvalid("target medium %d is not a medium", t.Medium)
		}
	}
	if n != 1 {
		return errInvalid("target must name exactly one of a segment, a host or a medium")
	}
	if len(t.SegmentID) > MaxHostLen || len(t.HostID) > MaxHostLen || len(sp.FromSegment) > MaxHostLen {
		return errInvalid("segment and host ids must be at most %d bytes", MaxHostLen)
	}
	return nil
}

// Migrate copies (or, with sp.Move, moves) each named object of one tenant
// to a target, by drain's phases (migrateChunk): a PROCESSING target placed
// pending, reserved at its agent, copied agent to agent by the source's
// agent, sealed with the object's checksum, then COMPLETE(target) — and for
// a move REMOVE(source) after it, so `stored` on the target medium precedes
// `removed` on the source medium. A failure after placement removes the
// never-readable target (releasing its allocation) and keeps the source.
// Placement never evicts: a target without room is NO_AVAILABLE_HANDLE.
// The error is for the request as a whole (invalid envelope, unknown target
// segment); per-key outcomes are in the results.
func (s *Store) Migrate(ctx context.Context, sp MigrateSpec) ([]MigrateResult, error) {
	sp.Tenant = NormalizeTenant(sp.Tenant)
	if err := ValidateMigrate(&sp); err != nil {
		return nil, err
	}
	if id := sp.Target.SegmentID; id != "" {
		sg, ok := s.reg.Segment(id)
		if !ok {
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "target segment %q not found", id)
		}
		if !sg.CanAllocate() {
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "target segment %q cannot take allocations (%s, %s)", id, sg.Lifecycle, sg.Health)
		}
	}
	mode := modeCopy
	if sp.Move {
		mode = modeMove
	}
	res := make([]MigrateResult, len(sp.Keys))
	moves := make([]*move, 0, len(sp.Keys))
	t, known := s.tenants.lookup(sp.Tenant)
	for i, k := range sp.Keys {
		res[i].Key = k
		if !known {
			res[i].Err = errNotFound(sp.Tenant, k)
			continue
		}
		moves = append(moves, &move{tenant: t, key: k, shard: s.shardIndex(t, k), idx: i})
	}
	for start := 0; start < len(moves); start += drainChunk {
		if err := ctx.Err(); err != nil {
			for _, mv := range moves[start:] {
				res[mv.idx].Err = rpcerr.Status(err)
			}
			break
		}
		chunk := moves[start:min(start+drainChunk, len(moves))]
		rel := &releases{}
		s.migratePlace(chunk, rel, &sp)
		s.migrateChunk(ctx, chunk, rel, mode)
		for _, mv := range chunk {
			r := &res[mv.idx]
			r.Source = mv.srcSeg
			if mv.err != nil {
				r.Err = mv.err
				continue
			}
			tg := &mv.target.seg
			r.Replica = &masterv1.ReplicaDescriptor{
				ReplicaId: mv.dst, SegmentId: tg.ID, AgentId: tg.AgentID, HostId: tg.HostID,
				DataEndpoint: tg.DataEndpoint, TransferEndpoint: tg.TransferEndpoint,
				AllocationId: mv.dstAlloc, Offset: mv.dstOff, Size: mv.size,
				Medium: tg.Medium, Status: masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE,
			}
		}
	}
	done := 0
	for i := range res {
		if res[i].Err == nil {
			done++
		}
	}
	s.lg.Info("objects migrated", "tenant", sp.Tenant, "move", sp.Move, "keys", len(sp.Keys), "done", done, "failed", len(sp.Keys)-done)
	return res, nil
}

// migratePlace is Migrate's phase 1 for one chunk: per object, choose the
// source replica and place a pending PROCESSING target, or set mv.err.
func (s *Store) migratePlace(chunk []*move, rel *releases, sp *MigrateSpec) {
	p := s.newPlacer(newExclusions())
	tgt := sp.Target
	var tgtIdx uint32
	if tgt.SegmentID != "" {
		tgtIdx = s.segs.intern(tgt.SegmentID)
	}
	// onTarget says whether replica r is on the target.
	onTarget := func(r *replica) bool {
		switch {
		case tgt.SegmentID != "":
			return r.seg == tgtIdx
		case tgt.HostID != "":
			sv, ok := s.reg.Segment(s.segs.get(r.seg).id)
			return ok && sv.HostID == tgt.HostID
		default:
			return masterv1.Medium(r.medium) == tgt.Medium
		}
	}
	nowMs := s.now().UnixMilli()
	forShards(chunk, func(mv *move) int { return mv.shard }, func(sh int, group []*move) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, mv := range group {
			o := shd.getLocked(mv.tenant, mv.key)
			if o == nil {
				mv.err = errNotFound(sp.Tenant, mv.key)
				continue
			}
			if o.put != nil {
				mv.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
					"object %q/%q has a write in progress", sp.Tenant, mv.key)
				continue
			}
			if sp.Move && o.flags&flagHardPin != 0 {
				mv.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
					"object %q/%q is hard-pinned and is not moved", sp.Tenant, mv.key)
				continue
			}
			si := -1
			for i := range o.replicas {
				r := &o.replicas[i]
				if onTarget(r) {
					mv.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_ALREADY_EXISTS,
						"object %q/%q already has a replica on the target", sp.Tenant, mv.key)
					break
				}
				if si < 0 && r.status == stComplete && (sp.FromSegment == "" || s.segs.get(r.seg).id == sp.FromSegment) {
					si = i
				}
			}
			if mv.err != nil {
				continue
			}
			if si < 0 {
				if sp.FromSegment != "" {
					mv.err = errNotFound(sp.Tenant, mv.key)
				} else {
					mv.err = errNotReady(sp.Tenant, mv.key, "no COMPLETE replica")
				}
				continue
			}
			r := o.replicas[si]
			sv, ok := s.reg.Segment(s.segs.get(r.seg).id)
			if !ok || !sv.CanServeRead() {
				mv.err = errNotReady(sp.Tenant, mv.key, "its source segment cannot serve reads")
				continue
			}
			avoid := make([]uint32, 0, len(o.replicas))
			for _, r := range o.replicas {
				avoid = append(avoid, r.seg)
			}
			var vs []*segView
			var perr *placeErr
			switch {
			case tgt.SegmentID != "":
				vs, perr = p.pickSegment(tgt.SegmentID, o.size)
			case tgt.HostID != "":
				vs, perr = p.pickHost(tgt.HostID, masterv1.Medium(r.medium), o.size)
			default:
				vs, perr = p.pick(1, tgt.Medium, o.size, "", nil, "", avoid)
			}
			if perr != nil {
				mv.err = perr.err
				continue
			}
			mv.src, mv.srcSeg, mv.srcAgent = r.id, sv.ID, sv.AgentID
			mv.objectLocked(shd, o, r, shd.softPinnedLocked(o, nowMs))
			mv.target = vs[0]
			mv.dst = m.create(o, vs[0].idx, uint8(vs[0].seg.Medium), true, 0)
		}
		m.commit()
		shd.mu.Unlock()
	})
}

// pickSegment is the segment id when it can allocate and has room for size.
func (p *placer) pickSegment(id string, size uint64) ([]*segView, *placeErr) {
	for _, all := range p.alloc {
		for i := range all {
			if v := &all[i]; v.seg.ID == id {
				if !v.fits(int64(size)) {
					return nil, errNoSpace(false, "target segment %q has no %d free bytes", id, size)
				}
				return []*segView{v}, nil
			}
		}
	}
	return nil, errNoSpace(false, "target segment %q cannot take allocations", id)
}

// pickHost is the segment of the host, of medium, with the most free space
// that has room for size.
func (p *placer) pickHost(host string, medium masterv1.Medium, size uint64) ([]*segView, *placeErr) {
	var best *segView
	all := p.alloc[medium]
	for i := range all {
		v := &all[i]
		if v.seg.HostID == host && v.fits(int64(size)) && (best == nil || v.free() > best.free()) {
			best = v
		}
	}
	if best == nil {
		return nil, errNoSpace(false, "no %s segment of host %q has %d free bytes", medium, host, size)
	}
	return []*segView{best}, nil
}

// migrateChunk runs phases 2-5 of a migration on a chunk whose targets are
// placed (phase 1: pending PROCESSING replicas; moves with err set or no
// target are skipped): reserve the targets, batched per agent; record the
// allocations; copy, batched per source agent (one call per drainCopyBytes
// of objects); seal, batched per target agent; then COMPLETE(target) and,
// in modeDrain and modeMove, REMOVE(source) after it (modeOffload: every
// replica of the source's medium). A move that fails after placement has
// its target removed (never readable, its allocation released) and keeps
// its source, except in modeOffload, which drops the victim as eviction
// would. It sends the releases and returns how many moves completed and
// how many victims were dropped for a failure.
func (s *Store) migrateChunk(ctx context.Context, chunk []*move, rel *releases, mode migrateMode) (moved, dropped int) {
	// Phase 2: reserve the targets, per agent.
	type rbatch struct {
		items []*masterv1.ReserveItem
		moves []*move
	}
	per := map[string]*rbatch{}
	for _, mv := range chunk {
		if mv.err != nil || mv.dst == 0 {
			continue
		}
		b := per[mv.target.seg.AgentID]
		if b == nil {
			b = &rbatch{}
			per[mv.target.seg.AgentID] = b
		}
		mv.tenantName = s.tenants.get(mv.tenant).name
		b.items = append(b.items, &masterv1.ReserveItem{
			SegmentId: mv.target.seg.ID, Size: mv.size, Tenant: mv.tenantName, Key: mv.key,
			ReplicaId: mv.dst, GroupId: mv.group, HardPin: mv.hard, SoftPinUntilUnixMs: mv.pinMs,
		})
		b.moves = append(b.moves, mv)
	}
	fanOut(per, func(agent string, b *rbatch) {
		out, err := s.agents.Reserve(ctx, agent, b.items)
		if err == nil && len(out) != len(b.items) {
			err = errInternal("agent %s answered %d reservations for %d items", agent, len(out), len(b.items))
		}
		for i, mv := range b.moves {
			switch {
			case err != nil:
				mv.err = err
			case out[i].GetStatus().GetCode() != 0:
				mv.err = rpcerr.FromItem(out[i].GetStatus())
			default:
				mv.dstAlloc, mv.dstOff = out[i].GetAllocationId(), out[i].GetOffset()
			}
		}
	})
	// Phase 3: record the target allocations.
	unlock := s.freeingMemory(mode)
	dropped += s.migrateSettle(ctx, chunk, rel, true, mode, func(m *mut, o *object, mv *move, di int) bool {
		if mv.err != nil {
			return false
		}
		o.replicas[di].allocID, o.replicas[di].offset, o.replicas[di].pending = mv.dstAlloc, mv.dstOff, false
		return true
	})
	// What this phase freed goes to the agents now, not after the copies,
	// which run at disk speed: an offload's victims whose target could not
	// be reserved are dropped. Their extents are free in the metadata from
	// the moment they were removed, and a PutStart short of room carves its
	// hole there (makeHole); an agent still holding them refuses the put
	// NO_AVAILABLE_HANDLE ("largest free extent" below the hole).
	s.sendReleasesNow(ctx, rel)
	unlock()
	// Phase 4: copy (each source agent: its items in batched calls, which
	// it runs over the targets' bulk transfer listeners), then seal
	// (target agents). A failed item fails its move alone: phase 5 removes
	// its target, as for a failed seal.
	now := s.now()
	exp, signer := now.Add(s.cfg.WriteTokenTTL), s.keys.Signer(now)
	type cbatch struct {
		items []*masterv1.CopyItem
		moves []*move
	}
	copies := map[string]*cbatch{}
	for _, mv := range chunk {
		if mv.err != nil || mv.dst == 0 {
			continue
		}
		b := copies[mv.srcAgent]
		if b == nil {
			b = &cbatch{}
			copies[mv.srcAgent] = b
		}
		tgt := &mv.target.seg
		b.items = append(b.items, &masterv1.CopyItem{
			Source:                 &masterv1.AllocationRef{SegmentId: mv.srcSeg, AllocationId: mv.srcAlloc},
			TargetEndpoint:         tgt.DataEndpoint,
			TargetTransferEndpoint: tgt.TransferEndpoint,
			Target:                 &masterv1.AllocationRef{SegmentId: tgt.ID, AllocationId: mv.dstAlloc},
			TargetToken: signer.Sign(token.Claims{Mode: token.Write, Tenant: mv.tenantName, Key: mv.key,
				SegmentID: tgt.ID, AllocationID: mv.dstAlloc, Expiry: exp, ReplicaID: mv.dst, Group: mv.group, HardPin: mv.hard}),
		})
		b.moves = append(b.moves, mv)
	}
	fanOut(copies, func(agent string, b *cbatch) {
		// One call per drainCopyBytes of objects, one after the other: each
		// call gets the session's copy timeout, which a chunk of large
		// objects in one call could outrun (failing every move in it).
		for lo := 0; lo < len(b.items); {
			hi, bytes := lo, uint64(0)
			for hi < len(b.items) && (hi == lo || bytes+b.moves[hi].size <= drainCopyBytes) {
				bytes += b.moves[hi].size
				hi++
			}
			out, err := s.agents.Copy(ctx, agent, b.items[lo:hi])
			if err == nil && len(out) != hi-lo {
				err = errInternal("agent %s answered %d copies for %d items", agent, len(out), hi-lo)
			}
			for i, mv := range b.moves[lo:hi] {
				if err != nil {
					mv.err = err
				} else {
					mv.err = rpcerr.FromItem(out[i])
				}
			}
			lo = hi
		}
	})
	type sbatch struct {
		items []*masterv1.SealItem
		moves []*move
	}
	seals := map[string]*sbatch{}
	for _, mv := range chunk {
		if mv.err != nil || mv.dst == 0 {
			continue
		}
		b := seals[mv.target.seg.AgentID]
		if b == nil {
			b = &sbatch{}
			seals[mv.target.seg.AgentID] = b
		}
		b.items = append(b.items, &masterv1.SealItem{SegmentId: mv.target.seg.ID, AllocationId: mv.dstAlloc, Checksum: mv.checksum, SoftPinUntilUnixMs: mv.pinMs})
		b.moves = append(b.moves, mv)
	}
	fanOut(seals, func(agent string, b *sbatch) {
		out, err := s.agents.Seal(ctx, agent, b.items)
		if err == nil && len(out) != len(b.items) {
			err = errInternal("agent %s answered %d seals for %d items", agent, len(out), len(b.items))
		}
		for i, mv := range b.moves {
			if err != nil {
				mv.err = err
			} else {
				mv.err = rpcerr.FromItem(out[i])
			}
		}
	})
	// Phase 5: COMPLETE(target) before REMOVE(source); on failure remove
	// the target (in modeOffload, the victim too).
	unlock = s.freeingMemory(mode)
	defer unlock()
	dropped += s.migrateSettle(ctx, chunk, rel, false, mode, func(m *mut, o *object, mv *move, di int) bool {
		if mv.err != nil {
			return false
		}
		if mode == modeOffload {
			if !s.stillVictimLocked(o, mv, di, m.nowMs) {
				mv.err = errOffloadStale(mv.key)
				return false
			}
			m.complete(o, di)
			// The object leaves memory: stored(disk) above, then
			// removed(cpu) with its last replica there.
			tm := o.replicas[di].medium
			for i := len(o.replicas) - 1; i >= 0; i-- {
				if o.replicas[i].medium != tm {
					m.remove(o, i, true)
				}
			}
			moved++
			return true
		}
		m.complete(o, di)
		if mode != modeCopy {
			if si := o.replicaIndex(mv.src); si >= 0 {
				m.remove(o, si, true)
			}
		}
		moved++
		return true
	})
	s.sendReleasesNow(ctx, rel)
	return moved, dropped
}

// migrateSettle re-looks-up each move's target replica under its shard lock
// and calls f; when f reports failure (or the target vanished) the target
// is removed, the source kept (in modeOffload the whole object is
// dropped when it is still the victim and ctx is not done) and the move is
// marked done. It returns how many victims were dropped that way. pending
// says the target's allocation is not yet recorded in its replica, so a
// vanished target's reservation is ours to release (once recorded,
// whoever removed the replica released it).
func (s *Store) migrateSettle(ctx context.Context, chunk []*move, rel *releases, pending bool, mode migrateMode, f func(m *mut, o *object, mv *move, di int) bool) (dropped int) {
	// A cancelled offload pass (the master stopping) keeps its victims.
	dropVictim := mode == modeOffload && ctx.Err() == nil
	sc := sampled(ctx)
	forShards(chunk, func(mv *move) int { return mv.shard }, func(sh int, group []*move) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(sc)
		for _, mv := range group {
			if mv.dst == 0 {
				continue
			}
			o := shd.getLocked(mv.tenant, mv.key)
			di := -1
			if o != nil {
				di = o.replicaIndex(mv.dst)
			}
			if di >= 0 {
				// Same replica only if it is still ours: our target segment,
				// and still pending (phase 3) or holding our allocation.
				r := o.replicas[di]
				if r.seg != mv.target.idx || r.pending != pending || (!pending && r.allocID != mv.dstAlloc) {
					di = -1
				}
			}
			if di < 0 {
				if pending && mv.err == nil && mv.dstAlloc != 0 {
					rel.add(mv.target.idx, mv.dstAlloc)
				}
				if mv.err == nil {
					mv.err = errNotFound("", mv.key)
				}
				mv.dst = 0
				continue
			}
			if f(m, o, mv, di) {
				continue
			}
			victim := dropVictim && s.stillVictimLocked(o, mv, di, m.nowMs)
			m.remove(o, di, true)
			if victim { // dropped, as evictVictimsLocked would
				for i := len(o.replicas) - 1; i >= 0; i-- {
					m.remove(o, i, true)
				}
				dropped++
			}
			m.dropIfEmpty(o)
			mv.dst = 0
		}
		m.commit()
		shd.mu.Unlock()
	})
	return dropped
}

// MigrateObjects is Migrate in Copy's and Move's wire types (the
// ObjectService and AdminService adapters call it).
func (s *Store) MigrateObjects(ctx context.Context, tenant string, keys []string, target *masterv1.MigrationTarget, move bool, fromSegment string) ([]*masterv1.MigrationResult, error) {
	res, err := s.Migrate(ctx, MigrateSpec{Tenant: tenant, Keys: keys, Move: move, FromSegment: fromSegment,
		Target: MigrateTarget{SegmentID: target.GetSegmentId(), HostID: target.GetHostId(), Medium: target.GetMedium()}})
	if err != nil {
		return nil, err
	}
	out := make([]*masterv1.MigrationResult, len(res))
	for i := range res {
		r := &res[i]
		out[i] = &masterv1.MigrationResult{Key: r.Key, Status: rpcerr.Item(r.Err), Replica: r.Replica, SourceSegmentId: r.Source}
	}
	return out, nil
}
