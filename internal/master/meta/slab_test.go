package meta

import (
	"testing"
	"unsafe"
)

func TestHugeSlab(t *testing.T) {
	var s hugeSlab[replica]
	a, b := s.take(3), s.take(2)
	if len(a) != 3 || cap(a) != 3 || len(b) != 2 || cap(b) != 2 {
		t.Fatalf("take: len/cap %d/%d and %d/%d, want 3/3 and 2/2", len(a), cap(a), len(b), cap(b))
	}
	a[2].allocID = 7
	if b[0].allocID != 0 {
		t.Fatal("runs overlap")
	}
	_ = append(a, replica{allocID: 9}) // no spare capacity: a copy
	if b[0].allocID != 0 {
		t.Fatal("append wrote into the next run")
	}
	// A run too big to carve is its own allocation.
	big := s.take(slabBlockBytes / int(unsafe.Sizeof(replica{})))
	if len(big) != slabBlockBytes/int(unsafe.Sizeof(replica{})) {
		t.Fatalf("big take: len %d", len(big))
	}
	// Past a block's end, a new block.
	n := 0
	for range 2 * slabBlockBytes / int(unsafe.Sizeof(replica{})) / 1000 {
		r := s.take(1000)
		for i := range r {
			if r[i] != (replica{}) {
				t.Fatal("take returned a non-zero value")
			}
			r[i].allocID = 1
		}
		n += len(r)
	}
	if n == 0 {
		t.Fatal("no runs")
	}
}

func TestRebuildAlloc(t *testing.T) {
	a := &rebuildAlloc{objs: &hugeSlab[object]{}, reps: &hugeSlab[replica]{}}
	seen := map[*object]bool{}
	for left := 10; left > 0; left-- {
		o := a.object(left)
		if seen[o] || o.size != 0 || o.key != "" || o.replicas != nil {
			t.Fatalf("object %p handed out twice or not zero", o)
		}
		seen[o] = true
		o.size = 1
		r := a.replicas(left)
		if len(r) != 0 || cap(r) != 1 {
			t.Fatalf("replicas: len %d cap %d, want 0 and 1", len(r), cap(r))
		}
		r = append(r, replica{allocID: uint64(left)})
		if r2 := a.replicas(left); cap(r2) == 1 && &r2[:1][0] == &r[0] {
			t.Fatal("replica arrays overlap")
		}
	}
}
