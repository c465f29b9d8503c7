// Package meta is the master's object metadata: objects, their replicas,
// placement, tenant quotas, leases and pins, eviction, and the change log
// derived from them (ARCHITECTURE.md §3, §5, §6).
//
// Ownership is a tree: a shard owns its objects, an object owns its replicas,
// a replica names one allocation at one segment by (segment index,
// allocation id). Every state change goes through the mutation path in
// mutation.go, which applies primitive replica events (REPLICA_CREATE,
// REPLICA_COMPLETE, REPLICA_FAILED, REPLICA_REMOVE) plus tenant accounting,
// and derives the change records, segment accounting and releases from
// them. Put, Upsert, Remove, Evict, Offload, DropSegments, Reconcile, Drain
// and Migrate only decide which events to apply.
//
// Lock order: offloadMu (offload passes, held across their agent I/O) →
// evictMu (eviction passes) → metadata shard → segment registry
// (cluster.Registry, in-memory reads only) → tenant table (adding and
// retiring tenants) → tenant → change log. A task locks one shard at a
// time, once per batch. No agent I/O happens under a shard lock: work that
// must talk to agents records its intent, unlocks, does the I/O, then
// re-locks and re-looks-up by (tenant, key, put sequence / replica id).
package meta

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"
)

// cluster.Metadata.
type Store struct {
	cfg    Config
	reg    cluster.Registry
	agents cluster.Agents
	id     cluster.Identity
	now    func() time.Time
	lg     *slog.Logger

	shards    []shard
	shardMask uint64
	segs      segTable
	tenants   tenantTable
	log       *changelog.Log
	keys      *token.Ring
	// leaseTTL is shared by every GetReplicaList answer (only read).
	leaseTTL *durationpb.Duration
	putSeq   atomic.Uint64
	ridSeq   atomic.Uint32
	// objSlab and repSlab supply rebuilt objects (slab.go).
	objSlab hugeSlab[object]
	repSlab hugeSlab[replica]

	// evictKick wakes Run's eviction check (capacity 1, never blocks).
	evictKick chan struct{}
	// evictMu serialises eviction runs.
	evictMu  sync.Mutex
	lastPass evictPassStats // guarded by evictMu

	// offloadMu serialises offload passes (offload.go); it is held across
	// their agent I/O, so it is taken before evictMu and any shard lock,
	// never under them. It guards offloadMore.
	offloadMu sync.Mutex
	// offloadMore holds the memory segments whose last offload pass was
	// cut short by its bounds: the next check carries on down to the low
	// watermark although they are below the high one now.
	offloadMore map[uint32]bool
	// offloadObjects and offloadBytes bound one offload pass
	// (offloadPassObjects, offloadPassBytes; tests lower them).
	offloadObjects int
	offloadBytes   int64

	// undrains maps a segment id to its *segDrain (drain.go): the count of
	// UndrainSegment calls (a running drain stops when it changes) and the
	// running or last drain.
	undrains sync.Map

	// owedMu guards owed: releases that could not be delivered. Only the
	// registry's and the tombstones' locks are taken under it.
	owedMu sync.Mutex
	owed   map[allocKey]struct{}
	// refusing: agents whose last answer to owed releases refused some
	// (logged once per streak, noteRefusing).
	refusing map[string]bool
	// tombs holds clients' removals while a disk segment is detached
	// (tombstone.go).
	tombs tombstones
	// unset records in etcd the segments a failover must distrust
	// (unsettled.go).
	unset unsettled
	// following: a warm standby's store (follow.go); releases are owed,
	// never sent.
	following atomic.Bool

	closeOnce sync.Once
	closed    chan struct{}

	// expiredPuts remembers the puts the sweep expired lately, so that
	// their PutEnd answers PUT_EXPIRED (see expire.go).
	expiredPuts expiredSet

	// promo is read promotion and Prefetch (promote.go).
	promo *promoter

	// hooks are test seams (nil outside tests).
	hooks storeHooks

	evicted        prometheus.Counter
	offloaded      prometheus.Counter
	offloadedBytes prometheus.Counter
	changes        prometheus.Counter
	reserved       prometheus.Counter
	expired        prometheus.Counter
	// lost counts the replicas removed because their agent reported their
	// allocations lost (Lost).
	lost prometheus.Counter
	// sealsByReceipt and sealsBySeal count the replicas PutEnd sealed or
	// tried to seal, by how: a seal receipt (sealed on write, receipt.go)
	// or a Seal to the agent (PutSeals, crescent_master_put_seals_total).
	sealsByReceipt, sealsBySeal atomic.Uint64
	// blankKick asks blankLoop for a refill; blanksTaken and reservesSent
	// count the replicas PutStart placed on a blank and those it reserved
	// at the agent (crescent_master_put_reservations_total).
	blankKick chan struct{}
	// spares are the blanks leased to clients (spare.go).
	spares                    spareLeases
	blanksTaken, reservesSent atomic.Uint64
}

var _ cluster.Metadata = (*Store)(nil)

// New builds a Store. It does no I/O and starts nothing.
func New(cfg Config, deps Deps, lg *slog.Logger) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if deps.Registry == nil || deps.Agents == nil {
		return nil, errors.New("meta: Registry and Agents are required")
	}
	if deps.Identity.Keys == nil {
		return nil, errors.New("meta: Identity.Keys is required")
	}
	if deps.Now == nil {
		deps.Now = time.Now
	}
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	s := &Store{
		cfg:            cfg,
		reg:            deps.Registry,
		agents:         deps.Agents,
		id:             deps.Identity,
		now:            deps.Now,
		lg:             lg,
		shards:         make([]shard, cfg.Shards),
		shardMask:      uint64(cfg.Shards - 1),
		log:            changelog.New(cfg.ChangeRetention, deps.Identity.Epoch),
		keys:           deps.Identity.Keys,
		leaseTTL:       durationpb.New(cfg.LeaseTTL),
		evictKick:      make(chan struct{}, 1),
		blankKick:      make(chan struct{}, 1),
		closed:         make(chan struct{}),
		owed:           make(map[allocKey]struct{}),
		refusing:       make(map[string]bool),
		offloadMore:    make(map[uint32]bool),
		offloadObjects: offloadPassObjects,
		offloadBytes:   offloadPassBytes,
		evicted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_evicted_objects_total", Help: "Objects evicted (dropped) under segment pressure.",
		}),
		offloaded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_offloaded_objects_total", Help: "Memory eviction victims moved to a disk segment instead of dropped (--evict-policy=offload).",
		}),
		offloadedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_offloaded_bytes_total", Help: "Bytes of the objects counted in crescent_master_offloaded_objects_total.",
		}),
		changes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_change_records_total", Help: "Change records appended to the change log.",
		}),
		reserved: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_replicas_created_total", Help: "Replicas created (REPLICA_CREATE events).",
		}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_expired_puts_total", Help: "PutStarts expired for want of a PutEnd within the put timeout.",
		}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_replicas_lost_total", Help: "Replicas removed because their agent reported their allocations lost (AllocationsLost: sealed bytes that no longer match their checksum or cannot be read).",
		}),
	}
	s.promo = newPromoter(cfg)
	for i := range s.shards {
		s.shards[i].tenants = make(map[uint32]*objMap)
	}
	s.segs.init()
	s.tenants.init(cfg.MaxTenants)
	if deps.Metrics != nil {
		objects := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_objects", Help: "Objects held, including puts in progress.",
		}, func() float64 { o, _, _ := s.Stats(); return float64(o) })
		bytes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_object_bytes", Help: "Logical bytes of objects held (once per object).",
		}, func() float64 { _, b, _ := s.Stats(); return float64(b) })
		rev := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_change_revision", Help: "Head revision of the change log.",
		}, func() float64 { return float64(s.log.Head()) })
		seals := func(via string, n *atomic.Uint64) prometheus.Collector {
			return prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "crescent_master_put_seals_total", ConstLabels: prometheus.Labels{"via": via},
				Help: "Replicas PutEnd sealed or tried to seal, by how: via=receipt (the agent sealed on write and the client passed its seal receipt) or via=seal (a Seal command to the agent).",
			}, func() float64 { return float64(n.Load()) })
		}
		reservations := func(via string, n *atomic.Uint64) prometheus.Collector {
			return prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "crescent_master_put_reservations_total", ConstLabels: prometheus.Labels{"via": via},
				Help: "Replicas PutStart placed, by how their allocation was had: via=blank (a blank reservation made ahead, no round trip to the agent) or via=reserve (a Reserve to the agent inside the PutStart).",
			}, func() float64 { return float64(n.Load()) })
		}
		blanks := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_blank_reservations", Help: "Blank reservations the master holds at agents for coming puts (--blank-pool per segment and object size).",
		}, func() float64 { n, _ := s.BlankStats(); return float64(n) })
		spares := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_spares", Help: "Spares (blank reservations leased to clients for puts without a PutStart) held now.",
		}, func() float64 { n, _, _, _ := s.SpareStats(); return float64(n) })
		detached := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_detached_segments", Help: "Segments dropped (their agent lost, stopped, cut off or stalled past --unmount-after) whose return may bring back their sealed objects: disk segments, and memory segments until their agent registers without them. Clients' removals meanwhile are kept as tombstones so they are not adopted back.",
		}, func() float64 { n, _, _ := s.tombs.stats(); return float64(n) })
		tombs := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_removal_tombstones", Help: "Removals kept while segments are detached: keys, and the patterns of RemoveByPrefix, RemoveByRegex and RemoveAll.",
		}, func() float64 { _, n, _ := s.tombs.stats(); return float64(n) })
		owed := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_owed_releases", Help: "Releases the master owes to agents: not delivered (the agent away) or refused (a disk segment whose journal cannot be written); sent again every second until taken, and returned rather than adopted by the agent's registration.",
		}, func() float64 { return float64(s.OwedReleases()) })
		unsettled := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_master_unsettled_segments", Help: "Segments this leader has recorded in etcd (or is about to) as unsettled: a client's removal there is not carried out at the agent yet (a release owed, or a tombstone while the segment is detached). A failover distrusts them: their cached objects are dropped (HA only).",
		}, func() float64 { return float64(s.unset.count()) })
		distrusted := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "crescent_master_distrusted_segments_total", Help: "Segments this master distrusted when it was elected, because an earlier leader left them unsettled: every replica on them was dropped (HA only).",
		}, func() float64 { return float64(s.unset.distrusted.Load()) })
		tombsDropped := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "crescent_master_removal_tombstones_dropped_total", Help: "Removals not kept because the tombstones were at their cap (262,144 keys; 1,024 patterns, 64 of them regexes): a detached segment's return may bring those objects back.",
		}, func() float64 { _, _, d := s.tombs.stats(); return float64(d) })
		spareOutcome := func(outcome string, pick func(leased, committed, lapsed uint64) uint64) prometheus.Collector {
			return prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "crescent_master_spares_total", ConstLabels: prometheus.Labels{"outcome": outcome},
				Help: "Spares by outcome: outcome=leased (leased to a client), committed (a put written into one and committed by its PutEnd), lapsed (expired, or dropped when the segment's agent registered or on Promote).",
			}, func() float64 { _, l, c, x := s.SpareStats(); return float64(pick(l, c, x)) })
		}
		for _, c := range append([]prometheus.Collector{s.evicted, s.offloaded, s.offloadedBytes, s.changes, s.reserved, s.expired, s.lost,
			seals("receipt", &s.sealsByReceipt), seals("seal", &s.sealsBySeal), objects, bytes, rev,
			reservations("blank", &s.blanksTaken), reservations("reserve", &s.reservesSent), blanks, spares,
			detached, tombs, tombsDropped, owed, unsettled, distrusted,
			spareOutcome("leased", func(l, _, _ uint64) uint64 { return l }),
			spareOutcome("committed", func(_, c, _ uint64) uint64 { return c }),
			spareOutcome("lapsed", func(_, _, x uint64) uint64 { return x })}, s.promo.collectors()...) {
			if err := deps.Metrics.Register(c); err != nil {
				return nil, fmt.Errorf("meta: register metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Log is the change log, for ChangeService.
func (s *Store) Log() *changelog.Log { return s.log }

// Epoch is the epoch of this master term.
func (s *Store) Epoch() uint64 { return s.id.Epoch }

// LeaseTTL is the read lease granted by Get and Exist.
func (s *Store) LeaseTTL() time.Duration { return s.cfg.LeaseTTL }

// Run runs the background work until ctx ends: the periodic and triggered
// eviction check, the sweep that expires puts past the put timeout (on the
// store's clock, every PutSweepInterval), and the promotion worker and the
// blank reservations' refills and sweep (their own goroutines, ended and
// waited for before Run returns). Leases and pins
// expire lazily and need no loop.
func (s *Store) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Go(func() { s.promoteLoop(ctx) })
	wg.Go(func() { s.blankLoop(ctx) })
	t := time.NewTicker(s.cfg.EvictInterval)
	defer t.Stop()
	sweep := time.NewTicker(s.cfg.PutSweepInterval)
	defer sweep.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.closed:
			return nil
		case <-sweep.C:
			s.expirePuts(ctx)
			s.retryOwed(ctx)
			s.tombs.expire(s.nowMs())
			s.syncUnsettled(ctx)
			continue
		case <-t.C:
		case <-s.evictKick:
		}
		s.evictOverHigh(ctx)
	}
}

// Close stops Run. Idempotent.
func (s *Store) Close() error {
	s.closeOnce.Do(func() { close(s.closed) })
	return nil
}

func (s *Store) kickEviction() {
	select {
	case s.evictKick <- struct{}{}:
	default:
	}
}

func (s *Store) nowMs() int64 { return s.now().UnixMilli() }

// storeHooks let tests run code at points where a race matters. Set them
// before the Store is used concurrently; nil hooks cost one load.
type storeHooks struct {
	// beforeLockAll runs at the start of lockAll, before the first shard
	// is locked: in RemoveAll after its removal pass, in Snapshot after
	// its argument checks.
	beforeLockAll func()
	// beforeAdopt runs in a reconcile's apply between its checks of each
	// allocation and its adoptions under the shard locks.
	beforeAdopt func()
}
