package meta

import (
	"sync"
	"sync/atomic"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

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
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED,
				"tenant %q: %d bytes used + %d > max_bytes %d", t.name, t.usedBytes, dBytes, t.maxBytes)
		}
		if dObjects > 0 && t.maxObjects > 0 && no > t.maxObjects {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED,
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
		return 0, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
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
