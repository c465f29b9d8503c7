// Package alloc is the offset allocator of one segment: it hands out aligned,
// non-overlapping extents of [0, capacity) and is the agent's authority for
// what is allocated.
//
// It is a TLSF ("two-level segregated fit", Masmano et al. 2004) allocator:
// free extents sit in segregated lists indexed by a first level (power of two)
// and a second level (32 linear sub-classes of that power), with a bitmap per
// level, so finding a fitting free extent is two find-first-set operations and
// Allocate and Free are O(1): an Extent carries the index of its block, so
// Free finds it without a lookup (an offset-keyed map was about 5 % of the
// agent's CPU on a put of 4 KiB objects, its misses included). Every extent,
// free or used, is linked to its physical neighbours, so Free coalesces with
// free neighbours at once and fragmentation stays bounded: two free extents
// are never adjacent. Allocate rounds the request up to the next sub-class
// boundary before searching ("good fit"), so any extent found is large enough
// (the rounding is not wasted: the remainder stays free); only when no such
// class has a block does it walk the request's own class, so Allocate fails
// exactly when no free extent is large enough.
//
// Sizes are kept in units of the alignment. The allocator is not safe for
// concurrent use; its segment serialises calls.
package alloc

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
)

// Alignment defaults. Memory segments use 64 B: one cache line, enough for
// any SIMD copy and for RDMA registration granularity at the byte level, and
// KV blocks (a few KiB and up) waste at most 63 B each. Disk segments use
// 4 KiB: the page and logical sector size, so extents can be read with
// O_DIRECT and never share a page (no read-modify-write by the page cache).
const (
	MemoryAlignment = 64
	DiskAlignment   = 4096
)

// Errors. They are sentinels; callers map them to wire reasons.
var (
	ErrNoSpace = errors.New("alloc: no free extent large enough")
	// ErrTooLarge is Allocate's answer to a size above the capacity: no
	// amount of freeing makes room. It wraps ErrNoSpace.
	ErrTooLarge     = fmt.Errorf("%w: the size exceeds the segment's capacity", ErrNoSpace)
	ErrInvalidSize  = errors.New("alloc: invalid size")
	ErrNotAllocated = errors.New("alloc: offset is not an allocated extent")
	ErrOverlap      = errors.New("alloc: extents overlap or lie outside the segment")
)

const (
	slBits  = 5
	slCount = 1 << slBits
	flCount = 64
	none    = int32(-1)
)

// Extent is an allocated range in bytes. Size is a multiple of the alignment.
// An Extent returned by Allocate or Restore also names its block inside the
// allocator, which Free uses; an Extent built by hand only describes a range.
type Extent struct {
	Offset uint64
	Size   uint64
	block  int32
}

// Stats is the allocator's exact accounting, in bytes.
type Stats struct {
	Capacity uint64
	// Used is the sum of allocated extents (alignment included).
	Used uint64
	// Free is Capacity - Used.
	Free uint64
	// LargestFree is the largest contiguous free extent.
	LargestFree uint64
	// Allocations is the number of allocated extents.
	Allocations int
	Alignment   uint64
}

type block struct {
	off, size          uint64 // units
	prevPhys, nextPhys int32
	prevFree, nextFree int32
	free               bool
}

// Allocator is a TLSF offset allocator over [0, capacity).
type Allocator struct {
	shift    uint
	capUnits uint64
	used     uint64 // units
	nAlloc   int

	flBitmap uint64
	slBitmap [flCount]uint32
	heads    [flCount][slCount]int32

	blocks []block
	spare  []int32 // recycled indices into blocks
}

// maxPresize bounds the blocks New sizes its tables for (about 16 MiB).
const maxPresize = 1 << 18

// New returns an allocator over capacity bytes (rounded down to a multiple of
// align). align must be a power of two.
func New(capacity, align uint64) (*Allocator, error) {
	if align == 0 || align&(align-1) != 0 {
		return nil, fmt.Errorf("alloc: alignment %d is not a power of two", align)
	}
	a := &Allocator{shift: uint(bits.TrailingZeros64(align))}
	a.capUnits = capacity >> a.shift
	if a.capUnits == 0 {
		return nil, fmt.Errorf("alloc: capacity %d is smaller than the alignment %d", capacity, align)
	}
	// Size the block table for a segment full of smallest extents
	// (bounded): growing it under load copied and faulted in ever larger
	// tables on the put path of a fresh agent.
	hint := int(min(a.capUnits+1, maxPresize))
	a.blocks = make([]block, 0, hint)
	a.reset()
	return a, nil
}

func (a *Allocator) reset() {
	for i := range a.heads {
		for j := range a.heads[i] {
			a.heads[i][j] = none
		}
	}
	a.flBitmap = 0
	a.slBitmap = [flCount]uint32{}
	a.blocks = a.blocks[:0]
	a.spare = a.spare[:0]
	a.used, a.nAlloc = 0, 0
	idx := a.newBlock(block{off: 0, size: a.capUnits, prevPhys: none, nextPhys: none})
	a.insertFree(idx)
}

// Alignment is the allocation granularity in bytes.
func (a *Allocator) Alignment() uint64 { return 1 << a.shift }

// Capacity is the usable size in bytes.
func (a *Allocator) Capacity() uint64 { return a.capUnits << a.shift }

// ExtentSize is the extent Allocate(size) would take: size rounded up to the
// alignment, or math.MaxUint64 when that does not fit in 64 bits (larger
// than any capacity, so never a valid extent).
func (a *Allocator) ExtentSize(size uint64) uint64 {
	u := a.units(size)
	if u > math.MaxUint64>>a.shift {
		return math.MaxUint64
	}
	return u << a.shift
}

// units is size in units of the alignment, rounded up; it cannot wrap
// (adding alignment-1 to a size near 2^64 would).
func (a *Allocator) units(size uint64) uint64 {
	u := size >> a.shift
	if size&(1<<a.shift-1) != 0 {
		u++
	}
	return u
}

// Allocate reserves an extent of at least size bytes and returns it. It
// refuses size 0 with ErrInvalidSize, a size above the capacity with
// ErrTooLarge and one no free extent can hold with ErrNoSpace.
func (a *Allocator) Allocate(size uint64) (Extent, error) {
	if size == 0 {
		return Extent{}, ErrInvalidSize
	}
	if size > a.capUnits<<a.shift {
		return Extent{}, ErrTooLarge
	}
	u := a.units(size)
	idx := a.findFit(u)
	if idx == none {
		return Extent{}, ErrNoSpace
	}
	a.removeFree(idx)
	if rest := a.blocks[idx].size - u; rest > 0 {
		b := &a.blocks[idx]
		b.size = u
		r := a.newBlock(block{off: b.off + u, size: rest, prevPhys: idx, nextPhys: b.nextPhys})
		// a.newBlock may have grown a.blocks; re-take pointers.
		if nx := a.blocks[r].nextPhys; nx != none {
			a.blocks[nx].prevPhys = r
		}
		a.blocks[idx].nextPhys = r
		a.insertFree(r)
	}
	b := &a.blocks[idx]
	b.free = false
	a.used += b.size
	a.nAlloc++
	return Extent{Offset: b.off << a.shift, Size: b.size << a.shift, block: idx}, nil
}

// Free returns an extent as Allocate or Restore returned it. An extent that
// is not allocated (freed already, or built by hand) is refused with
// ErrNotAllocated, unless its block was reused since for an allocation of
// the very same range: freeing twice is the caller's bug, as it was when
// extents were looked up by offset.
func (a *Allocator) Free(e Extent) error {
	idx := e.block
	if idx < 0 || int(idx) >= len(a.blocks) {
		return ErrNotAllocated
	}
	b := &a.blocks[idx]
	// Spare (recycled) blocks are marked free, so they fail here too.
	if b.free || b.off<<a.shift != e.Offset || b.size<<a.shift != e.Size {
		return ErrNotAllocated
	}
	b.free = true
	a.used -= b.size
	a.nAlloc--
	if p := b.prevPhys; p != none && a.blocks[p].free {
		a.removeFree(p)
		idx = a.merge(p, idx)
	}
	if n := a.blocks[idx].nextPhys; n != none && a.blocks[n].free {
		a.removeFree(n)
		idx = a.merge(idx, n)
	}
	a.insertFree(idx)
	return nil
}

// Restore rebuilds the allocator from a set of allocated extents (a persisted
// allocation table). It replaces any current state. Extents must be aligned,
// inside the capacity and pairwise disjoint; sizes are rounded up to the
// alignment. It returns the allocated extents in exts order, for Free.
func (a *Allocator) Restore(exts []Extent) ([]Extent, error) {
	order := make([]int, len(exts))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(x, y int) int { return cmp.Compare(exts[x].Offset, exts[y].Offset) })
	var end uint64
	for _, i := range order {
		e := exts[i]
		if e.Size == 0 || e.Offset&((1<<a.shift)-1) != 0 || e.Offset < end {
			return nil, fmt.Errorf("%w: offset %d size %d", ErrOverlap, e.Offset, e.Size)
		}
		u := a.units(e.Size)
		if e.Offset>>a.shift > a.capUnits || u > a.capUnits-(e.Offset>>a.shift) {
			return nil, fmt.Errorf("%w: offset %d size %d", ErrOverlap, e.Offset, e.Size)
		}
		end = (e.Offset>>a.shift + u) << a.shift
	}
	a.reset()
	out := make([]Extent, len(exts))
	if len(exts) == 0 {
		return out, nil
	}
	// Rebuild the physical chain from scratch.
	a.blocks = a.blocks[:0]
	a.flBitmap = 0
	a.slBitmap = [flCount]uint32{}
	for i := range a.heads {
		for j := range a.heads[i] {
			a.heads[i][j] = none
		}
	}
	prev := none
	var cur uint64
	link := func(b block) int32 {
		b.prevPhys, b.nextPhys = prev, none
		idx := a.newBlock(b)
		if prev != none {
			a.blocks[prev].nextPhys = idx
		}
		prev = idx
		return idx
	}
	for _, i := range order {
		off, u := exts[i].Offset>>a.shift, a.units(exts[i].Size)
		if off > cur {
			a.insertFree(link(block{off: cur, size: off - cur}))
		}
		idx := link(block{off: off, size: u})
		out[i] = Extent{Offset: off << a.shift, Size: u << a.shift, block: idx}
		a.used += u
		a.nAlloc++
		cur = off + u
	}
	if cur < a.capUnits {
		a.insertFree(link(block{off: cur, size: a.capUnits - cur}))
	}
	return out, nil
}

// Stats returns the exact accounting. LargestFree walks one size class.
func (a *Allocator) Stats() Stats {
	return Stats{
		Capacity:    a.capUnits << a.shift,
		Used:        a.used << a.shift,
		Free:        (a.capUnits - a.used) << a.shift,
		LargestFree: a.largestFree() << a.shift,
		Allocations: a.nAlloc,
		Alignment:   1 << a.shift,
	}
}

func (a *Allocator) largestFree() uint64 {
	if a.flBitmap == 0 {
		return 0
	}
	fl := 63 - bits.LeadingZeros64(a.flBitmap)
	sl := 31 - bits.LeadingZeros32(a.slBitmap[fl])
	var best uint64
	for i := a.heads[fl][sl]; i != none; i = a.blocks[i].nextFree {
		best = max(best, a.blocks[i].size)
	}
	return best
}

func (a *Allocator) newBlock(b block) int32 {
	b.prevFree, b.nextFree = none, none
	if n := len(a.spare); n > 0 {
		idx := a.spare[n-1]
		a.spare = a.spare[:n-1]
		a.blocks[idx] = b
		return idx
	}
	a.blocks = append(a.blocks, b)
	return int32(len(a.blocks) - 1)
}

// merge joins physically adjacent blocks l and r (l before r) into l and
// recycles r. Neither may be on a free list.
func (a *Allocator) merge(l, r int32) int32 {
	lb, rb := &a.blocks[l], &a.blocks[r]
	lb.size += rb.size
	lb.nextPhys = rb.nextPhys
	if rb.nextPhys != none {
		a.blocks[rb.nextPhys].prevPhys = l
	}
	lb.free = true
	// A recycled block must never pass Free's check: size 0 matches no
	// extent.
	rb.free, rb.size = true, 0
	a.spare = append(a.spare, r)
	return l
}

// mapping returns the (first, second) level class a free block of u units is
// filed under.
func mapping(u uint64) (int, int) {
	if u < slCount {
		return 0, int(u)
	}
	f := bits.Len64(u) - 1
	return f - slBits + 1, int((u >> (f - slBits)) & (slCount - 1))
}

// findFit returns a free block of at least u units, or none. It first looks
// in the classes whose every block fits (O(1)); failing that it walks the
// one class that may hold a fitting block among smaller ones, so Allocate
// fails only when no free extent is large enough.
func (a *Allocator) findFit(u uint64) int32 {
	if idx := a.goodFit(u); idx != none {
		return idx
	}
	fl, sl := mapping(u)
	for i := a.heads[fl][sl]; i != none; i = a.blocks[i].nextFree {
		if a.blocks[i].size >= u {
			return i
		}
	}
	return none
}

func (a *Allocator) goodFit(u uint64) int32 {
	if u >= slCount {
		round := uint64(1)<<(bits.Len64(u)-1-slBits) - 1
		if u+round < u {
			return none
		}
		u += round
	}
	fl, sl := mapping(u)
	slMap := a.slBitmap[fl] & (^uint32(0) << sl)
	if slMap == 0 {
		flMap := a.flBitmap & (^uint64(0) << (fl + 1))
		if fl+1 >= flCount || flMap == 0 {
			return none
		}
		fl = bits.TrailingZeros64(flMap)
		slMap = a.slBitmap[fl]
	}
	return a.heads[fl][bits.TrailingZeros32(slMap)]
}

func (a *Allocator) insertFree(idx int32) {
	b := &a.blocks[idx]
	b.free = true
	fl, sl := mapping(b.size)
	h := a.heads[fl][sl]
	b.prevFree, b.nextFree = none, h
	if h != none {
		a.blocks[h].prevFree = idx
	}
	a.heads[fl][sl] = idx
	a.flBitmap |= 1 << fl
	a.slBitmap[fl] |= 1 << sl
}

func (a *Allocator) removeFree(idx int32) {
	b := &a.blocks[idx]
	fl, sl := mapping(b.size)
	if b.prevFree != none {
		a.blocks[b.prevFree].nextFree = b.nextFree
	} else {
		a.heads[fl][sl] = b.nextFree
	}
	if b.nextFree != none {
		a.blocks[b.nextFree].prevFree = b.prevFree
	}
	b.prevFree, b.nextFree = none, none
	b.free = false
	if a.heads[fl][sl] == none {
		a.slBitmap[fl] &^= 1 << sl
		if a.slBitmap[fl] == 0 {
			a.flBitmap &^= 1 << fl
		}
	}
}

// check verifies every internal invariant; tests call it after each step.
func (a *Allocator) check() error {
	// Physical chain: starts at offset 0, contiguous, covers the capacity,
	// no two free neighbours.
	var head int32 = none
	live := 0
	spare := map[int32]bool{}
	for _, s := range a.spare {
		spare[s] = true
	}
	for i := range a.blocks {
		if spare[int32(i)] {
			continue
		}
		live++
		if a.blocks[i].prevPhys == none {
			if head != none {
				return fmt.Errorf("two chain heads %d and %d", head, i)
			}
			head = int32(i)
		}
	}
	var cur, used uint64
	n, nAlloc, nFree := 0, 0, 0
	prevFree := false
	prev := none
	for i := head; i != none; i = a.blocks[i].nextPhys {
		b := a.blocks[i]
		n++
		if n > live {
			return fmt.Errorf("physical chain loops")
		}
		if b.prevPhys != prev {
			return fmt.Errorf("block %d prevPhys %d, want %d", i, b.prevPhys, prev)
		}
		if b.off != cur || b.size == 0 {
			return fmt.Errorf("block %d at %d size %d, want offset %d", i, b.off, b.size, cur)
		}
		if b.free {
			if prevFree {
				return fmt.Errorf("adjacent free blocks at %d", b.off)
			}
			nFree++
		} else {
			nAlloc++
			used += b.size
		}
		prevFree = b.free
		cur += b.size
		prev = i
	}
	if n != live {
		return fmt.Errorf("chain has %d blocks, %d live", n, live)
	}
	if cur != a.capUnits {
		return fmt.Errorf("chain covers %d units, capacity %d", cur, a.capUnits)
	}
	if used != a.used || nAlloc != a.nAlloc {
		return fmt.Errorf("used %d/%d allocs %d/%d disagree", used, a.used, nAlloc, a.nAlloc)
	}
	// Free lists: every free block exactly once, in its class; bitmaps match.
	seen := 0
	for fl := range flCount {
		for sl := range slCount {
			h := a.heads[fl][sl]
			bit := a.slBitmap[fl]&(1<<sl) != 0
			if (h != none) != bit {
				return fmt.Errorf("class %d/%d head %d bitmap %v", fl, sl, h, bit)
			}
			p := none
			for i := h; i != none; i = a.blocks[i].nextFree {
				b := a.blocks[i]
				if !b.free || b.prevFree != p {
					return fmt.Errorf("free list %d/%d corrupt at %d", fl, sl, i)
				}
				if f, s := mapping(b.size); f != fl || s != sl {
					return fmt.Errorf("block size %d in class %d/%d, want %d/%d", b.size, fl, sl, f, s)
				}
				seen++
				p = i
			}
		}
		if (a.slBitmap[fl] != 0) != (a.flBitmap&(1<<fl) != 0) {
			return fmt.Errorf("first-level bitmap disagrees at %d", fl)
		}
	}
	if seen != nFree {
		return fmt.Errorf("free lists hold %d blocks, chain %d", seen, nFree)
	}
	return nil
}
