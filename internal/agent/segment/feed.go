package segment

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// DefaultFeedSize is the number of recent changes a Feed keeps.
const DefaultFeedSize = 1 << 17

// ErrBehind answers a Read from a version that has fallen out of the feed's
// ring: the reader has missed changes and must take the whole table again.
var ErrBehind = errors.New("segment feed: the position has fallen out of the ring")

// Feed is the agent's table change feed (issue 15, warm standbys): the
// changes of every segment's allocation table that a master rebuilding its
// object map cares about, numbered from 1. A change is an allocation that
// became SEALED or a SEALED allocation released; RESERVED allocations, and
// their releases and expiries, are not changes (a master ignores them in a
// rebuild). One Feed per agent process: Position names it by a random
// instance id, so a master following one process never applies another's
// versions.
//
// A segment records its changes while it holds its own mutex, after the
// table shows them, so once a reader has read version V every change up to
// V is visible in the segments' tables (Set.Table): a table taken after
// Position, plus the changes after that position, is the table at the end.
// Re-applying a change the table already shows is a no-op (an allocation is
// sealed before it is released and ids are never reused).
//
// The feed keeps the last Size changes in a ring; a reader that falls
// further behind gets ErrBehind. Recording costs one lock and the change's
// message, built once and shared by every reader: an agent follows two
// standbys in a cluster of three masters, and building the message per
// reader from the table entry kept in the ring allocated over a third more
// per put object in all (BenchmarkPutCycle with CRESCENT_BENCH_FOLLOW).
type Feed struct {
	instance string
	mask     uint64

	// mu guards the fields below. Lock order: Segment.mu → Feed.mu;
	// nothing else is locked or called under it.
	mu      sync.Mutex
	version uint64
	ring    []Change      // change v lives in ring[(v-1)&mask]
	wake    chan struct{} // closed at the next change; nil when nobody waits
}

// Change is one change of the feed.
type Change struct {
	a        *masterv1.Allocation
	released bool
}

// Released reports whether the change is a release (else a seal).
func (c Change) Released() bool { return c.released }

// Allocation is the change as the wire carries it (TableDelta): for a seal
// the complete allocation, segment_id set; for a release its segment_id,
// allocation_id, tenant and key. Every reader gets the same message: it
// must not be modified.
func (c Change) Allocation() *masterv1.Allocation { return c.a }

// closedChan is what Changed returns when a change is already there.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// NewFeed returns a feed that keeps the last size changes (rounded up to a
// power of two; DefaultFeedSize when size <= 0), with a fresh random
// instance id.
func NewFeed(size int) *Feed {
	if size <= 0 {
		size = DefaultFeedSize
	}
	n := 1
	for n < size {
		n <<= 1
	}
	var id [16]byte
	_, _ = rand.Read(id[:]) // never fails (crypto/rand)
	return &Feed{instance: hex.EncodeToString(id[:]), mask: uint64(n - 1), ring: make([]Change, n)}
}

// Instance is the feed's random id.
func (f *Feed) Instance() string { return f.instance }

// Size is how many recent changes the feed keeps.
func (f *Feed) Size() int { return len(f.ring) }

// Position returns the feed's instance and the number of changes recorded.
// Every change up to version is visible in the segments' tables when it
// returns.
func (f *Feed) Position() (instance string, version uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.instance, f.version
}

// Read appends to dst the changes after version from, at most limit of them,
// oldest first: the last one appended is version from+len(appended). It
// answers ErrBehind when the changes right after from are no longer kept.
func (f *Feed) Read(dst []Change, from uint64, limit int) ([]Change, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case from > f.version:
		return dst, fmt.Errorf("segment feed: version %d is ahead of the feed's %d", from, f.version)
	case f.version-from > uint64(len(f.ring)):
		return dst, fmt.Errorf("%w: version %d, the ring keeps %d to %d", ErrBehind, from, f.version-uint64(len(f.ring))+1, f.version)
	}
	n := min(f.version-from, uint64(max(limit, 0)))
	for v := from + 1; v <= from+n; v++ {
		dst = append(dst, f.ring[(v-1)&f.mask])
	}
	return dst, nil
}

// Changed returns a channel that is closed once the feed holds a change
// after version after (at once when it already does).
func (f *Feed) Changed(after uint64) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.version > after {
		return closedChan
	}
	if f.wake == nil {
		f.wake = make(chan struct{})
	}
	return f.wake
}

// sealed records that e of seg became SEALED; seg.mu is held, and the
// table shows it.
func (f *Feed) sealed(seg *Segment, e *entry) { f.add(Change{a: e.proto(seg.id)}) }

// released records that the SEALED entry e left seg's table; seg.mu is
// held.
func (f *Feed) released(seg *Segment, e *entry) {
	f.add(Change{a: &masterv1.Allocation{SegmentId: seg.id, AllocationId: e.id, Tenant: e.tenant, Key: e.key}, released: true})
}

// add records c (its message built before the lock).
func (f *Feed) add(c Change) {
	f.mu.Lock()
	f.version++
	f.ring[(f.version-1)&f.mask] = c
	if f.wake != nil {
		close(f.wake)
		f.wake = nil
	}
	f.mu.Unlock()
}
