package meta

import (
	"sync"
	"sync/atomic"
	"time"
)

// Removals a returning segment must not undo.
//
// An unmount (DropSegments: the agent was lost, or stopped) drops the
// replicas on its segments from the metadata. The bytes may outlive that:
// a disk segment's sealed allocations persist, and its agent mounts it
// again with the same id; an agent that was only cut off or stalled (a
// network partition, a SIGSTOP, a long pause) past --unmount-after comes
// back with its memory segments too, same ids, same sealed allocations
// (make soak). Reconcile adopts them. An object a client removed in
// between would come back (e2e TestRemovedWhileDiskAgentAway, meta
// TestRemovedWhileMemoryDetached). So while any segment is detached
// (dropped and not yet registered again), every removal by a client
// records a tombstone, (tenant, key) and the time — a removal that found
// nothing too, since the key may live on a detached segment; a reconcile
// returns, never adopts, a sealed allocation on a detached segment whose
// key was removed at or after the segment was detached. The segment's
// next registration ends its detachment, and the tombstones go once no
// segment is detached. A memory segment its agent no longer lists when it
// registers again (it restarted: its memory segments have new ids) is
// gone for good and forgotten then.
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

// detachedSeg is a dropped segment that may come back.
type detachedSeg struct {
	atMs   int64  // when it was dropped
	agent  string // the agent it belonged to
	memory bool
}

type tombstones struct {
	// active is set while detached is not empty: removals record.
	active atomic.Bool

	mu       sync.Mutex
	detached map[uint32]detachedSeg // by segment index
	removed  map[tombKey]int64
	dropped  atomic.Uint64
}

// detach records that segment idx of agent was dropped at nowMs.
func (t *tombstones) detach(idx uint32, nowMs int64, agent string, memory bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.detached == nil {
		t.detached = map[uint32]detachedSeg{}
	}
	t.detached[idx] = detachedSeg{atMs: nowMs, agent: agent, memory: memory}
	t.active.Store(true)
}

// attach ends the detachment of the segments agent registered (idxs: all
// of them) and forgets its detached memory segments it no longer has,
// returning those.
func (t *tombstones) attach(agent string, idxs map[uint32]bool) (gone []uint32) {
	if !t.active.Load() {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for idx, d := range t.detached {
		switch {
		case idxs[idx]:
			delete(t.detached, idx)
		case d.memory && d.agent == agent:
			delete(t.detached, idx)
			gone = append(gone, idx)
		}
	}
	t.settleLocked()
	return gone
}

// expire forgets the segments detached before nowMs-detachedRetention.
func (t *tombstones) expire(nowMs int64) {
	if !t.active.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for idx, d := range t.detached {
		if nowMs-d.atMs > detachedRetention.Milliseconds() {
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
	d, ok := t.detached[idx]
	if !ok {
		return false
	}
	rm, ok := t.removed[tombKey{tenant, key}]
	return ok && rm >= d.atMs
}

// stats returns the detached segments, the tombstones, and the removals
// not recorded for the cap.
func (t *tombstones) stats() (detached, removed int, dropped uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.detached), len(t.removed), t.dropped.Load()
}
