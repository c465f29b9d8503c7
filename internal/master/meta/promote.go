package meta

import (
	"context"
	"strings"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/prometheus/client_golang/prometheus"
)

// Promotion (issue 17 item 3, tiering.md §4): reads of objects with no
// readable memory replica are counted in a count-min sketch (sketch.go);
// the read that takes a key's count to the threshold puts it on a bounded
// queue (a full queue drops it, counted). One worker (promoteLoop, run by
// Store.Run) copies queued keys to memory in chunks: its own phase 1
// (promotePlace: a pending PROCESSING memory target, only on a memory
// segment that stays under the low watermark with it) and then the shared
// migration phases (migrateChunk, modeCopy: reserve, agent-to-agent copy,
// seal, COMPLETE). The disk replica stays; the memory replica records
// `stored(memory)`. A byte-rate token bucket admits the chunks; since
// placement never evicts and never fills a segment past its low
// watermark, a promotion never causes an eviction, now or at the next
// watermark check. Prefetch enqueues keys directly, or (wait) runs the
// same promotion at once without the rate budget.

// promoteChunk bounds the keys of one promotion step (one migrateChunk).
const promoteChunk = drainChunk

// promoteRetry is how long the worker waits for the budget to refill when
// keys are held back by it.
const promoteRetry = 50 * time.Millisecond

// promoteItem is one queued key.
type promoteItem struct{ tenant, key string }

// promoter is the store's promotion state.
type promoter struct {
	// threshold is the count that queues a key; 0 disables counting.
	threshold int
	sk        *sketch
	queue     chan promoteItem

	// bucketMu guards the token bucket (tokens, at): bytes the worker may
	// promote now, refilled at rate up to burst.
	bucketMu    sync.Mutex
	tokens      float64
	at          time.Time
	rate, burst float64

	promoted   prometheus.Counter
	drops      prometheus.Counter
	gated      prometheus.Counter
	prefetches prometheus.Counter
}

func newPromoter(cfg Config) *promoter {
	p := &promoter{
		queue: make(chan promoteItem, cfg.PromoteQueue),
		rate:  float64(cfg.PromoteBytesPerSec),
		// A second's worth: a burst after an idle period stays one
		// second of the budget.
		burst: float64(cfg.PromoteBytesPerSec),
		promoted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_promotions_total",
			Help: "Objects given a memory replica by promotion (counted reads or Prefetch).",
		}),
		drops: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_promotion_drops_total",
			Help: "Keys not put on the promotion queue because it was full.",
		}),
		gated: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_promotions_gated_total",
			Help: "Queued keys not promoted because no memory segment under its low watermark had room.",
		}),
		prefetches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_prefetch_requests_total",
			Help: "Prefetch requests served.",
		}),
	}
	p.tokens = p.burst
	if cfg.PromoteThreshold > 0 {
		p.threshold = cfg.PromoteThreshold
		p.sk = newSketch(cfg.PromoteHalveEvery)
	}
	return p
}

func (p *promoter) collectors() []prometheus.Collector {
	return []prometheus.Collector{p.promoted, p.drops, p.gated, p.prefetches}
}

// enqueue puts a key on the queue, or counts a drop when it is full. The
// key is cloned: it may alias a request's buffer.
func (p *promoter) enqueue(tenant, key string) bool {
	select {
	case p.queue <- promoteItem{tenant: tenant, key: strings.Clone(key)}:
		return true
	default:
		p.drops.Inc()
		return false
	}
}

// refill refills the bucket to now and reports whether it holds tokens.
func (p *promoter) refill(now time.Time) bool {
	p.bucketMu.Lock()
	defer p.bucketMu.Unlock()
	if !p.at.IsZero() && now.After(p.at) {
		p.tokens = min(p.burst, p.tokens+p.rate*now.Sub(p.at).Seconds())
	}
	p.at = now
	return p.tokens > 0
}

// spend takes n bytes from the bucket, which may go below zero (a large
// object is admitted whole; the next ones wait until it is paid back).
// It reports whether there were tokens before.
func (p *promoter) spend(n uint64) bool {
	p.bucketMu.Lock()
	defer p.bucketMu.Unlock()
	if p.tokens <= 0 {
		return false
	}
	p.tokens -= float64(n)
	return true
}

// hasMemory reports whether a read view has a memory replica.
func hasMemory(reps []readRep) bool {
	for i := range reps {
		if reps[i].r.medium == uint8(masterv1.Medium_MEDIUM_MEMORY) {
			return true
		}
	}
	return false
}

// countRead counts a read of an object with no readable memory replica
// and queues the key when its count reaches the threshold (once per
// crossing: after a halving it may cross again). tenant is the tenant's
// name, t its id.
func (s *Store) countRead(t uint32, tenant, key string) {
	if s.promo.sk.add(sketchHash(t, key)) == s.promo.threshold {
		s.promo.enqueue(tenant, key)
	}
}

// promoteLoop is the promotion worker: it takes queued keys and promotes
// them a chunk at a time within the budget, until ctx ends or the store
// closes.
func (s *Store) promoteLoop(ctx context.Context) {
	var held []promoteItem
	for {
		if len(held) == 0 {
			select {
			case <-ctx.Done():
				return
			case <-s.closed:
				return
			case it := <-s.promo.queue:
				held = append(held, it)
			}
		} else {
			t := time.NewTimer(promoteRetry)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-s.closed:
				t.Stop()
				return
			case <-t.C:
			}
		}
		held = s.promoteStep(ctx, held)
	}
}

// promoteStep tops held up from the queue to a chunk, promotes what the
// budget admits and returns the keys it held back for the budget.
func (s *Store) promoteStep(ctx context.Context, held []promoteItem) []promoteItem {
fill:
	for len(held) < promoteChunk {
		select {
		case it := <-s.promo.queue:
			held = append(held, it)
		default:
			break fill
		}
	}
	if !s.promo.refill(s.now()) {
		return held
	}
	res := s.promote(ctx, held, true)
	left := held[:0]
	for i, r := range res {
		if r.deferred {
			left = append(left, held[i])
		}
	}
	return left
}

// PrefetchResult is one key's Prefetch outcome, in request order.
type PrefetchResult struct {
	Key string
	// State is what was done when Err is nil.
	State masterv1.PrefetchState
	Err   error
	// Replica is the new memory replica when State is COPIED.
	Replica *masterv1.ReplicaDescriptor
}

// promoteResult is one item's outcome of promote.
type promoteResult struct {
	PrefetchResult
	// deferred: held back by the budget, neither tried nor refused.
	deferred bool
}

// promote copies each item's object to a memory segment (a Copy: the
// source stays), by promotePlace and migrateChunk. With budget, items are
// admitted while the token bucket holds tokens and the rest come back
// deferred.
func (s *Store) promote(ctx context.Context, items []promoteItem, budget bool) []promoteResult {
	res := make([]promoteResult, len(items))
	moves := make([]*move, 0, len(items))
	for i, it := range items {
		res[i].Key = it.key
		t, ok := s.tenants.lookup(it.tenant)
		if !ok {
			res[i].Err = errNotFound(it.tenant, it.key)
			continue
		}
		moves = append(moves, &move{tenant: t, key: it.key, shard: s.shardIndex(t, it.key), idx: i})
	}
	for start := 0; start < len(moves); start += promoteChunk {
		chunk := moves[start:min(start+promoteChunk, len(moves))]
		if err := ctx.Err(); err != nil {
			for _, mv := range chunk {
				res[mv.idx].Err = rpcerr.Status(err)
			}
			continue
		}
		rel := &releases{}
		s.promotePlace(chunk, rel, res, items, budget)
		s.migrateChunk(ctx, chunk, rel, modeCopy)
		promoted := 0
		for _, mv := range chunk {
			r := &res[mv.idx]
			if r.Err != nil || r.State != masterv1.PrefetchState_PREFETCH_STATE_UNSPECIFIED || r.deferred {
				continue // decided in phase 1
			}
			if mv.err != nil || mv.dst == 0 {
				r.Err = mv.err
				if r.Err == nil {
					r.Err = errInternal("promotion of %q ended without a replica", mv.key)
				}
				continue
			}
			tg := &mv.target.seg
			r.State = masterv1.PrefetchState_PREFETCH_STATE_COPIED
			r.Replica = &masterv1.ReplicaDescriptor{
				ReplicaId: mv.dst, SegmentId: tg.ID, AgentId: tg.AgentID, HostId: tg.HostID,
				DataEndpoint: tg.DataEndpoint, TransferEndpoint: tg.TransferEndpoint,
				AllocationId: mv.dstAlloc, Offset: mv.dstOff, Size: mv.size,
				Medium: tg.Medium, Status: masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE,
			}
			promoted++
		}
		s.promo.promoted.Add(float64(promoted))
	}
	return res
}

// promotePlace is a promotion's phase 1 for one chunk: per object, decide
// whether it needs a memory replica (IN_MEMORY, not found, busy), admit it
// against the budget, choose its source (a COMPLETE replica on a segment
// that serves reads) and place a pending PROCESSING target on a memory
// segment that stays under its low watermark with it (errPromoteGated
// when there is none). res and items are indexed by mv.idx.
func (s *Store) promotePlace(chunk []*move, rel *releases, res []promoteResult, items []promoteItem, budget bool) {
	p := s.newPlacer(newExclusions())
	mem := uint8(masterv1.Medium_MEDIUM_MEMORY)
	nowMs := s.now().UnixMilli()
	forShards(chunk, func(mv *move) int { return mv.shard }, func(sh int, group []*move) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, mv := range group {
			r := &res[mv.idx]
			tenant := items[mv.idx].tenant
			o := shd.getLocked(mv.tenant, mv.key)
			if o == nil {
				r.Err = errNotFound(tenant, mv.key)
				continue
			}
			if o.put != nil {
				r.Err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
					"object %q/%q has a write in progress", tenant, mv.key)
				continue
			}
			// A memory replica that cannot serve reads (its segment
			// suspected, say) does not count as in memory: the object may
			// get another, on another segment.
			si, inMem, busy := -1, false, false
			var srcView *segView
			for i := range o.replicas {
				rp := &o.replicas[i]
				if rp.status != stComplete {
					busy = busy || rp.medium == mem
					continue
				}
				sv, ok := s.reg.Segment(s.segs.get(rp.seg).id)
				if !ok || !sv.CanServeRead() {
					continue
				}
				if rp.medium == mem {
					inMem = true
				} else if si < 0 {
					si, srcView = i, &segView{idx: rp.seg, seg: sv}
				}
			}
			switch {
			case inMem:
				r.State = masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY
				continue
			case busy:
				r.Err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
					"object %q/%q already has a copy to memory in progress", tenant, mv.key)
				continue
			case si < 0:
				r.Err = errNotReady(tenant, mv.key, "no COMPLETE replica on a segment that serves reads")
				continue
			}
			v := s.pickUnderLow(p, o, srcView.seg.HostID)
			if v == nil {
				r.Err = errPromoteGated(tenant, mv.key, o.size)
				if budget {
					s.promo.gated.Inc()
				}
				continue
			}
			if budget && !s.promo.spend(o.size) {
				r.deferred = true
				continue
			}
			src := o.replicas[si]
			mv.src, mv.srcSeg, mv.srcAgent = src.id, srcView.seg.ID, srcView.seg.AgentID
			mv.objectLocked(shd, o, src, shd.softPinnedLocked(o, nowMs))
			mv.target = v
			mv.dst = m.create(o, v.idx, mem, true, 0)
		}
		m.commit()
		shd.mu.Unlock()
	})
}

func errPromoteGated(tenant, key string, size uint64) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE,
		"object %q/%q: no memory segment stays under its low watermark with %d more bytes (promotion never evicts)", tenant, key, size)
}

// pickUnderLow is the memory segment for promoting o: one that can
// allocate, holds no replica of o, has a free extent for it, and stays at
// or under the low watermark with it; on the source's host first (the
// copy stays local), then the most free. nil when there is none.
func (s *Store) pickUnderLow(p *placer, o *object, srcHost string) *segView {
	var best *segView
	size := int64(o.size)
	all := p.alloc[masterv1.Medium_MEDIUM_MEMORY]
next:
	for i := range all {
		v := &all[i]
		if !v.fits(size) || float64(v.e.used(v.seg)+size) > s.cfg.LowWatermark*float64(v.seg.Capacity) {
			continue
		}
		for _, r := range o.replicas {
			if r.seg == v.idx {
				continue next
			}
		}
		if best == nil {
			best = v
			continue
		}
		local, bestLocal := v.seg.HostID == srcHost, best.seg.HostID == srcHost
		if (local && !bestLocal) || (local == bestLocal && v.free() > best.free()) {
			best = v
		}
	}
	return best
}

// ValidatePrefetch checks a Prefetch request's envelope: Copy's limits
// (1..MaxMigrateKeys distinct valid keys). Errors are INVALID_PARAMS for
// the whole request.
func ValidatePrefetch(tenant string, keys []string) error {
	return ValidateMigrate(&MigrateSpec{Tenant: NormalizeTenant(tenant), Keys: keys,
		Target: MigrateTarget{Medium: masterv1.Medium_MEDIUM_MEMORY}})
}

// Prefetch asks for a memory replica of each named object of one tenant.
// Without wait each key that needs one is queued for the promotion worker
// (QUEUED; LIMIT_EXCEEDED when the queue is full); with wait it is copied
// at once, without the rate budget (COPIED). A key that has a readable
// memory replica is IN_MEMORY either way. The error is for the request as
// a whole (an invalid envelope).
func (s *Store) Prefetch(ctx context.Context, tenant string, keys []string, wait bool) ([]PrefetchResult, error) {
	tenant = NormalizeTenant(tenant)
	if err := ValidatePrefetch(tenant, keys); err != nil {
		return nil, err
	}
	s.promo.prefetches.Inc()
	items := make([]promoteItem, len(keys))
	for i, k := range keys {
		items[i] = promoteItem{tenant: tenant, key: k}
	}
	out := make([]PrefetchResult, len(keys))
	if wait {
		for i, r := range s.promote(ctx, items, false) {
			out[i] = r.PrefetchResult
		}
		return out, nil
	}
	t, known := s.tenants.lookup(tenant)
	type ref struct{ i, shard int }
	refs := make([]ref, 0, len(keys))
	for i, k := range keys {
		out[i].Key = k
		if !known {
			out[i].Err = errNotFound(tenant, k)
			continue
		}
		refs = append(refs, ref{i: i, shard: s.shardIndex(t, k)})
	}
	c := segCache{s: s}
	var v readView
	forShards(refs, func(r ref) int { return r.shard }, func(sh int, group []ref) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		for _, r := range group {
			o := shd.getLocked(t, keys[r.i])
			if o == nil {
				out[r.i].Err = errNotFound(tenant, keys[r.i])
			} else if err := s.readLocked(shd, o, &c, tenant, keys[r.i], &v); err != nil {
				out[r.i].Err = err // not readable: nothing to promote
			} else if hasMemory(v.reps) {
				out[r.i].State = masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY
			}
		}
		shd.mu.Unlock()
	})
	// Enqueue outside the shard locks.
	for i, k := range keys {
		if out[i].Err != nil || out[i].State != masterv1.PrefetchState_PREFETCH_STATE_UNSPECIFIED {
			continue
		}
		if !s.promo.enqueue(tenant, k) {
			out[i].Err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
				"object %q/%q: the promotion queue is full", tenant, k)
			continue
		}
		out[i].State = masterv1.PrefetchState_PREFETCH_STATE_QUEUED
	}
	return out, nil
}

// PrefetchObjects is Prefetch in the wire types (the ObjectService adapter
// calls it).
func (s *Store) PrefetchObjects(ctx context.Context, tenant string, keys []string, wait bool) ([]*masterv1.PrefetchResult, error) {
	res, err := s.Prefetch(ctx, tenant, keys, wait)
	if err != nil {
		return nil, err
	}
	out := make([]*masterv1.PrefetchResult, len(res))
	for i := range res {
		r := &res[i]
		out[i] = &masterv1.PrefetchResult{Key: r.Key, Status: rpcerr.Item(r.Err), State: r.State, Replica: r.Replica}
	}
	return out, nil
}
