package meta

import (
	"regexp"
	"strings"
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
// A RemoveByPrefix, RemoveByRegex or RemoveAll records its pattern the
// same way (a patternTomb: tenant, prefix or regex or every key, time), so
// that it also covers the keys living on a detached segment, which it could
// not find. A removal without force skips hard-pinned objects, so its
// tombstone (by key or pattern) does not cover a hard-pinned allocation;
// one with force does.
//
// Bounded: at most maxTombstones keys and maxPatternTombs patterns are
// kept (further removals are counted in
// crescent_master_removal_tombstones_dropped_total, not recorded), and a
// segment detached for longer than detachedRetention is forgotten (its
// return may bring back objects removed meanwhile). Memory only: a new
// leader after a failover has none, and distrusts instead every segment an
// earlier leader recorded in etcd as unsettled (unsettled.go).
const (
	maxTombstones     = 1 << 18
	maxPatternTombs   = 1024
	maxRegexTombs     = 64 // of maxPatternTombs: a reconcile matches each against a returning key
	detachedRetention = 24 * time.Hour
)

type tombKey struct{ tenant, key string }

// removedAt is when a key (or pattern) was last removed, and when last
// with force (if forced).
type removedAt struct {
	anyMs, forceMs int64
	forced         bool
}

func (r *removedAt) note(nowMs int64, force bool) {
	r.anyMs = nowMs
	if force {
		r.forceMs, r.forced = nowMs, true
	}
}

// covers reports whether the removals recorded in r took an allocation of
// the key detached at detachedMs (hard-pinned: only a forced one did).
func (r removedAt) covers(detachedMs int64, hardPin bool) bool {
	if hardPin {
		return r.forced && r.forceMs >= detachedMs
	}
	return r.anyMs >= detachedMs
}

// patternTomb is a RemoveByPrefix (prefix), RemoveByRegex (rx) or
// RemoveAll (neither) of tenant's keys.
type patternTomb struct {
	tenant, prefix string
	rx             *regexp.Regexp
	at             removedAt
}

func (p *patternTomb) same(tenant, prefix string, rx *regexp.Regexp) bool {
	if p.tenant != tenant || p.prefix != prefix || (p.rx == nil) != (rx == nil) {
		return false
	}
	return rx == nil || p.rx.String() == rx.String()
}

func (p *patternTomb) matches(key string) bool {
	switch {
	case p.rx != nil:
		return p.rx.MatchString(key)
	case p.prefix != "":
		return strings.HasPrefix(key, p.prefix)
	}
	return true
}

// detachedSeg is a dropped segment that may come back.
type detachedSeg struct {
	atMs   int64  // when it was dropped
	agent  string // the agent it belonged to
	memory bool
	// all: every key counts as removed (Distrust: an earlier leader left
	// the segment unsettled, and its removals are unknown here).
	all bool
}

type tombstones struct {
	// active is set while detached is not empty: removals record.
	active atomic.Bool

	mu       sync.Mutex
	detached map[uint32]detachedSeg // by segment index
	removed  map[tombKey]removedAt
	patterns []patternTomb
	regexes  int // patterns with rx
	dropped  atomic.Uint64
}

// detach records that segment idx of agent was dropped at nowMs.
func (t *tombstones) detach(idx uint32, nowMs int64, agent string, memory bool) {
	t.detachAs(idx, detachedSeg{atMs: nowMs, agent: agent, memory: memory})
}

// distrust detaches segment idx with every key removed: a newly elected
// leader's segment that an earlier leader left unsettled (unsettled.go).
// Its next registration ends it, as any detachment's; until then no sealed
// allocation on it is adopted. A live segment too: its agent's first
// registration with this leader comes before anything is placed on it
// (blanks and spares do not survive a promotion), so every allocation it
// lists was sealed under an earlier leader.
func (t *tombstones) distrust(idx uint32, nowMs int64, agent string, memory bool) {
	t.detachAs(idx, detachedSeg{atMs: nowMs, agent: agent, memory: memory, all: true})
}

// detachAs records d for segment idx. A distrusted segment stays so until
// it registers: a later detach keeps all.
func (t *tombstones) detachAs(idx uint32, d detachedSeg) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.detached == nil {
		t.detached = map[uint32]detachedSeg{}
	}
	d.all = d.all || t.detached[idx].all
	t.detached[idx] = d
	t.active.Store(true)
}

// detachedInfo returns segment idx's detachment, if it is detached.
func (t *tombstones) detachedInfo(idx uint32) (detachedSeg, bool) {
	if !t.active.Load() {
		return detachedSeg{}, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	d, ok := t.detached[idx]
	return d, ok
}

// detachedSet returns the detached segments (a new map).
func (t *tombstones) detachedSet() map[uint32]bool {
	out := map[uint32]bool{}
	if !t.active.Load() {
		return out
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for idx := range t.detached {
		out[idx] = true
	}
	return out
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

// isDetached reports whether segment idx is detached.
func (t *tombstones) isDetached(idx uint32) bool {
	if !t.active.Load() {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.detached[idx]
	return ok
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
		t.detached, t.removed, t.patterns, t.regexes = nil, nil, nil, 0
		t.active.Store(false)
	}
}

// record notes a client's removal of (tenant, key) at nowMs, while a
// segment is detached. A leaf lock: called under a shard's.
func (t *tombstones) record(tenant, key string, nowMs int64, force bool) {
	if !t.active.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.detached) == 0 {
		return
	}
	k := tombKey{tenant, key}
	r, ok := t.removed[k]
	if !ok && len(t.removed) >= maxTombstones {
		t.dropped.Add(1)
		return
	}
	if t.removed == nil {
		t.removed = map[tombKey]removedAt{}
	}
	r.note(nowMs, force)
	t.removed[k] = r
}

// recordPattern notes a RemoveByPrefix (prefix), RemoveByRegex (rx) or
// RemoveAll (neither) of tenant's keys at nowMs, while a segment is
// detached: it found only the objects in the metadata, and the pattern
// covers the detached segments' keys too.
func (t *tombstones) recordPattern(tenant, prefix string, rx *regexp.Regexp, nowMs int64, force bool) {
	if !t.active.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.detached) == 0 {
		return
	}
	for i := range t.patterns {
		if p := &t.patterns[i]; p.same(tenant, prefix, rx) {
			p.at.note(nowMs, force)
			return
		}
	}
	if len(t.patterns) >= maxPatternTombs || (rx != nil && t.regexes >= maxRegexTombs) {
		t.dropped.Add(1)
		return
	}
	if rx != nil {
		t.regexes++
	}
	p := patternTomb{tenant: tenant, prefix: prefix, rx: rx}
	p.at.note(nowMs, force)
	t.patterns = append(t.patterns, p)
}

// removedSince reports whether (tenant, key) was removed, by key or by a
// pattern, while segment idx was detached: its allocation there (hard
// pinned or not) is an object removed since.
func (t *tombstones) removedSince(idx uint32, tenant, key string, hardPin bool) bool {
	if !t.active.Load() {
		return false
	}
	var buf [8]*patternTomb
	cands := buf[:0]
	t.mu.Lock()
	d, ok := t.detached[idx]
	if !ok || d.all {
		t.mu.Unlock()
		return ok
	}
	if r, ok := t.removed[tombKey{tenant, key}]; ok && r.covers(d.atMs, hardPin) {
		t.mu.Unlock()
		return true
	}
	for i := range t.patterns {
		if p := &t.patterns[i]; p.tenant == tenant && p.at.covers(d.atMs, hardPin) {
			cands = append(cands, p)
		}
	}
	t.mu.Unlock()
	// Matched with no lock held (a regex costs up to MaxRegexInsts per
	// byte of key): a pattern's tenant, prefix and rx never change.
	for _, p := range cands {
		if p.matches(key) {
			return true
		}
	}
	return false
}

// stats returns the detached segments, the tombstones (keys and
// patterns), and the removals not recorded for the caps.
func (t *tombstones) stats() (detached, removed int, dropped uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.detached), len(t.removed) + len(t.patterns), t.dropped.Load()
}
