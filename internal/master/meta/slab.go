package meta

import (
	"sync"
	"unsafe"
)

// A rebuild creates millions of objects in seconds (a restarted master
// adopting every allocation its agents report, issue 15), and on a VM a
// first touch of a 4 KiB page costs microseconds: profiled at 4M objects,
// a third of the rebuild's CPU went to page faults on the objects, their
// replica arrays and the maps. Rebuilt objects and their first replicas are
// therefore carved from large blocks that ask the kernel for transparent
// huge pages (madvise MADV_HUGEPAGE, which works where THP is "madvise", the
// default of Debian and Ubuntu, as well as "always"): one fault per 2 MiB
// instead of 512.
//
// The price is memory held longer: a block stays allocated while any object
// carved from it lives, and a slot freed by a removal is not reused (a
// removed object may still be held by a put phase that checks it through
// its fields, so its memory must not become another object's). A rebuilt
// cache that later turns over holds up to a block per shard group of
// survivors; ordinary puts allocate objects one by one, as before.

// slabBlockBytes is the size of one block: 8 MiB holds at least three
// whole aligned huge pages wherever it lands (Go aligns large allocations
// to 8 KiB only).
const slabBlockBytes = 8 << 20

// hugeSlab hands out runs of T from shared blocks. Safe for concurrent
// use.
type hugeSlab[T any] struct {
	mu   sync.Mutex
	free []T
}

// take returns a zeroed run of n values (n ≥ 1), with no spare capacity:
// appending to it reallocates.
func (s *hugeSlab[T]) take(n int) []T {
	var z T
	size := int(unsafe.Sizeof(z))
	if n*size > slabBlockBytes/8 {
		return make([]T, n) // too big to carve without waste
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.free) < n {
		s.free = make([]T, slabBlockBytes/size)
		adviseHugePages(unsafe.Pointer(unsafe.SliceData(s.free)), len(s.free)*size)
	}
	out := s.free[:n:n]
	s.free = s.free[n:]
	return out
}

// rebuildAlloc is one shard group's supply of objects and replicas during
// a rebuild: it takes from the store's slabs as objects are created, at
// most as many at a time as the group may still create.
type rebuildAlloc struct {
	objs *hugeSlab[object]
	reps *hugeSlab[replica]
	o    []object
	r    []replica
}

// object returns a zeroed object; left is an upper bound on how many more
// this group may ask for (itself included).
func (a *rebuildAlloc) object(left int) *object {
	if len(a.o) == 0 {
		a.o = a.objs.take(max(min(left, 4096), 1))
	}
	o := &a.o[0]
	a.o = a.o[1:]
	return o
}

// replicas returns an empty replica array with room for one.
func (a *rebuildAlloc) replicas(left int) []replica {
	if len(a.r) == 0 {
		a.r = a.reps.take(max(min(left, 4096), 1))
	}
	r := a.r[:0:1]
	a.r = a.r[1:]
	return r
}
