package meta

import (
	"sync"
	"sync/atomic"
	"time"
)

// Removals a returning disk segment must not undo.
//
// An unmount (DropSegments: the agent was lost, or stopped) drops the
// replicas on its segments from the metadata. A memory segment's bytes
// are gone with it, but a disk segment's sealed allocations persist: its
// agent mounts it again with the same id, and Reconcile adopts them. An
// object a client removed in between would come back (e2e
// TestRemovedWhileDiskAgentAway). So while any disk segment is detached
// (dropped and not yet registered again), every removal by a client
// records a tombstone, (tenant, key) and the time; a reconcile returns,
// never adopts, a sealed allocation on a detached segment whose key was
// removed at or after the segment was detached. The segment's next
// registration ends its detachment, and the tombstones go once no segment
// is detached.
//
// Bounded: at most maxTombstones are kept (further removals are counted
// in crescent_master_removal_tombstones_dropped_total, not recorded), and
// a segment detached for longer
// than detachedRetention is forgotten (its return may bring back objects
// removed meanwhile). Memory only: a new leader after a failover has
// none.
const (
	maxTombstones     = 1 << 18
	detachedRetention = 24 * time.Hour
)

type tombKey struct{ tenant, key string }

type tombstones struct {
	// active is set while detached is not empty: removals record.
	active atomic.Bool

	mu       sync.Mutex
	detached map[uint32]int64 // segment index → when it was dropped (ms)
	removed  map[tombKey]int64
	dropped  atomic.Uint64
}

// detach records that disk segment idx was dropped at nowMs.
func (t *tombstones) detach(idx uint32, nowMs int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.detached == nil {
		t.detached = map[uint32]int64{}
	}
	t.detached[idx] = nowMs
	t.active.Store(true)
}

// attach ends the detachment of the segments (their agent registered).
func (t *tombstones) attach(idxs map[uint32]bool) {
	if !t.active.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for idx := range idxs {
		delete(t.detached, idx)
	}
	t.settleLocked()
}

// expire forgets the segments detached before nowMs-detachedRetention.
func (t *tombstones) expire(nowMs int64) {
	if !t.active.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for idx, at := range t.detached {
		if nowMs-at > detachedRetention.Milliseconds() {
			delete(t.detached, idx)
		}
	}
	t.settleLocked()
}

func (t *tombstones) settleLocked() {
	if len(t.detached) == 0 {
		t.detached, t.removed = nil, nil
		t.active.Store(false)
	}
}

// record notes a client's removal of (tenant, key) at nowMs, while a
// disk segment is detached. A leaf lock: called under a shard's.
func (t *tombstones) record(tenant, key string, nowMs int64) {
	if !t.active.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.detached) == 0 {
		return
	}
	k := tombKey{tenant, key}
	if _, ok := t.removed[k]; !ok && len(t.removed) >= maxTombstones {
		t.dropped.Add(1)
		return
	}
	if t.removed == nil {
		t.removed = map[tombKey]int64{}
	}
	t.removed[k] = nowMs
}

// removedSince reports whether (tenant, key) was removed while segment
// idx was detached: its allocation there is an object removed since.
func (t *tombstones) removedSince(idx uint32, tenant, key string) bool {
	if !t.active.Load() {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	at, ok := t.detached[idx]
	if !ok {
		return false
	}
	rm, ok := t.removed[tombKey{tenant, key}]
	return ok && rm >= at
}

// stats returns the detached segments, the tombstones, and the removals
// not recorded for the cap.
func (t *tombstones) stats() (detached, removed int, dropped uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.detached), len(t.removed), t.dropped.Load()
}
