package meta

import (
	"context"
	"errors"
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"go.opentelemetry.io/otel/trace"
)

// mut is the one mutation path. A task opens one on a shard it has locked,
// applies primitive events to that shard's objects, and commits before it
// unlocks. Everything else — change records, per-segment accounting, tenant
// usage, releases owed to agents — is derived here from the events, so no
// caller writes side effects of its own.
type mut struct {
	s     *Store
	sh    *shard
	nowMs int64
	recs  []changelog.Record
	// rel collects allocations to release at agents after unlock.
	rel *releases
	// relink holds objects whose access clock touchLater set, out of the
	// shard's recency list until commit places them all in one merge.
	relink []*object
	// span is the sampled span of the task (zero: none), named with its
	// change records (under).
	span trace.SpanContext
	// prepaid is usage already charged to a tenant for objects this
	// session will create by force (prepay): newObject takes from it
	// instead of charging each object (the tenant's lock is shared by every
	// shard, and a rebuild creates millions of objects).
	prepaid prepaid
	// rebuild, when set, supplies the objects newObject(force) creates
	// and their first replica arrays (slab.go); rebuildLeft bounds how
	// many more the task may create.
	rebuild     *rebuildAlloc
	rebuildLeft int
}

// prepaid is a tenant's usage charged ahead by prepay.
type prepaid struct {
	tenant         uint32
	bytes, objects int64
	on             bool
}

// prepay charges tenant (by force) for up to objects new objects of bytes
// in all, which newObject(force) then takes from; settle gives back what
// was not used. The tenant's usage is never below the truth meanwhile, so
// no refund can find it idle too early.
func (m *mut) prepay(tenant uint32, bytes, objects int64) {
	m.settle()
	_ = m.s.tenants.get(tenant).charge(bytes, objects, true)
	m.prepaid = prepaid{tenant: tenant, bytes: bytes, objects: objects, on: true}
}

// settle gives back what prepay charged and newObject did not use.
func (m *mut) settle() {
	if p := m.prepaid; p.on {
		if p.bytes != 0 || p.objects != 0 {
			_ = m.s.tenants.get(p.tenant).charge(-p.bytes, -p.objects, true)
		}
		m.prepaid = prepaid{}
	}
}

// under names sc (a sampled span, or zero) as the span of m's change
// records, and returns m.
func (m *mut) under(sc trace.SpanContext) *mut {
	m.span = sc
	return m
}

// mutPool recycles mutation sessions (and their record buffers).
var mutPool = sync.Pool{New: func() any { return &mut{} }}

func (s *Store) begin(sh *shard, rel *releases) *mut {
	m := mutPool.Get().(*mut)
	m.s, m.sh, m.nowMs, m.rel = s, sh, s.nowMs(), rel
	return m
}

// commit appends the derived change records and ends the session (m must
// not be used afterwards). Call it before unlocking the shard so that
// revision order matches state order.
func (m *mut) commit() {
	m.settle()
	if len(m.relink) > 0 {
		m.sh.relinkLocked(m.relink)
		clear(m.relink)
		m.relink = m.relink[:0]
	}
	if len(m.recs) > 0 {
		m.s.log.AppendTraced(m.recs, m.span)
		m.s.changes.Add(float64(len(m.recs)))
		clear(m.recs)
		m.recs = m.recs[:0]
	}
	m.s, m.sh, m.rel, m.span = nil, nil, nil, trace.SpanContext{}
	mutPool.Put(m)
}

func (m *mut) record(typ changelog.Type, o *object, medium uint8) {
	r := changelog.Record{
		Type:   typ,
		Tenant: m.s.tenants.get(o.tenant).name,
		Key:    o.key,
		Medium: masterv1.Medium(medium),
		TimeMs: m.nowMs,
	}
	if typ == changelog.Stored {
		r.Group = m.sh.groupOf(o)
	}
	m.recs = append(m.recs, r)
}

// touchLater sets o's access clock like shard.touchLocked, but leaves
// placing o in the recency list to commit, which places every object so
// touched in one merge. For clocks that arrive in no particular order
// (Reconcile adopting sealed times), where placing them one by one would
// walk the list once each.
func (m *mut) touchLater(o *object, ms int64) {
	o.accessMs = ms
	if m.sh.linkedLocked(o) {
		m.sh.unlinkLocked(o)
		m.relink = append(m.relink, o)
	}
}

// ---- tenant events ----

// newObject creates an object in the shard, charging its tenant (the
// object-created tenant event). force skips the quota check (adoption of
// bytes that already exist).
func (m *mut) newObject(tenant uint32, key string, size uint64, force bool) (*object, error) {
	if p := &m.prepaid; force && p.on && p.tenant == tenant && p.objects > 0 && p.bytes >= int64(size) {
		p.bytes -= int64(size)
		p.objects--
	} else if err := m.s.tenants.get(tenant).charge(int64(size), 1, force); err != nil {
		return nil, err
	}
	var o *object
	if force && m.rebuild != nil {
		o = m.rebuild.object(m.rebuildLeft)
		*o = object{key: key, tenant: tenant, size: size, nextRID: 1}
	} else {
		o = &object{key: key, tenant: tenant, size: size, nextRID: 1}
	}
	m.sh.insertLocked(o)
	return o, nil
}

// dropIfEmpty erases an object that has no replicas left and refunds its
// tenant (the object-erased tenant event), retiring the tenant when that
// left it idle. It reports whether it did.
func (m *mut) dropIfEmpty(o *object) bool {
	if len(o.replicas) > 0 {
		return false
	}
	m.sh.deleteLocked(o)
	if t := m.s.tenants.get(o.tenant); t.refund(o.size) && t.pins.Load() == 0 {
		m.s.tenants.retire(t) // its last object: an idle tenant leaves the table
	}
	// Cleared so that a put phase holding o (putItem.obj, endItem.obj)
	// sees it gone without a lookup.
	m.sh.endPutLocked(o)
	return true
}

// dropGone erases o once the replicas its agents no longer hold have been
// removed and none is left (a segment dropped, an allocation the agent
// lost or never sealed). A put in progress on it ends, remembered as
// expired: its writer's PutEnd and PutRevoke answer PUT_EXPIRED ("not
// stored, put it again"; the SDKs do, once), not OBJECT_NOT_FOUND.
func (m *mut) dropGone(o *object) {
	if len(o.replicas) > 0 {
		return
	}
	if o.put != nil {
		m.s.expiredPuts.add(expiredHash(m.s.tenants.get(o.tenant).name, o.key))
		m.sh.endPutLocked(o)
	}
	m.dropIfEmpty(o)
}

// ---- replica events ----

// create is REPLICA_CREATE: a PROCESSING replica on segment seg.
func (m *mut) create(o *object, seg uint32, medium uint8, pending bool, allocID uint64) uint32 {
	// Ids come from a store-wide counter (kept monotonic per object), so a
	// stale task's (tenant, key, replica id) never matches a replica of a
	// later incarnation of the same key.
	id := max(o.nextRID, m.s.ridSeq.Add(1))
	o.nextRID = id + 1
	o.replicas = append(o.replicas, replica{allocID: allocID, seg: seg, id: id, status: stProcessing, medium: medium, pending: pending})
	e := m.s.segs.get(seg)
	e.placed.Add(int64(o.size))
	e.replicas.Add(1)
	m.s.reserved.Inc()
	return id
}

// adopt is REPLICA_CREATE followed by REPLICA_COMPLETE for a replica whose
// bytes are already sealed at an agent (Reconcile).
func (m *mut) adopt(o *object, seg uint32, medium uint8, allocID, offset uint64, id uint32) {
	if id == 0 || o.replicaIndex(id) >= 0 {
		id = o.nextRID
	}
	if id >= o.nextRID {
		o.nextRID = id + 1
	}
	if o.replicas == nil && m.rebuild != nil {
		o.replicas = m.rebuild.replicas(m.rebuildLeft)
	}
	o.replicas = append(o.replicas, replica{allocID: allocID, offset: offset, seg: seg, id: id, status: stProcessing, medium: medium})
	e := m.s.segs.get(seg)
	e.placed.Add(int64(o.size))
	e.replicas.Add(1)
	m.complete(o, len(o.replicas)-1)
}

// complete is REPLICA_COMPLETE. The first COMPLETE replica on a medium
// records `stored`.
func (m *mut) complete(o *object, i int) {
	r := &o.replicas[i]
	if r.status != stProcessing {
		return
	}
	if !o.hasCompleteOn(r.medium, i) {
		m.record(changelog.Stored, o, r.medium)
	}
	r.status = stComplete
}

// fail is REPLICA_FAILED (the caller removes the replica next).
func (m *mut) fail(o *object, i int) {
	if o.replicas[i].status == stProcessing {
		o.replicas[i].status = stFailed
	}
}

// remove is REPLICA_REMOVE: the replica leaves the object; when it was the
// last COMPLETE one on its medium, `removed` is recorded. With release, its
// allocation is owed back to its agent (sent after unlock).
func (m *mut) remove(o *object, i int, release bool) {
	r := o.replicas[i]
	if r.status == stComplete && !o.hasCompleteOn(r.medium, i) {
		m.record(changelog.Removed, o, r.medium)
	}
	e := m.s.segs.get(r.seg)
	e.placed.Add(-int64(o.size))
	e.replicas.Add(-1)
	e.freedMs.Store(m.nowMs)
	if release && !r.pending && m.rel != nil {
		m.rel.add(r.seg, r.allocID)
	}
	last := len(o.replicas) - 1
	copy(o.replicas[i:], o.replicas[i+1:])
	o.replicas[last] = replica{}
	o.replicas = o.replicas[:last]
	if len(o.replicas) == 0 {
		o.replicas = nil
	}
}

// removeAll removes every replica of o (releasing them when release) and
// erases it.
func (m *mut) removeAll(o *object, release bool) {
	for i := len(o.replicas) - 1; i >= 0; i-- {
		m.remove(o, i, release)
	}
	m.dropIfEmpty(o)
}

// ---- releases owed to agents ----

// releases collects allocations to free at agents once no shard lock is held.
type releases struct {
	mu    sync.Mutex
	items map[uint32][]uint64 // segment index → allocation ids
	// removal: a client's removal, which a failover must not undo: a
	// segment a release is owed on is unsettled (unsettled.go).
	removal bool
}

func (r *releases) add(seg uint32, alloc uint64) {
	r.mu.Lock()
	if r.items == nil {
		r.items = make(map[uint32][]uint64)
	}
	r.items[seg] = append(r.items[seg], alloc)
	r.mu.Unlock()
}

// send releases the collected allocations, batched per agent and in
// parallel across agents. Segments that are gone or whose agent cannot be
// reached are skipped: the agent's own reconcile (or its unmount) frees
// them. Must be called with no shard lock held.
func (s *Store) sendReleases(ctx context.Context, r *releases) {
	if r == nil {
		return
	}
	r.mu.Lock()
	items := r.items
	r.items = nil
	r.mu.Unlock()
	if len(items) == 0 {
		return
	}
	if s.following.Load() {
		for seg, allocs := range items {
			s.owe(seg, allocs) // a standby sends nothing; the leader it becomes does
		}
		return
	}
	per := make(map[string][]*masterv1.AllocationRef)
	segsOf := make(map[string][]uint32) // each agent's segments in per
	for seg, allocs := range items {
		e := s.segs.get(seg)
		sv, ok := s.reg.Segment(e.id)
		if !ok || sv.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
			continue // the segment is gone, and its allocations with it
		}
		if !sv.CanContinueCleanup() {
			s.owe(seg, allocs)
			if r.removal {
				s.markUnsettled(seg) // after the owe (syncUnsettled)
			}
			continue
		}
		for _, a := range allocs {
			per[sv.AgentID] = append(per[sv.AgentID], &masterv1.AllocationRef{SegmentId: e.id, AllocationId: a})
		}
		segsOf[sv.AgentID] = append(segsOf[sv.AgentID], seg)
	}
	fanOut(per, func(agent string, refs []*masterv1.AllocationRef) {
		if err := s.agents.Release(ctx, agent, refs); err != nil {
			var failed *cluster.ReleaseFailed
			if errors.As(err, &failed) {
				// Answered, but some were not released (a disk segment
				// whose journal cannot be written): those stay allocated
				// at the agent, sealed, and would be adopted back.
				refs = failed.Refs
			}
			s.lg.Warn("release at agent failed; owed, sent again until the agent takes it or reconciles", "agent_id", agent, "allocations", len(refs), "err", err)
			s.Owe(refs)
			if r.removal {
				s.markUnsettledRefs(refs)
			}
			if failed == nil {
				return
			}
		}
		// The agent has freed them: a heartbeat it sent before this ack
		// (same stream, so received before it) still counts them, and
		// must not pass for newer than the free (segEntry.freedMs).
		now := s.nowMs()
		for _, seg := range segsOf[agent] {
			s.segs.get(seg).freedMs.Store(now)
		}
	})
}

// sendReleasesNow sends rel's releases under a cleanup context (they go
// out even when ctx is done: the metadata no longer names them).
func (s *Store) sendReleasesNow(ctx context.Context, rel *releases) {
	cctx, cancel := cleanupCtx(ctx)
	defer cancel()
	s.sendReleases(cctx, rel)
}

// retryOwed sends again the releases owed on segments whose agent is
// connected (one that answered but could not release them: a disk segment
// whose journal failed for a while), and forgets those it takes. An owed
// release stays owed while it is in flight, so a reconcile meanwhile
// still returns it rather than adopt it. Releases owed on a segment that is
// gone are forgotten (mayReturnLocked): a detached segment past
// detachedRetention. A standby sends nothing.
func (s *Store) retryOwed(ctx context.Context) {
	if s.following.Load() {
		return
	}
	per := map[string][]*masterv1.AllocationRef{}
	keys := map[string][]allocKey{}
	forgot := 0
	s.owedMu.Lock()
	for k := range s.owed {
		e := s.segs.get(k.seg)
		sv, ok := s.reg.Segment(e.id)
		if !ok || !sv.CanContinueCleanup() {
			if !s.mayReturnLocked(k.seg) {
				delete(s.owed, k)
				forgot++
			}
			continue
		}
		per[sv.AgentID] = append(per[sv.AgentID], &masterv1.AllocationRef{SegmentId: e.id, AllocationId: k.alloc})
		keys[sv.AgentID] = append(keys[sv.AgentID], k)
	}
	s.owedMu.Unlock()
	if forgot > 0 {
		s.lg.Info("forgot releases owed on segments that are gone", "allocations", forgot)
	}
	if len(per) == 0 {
		return
	}
	rctx, cancel := cleanupCtx(ctx)
	defer cancel()
	fanOut(per, func(agent string, refs []*masterv1.AllocationRef) {
		err := s.agents.Release(rctx, agent, refs)
		var failed *cluster.ReleaseFailed
		if err != nil && !errors.As(err, &failed) {
			return // still owed
		}
		s.noteRefusing(agent, failed, len(refs))
		still := map[allocKey]bool{}
		if failed != nil {
			for _, r := range failed.Refs {
				if idx, ok := s.segs.lookup(r.SegmentId); ok {
					still[allocKey{idx, r.AllocationId}] = true
				}
			}
		}
		now := s.nowMs()
		s.owedMu.Lock()
		for _, k := range keys[agent] {
			if !still[k] {
				delete(s.owed, k)
				s.segs.get(k.seg).freedMs.Store(now)
			}
		}
		s.owedMu.Unlock()
	})
}

// noteRefusing logs when agent starts refusing the releases sent again
// (failed names them), once until it takes them all, and when it does.
func (s *Store) noteRefusing(agent string, failed *cluster.ReleaseFailed, sent int) {
	s.owedMu.Lock()
	was := s.refusing[agent]
	if failed != nil {
		s.refusing[agent] = true
	} else {
		delete(s.refusing, agent)
	}
	s.owedMu.Unlock()
	switch {
	case failed != nil && !was:
		s.lg.Warn("agent refuses releases; they stay owed and are sent again every second (the space stays taken at the agent)",
			"agent_id", agent, "refused", len(failed.Refs), "sent", sent, "err", failed.Err)
	case failed == nil && was:
		s.lg.Info("agent took the releases it had refused", "agent_id", agent, "released", sent)
	}
}

// OwedReleases is the number of releases the master owes to agents: ones
// it could not deliver (the agent away) or the agent refused (a disk
// segment whose journal cannot be written), sent again until taken.
func (s *Store) OwedReleases() int {
	s.owedMu.Lock()
	defer s.owedMu.Unlock()
	return len(s.owed)
}

// owe remembers allocations whose release could not be delivered, so that
// the agent's next Reconcile returns them for release instead of adopting
// them back (which would resurrect removed objects). Nothing is owed on a
// segment that is gone (mayReturnLocked).
func (s *Store) owe(seg uint32, allocs []uint64) {
	s.owedMu.Lock()
	defer s.owedMu.Unlock()
	if !s.mayReturnLocked(seg) {
		return
	}
	for _, a := range allocs {
		s.owed[allocKey{seg, a}] = struct{}{}
	}
}

// mayReturnLocked reports whether segment idx may still hold allocations
// a release is owed for: it is registered and not UNMOUNTED (its agent is
// away or stalled, and reconciles or is unmounted), or it is detached and
// may come back (tombstone.go). A segment past both is gone with its
// allocations: a memory segment its agent registered without, a disk
// segment detached longer than detachedRetention. A release owed on it
// could be neither sent nor returned, and would stay owed for good (the
// soak's "owes 83 releases at rest", after a release failed while its
// agent restarted).
//
// owedMu is held (the registry's and the tombstones' locks are taken
// under it). attach forgets a detachment, the segment already UNMOUNTED,
// before it forgets the releases owed on the segment under owedMu: an owe
// racing it lands before that and is forgotten with the rest, or finds
// the segment gone.
func (s *Store) mayReturnLocked(idx uint32) bool {
	if sv, ok := s.reg.Segment(s.segs.get(idx).id); ok && sv.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
		return true
	}
	return s.tombs.isDetached(idx)
}

// takeOwed reports whether k was owed, forgetting it.
func (s *Store) takeOwed(k allocKey) bool {
	s.owedMu.Lock()
	defer s.owedMu.Unlock()
	_, ok := s.owed[k]
	delete(s.owed, k)
	return ok
}

// fanOut calls f once per key, concurrently when there are several, and
// waits for all of them.
func fanOut[T any](per map[string]T, f func(string, T)) {
	if len(per) == 1 {
		for k, v := range per {
			f(k, v)
		}
		return
	}
	var wg sync.WaitGroup
	for k, v := range per {
		wg.Go(func() { f(k, v) })
	}
	wg.Wait()
}
