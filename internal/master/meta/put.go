package meta

import (
	"context"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/tracectx"
)

// PutSpec is one PutStart, already validated for shape by the adapter (New
// re-checks what the state depends on).
type PutSpec struct {
	Tenant          string
	Key             string
	Size            uint64
	ReplicaNum      int
	Medium          masterv1.Medium
	Preferred       []string
	PreferLocalHost string
	SoftPin         bool
	// SoftPinTTL is the soft pin lifetime from the first COMPLETE; 0 means
	// the configured default.
	SoftPinTTL time.Duration
	HardPin    bool
	Group      string
	ClientID   string
	Upsert     bool

	// hole is a segment eviction just made a contiguous hole on for this
	// put's retry; it is tried first.
	hole string
	// spare is the leased blank a put committed by PutEnd goes on
	// (spare.go): placed there, not reserved, never retried elsewhere.
	// spareAttached: its replica holds the allocation (a failure from
	// then on releases it with the replica).
	spare         *spareRef
	spareAttached bool
}

// PutStartResult is one BatchPutStart outcome.
type PutStartResult struct {
	Replicas []*masterv1.ReplicaDescriptor
	Err      error
}

// cleanupTimeout bounds agent traffic that must happen even when the caller
// has gone (releases of allocations the metadata no longer owns).
const cleanupTimeout = 10 * time.Second

func cleanupCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
}

func errPutExpired(tenant, key string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_PUT_EXPIRED,
		"no put in progress for %q/%q (ended, revoked, preempted, expired, or its segments went away)", tenant, key)
}

// MaxObjectSizeCap bounds the object size whatever the configuration: 64
// GiB holds a whole 128k-token sequence of a 70B model's KV cache in fp16
// (about 40 GiB) as one object, is the segment size the disk checks are
// budgeted for, and keeps every size sum of one request (MaxReplicaNum
// replicas, a full batch of puts) far below 2^63, so the int64 accounting
// of segments, quotas and eviction needs no overflow check.
const MaxObjectSizeCap = 64 << 30

// maxObjectSize is the largest object a PutStart may ask for:
// Config.MaxObjectSize, else the capacity of the largest of segs (the
// registered segments), at most MaxObjectSizeCap.
func (s *Store) maxObjectSize(segs []cluster.Segment) uint64 {
	if s.cfg.MaxObjectSize > 0 {
		return s.cfg.MaxObjectSize
	}
	var largest uint64
	for i := range segs {
		largest = max(largest, segs[i].Capacity)
	}
	if largest == 0 || largest > MaxObjectSizeCap {
		return MaxObjectSizeCap
	}
	return largest
}

func errTooLarge(size, limit uint64) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_TOO_LARGE,
		"object of %d bytes exceeds the maximum object size, %d bytes (--max-object-size, default the largest segment)", size, limit)
}

func errIllegalClient(tenant, key string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT,
		"put of %q/%q was started by another client", tenant, key)
}

// checkSpec validates sp; maxSize is maxObjectSize's answer.
func (s *Store) checkSpec(sp *PutSpec, maxSize uint64) error {
	if err := ValidateKey(sp.Tenant, sp.Key); err != nil {
		return err
	}
	if sp.Size == 0 {
		return errInvalid("size must be > 0")
	}
	if sp.Size > maxSize {
		return errTooLarge(sp.Size, maxSize)
	}
	if sp.ReplicaNum < 1 || sp.ReplicaNum > MaxReplicaNum {
		return errInvalid("replica_num must be 1..%d, got %d", MaxReplicaNum, sp.ReplicaNum)
	}
	switch sp.Medium {
	case masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK:
	default:
		return errInvalid("unknown medium %d", sp.Medium)
	}
	if sp.SoftPinTTL < 0 || sp.SoftPinTTL > s.cfg.MaxSoftPinTTL {
		return errInvalid("soft_pin_ttl must be 0..%v, got %v", s.cfg.MaxSoftPinTTL, sp.SoftPinTTL)
	}
	if len(sp.Group) > MaxGroupLen {
		return errInvalid("group_id must be at most %d bytes", MaxGroupLen)
	}
	return validatePutStrings(sp)
}

// PutStart starts one put; see BatchPutStart.
func (s *Store) PutStart(ctx context.Context, sp PutSpec) ([]*masterv1.ReplicaDescriptor, error) {
	r := s.BatchPutStart(ctx, []PutSpec{sp})
	return r[0].Replicas, r[0].Err
}

// plannedRep is one replica a put placed, followed through reservation.
type plannedRep struct {
	id      uint32
	v       *segView
	allocID uint64
	offset  uint64
	err     error
}

// putItem is one PutStart followed through its phases.
type putItem struct {
	i      int
	tenant uint32
	shard  int
	seq    uint64
	// obj is the object phase 1 recorded the put on. Later phases use it
	// instead of looking the key up again: an object leaves the map only
	// through dropIfEmpty, which clears its put, so a stale obj fails the
	// put.seq check exactly as a fresh lookup would (and a newer object
	// under the same key is never mistaken for this put's).
	obj   *object
	reps  []plannedRep
	err   error
	retry bool // failed for lack of space or agent; worth one more round
}

// BatchPutStart starts many puts: per shard it validates, charges quota,
// places and records PROCESSING replicas (one lock per shard); then it
// reserves at the agents (one Reserve per agent, agents in parallel); then
// per shard it re-looks-up each put and fills in the allocations (or reverts
// it). Puts that failed for lack of space trigger eviction and are retried
// once; puts whose agent failed are retried once on other segments. specs
// are normalised in place (default tenant, replica_num, medium). A size
// above maxObjectSize fails with OBJECT_TOO_LARGE before any of that.
func (s *Store) BatchPutStart(ctx context.Context, specs []PutSpec) []PutStartResult {
	ctx, span := tracer.Child(ctx, "master.put_start")
	res := make([]PutStartResult, len(specs))
	rounds := 0
	defer func() {
		if span.IsRecording() {
			var size uint64
			for i := range specs {
				size += specs[i].Size
			}
			span.SetAttributes(tracectx.Items.Int(len(specs)), tracectx.Bytes.Int64(int64(min(size, 1<<63-1))), attrRounds.Int(rounds))
			if t := uniformTenant(specs, func(sp *PutSpec) string { return sp.Tenant }); t != "" {
				span.SetAttributes(tracectx.Tenant.String(t))
			}
			batchOutcome(span, func(yield func(error) bool) {
				for i := range res {
					if !yield(res[i].Err) {
						return
					}
				}
			})
		}
		span.End()
	}()
	items := make([]*putItem, 0, len(specs))
	arena := make([]putItem, len(specs))
	// One registry snapshot gives the size limit and the first round's
	// placement.
	segs := s.reg.Segments()
	maxSize := s.maxObjectSize(segs)
	for i := range specs {
		sp := &specs[i]
		sp.Tenant = NormalizeTenant(sp.Tenant)
		if sp.ReplicaNum == 0 {
			sp.ReplicaNum = 1
		}
		if sp.Medium == masterv1.Medium_MEDIUM_UNSPECIFIED {
			sp.Medium = masterv1.Medium_MEDIUM_MEMORY
		}
		if err := s.checkSpec(sp, maxSize); err != nil {
			res[i].Err = err
			continue
		}
		t, err := s.tenants.acquire(sp.Tenant)
		if err != nil {
			res[i].Err = err
			continue
		}
		arena[i] = putItem{i: i, tenant: t, shard: s.shardIndex(t, sp.Key)}
		items = append(items, &arena[i])
	}
	// The tenants stay pinned until every round is over; a tenant whose
	// puts all failed then leaves the table (tenantTable.release).
	defer s.releaseTenants(items)
	exclude := newExclusions()
	var wd descWriter
	for round := 0; round < 2 && len(items) > 0; round++ {
		if round > 0 {
			segs = s.reg.Segments() // after eviction and exclusions
		}
		rounds++
		s.putStartRound(ctx, specs, items, s.newPlacerFrom(segs, exclude), exclude)
		now := s.now()
		wd.reset(items, now.Add(s.cfg.WriteTokenTTL), s.keys.Signer(now))
		var retry []*putItem
		type want struct{ total, largest uint64 }
		evict := map[masterv1.Medium]want{}
		for _, it := range items {
			if it.err == nil {
				res[it.i].Replicas = s.writeDescriptors(&wd, &specs[it.i], it)
				continue
			}
			if !it.retry || round == 1 || specs[it.i].spare != nil {
				res[it.i].Err = it.err
				continue
			}
			if rpcerr.Reason(it.err) == "NO_AVAILABLE_HANDLE" {
				w := evict[specs[it.i].Medium]
				w.total += specs[it.i].Size
				w.largest = max(w.largest, specs[it.i].Size)
				evict[specs[it.i].Medium] = w
			}
			*it = putItem{i: it.i, tenant: it.tenant, shard: it.shard}
			retry = append(retry, it)
		}
		for medium, w := range evict {
			// Blanks are the first room to give back: they are no
			// object's, and they sit between objects where eviction's
			// contiguous hole must form.
			s.releaseBlanksOf(ctx, medium)
			if hole := s.evictFor(ctx, medium, w.total, w.largest); hole != "" {
				for _, it := range retry {
					if specs[it.i].Medium == medium {
						specs[it.i].hole = hole
					}
				}
			}
		}
		items = retry
	}
	return res
}

// putStartRound runs the three phases for items, placing with p (built
// without exclude's segments and agents; the failures of this round are
// added to exclude).
func (s *Store) putStartRound(ctx context.Context, specs []PutSpec, items []*putItem, p *placer, exclude *exclusions) {
	rel := &releases{}
	// Phase 1: per shard, under its lock, decide and record (an upsert's
	// old replicas are removed here: their records name the span).
	pctx, place := tracer.Child(ctx, "master.place")
	sc := tracectx.Carried(pctx, place)
	forShards(items, func(it *putItem) int { return it.shard }, func(sh int, group []*putItem) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(sc)
		for _, it := range group {
			s.placeLocked(m, p, &specs[it.i], it)
		}
		m.commit()
		shd.mu.Unlock()
	})
	if place.IsRecording() {
		placed := 0
		for _, it := range items {
			if it.err == nil {
				placed++
			}
		}
		place.SetAttributes(tracectx.Items.Int(len(items)), tracectx.Failed.Int(len(items)-placed))
	}
	place.End()
	// Phase 2: take a blank reservation where the segment has one of the
	// size (blank.go), else reserve at the agents, batched per agent.
	type batch struct {
		items []*masterv1.ReserveItem
		reps  []*plannedRep
	}
	per := map[string]*batch{}
	ris := slab[masterv1.ReserveItem]{n: len(items)}
	nowMs := s.nowMs()
	for _, it := range items {
		if it.err != nil {
			continue
		}
		sp := &specs[it.i]
		for r := range it.reps {
			rp := &it.reps[r]
			if sp.spare != nil {
				rp.allocID, rp.offset = sp.spare.alloc, sp.spare.offset
				continue
			}
			if b, ok := s.takeBlank(rp.v, sp.Size, nowMs); ok {
				rp.allocID, rp.offset = b.alloc, b.offset
				continue
			}
			s.reservesSent.Add(1)
			b := per[rp.v.seg.AgentID]
			if b == nil {
				b = &batch{}
				per[rp.v.seg.AgentID] = b
			}
			ri := ris.next()
			ri.SegmentId, ri.Size, ri.Tenant, ri.Key = rp.v.seg.ID, sp.Size, sp.Tenant, sp.Key
			ri.ReplicaId, ri.GroupId, ri.HardPin = rp.id, sp.Group, sp.HardPin
			b.items = append(b.items, ri)
			b.reps = append(b.reps, rp)
		}
	}
	fanOut(per, func(agent string, b *batch) {
		out, err := s.agents.Reserve(ctx, agent, b.items)
		if err == nil && len(out) != len(b.items) {
			err = errInternal("agent %s answered %d reservations for %d items", agent, len(out), len(b.items))
		}
		for i, rp := range b.reps {
			switch {
			case err != nil:
				rp.err = err
			case out[i].GetStatus().GetCode() != 0:
				rp.err = rpcerr.FromItem(out[i].GetStatus())
			default:
				rp.allocID, rp.offset = out[i].GetAllocationId(), out[i].GetOffset()
			}
		}
	})
	// Phase 3: per shard, re-look-up each put and fill in or revert.
	forShards(items, func(it *putItem) int { return it.shard }, func(sh int, group []*putItem) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, it := range group {
			if it.err == nil {
				s.settleReservationsLocked(m, &specs[it.i], it, exclude)
			}
		}
		m.commit()
		shd.mu.Unlock()
	})
	s.sendReleasesNow(ctx, rel)
}

// placeLocked is phase 1 of one put.
func (s *Store) placeLocked(m *mut, p *placer, sp *PutSpec, it *putItem) {
	o := m.sh.getLocked(it.tenant, sp.Key)
	if o != nil {
		switch {
		case o.put != nil && m.nowMs-o.put.startMs < s.cfg.PutPreemptAfter.Milliseconds():
			it.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_ALREADY_EXISTS,
				"object %q/%q has a write in progress", sp.Tenant, sp.Key)
			return
		case o.put == nil && len(o.replicas) > 0 && !sp.Upsert:
			it.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_ALREADY_EXISTS,
				"object %q/%q exists", sp.Tenant, sp.Key)
			return
		case o.put == nil && o.leased(m.nowMs, s.cfg.LeaseTTL):
			it.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE,
				"object %q/%q is being read; upsert after its lease", sp.Tenant, sp.Key)
			return
		}
	}
	// Place before destroying anything, so a failed upsert keeps the old
	// object. The old replicas' segments stay eligible (their space is
	// freed below).
	var vs []*segView
	if sp.spare != nil {
		v := p.spareView(sp.spare)
		if v == nil {
			it.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
				"the spare's segment %s can no longer take puts", s.segs.get(sp.spare.seg).id)
			return
		}
		vs = []*segView{v}
	} else {
		var perr *placeErr
		if vs, perr = p.pick(sp.ReplicaNum, sp.Medium, sp.Size, sp.hole, sp.Preferred, sp.PreferLocalHost, nil); perr != nil {
			it.err, it.retry = perr.err, perr.space
			return
		}
	}
	if o != nil {
		// Preempt an abandoned put, or replace (upsert) the object: charge
		// the size difference first (nothing changes if the quota refuses),
		// then remove every old replica, then resize.
		if err := s.tenants.get(o.tenant).charge(int64(sp.Size)-int64(o.size), 0, false); err != nil {
			it.err = err
			return
		}
		for i := len(o.replicas) - 1; i >= 0; i-- {
			m.remove(o, i, true)
		}
		m.sh.endPutLocked(o)
		m.sh.clearSoftPinLocked(o)
		m.sh.setGroupLocked(o, sp.Group)
		o.size, o.checksum = sp.Size, 0
		o.flags, o.sealedMs = 0, 0
	} else {
		var err error
		if o, err = m.newObject(it.tenant, sp.Key, sp.Size, false); err != nil {
			it.err = err
			return
		}
		m.sh.setGroupLocked(o, sp.Group)
	}
	if sp.HardPin {
		o.flags |= flagHardPin
	}
	it.seq, it.obj = s.putSeq.Add(1), o
	ps := &putState{client: sp.ClientID, seq: it.seq, startMs: m.nowMs, phase: phasePlacing}
	if sp.SoftPin {
		ps.softPinTTL = sp.SoftPinTTL
		if ps.softPinTTL == 0 {
			ps.softPinTTL = s.cfg.SoftPinTTL
		}
	}
	m.sh.startPutLocked(o, ps)
	it.reps = make([]plannedRep, len(vs))
	sp.spareAttached = sp.spare != nil
	for i, v := range vs {
		if sp.spare != nil {
			it.reps[i] = plannedRep{id: m.createSpare(o, v.idx, sp.spare.rid), v: v}
			continue
		}
		it.reps[i] = plannedRep{id: m.create(o, v.idx, uint8(sp.Medium), true, 0), v: v}
		if s.overHigh(v) {
			s.kickEviction()
		}
	}
}

// settleReservationsLocked is phase 3 of one put.
func (s *Store) settleReservationsLocked(m *mut, sp *PutSpec, it *putItem, exclude *exclusions) {
	o := it.obj
	if o == nil || o.put == nil || o.put.seq != it.seq {
		// Preempted or its segments dropped meanwhile: whatever we reserved
		// is nobody's.
		for _, rp := range it.reps {
			if rp.err == nil {
				m.rel.add(rp.v.idx, rp.allocID)
			}
		}
		it.err = errPutExpired(sp.Tenant, sp.Key)
		return
	}
	var firstErr error
	for _, rp := range it.reps {
		idx := o.replicaIndex(rp.id)
		switch {
		case idx < 0:
			if rp.err == nil {
				m.rel.add(rp.v.idx, rp.allocID)
			}
			if firstErr == nil {
				firstErr = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
					"segment %s went away during placement", rp.v.seg.ID)
				it.retry = true
			}
		case rp.err != nil:
			m.fail(o, idx)
			if firstErr == nil {
				firstErr = rp.err
			}
			switch rpcerr.Reason(rp.err) {
			case "NO_AVAILABLE_HANDLE":
				it.retry = true
			case "AGENT_UNAVAILABLE":
				it.retry = true
				exclude.agents[rp.v.seg.AgentID] = true
			case "SEGMENT_UNAVAILABLE", "SEGMENT_NOT_FOUND":
				it.retry = true
				exclude.segs[rp.v.idx] = true
			}
		default:
			o.replicas[idx].allocID, o.replicas[idx].offset = rp.allocID, rp.offset
			o.replicas[idx].pending = false
		}
	}
	if firstErr == nil {
		o.put.phase = phaseOpen
		return
	}
	// Revert the whole put: release what was reserved, refund the quota.
	for i := len(o.replicas) - 1; i >= 0; i-- {
		m.remove(o, i, true)
	}
	m.sh.endPutLocked(o)
	m.dropIfEmpty(o)
	it.err = firstErr
}

// descWriter holds what a round's PutStart answers share: their token
// expiry and the memory of their descriptors (one allocation each per
// round instead of two per put).
type descWriter struct {
	exp    time.Time
	signer *token.Signer
	descs  []masterv1.ReplicaDescriptor
	ptrs   []*masterv1.ReplicaDescriptor
}

// reset sizes w for the successful puts among items, with tokens that
// expire at exp, signed by signer.
func (w *descWriter) reset(items []*putItem, exp time.Time, signer *token.Signer) {
	n := 0
	for _, it := range items {
		if it.err == nil {
			n += len(it.reps)
		}
	}
	*w = descWriter{exp: exp, signer: signer, descs: make([]masterv1.ReplicaDescriptor, n), ptrs: make([]*masterv1.ReplicaDescriptor, n)}
}

// writeDescriptors builds the PutStart answer with write tokens.
func (s *Store) writeDescriptors(w *descWriter, sp *PutSpec, it *putItem) []*masterv1.ReplicaDescriptor {
	exp := w.exp
	n := len(it.reps)
	out, descs := w.ptrs[:n:n], w.descs[:n:n]
	w.ptrs, w.descs = w.ptrs[n:], w.descs[n:]
	for i, rp := range it.reps {
		out[i] = &descs[i]
		*out[i] = masterv1.ReplicaDescriptor{
			ReplicaId:        rp.id,
			SegmentId:        rp.v.seg.ID,
			AgentId:          rp.v.seg.AgentID,
			HostId:           rp.v.seg.HostID,
			DataEndpoint:     rp.v.seg.DataEndpoint,
			TransferEndpoint: rp.v.seg.TransferEndpoint,
			AllocationId:     rp.allocID,
			Offset:           rp.offset,
			Size:             sp.Size,
			Medium:           sp.Medium,
			Status:           masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING,
			// The token names the whole replica: an agent writing into a
			// blank reservation records it from the token.
			Token: w.signer.Sign(token.Claims{Mode: token.Write, Tenant: sp.Tenant, Key: sp.Key,
				SegmentID: rp.v.seg.ID, AllocationID: rp.allocID, Expiry: exp,
				ReplicaID: rp.id, Group: sp.Group, HardPin: sp.HardPin}),
			TokenExpiryUnixMs: exp.UnixMilli(),
		}
	}
	return out
}
