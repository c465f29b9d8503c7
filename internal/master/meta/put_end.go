package meta

import (
	"context"
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
)

// PutEndSpec is one PutEnd.
type PutEndSpec struct {
	Tenant, Key, ClientID string
	Checksum              uint64
	// Receipts are the agents' seal receipts for the put's replicas
	// (PutEndRequest.seal_receipts): a replica with a valid one was sealed
	// on write and is committed without a Seal (receipt.go).
	Receipts [][]byte
	// Spare, when set, is the leased spare the put wrote into without a
	// PutStart: this PutEnd starts the put on it first (spare.go).
	Spare *SpareSpec
}

// PutEnd ends one put; see BatchPutEnd.
func (s *Store) PutEnd(ctx context.Context, sp PutEndSpec) error {
	return s.BatchPutEnd(ctx, []PutEndSpec{sp})[0]
}

type sealRep struct {
	id    uint32
	seg   uint32
	alloc uint64
	err   error
	// receipted: a valid seal receipt vouches for the seal (no Seal is
	// sent); err is then nil.
	receipted bool
}

type endItem struct {
	i       int
	tenant  uint32
	shard   int
	seq     uint64
	obj     *object // as putItem.obj: phase 3 re-checks it, not the map
	pinMs   int64
	reps    []sealRep
	err     error
	settled bool // answered in phase 1 (idempotent repeat or error)
	// receipts are the spec's seal receipts, opened (receipt.go), or
	// receiptErr why they did not open.
	receipts   []openedReceipt
	receiptErr error
}

// BatchPutEnd seals many puts: per shard it checks the writer and collects
// the allocations; it seals them at the agents (one Seal per agent, agents
// in parallel); then per shard it marks the sealed replicas COMPLETE
// (recording `stored`) and removes the ones that failed.
func (s *Store) BatchPutEnd(ctx context.Context, specs []PutEndSpec) []error {
	ctx, span := tracer.Child(ctx, "master.put_end")
	sc := tracectx.Carried(ctx, span)
	res := make([]error, len(specs))
	defer func() {
		if span.IsRecording() {
			span.SetAttributes(tracectx.Items.Int(len(specs)))
			if t := uniformTenant(specs, func(sp *PutEndSpec) string { return sp.Tenant }); t != "" {
				span.SetAttributes(tracectx.Tenant.String(t))
			}
			batchOutcome(span, slices.Values(res))
		}
		span.End()
	}()
	items := make([]*endItem, 0, len(specs))
	arena := make([]endItem, len(specs))
	for i := range specs {
		if specs[i].Spare != nil {
			s.startSpares(ctx, specs, res)
			break
		}
	}
	for i := range specs {
		sp := &specs[i]
		if res[i] != nil {
			continue
		}
		if err := ValidateClientID(sp.ClientID); err != nil {
			res[i] = err
			continue
		}
		t, shard, err := s.locate(&sp.Tenant, sp.Key)
		if err != nil {
			res[i] = s.notFoundOrExpired(err, sp.Tenant, sp.Key)
			continue
		}
		arena[i] = endItem{i: i, tenant: t, shard: shard}
		if len(sp.Receipts) > 0 {
			// A receipt that does not open fails the put (in phase 1,
			// once the writer is checked), never just this call.
			arena[i].receipts, arena[i].receiptErr = s.openReceipts(sp.Receipts, sp.Tenant, sp.Key, sp.Spare != nil)
		}
		items = append(items, &arena[i])
	}
	type batch struct {
		items []*masterv1.SealItem
		reps  []*sealRep
	}
	per := map[string]*batch{}
	forShards(items, func(it *endItem) int { return it.shard }, func(sh int, group []*endItem) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		now := s.nowMs()
		for _, it := range group {
			sp := &specs[it.i]
			o := shd.getLocked(it.tenant, sp.Key)
			switch {
			case o == nil:
				it.err, it.settled = s.notFoundOrExpired(errNotFound(sp.Tenant, sp.Key), sp.Tenant, sp.Key), true
				continue
			case o.put == nil:
				// Ended already (a retried PutEnd): OK for the same bytes,
				// as settleSealsLocked answers a concurrent one.
				if !o.hasComplete() || o.checksum != sp.Checksum {
					it.err = errPutExpired(sp.Tenant, sp.Key)
				}
				it.settled = true
				continue
			case o.put.client != sp.ClientID:
				it.err, it.settled = errIllegalClient(sp.Tenant, sp.Key), true
				continue
			case o.put.phase == phasePlacing:
				it.err, it.settled = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY,
					"put of %q/%q is still being placed", sp.Tenant, sp.Key), true
				continue
			}
			o.put.phase = phaseSealing
			it.seq, it.obj = o.put.seq, o
			if o.put.softPinTTL > 0 {
				it.pinMs = now + o.put.softPinTTL.Milliseconds()
			}
			for _, r := range o.replicas {
				if r.status == stProcessing && !r.pending {
					it.reps = append(it.reps, sealRep{id: r.id, seg: r.seg, alloc: r.allocID})
				}
			}
			if len(it.receipts) > 0 || it.receiptErr != nil {
				s.applyReceiptsLocked(it, o, sp)
			}
		}
		shd.mu.Unlock()
	})
	sis := slab[masterv1.SealItem]{n: len(items)}
	var viaReceipt, viaSeal int
	for _, it := range items {
		if it.settled {
			continue
		}
		for r := range it.reps {
			rp := &it.reps[r]
			if rp.receipted {
				viaReceipt++
			}
			if rp.receipted || rp.err != nil {
				continue
			}
			viaSeal++
			e := s.segs.get(rp.seg)
			sv, ok := s.reg.Segment(e.id)
			if !ok || !sv.CanContinueCleanup() {
				rp.err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
					"segment %s cannot seal now", e.id)
				continue
			}
			b := per[sv.AgentID]
			if b == nil {
				b = &batch{}
				per[sv.AgentID] = b
			}
			si := sis.next()
			si.SegmentId, si.AllocationId, si.Checksum, si.SoftPinUntilUnixMs = e.id, rp.alloc, specs[it.i].Checksum, it.pinMs
			b.items = append(b.items, si)
			b.reps = append(b.reps, rp)
		}
	}
	s.sealsByReceipt.Add(uint64(viaReceipt))
	s.sealsBySeal.Add(uint64(viaSeal))
	fanOut(per, func(agent string, b *batch) {
		out, err := s.agents.Seal(ctx, agent, b.items)
		if err == nil && len(out) != len(b.items) {
			err = errInternal("agent %s answered %d seals for %d items", agent, len(out), len(b.items))
		}
		for i, rp := range b.reps {
			if err != nil {
				rp.err = err
			} else {
				rp.err = rpcerr.FromItem(out[i])
			}
		}
	})
	var unsealable map[string][]uint32
	for agent, b := range per {
		for _, rp := range b.reps {
			if rpcerr.Reason(rp.err) == "SEGMENT_UNAVAILABLE" && !slices.Contains(unsealable[agent], rp.seg) {
				if unsealable == nil {
					unsealable = map[string][]uint32{}
				}
				unsealable[agent] = append(unsealable[agent], rp.seg)
			}
		}
	}
	if unsealable != nil {
		s.dropBlanksOfUnsealable(ctx, unsealable)
	}
	rel := &releases{}
	forShards(items, func(it *endItem) int { return it.shard }, func(sh int, group []*endItem) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(sc)
		for _, it := range group {
			if !it.settled {
				s.settleSealsLocked(ctx, m, &specs[it.i], it)
			}
		}
		m.commit()
		shd.mu.Unlock()
	})
	s.sendReleasesNow(ctx, rel)
	for _, it := range items {
		res[it.i] = it.err
	}
	return res
}

func (s *Store) settleSealsLocked(ctx context.Context, m *mut, sp *PutEndSpec, it *endItem) {
	o := it.obj
	if o == nil || o.put == nil || o.put.seq != it.seq {
		if o != nil && o.put == nil && o.hasComplete() && o.checksum == sp.Checksum {
			return // a concurrent PutEnd finished it
		}
		it.err = errPutExpired(sp.Tenant, sp.Key)
		return
	}
	var firstErr error
	completed := 0
	for _, rp := range it.reps {
		idx := o.replicaIndex(rp.id)
		if idx < 0 {
			continue
		}
		if rp.err != nil {
			if firstErr == nil {
				firstErr = rp.err
			}
			m.fail(o, idx)
			m.remove(o, idx, true)
			continue
		}
		o.checksum = sp.Checksum
		m.complete(o, idx)
		completed++
	}
	if completed == 0 {
		for i := len(o.replicas) - 1; i >= 0; i-- {
			m.remove(o, i, true)
		}
		m.sh.endPutLocked(o)
		m.dropIfEmpty(o)
		if firstErr == nil {
			firstErr = it.receiptErr
		}
		if firstErr == nil {
			firstErr = errPutExpired(sp.Tenant, sp.Key)
		}
		it.err = firstErr
		return
	}
	if firstErr != nil {
		s.lg.WarnContext(ctx, "put ended with fewer replicas", "tenant", sp.Tenant, "key", sp.Key, "completed", completed, "err", firstErr)
	}
	// Any replica of the put left PROCESSING (not sealed) is dropped.
	for i := len(o.replicas) - 1; i >= 0; i-- {
		if o.replicas[i].status == stProcessing {
			m.remove(o, i, true)
		}
	}
	m.sh.endPutLocked(o)
	o.sealedMs = m.nowMs
	m.sh.touchLocked(o, m.nowMs)
	if it.pinMs > 0 {
		m.sh.setSoftPinLocked(o, it.pinMs)
	}
}
