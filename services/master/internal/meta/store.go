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
// them. Put, Upsert, Remove, Evict, DropSegments, Reconcile and Drain only
// decide which events to apply.
//
// Lock order: metadata shard → segment registry (cluster.Registry, in-memory
// reads only) → tenant table (adding and retiring tenants) → tenant →
// change log. A task locks one shard at a time, once
// per batch. No agent I/O happens under a shard lock: work that must talk to
// agents records its intent, unlocks, does the I/O, then re-locks and
// re-looks-up by (tenant, key, put sequence / replica id).
package meta

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/services/master/internal/changelog"
	"github.com/crescent-kv/crescent/services/master/internal/cluster"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
)

// DefaultTenant is the tenant of requests that name none.
const DefaultTenant = "default"

// Limits enforced on input (the adapters validate against them too). Every
// string a request may leave in the master's memory is bounded here.
const (
	MaxKeyLen     = 4096 // key, and a RemoveByPrefix/ListObjects prefix
	MaxTenantLen  = 256
	MaxGroupLen   = 1024
	MaxReplicaNum = 16
	// MaxClientIDLen bounds PutStart's client_id (kept with the put until
	// it ends) and the client_id of PutEnd and PutRevoke.
	MaxClientIDLen = 256
	// MaxHostLen bounds client_host, prefer_local_host and each preferred
	// segment id (the agents' own ids are limited to 256 bytes too).
	MaxHostLen = 256
	// MaxRegexLen and MaxRegexInsts bound a RemoveByRegex pattern: its
	// length in bytes, and its compiled program (regexp/syntax
	// instructions). RE2 matching is linear in input × program, so the
	// program size bounds each key's cost.
	MaxRegexLen   = 1024
	MaxRegexInsts = 4096
	// DefaultScanBudget is Config.ScanBudget's default.
	DefaultScanBudget = 1 << 16
)

// Config tunes the metadata. Zero values take the defaults listed.
type Config struct {
	// Shards is the number of metadata shards, a power of two (default 256).
	Shards int
	// LeaseTTL is the read lease granted by Get and Exist (default 10 s).
	LeaseTTL time.Duration
	// SoftPinTTL is the default soft pin lifetime (default 30 min);
	// MaxSoftPinTTL caps a requested one (default 24 h).
	SoftPinTTL    time.Duration
	MaxSoftPinTTL time.Duration
	// PutPreemptAfter is the put timeout: a PutStart not ended within it
	// may be preempted by a new PutStart on the same key, and the
	// background sweep (Run) expires it — its replicas removed and released
	// at the agents, its quota refunded, nothing published (default 30 s,
	// Mooncake's). Keep it below the agents' reserved grace (the master's
	// --reserved-grace, 60 s), so that the master, which knows the put,
	// releases its reservations before the agents reclaim them blindly.
	PutPreemptAfter time.Duration
	// PutSweepInterval is the period of that sweep (default 1 s).
	PutSweepInterval time.Duration
	// MaxObjectSize refuses PutStarts of larger objects with
	// OBJECT_TOO_LARGE, before any placement or eviction. 0 means the
	// capacity of the largest registered segment (an object no segment can
	// hold is never placed); either way at most MaxObjectSizeCap.
	MaxObjectSize uint64
	// WriteTokenTTL is how long PutStart's write tokens last (default 5 min).
	WriteTokenTTL time.Duration
	// HighWatermark and LowWatermark are segment fill ratios: eviction starts
	// at high (default 0.90) and stops at low (default 0.80).
	HighWatermark float64
	LowWatermark  float64
	// EvictInterval is the period of the background eviction check
	// (default 1 s).
	EvictInterval time.Duration
	// ChangeRetention is the number of change records retained (default
	// changelog.DefaultRetention).
	ChangeRetention int
	// MaxTenants bounds the number of tenants held at once (default 65536,
	// at most MaxTenantsLimit); a new one beyond it fails with
	// LIMIT_EXCEEDED. Tenants that hold nothing and have no quota are
	// dropped, so this counts live ones.
	MaxTenants int
	// ScanBudget is how many keys one RemoveByPrefix/RemoveByRegex call
	// examines before it answers with a page token (default
	// DefaultScanBudget); a RemoveByRegex page also ends once its matching
	// work reaches matchBudget.
	ScanBudget int
}

func (c Config) withDefaults() Config {
	if c.Shards <= 0 {
		c.Shards = 256
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 10 * time.Second
	}
	if c.SoftPinTTL <= 0 {
		c.SoftPinTTL = 30 * time.Minute
	}
	if c.MaxSoftPinTTL <= 0 {
		c.MaxSoftPinTTL = 24 * time.Hour
	}
	if c.PutPreemptAfter <= 0 {
		c.PutPreemptAfter = 30 * time.Second
	}
	if c.PutSweepInterval <= 0 {
		c.PutSweepInterval = time.Second
	}
	if c.WriteTokenTTL <= 0 {
		c.WriteTokenTTL = 5 * time.Minute
	}
	if c.HighWatermark <= 0 {
		c.HighWatermark = 0.90
	}
	if c.LowWatermark <= 0 {
		c.LowWatermark = 0.80
	}
	if c.EvictInterval <= 0 {
		c.EvictInterval = time.Second
	}
	if c.ChangeRetention <= 0 {
		c.ChangeRetention = changelog.DefaultRetention
	}
	if c.MaxTenants <= 0 {
		c.MaxTenants = 1 << 16
	}
	if c.ScanBudget <= 0 {
		c.ScanBudget = DefaultScanBudget
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.Shards&(c.Shards-1) != 0 {
		return fmt.Errorf("meta: shards %d is not a power of two", c.Shards)
	}
	if c.LowWatermark >= c.HighWatermark || c.HighWatermark > 1 {
		return fmt.Errorf("meta: watermarks low %.2f high %.2f: want 0 < low < high <= 1", c.LowWatermark, c.HighWatermark)
	}
	if c.SoftPinTTL > c.MaxSoftPinTTL {
		return fmt.Errorf("meta: soft pin ttl %v exceeds max %v", c.SoftPinTTL, c.MaxSoftPinTTL)
	}
	if c.MaxObjectSize > MaxObjectSizeCap {
		return fmt.Errorf("meta: max object size %d exceeds the cap %d", c.MaxObjectSize, uint64(MaxObjectSizeCap))
	}
	return nil
}

// Deps are the metadata's collaborators.
type Deps struct {
	Registry cluster.Registry
	Agents   cluster.Agents
	Identity cluster.Identity
	// Now is the clock (default time.Now); tests move it.
	Now func() time.Time
	// Metrics receives the metadata's collectors; nil registers nothing.
	Metrics prometheus.Registerer
}

// Store is the object metadata. Create it with New; it implements
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
	signer    *token.Signer
	// leaseTTL is shared by every GetReplicaList answer (only read).
	leaseTTL *durationpb.Duration
	putSeq   atomic.Uint64
	ridSeq   atomic.Uint32

	// evictKick wakes Run's eviction check (capacity 1, never blocks).
	evictKick chan struct{}
	// evictMu serialises eviction runs.
	evictMu  sync.Mutex
	lastPass evictPassStats // guarded by evictMu

	// undrains maps a segment id to its *atomic.Uint64 count of
	// UndrainSegment calls; a running drain stops when it changes.
	undrains sync.Map

	// owedMu guards owed: releases that could not be delivered (leaf lock).
	owedMu sync.Mutex
	owed   map[allocKey]struct{}

	closeOnce sync.Once
	closed    chan struct{}

	// expiredPuts remembers the puts the sweep expired lately, so that
	// their PutEnd answers PUT_EXPIRED (see expire.go).
	expiredPuts expiredSet

	evicted  prometheus.Counter
	changes  prometheus.Counter
	reserved prometheus.Counter
	expired  prometheus.Counter
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
	if len(deps.Identity.TokenKey) == 0 {
		return nil, errors.New("meta: Identity.TokenKey is required")
	}
	if deps.Now == nil {
		deps.Now = time.Now
	}
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	s := &Store{
		cfg:       cfg,
		reg:       deps.Registry,
		agents:    deps.Agents,
		id:        deps.Identity,
		now:       deps.Now,
		lg:        lg,
		shards:    make([]shard, cfg.Shards),
		shardMask: uint64(cfg.Shards - 1),
		log:       changelog.New(cfg.ChangeRetention, deps.Identity.Epoch),
		signer:    token.NewSigner(deps.Identity.TokenKey),
		leaseTTL:  durationpb.New(cfg.LeaseTTL),
		evictKick: make(chan struct{}, 1),
		closed:    make(chan struct{}),
		owed:      make(map[allocKey]struct{}),
		evicted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_evicted_objects_total", Help: "Objects evicted under segment pressure.",
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
	}
	for i := range s.shards {
		s.shards[i].tenants = make(map[uint32]map[string]*object)
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
		for _, c := range []prometheus.Collector{s.evicted, s.changes, s.reserved, s.expired, objects, bytes, rev} {
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
// eviction check, and the sweep that expires puts past the put timeout
// (on the store's clock, every PutSweepInterval). Leases and pins expire
// lazily and need no loop.
func (s *Store) Run(ctx context.Context) error {
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

// ---- objects and shards ----

// Replica status values stored in replica.status (masterv1.ReplicaStatus).
const (
	stProcessing = uint8(masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING)
	stComplete   = uint8(masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE)
	stFailed     = uint8(masterv1.ReplicaStatus_REPLICA_STATUS_FAILED)
)

// replica is one copy of an object: 32 bytes.
type replica struct {
	allocID uint64 // allocation id at the agent; valid unless pending
	offset  uint64 // byte offset of the allocation in its segment (hole-making eviction)
	seg     uint32 // segment table index
	id      uint32 // per-object, monotonic, never reused while the object exists
	status  uint8
	medium  uint8
	// pending: the reservation at the agent is in flight; allocID unknown.
	pending bool
}

// Object flags.
const (
	flagHardPin uint8 = 1 << iota
	flagSoftPin
	flagLeased
)

// object is one (tenant, key). 136 bytes plus its replica array; the key
// string is shared with the shard map and the change records.
type object struct {
	key      string
	group    string
	size     uint64
	checksum uint64
	// accessMs is the last read (or the completion) time, Unix ms: the
	// eviction clock. With flagLeased, the read lease lasts until
	// accessMs+LeaseTTL. Write it only through shard.touchLocked (or
	// mut.touchLater), which keep the shard's recency list in order.
	accessMs int64
	// prev and next link the object into its shard's recency list (see
	// shard); both nil when it is not linked.
	prev, next *object
	// sealedMs is when the current version became COMPLETE (Reconcile's
	// "newer sealed wins").
	sealedMs  int64
	softPinMs int64     // soft pin expiry with flagSoftPin
	put       *putState // the write in progress, nil when none
	replicas  []replica
	nextRID   uint32
	tenant    uint32
	flags     uint8
}

// putState is a write in progress (PutStart → PutEnd/PutRevoke). Set and
// clear object.put only through shard.startPutLocked and endPutLocked,
// which keep the shard's put list.
type putState struct {
	client     string
	seq        uint64 // store-wide identity of this put (async re-lookup)
	startMs    int64
	softPinTTL time.Duration
	phase      uint8
	// obj is the object this put writes; prev and next link the put into
	// its shard's put list (see putList).
	obj        *object
	prev, next *putState
}

// Put phases.
const (
	phasePlacing uint8 = iota // reservations in flight; descriptors not yet returned
	phaseOpen                 // descriptors returned; the client writes
	phaseSealing              // PutEnd is sealing at the agents
)

func (o *object) leased(nowMs int64, ttl time.Duration) bool {
	return o.flags&flagLeased != 0 && nowMs < o.accessMs+ttl.Milliseconds()
}

func (o *object) softPinned(nowMs int64) bool {
	return o.flags&flagSoftPin != 0 && nowMs < o.softPinMs
}

func (o *object) hasComplete() bool {
	for i := range o.replicas {
		if o.replicas[i].status == stComplete {
			return true
		}
	}
	return false
}

func (o *object) hasCompleteOn(medium uint8, except int) bool {
	for i := range o.replicas {
		if i != except && o.replicas[i].status == stComplete && o.replicas[i].medium == medium {
			return true
		}
	}
	return false
}

func (o *object) replicaIndex(id uint32) int {
	for i := range o.replicas {
		if o.replicas[i].id == id {
			return i
		}
	}
	return -1
}

// shard owns a slice of the keyspace.
//
// Besides the maps, a shard keeps its objects in a recency list: doubly
// linked through object.prev/next, ordered by accessMs, least recent at
// head (ties in any order). An object is in the list exactly while it is
// in the maps (insertLocked, deleteLocked), and every write of accessMs
// repositions it (touchLocked): the common case, a new access not older
// than the tail's, is an O(1) move to the tail; an older one (a rebuild
// from the agents' sealed times, a clock stepping back) walks from the tail
// to its place. An eviction pass reads list prefixes instead of scanning
// every object (see evict).
type shard struct {
	// mu guards tenants, the recency list and every object reachable from
	// them, including the objects' replicas and put states. Lock order:
	// shard → registry → tenant table → tenant → change log. Never held
	// across agent I/O.
	mu         sync.Mutex
	tenants    map[uint32]map[string]*object
	head, tail *object // recency list: least and most recent access
	// puts lists the shard's puts in progress, oldest start first (see
	// expire.go), for the sweep that expires them.
	puts putList
	_    [16]byte // keep neighbouring shard locks off one cache line
}

func (sh *shard) getLocked(tenant uint32, key string) *object {
	return sh.tenants[tenant][key]
}

// insertLocked adds o to the maps and, at its accessMs, to the list.
func (sh *shard) insertLocked(o *object) {
	m := sh.tenants[o.tenant]
	if m == nil {
		m = make(map[string]*object)
		sh.tenants[o.tenant] = m
	}
	m[o.key] = o
	sh.linkLocked(o)
}

// deleteLocked removes o from the maps and the list.
func (sh *shard) deleteLocked(o *object) {
	m := sh.tenants[o.tenant]
	delete(m, o.key)
	if len(m) == 0 {
		delete(sh.tenants, o.tenant)
	}
	sh.unlinkLocked(o)
}

// linkedLocked reports whether o is in the list.
func (sh *shard) linkedLocked(o *object) bool { return o.prev != nil || sh.head == o }

// touchLocked sets o's access clock and moves it to its place in the list.
// An object that is not linked (gone from the maps, or waiting for
// relinkLocked) only gets the new clock.
func (sh *shard) touchLocked(o *object, ms int64) {
	o.accessMs = ms
	if !sh.linkedLocked(o) || (o.next == nil || ms <= o.next.accessMs) && (o.prev == nil || o.prev.accessMs <= ms) {
		return // not listed, or still in order where it is (the tail, say)
	}
	sh.unlinkLocked(o)
	sh.linkLocked(o)
}

// linkLocked inserts an unlinked o at its place by accessMs: at the tail or
// the head in O(1), elsewhere after a walk from the tail (past every object
// with a later access).
func (sh *shard) linkLocked(o *object) {
	switch {
	case sh.tail == nil || sh.tail.accessMs <= o.accessMs:
		sh.insertAfterLocked(o, sh.tail)
	case o.accessMs <= sh.head.accessMs:
		sh.insertAfterLocked(o, nil)
	default:
		c := sh.tail
		for c.accessMs > o.accessMs {
			c = c.prev // stops at the head at the latest (o.accessMs > head's)
		}
		sh.insertAfterLocked(o, c)
	}
}

// insertAfterLocked links o right after c (at the head when c is nil).
func (sh *shard) insertAfterLocked(o, c *object) {
	o.prev = c
	if c == nil {
		o.next = sh.head
		sh.head = o
	} else {
		o.next = c.next
		c.next = o
	}
	if o.next == nil {
		sh.tail = o
	} else {
		o.next.prev = o
	}
}

// unlinkLocked takes o out of the list (a no-op when it is not in it).
func (sh *shard) unlinkLocked(o *object) {
	if !sh.linkedLocked(o) {
		return
	}
	if o.prev == nil {
		sh.head = o.next
	} else {
		o.prev.next = o.next
	}
	if o.next == nil {
		sh.tail = o.prev
	} else {
		o.next.prev = o.prev
	}
	o.prev, o.next = nil, nil
}

// relinkLocked links the objects of xs that are in the maps but not in the
// list (mut.touchLater unlinked them), in one merge from the tail: sorted
// newest first, each is placed after a walk that resumes where the previous
// one stopped, so k objects cost O(k log k) plus the list walked once at
// most, where placing them one by one could walk it k times. xs is
// reordered.
func (sh *shard) relinkLocked(xs []*object) {
	slices.SortFunc(xs, func(a, b *object) int { return cmp.Compare(b.accessMs, a.accessMs) })
	c := sh.tail
	for _, o := range xs {
		if sh.linkedLocked(o) || sh.getLocked(o.tenant, o.key) != o {
			continue // a duplicate already placed, or dropped meanwhile
		}
		for c != nil && c.accessMs > o.accessMs {
			c = c.prev
		}
		sh.insertAfterLocked(o, c)
	}
}

func (s *Store) shardIndex(tenant uint32, key string) int {
	var d xxhash.Digest
	d.Reset()
	var tb [4]byte
	tb[0], tb[1], tb[2], tb[3] = byte(tenant), byte(tenant>>8), byte(tenant>>16), byte(tenant>>24)
	_, _ = d.Write(tb[:])
	_, _ = d.WriteString(key)
	return int(d.Sum64() & s.shardMask)
}

// lockAll locks every shard in index order (snapshot, RemoveAll's final
// check). Nobody else holds two shard locks, so this cannot deadlock.
func (s *Store) lockAll() {
	for i := range s.shards {
		s.shards[i].mu.Lock()
	}
}

// ---- segment interning ----

// segEntry is the metadata's per-segment state: its id and what the
// metadata has placed on it (derived from replica events).
type segEntry struct {
	id       string
	placed   atomic.Int64 // bytes of replicas of any status
	replicas atomic.Int64
	// freedMs is when a replica last left the segment (Unix ms): an agent
	// report older than that overstates the segment's use.
	freedMs atomic.Int64
}

// used is the segment's use for placement and eviction: what the metadata
// has placed, or the agent's last report when that is larger and not older
// than the metadata's last removal there (the report includes alignment
// and allocations the metadata does not know; a stale one does not see
// what was just freed).
func (e *segEntry) used(sg cluster.Segment) int64 {
	p := e.placed.Load()
	if e.freedMs.Load() > sg.LastHeartbeatMs {
		return p
	}
	return max(p, int64(sg.Used))
}

// segTable interns segment ids to small indexes (ids are never reused, so
// entries are never removed). Reads are lock-free: both the index and the
// list are copy-on-write.
type segTable struct {
	mu   sync.Mutex // serialises interning; leaf lock
	byID atomic.Pointer[map[string]uint32]
	list atomic.Pointer[[]*segEntry]
}

func (t *segTable) init() {
	m := map[string]uint32{}
	t.byID.Store(&m)
	l := []*segEntry{}
	t.list.Store(&l)
}

func (t *segTable) intern(id string) uint32 {
	if i, ok := (*t.byID.Load())[id]; ok {
		return i
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	old := *t.byID.Load()
	if i, ok := old[id]; ok {
		return i
	}
	ol := *t.list.Load()
	nl := make([]*segEntry, len(ol), len(ol)+1)
	copy(nl, ol)
	nl = append(nl, &segEntry{id: id})
	i := uint32(len(ol))
	nm := make(map[string]uint32, len(old)+1)
	for k, v := range old {
		nm[k] = v
	}
	nm[id] = i
	t.list.Store(&nl)
	t.byID.Store(&nm)
	return i
}

func (t *segTable) lookup(id string) (uint32, bool) {
	i, ok := (*t.byID.Load())[id]
	return i, ok
}

func (t *segTable) get(i uint32) *segEntry { return (*t.list.Load())[i] }

func (t *segTable) all() []*segEntry { return *t.list.Load() }

// ---- tenants ----

// A tenant id's low tenantIdxBits bits index its slot in the table; the
// high bits are the slot's generation, bumped each time a retired tenant's
// slot is given to a new tenant. The shard maps are keyed by the whole id,
// so a reader that looked a tenant up just before it retired finds no
// objects under its stale id, never the objects of the slot's next tenant.
const (
	tenantIdxBits = 18
	tenantIdxMask = 1<<tenantIdxBits - 1
	// MaxTenantsLimit is the most tenants a Store can hold at once
	// (Config.MaxTenants is clamped to it).
	MaxTenantsLimit = 1 << tenantIdxBits
	tenantChunk     = 1024
)

// tenant is a tenant's quota and usage. Usage is derived by the mutation
// path: an object is charged its size (once, whatever its replica count)
// from its creation at PutStart until it leaves the map.
//
// Lifecycle: a tenant is added by the first operation that may store
// something under it or sets its quota (tenantTable.acquire), and retired
// as soon as it holds no object, has no quota and no such operation holds
// it (tenantTable.release, mut.dropIfEmpty). Puts that fail therefore leave
// no tenant behind.
type tenant struct {
	name string
	id   uint32
	// pins counts operations that may create objects under id (acquire …
	// release). A pinned tenant is not retired.
	pins atomic.Int64
	// retired: the tenant left the table and id names nothing any more.
	// Written only under tenantTable.mu.
	retired atomic.Bool
	// mu guards the fields below; leaf lock (taken under a shard lock).
	mu          sync.Mutex
	maxBytes    uint64
	maxObjects  uint64
	usedBytes   uint64
	usedObjects uint64
}

// charge adds dBytes and dObjects to the usage. Growth beyond a limit fails
// unless force; shrinking always succeeds (a quota shrunk below usage
// rejects only growth).
func (t *tenant) charge(dBytes, dObjects int64, force bool) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	nb := uint64(int64(t.usedBytes) + dBytes)
	no := uint64(int64(t.usedObjects) + dObjects)
	if !force {
		if dBytes > 0 && t.maxBytes > 0 && nb > t.maxBytes {
			return rpcerr.New(codes.ResourceExhausted, masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED,
				"tenant %q: %d bytes used + %d > max_bytes %d", t.name, t.usedBytes, dBytes, t.maxBytes)
		}
		if dObjects > 0 && t.maxObjects > 0 && no > t.maxObjects {
			return rpcerr.New(codes.ResourceExhausted, masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED,
				"tenant %q: %d objects used + %d > max_objects %d", t.name, t.usedObjects, dObjects, t.maxObjects)
		}
	}
	t.usedBytes, t.usedObjects = nb, no
	return nil
}

// refund takes one erased object of size bytes off the usage and reports
// whether the tenant is then idle (see idleLocked).
func (t *tenant) refund(size uint64) (idle bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.usedBytes -= size
	t.usedObjects--
	return t.idleLocked()
}

// idleLocked: nothing stored and no quota, so nothing would be lost by
// forgetting the tenant.
func (t *tenant) idleLocked() bool {
	return t.usedObjects == 0 && t.usedBytes == 0 && t.maxBytes == 0 && t.maxObjects == 0
}

func (t *tenant) quota() *masterv1.TenantQuota {
	t.mu.Lock()
	defer t.mu.Unlock()
	return &masterv1.TenantQuota{
		Tenant: t.name, MaxBytes: t.maxBytes, MaxObjects: t.maxObjects,
		UsedBytes: t.usedBytes, UsedObjects: t.usedObjects,
	}
}

// tenantTable interns tenant names to ids. Lookups are lock-free: the name
// index is copy-on-write and the slots are atomic pointers in fixed chunks.
type tenantTable struct {
	max int
	// mu serialises adding and retiring tenants. Lock order: shard → mu →
	// tenant.mu.
	mu sync.Mutex
	// byName may still name tenants that retired since the last add (which
	// rebuilds it without them); lookups check.
	byName atomic.Pointer[map[string]uint32]
	chunks [MaxTenantsLimit / tenantChunk]atomic.Pointer[[tenantChunk]atomic.Pointer[tenant]]
	next   atomic.Uint32 // slots ever used; written under mu
	free   []uint32      // ids of retired tenants whose slot is free, oldest first (mu)
	live   int           // tenants not retired (mu)
}

func (t *tenantTable) init(max int) {
	t.max = min(max, MaxTenantsLimit)
	m := map[string]uint32{}
	t.byName.Store(&m)
}

func (t *tenantTable) slot(id uint32) *atomic.Pointer[tenant] {
	i := id & tenantIdxMask
	return &t.chunks[i/tenantChunk].Load()[i%tenantChunk]
}

// get returns the tenant an id was issued to, or the slot's newer tenant
// when that one retired and its slot was reused (callers hold ids of
// objects, which keep their tenant alive, or compare ids).
func (t *tenantTable) get(i uint32) *tenant { return t.slot(i).Load() }

// lookup returns the id of a known tenant (lock-free). It may return the id
// of a tenant that just retired: that id names no objects.
func (t *tenantTable) lookup(name string) (uint32, bool) {
	i, ok := (*t.byName.Load())[name]
	return i, ok
}

// lookupLive returns a tenant that has not retired, or nil.
func (t *tenantTable) lookupLive(name string) *tenant {
	i, ok := t.lookup(name)
	if !ok {
		return nil
	}
	if tp := t.get(i); tp.id == i && !tp.retired.Load() {
		return tp
	}
	return nil
}

// acquire returns the id of name, adding the tenant when it is new or
// retired, and pins it: it is not retired before the matching release. A
// new tenant beyond the table's cap fails with LIMIT_EXCEEDED.
func (t *tenantTable) acquire(name string) (uint32, error) {
	if i, ok := t.lookup(name); ok {
		// Pin, then check: a retire sets retired before it reads pins,
		// so one of the two sees the other (atomics are sequentially
		// consistent).
		if tp := t.get(i); tp.id == i {
			tp.pins.Add(1)
			if !tp.retired.Load() {
				return i, nil
			}
			tp.pins.Add(-1)
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	old := *t.byName.Load()
	if i, ok := old[name]; ok {
		if tp := t.get(i); tp.id == i && !tp.retired.Load() {
			tp.pins.Add(1)
			return i, nil
		}
	}
	if t.live >= t.max {
		return 0, rpcerr.New(codes.ResourceExhausted, masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
			"too many tenants (max %d); remove a tenant's objects and quota to free one", t.max)
	}
	var id uint32
	if len(t.free) > 0 {
		prev := t.free[0]
		t.free = append(t.free[:0], t.free[1:]...)
		id = (prev>>tenantIdxBits+1)<<tenantIdxBits | prev&tenantIdxMask
	} else {
		id = t.next.Load()
		if id%tenantChunk == 0 {
			t.chunks[id/tenantChunk].Store(new([tenantChunk]atomic.Pointer[tenant]))
		}
		t.next.Store(id + 1)
	}
	tp := &tenant{name: name, id: id}
	tp.pins.Store(1)
	t.slot(id).Store(tp)
	nm := make(map[string]uint32, t.live+1)
	for k, v := range old {
		if x := t.get(v); x.id == v && !x.retired.Load() {
			nm[k] = v
		}
	}
	nm[name] = id
	t.byName.Store(&nm)
	t.live++
	return id, nil
}

// release drops a pin taken by acquire, retiring the tenant when it is
// then idle.
func (t *tenantTable) release(i uint32) {
	tp := t.get(i)
	if tp.pins.Add(-1) != 0 {
		return
	}
	tp.mu.Lock()
	idle := tp.idleLocked()
	tp.mu.Unlock()
	if idle {
		t.retire(tp)
	}
}

// retire removes tp from the table if it is idle and unpinned. Callers hold
// no tenant lock (a shard lock is fine).
func (t *tenantTable) retire(tp *tenant) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if tp.retired.Load() || t.get(tp.id) != tp {
		return
	}
	// Mark first, then check pins and usage: an acquire that pinned before
	// the mark is seen here; one that pins after it sees the mark and backs
	// off to the slow path, which waits for mu.
	tp.retired.Store(true)
	tp.mu.Lock()
	idle := tp.idleLocked()
	tp.mu.Unlock()
	if tp.pins.Load() != 0 || !idle {
		tp.retired.Store(false)
		return
	}
	t.free = append(t.free, tp.id)
	t.live--
}

// releaseTenants releases the tenant pins of a BatchPutStart's accepted
// items (its retries reuse the same putItems, keeping their tenant).
func (s *Store) releaseTenants(items []*putItem) {
	for _, it := range items {
		s.tenants.release(it.tenant)
	}
}

// all returns the tenants that have not retired, in slot order.
func (t *tenantTable) all() []*tenant {
	n := t.next.Load()
	out := make([]*tenant, 0, n)
	for i := range n {
		if tp := t.get(i); tp != nil && !tp.retired.Load() {
			out = append(out, tp)
		}
	}
	return out
}

// ---- common errors ----

func errNotFound(tenant, key string) error {
	return rpcerr.New(codes.NotFound, masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "object %q/%q not found", tenant, key)
}

func errInvalid(format string, args ...any) error {
	return rpcerr.New(codes.InvalidArgument, masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...)
}

func errInternal(format string, args ...any) error {
	return rpcerr.New(codes.Internal, masterv1.ErrorReason_ERROR_REASON_INTERNAL, format, args...)
}

// NormalizeTenant maps "" to DefaultTenant.
func NormalizeTenant(t string) string {
	if t == "" {
		return DefaultTenant
	}
	return t
}

// ValidateKey checks a tenant and key pair.
func ValidateKey(tenant, key string) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return errInvalid("key must be 1..%d bytes, got %d", MaxKeyLen, len(key))
	}
	if len(tenant) > MaxTenantLen {
		return errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	return nil
}

// ValidateClientID checks a client id (empty is allowed).
func ValidateClientID(id string) error {
	if len(id) > MaxClientIDLen {
		return errInvalid("client_id must be at most %d bytes, got %d", MaxClientIDLen, len(id))
	}
	return nil
}

// validatePutStrings checks the strings of a PutStart that ValidateKey and
// the group check do not: client id, preferred host and segments.
func validatePutStrings(sp *PutSpec) error {
	if err := ValidateClientID(sp.ClientID); err != nil {
		return err
	}
	if len(sp.PreferLocalHost) > MaxHostLen {
		return errInvalid("prefer_local_host must be at most %d bytes, got %d", MaxHostLen, len(sp.PreferLocalHost))
	}
	for _, id := range sp.Preferred {
		if len(id) > MaxHostLen {
			return errInvalid("preferred segment ids must be at most %d bytes, got %d", MaxHostLen, len(id))
		}
	}
	return nil
}

// locate normalizes *tenant in place, validates the key and resolves the
// tenant's index and the key's shard. A tenant that never held anything
// answers OBJECT_NOT_FOUND: every read, end, revoke and remove starts here.
func (s *Store) locate(tenant *string, key string) (t uint32, shard int, err error) {
	*tenant = NormalizeTenant(*tenant)
	if err := ValidateKey(*tenant, key); err != nil {
		return 0, 0, err
	}
	t, ok := s.tenants.lookup(*tenant)
	if !ok {
		return 0, 0, errNotFound(*tenant, key)
	}
	return t, s.shardIndex(t, key), nil
}

// located is one spec of a batch call resolved to its tenant and shard.
type located struct {
	i, shard int
	tenant   uint32
}

func (l located) shardOf() int { return l.shard }

// locateAll resolves specs 0..n-1 of a batch (spec gives each one's tenant,
// normalized in place, and key); one that fails validation goes to fail
// and is left out.
func (s *Store) locateAll(n int, spec func(i int) (tenant *string, key string), fail func(i int, err error)) []located {
	out := make([]located, 0, n)
	for i := range n {
		tp, key := spec(i)
		t, shard, err := s.locate(tp, key)
		if err != nil {
			fail(i, err)
			continue
		}
		out = append(out, located{i: i, tenant: t, shard: shard})
	}
	return out
}
