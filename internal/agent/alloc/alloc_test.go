package alloc

import (
	"errors"
	"math"
	"math/big"
	"math/rand/v2"
	"slices"
	"testing"

	"pgregory.net/rapid"
)

func mustNew(t testing.TB, capacity, align uint64) *Allocator {
	t.Helper()
	a, err := New(capacity, align)
	if err != nil {
		t.Fatalf("New(%d, %d): %v", capacity, align, err)
	}
	return a
}

func TestNewRejectsBadParams(t *testing.T) {
	tests := []struct {
		name            string
		capacity, align uint64
	}{
		{"zero alignment", 1 << 20, 0},
		{"alignment not power of two", 1 << 20, 48},
		{"capacity below alignment", 32, 64},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.capacity, tc.align); err == nil {
				t.Fatalf("New(%d, %d) = nil error, want error", tc.capacity, tc.align)
			}
		})
	}
}

func TestAllocateAlignsAndAccounts(t *testing.T) {
	tests := []struct {
		name     string
		align    uint64
		size     uint64
		wantSize uint64
	}{
		{"exact", 64, 128, 128},
		{"rounds up", 64, 65, 128},
		{"one byte", 64, 1, 64},
		{"disk page", 4096, 5000, 8192},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := mustNew(t, 1<<20, tc.align)
			e, err := a.Allocate(tc.size)
			if err != nil {
				t.Fatalf("Allocate(%d): %v", tc.size, err)
			}
			if e.Size != tc.wantSize || e.Offset%tc.align != 0 {
				t.Fatalf("Allocate(%d) = %+v, want size %d aligned to %d", tc.size, e, tc.wantSize, tc.align)
			}
			if got := a.ExtentSize(tc.size); got != tc.wantSize {
				t.Fatalf("ExtentSize(%d) = %d, want %d", tc.size, got, tc.wantSize)
			}
			st := a.Stats()
			if st.Used != tc.wantSize || st.Free != 1<<20-tc.wantSize || st.Allocations != 1 {
				t.Fatalf("Stats = %+v, want used %d", st, tc.wantSize)
			}
			if err := a.check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestAllocateErrors(t *testing.T) {
	a := mustNew(t, 4096, 64)
	if _, err := a.Allocate(0); !errors.Is(err, ErrInvalidSize) {
		t.Fatalf("Allocate(0) err = %v, want ErrInvalidSize", err)
	}
	if _, err := a.Allocate(4097); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Allocate(4097) err = %v, want ErrNoSpace", err)
	}
	if _, err := a.Allocate(^uint64(0)); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Allocate(max) err = %v, want ErrNoSpace", err)
	}
	e, err := a.Allocate(4096)
	if err != nil {
		t.Fatalf("Allocate(whole): %v", err)
	}
	if _, err := a.Allocate(64); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Allocate on full err = %v, want ErrNoSpace", err)
	}
	for name, bad := range map[string]Extent{
		"inside":    {Offset: e.Offset + 64, Size: e.Size - 64, block: e.block},
		"unaligned": {Offset: 3, Size: e.Size, block: e.block},
		"shorter":   {Offset: e.Offset, Size: 64, block: e.block},
		"by hand":   {Offset: e.Offset, Size: e.Size, block: 7},
		"negative":  {Offset: e.Offset, Size: e.Size, block: -1},
	} {
		if err := a.Free(bad); !errors.Is(err, ErrNotAllocated) {
			t.Fatalf("Free(%s %+v) err = %v, want ErrNotAllocated", name, bad, err)
		}
	}
	if err := a.Free(e); err != nil {
		t.Fatalf("Free: %v", err)
	}
	if err := a.Free(e); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("double Free err = %v, want ErrNotAllocated", err)
	}
}

// TestHugeSizes: sizes near 2^64 (a uint64 from the wire, or from a
// damaged journal) are refused, never rounded through a wrap into a small
// or empty extent.
func TestHugeSizes(t *testing.T) {
	a := mustNew(t, 1<<20, 64)
	for _, size := range []uint64{1<<20 + 1, 1 << 62, 1 << 63, math.MaxUint64 - 63, math.MaxUint64 - 62, math.MaxUint64} {
		if _, err := a.Allocate(size); !errors.Is(err, ErrTooLarge) || !errors.Is(err, ErrNoSpace) {
			t.Errorf("Allocate(%d) err = %v, want ErrTooLarge (an ErrNoSpace)", size, err)
		}
	}
	for _, tc := range []struct{ size, want uint64 }{
		{1, 64}, {64, 64}, {65, 128},
		{math.MaxUint64 - 63, math.MaxUint64 - 63}, // 2^64-64 is aligned
		{math.MaxUint64 - 62, math.MaxUint64},
		{math.MaxUint64, math.MaxUint64},
	} {
		if got := a.ExtentSize(tc.size); got != tc.want {
			t.Errorf("ExtentSize(%d) = %d, want %d", tc.size, got, tc.want)
		}
	}
	for _, e := range []Extent{
		{Offset: 0, Size: math.MaxUint64},
		{Offset: 0, Size: math.MaxUint64 - 62},
		{Offset: 1<<64 - 64, Size: 64},
		{Offset: 1 << 20, Size: 64},
		{Offset: 1<<20 - 64, Size: 65},
	} {
		if _, err := a.Restore([]Extent{e}); !errors.Is(err, ErrOverlap) {
			t.Errorf("Restore(%+v) err = %v, want ErrOverlap", e, err)
		}
		if err := a.check(); err != nil {
			t.Fatalf("after the refused Restore(%+v): %v", e, err)
		}
	}
	if e, err := a.Allocate(1 << 20); err != nil || e.Size != 1<<20 {
		t.Fatalf("Allocate(capacity) after the refusals = %+v, %v", e, err)
	}
}

// TestDoubleFreeAfterMerge frees an extent whose block was then merged
// into a neighbour and recycled: the stale extent must be refused.
func TestDoubleFreeAfterMerge(t *testing.T) {
	a := mustNew(t, 64*4, 64)
	var exts []Extent
	for range 4 {
		e, err := a.Allocate(64)
		if err != nil {
			t.Fatal(err)
		}
		exts = append(exts, e)
	}
	// exts[2] is freed alone, then exts[1] merges it (it is the right
	// neighbour and goes to the spare list).
	for _, i := range []int{2, 1} {
		if err := a.Free(exts[i]); err != nil {
			t.Fatal(err)
		}
	}
	for _, i := range []int{2, 1} {
		if err := a.Free(exts[i]); !errors.Is(err, ErrNotAllocated) {
			t.Fatalf("second Free(%+v) err = %v, want ErrNotAllocated", exts[i], err)
		}
		if err := a.check(); err != nil {
			t.Fatal(err)
		}
	}
	if st := a.Stats(); st.Allocations != 2 || st.Used != 128 {
		t.Fatalf("Stats = %+v, want the two other extents", st)
	}
}

func TestFreeCoalesces(t *testing.T) {
	a := mustNew(t, 64*10, 64)
	var exts []Extent
	for range 10 {
		e, err := a.Allocate(64)
		if err != nil {
			t.Fatal(err)
		}
		exts = append(exts, e)
	}
	// Free every other extent: largest free stays one unit.
	for i := 0; i < 10; i += 2 {
		if err := a.Free(exts[i]); err != nil {
			t.Fatal(err)
		}
	}
	if got := a.Stats().LargestFree; got != 64 {
		t.Fatalf("LargestFree = %d, want 64", got)
	}
	// Freeing the rest coalesces into one extent of the whole capacity.
	for i := 1; i < 10; i += 2 {
		if err := a.Free(exts[i]); err != nil {
			t.Fatal(err)
		}
		if err := a.check(); err != nil {
			t.Fatal(err)
		}
	}
	if st := a.Stats(); st.LargestFree != 640 || st.Used != 0 || st.Allocations != 0 {
		t.Fatalf("Stats = %+v, want one free extent of 640", st)
	}
	if len(a.blocks)-len(a.spare) != 1 {
		t.Fatalf("live blocks = %d, want 1", len(a.blocks)-len(a.spare))
	}
}

func TestGoodFitNeverFails(t *testing.T) {
	// A request fits whenever a free extent at least as large as its class
	// bound exists; with one free extent of exactly the size it must succeed.
	for _, size := range []uint64{64, 31 * 64, 32 * 64, 33 * 64, 1000 * 64, 4095 * 64} {
		a := mustNew(t, size, 64)
		if _, err := a.Allocate(size); err != nil {
			t.Fatalf("Allocate(%d) of a %d segment: %v", size, size, err)
		}
	}
}

func TestRestore(t *testing.T) {
	a := mustNew(t, 1<<16, 64)
	in := []Extent{{Offset: 4096, Size: 100}, {Offset: 0, Size: 64}, {Offset: 59968, Size: 5568}}
	got, err := a.Restore(in)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if len(got) != len(in) || got[0].Offset != 4096 || got[0].Size != 128 || got[1].Offset != 0 || got[1].Size != 64 || got[2].Size != 5568 {
		t.Fatalf("Restore = %+v, want the extents of %+v in order, sizes rounded", got, in)
	}
	if err := a.check(); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Used != 64+128+5568 || st.Allocations != 3 {
		t.Fatalf("Stats after Restore = %+v", st)
	}
	for _, e := range got {
		if err := a.Free(e); err != nil {
			t.Fatalf("Free(%+v) after Restore: %v", e, err)
		}
	}
	if st := a.Stats(); st.Used != 0 || st.LargestFree != 1<<16 {
		t.Fatalf("Stats after freeing = %+v", st)
	}

	bad := [][]Extent{
		{{Offset: 0, Size: 128}, {Offset: 64, Size: 64}},
		{{Offset: 3, Size: 64}},
		{{Offset: 1<<16 - 64, Size: 128}},
		{{Offset: 1 << 20, Size: 64}},
		{{Offset: 0, Size: 0}},
	}
	for _, exts := range bad {
		if _, err := a.Restore(exts); !errors.Is(err, ErrOverlap) {
			t.Fatalf("Restore(%v) err = %v, want ErrOverlap", exts, err)
		}
	}
}

// model is the reference the property test compares against: the set of
// allocated extents.
type model map[uint64]uint64

func (m model) overlaps(e Extent) bool {
	for off, sz := range m {
		if e.Offset < off+sz && off < e.Offset+e.Size {
			return true
		}
	}
	return false
}

func TestPropertyNeverOverlapNeverLeak(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		align := uint64(1) << rapid.IntRange(0, 12).Draw(t, "alignShift")
		capacity := rapid.Uint64Range(align, align*4096).Draw(t, "capacity")
		a, err := New(capacity, align)
		if err != nil {
			t.Fatal(err)
		}
		m := model{}
		exts := map[uint64]Extent{} // live extents by offset
		var freed []Extent          // extents freed already
		var used uint64
		ops := rapid.IntRange(1, 300).Draw(t, "ops")
		for range ops {
			if len(freed) > 0 && rapid.IntRange(0, 9).Draw(t, "refree") == 0 {
				// Freeing a freed extent again is refused, unless its
				// block now holds a live allocation of the same range.
				stale := rapid.SampledFrom(freed).Draw(t, "stale")
				if live, ok := exts[stale.Offset]; ok && live == stale {
					continue
				}
				if err := a.Free(stale); !errors.Is(err, ErrNotAllocated) {
					t.Fatalf("Free of freed %+v err = %v, want ErrNotAllocated", stale, err)
				}
			} else if len(m) == 0 || rapid.Bool().Draw(t, "alloc") {
				size := rapid.Uint64Range(1, capacity/4+1).Draw(t, "size")
				e, err := a.Allocate(size)
				if err != nil {
					if !errors.Is(err, ErrNoSpace) {
						t.Fatalf("Allocate(%d): %v", size, err)
					}
					// Allocate fails only when no free extent is large enough.
					if lf := a.Stats().LargestFree; lf >= a.ExtentSize(size) {
						t.Fatalf("Allocate(%d) = ErrNoSpace with largest free %d", size, lf)
					}
					continue
				}
				if e.Size != a.ExtentSize(size) || e.Offset%align != 0 || e.Offset+e.Size > a.Capacity() {
					t.Fatalf("Allocate(%d) = %+v: bad extent", size, e)
				}
				if m.overlaps(e) {
					t.Fatalf("Allocate(%d) = %+v overlaps a live extent", size, e)
				}
				m[e.Offset] = e.Size
				exts[e.Offset] = e
				used += e.Size
			} else {
				offs := make([]uint64, 0, len(m))
				for o := range m {
					offs = append(offs, o)
				}
				slices.Sort(offs)
				off := rapid.SampledFrom(offs).Draw(t, "free")
				if err := a.Free(exts[off]); err != nil {
					t.Fatalf("Free(%d): %v", off, err)
				}
				used -= m[off]
				freed = append(freed, exts[off])
				delete(m, off)
				delete(exts, off)
			}
			if err := a.check(); err != nil {
				t.Fatal(err)
			}
			st := a.Stats()
			if st.Used != used || st.Allocations != len(m) || st.Free != st.Capacity-used {
				t.Fatalf("Stats = %+v, want used %d allocations %d", st, used, len(m))
			}
		}
		for off := range m {
			if err := a.Free(exts[off]); err != nil {
				t.Fatalf("final Free(%d): %v", off, err)
			}
		}
		if st := a.Stats(); st.Used != 0 || st.LargestFree != st.Capacity {
			t.Fatalf("leak after freeing everything: %+v", st)
		}
	})
}

// FuzzAllocator drives the allocator with an arbitrary operation sequence
// (two bytes per op: kind+size) and checks every invariant after each op.
func FuzzAllocator(f *testing.F) {
	f.Add([]byte{0, 1, 0, 2, 1, 0, 0, 200, 1, 1})
	f.Add([]byte{0, 255, 0, 255, 0, 255, 0, 255, 1, 2, 1, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		a := mustNew(t, 64*1024, 64)
		var live []Extent
		for i := 0; i+1 < len(ops); i += 2 {
			kind, arg := ops[i], uint64(ops[i+1])
			switch {
			case kind%3 != 2:
				e, err := a.Allocate(arg*97 + 1)
				if err == nil {
					live = append(live, e)
				} else if !errors.Is(err, ErrNoSpace) {
					t.Fatalf("Allocate: %v", err)
				}
			case len(live) > 0:
				j := int(arg) % len(live)
				if err := a.Free(live[j]); err != nil {
					t.Fatalf("Free(%+v): %v", live[j], err)
				}
				live = slices.Delete(live, j, j+1)
			default:
				if err := a.Free(Extent{Offset: arg * 64, Size: 64}); !errors.Is(err, ErrNotAllocated) {
					t.Fatalf("Free of nothing err = %v", err)
				}
			}
			if err := a.check(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// BenchmarkAllocFree measures allocate/free pairs against a segment that is
// about half full of mixed-size live allocations, the steady state of a cache.
func BenchmarkAllocFree(b *testing.B) {
	for _, bc := range []struct {
		name string
		size uint64
	}{{"4KiB", 4 << 10}, {"64KiB", 64 << 10}, {"mixed", 0}} {
		b.Run(bc.name, func(b *testing.B) {
			a := mustNew(b, 4<<30, MemoryAlignment)
			r := rand.New(rand.NewPCG(1, 2))
			sizeOf := func() uint64 {
				if bc.size != 0 {
					return bc.size
				}
				return 1 + r.Uint64N(256<<10)
			}
			var live []Extent
			for a.Stats().Used < 2<<30 {
				e, err := a.Allocate(sizeOf())
				if err != nil {
					b.Fatal(err)
				}
				live = append(live, e)
			}
			// Free a random third to fragment.
			for i := 0; i < len(live); i += 3 {
				if err := a.Free(live[i]); err != nil {
					b.Fatal(err)
				}
			}
			sizes := make([]uint64, 1024)
			for i := range sizes {
				sizes[i] = sizeOf()
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				e, err := a.Allocate(sizes[i&1023])
				if err != nil {
					b.Fatal(err)
				}
				if err := a.Free(e); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
		})
	}
}

// FuzzExtentSize checks the rounding against exact arithmetic: the extent
// is the size rounded up to the alignment, or MaxUint64 when that needs
// more than 64 bits; Allocate refuses any size above the capacity.
func FuzzExtentSize(f *testing.F) {
	f.Add(uint64(1), uint8(6))
	f.Add(uint64(math.MaxUint64), uint8(12))
	f.Add(uint64(math.MaxUint64-4094), uint8(12))
	var as [20]*Allocator // one per alignment; the checks change nothing
	for i := range as {
		as[i] = mustNew(f, 1<<21, 1<<i)
	}
	f.Fuzz(func(t *testing.T, size uint64, shift uint8) {
		shift %= 20
		a := as[shift]
		want := new(big.Int).SetUint64(size)
		align := big.NewInt(1 << shift)
		want.Add(want, new(big.Int).Sub(align, big.NewInt(1)))
		want.Div(want, align)
		want.Mul(want, align)
		if !want.IsUint64() {
			want.SetUint64(math.MaxUint64)
		}
		if got := a.ExtentSize(size); got != want.Uint64() {
			t.Fatalf("ExtentSize(%d) with alignment %d = %d, want %d", size, 1<<shift, got, want.Uint64())
		}
		if size > a.Capacity() {
			if _, err := a.Allocate(size); !errors.Is(err, ErrTooLarge) {
				t.Fatalf("Allocate(%d) over the capacity %d = %v, want ErrTooLarge", size, a.Capacity(), err)
			}
		}
	})
}
