package meta

import (
	"sync"
	"sync/atomic"

	"github.com/crescent-kv/crescent/internal/master/cluster"
)

// segEntry is the metadata's per-segment state: its id and what the
// metadata has placed on it (derived from replica events).
type segEntry struct {
	id       string
	placed   atomic.Int64 // bytes of replicas of any status
	replicas atomic.Int64
	// freedMs is when a replica last left the segment (Unix ms), set again
	// when the agent acknowledges the release: an agent report not newer
	// than that overstates the segment's use. (Set only at removal, a
	// heartbeat the agent sent before it applied the release but that
	// arrived after the removal passed for fresh, and a put that had just
	// evicted for room found none: seen as NO_AVAILABLE_HANDLE in e2e.)
	freedMs atomic.Int64
	// blanks are the segment's blank reservations (blank.go), and
	// blankBytes their object bytes, counted as used for placement.
	blanks     blankPools
	blankBytes atomic.Int64
}

// used is the segment's use for placement and eviction: what the metadata
// has placed (and holds in blank reservations), or the agent's last report
// when that is larger and not older than the metadata's last removal there
// (the report includes alignment and allocations the metadata does not
// know; a stale one does not see what was just freed).
func (e *segEntry) used(sg cluster.Segment) int64 {
	p := e.placed.Load() + e.blankBytes.Load()
	if e.freedMs.Load() >= sg.LastHeartbeatMs {
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
