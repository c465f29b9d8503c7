package announced

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestTableModel drives a table through splits, directory doublings and
// backward-shift deletions against a map: keys with real hashes, and a
// cluster of keys that all share one hash.
func TestTableModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	var ar arena
	var tb table
	model := map[string]uint64{} // key -> ref
	hash := func(k string) uint64 {
		if k[0] == 'c' {
			return slotHash(42) // the cluster
		}
		return slotHash(hashKey(k))
	}
	check := func(op int) {
		if tb.len() != len(model) {
			t.Fatalf("op %d: len %d, want %d", op, tb.len(), len(model))
		}
		n := 0
		for ref := range tb.all {
			n++
			k, _ := ar.record(ref)
			if model[string(k)] != ref {
				t.Fatalf("op %d: all yields %q at %d, model has %d", op, k, ref, model[string(k)])
			}
		}
		if n != len(model) {
			t.Fatalf("op %d: all yields %d entries, want %d", op, n, len(model))
		}
		for k, ref := range model {
			if s, i := tb.find(&ar, hash(k), k); i < 0 || s.slots[i].ref != ref {
				t.Fatalf("op %d: find %q = %d, want ref %d", op, k, i, ref)
			}
		}
		for _, s := range tb.dir {
			if s.n*4 > len(s.slots)*3 {
				t.Fatalf("op %d: a subtable holds %d in %d slots", op, s.n, len(s.slots))
			}
		}
	}
	for op := range 250000 {
		var k string
		if rng.IntN(50) == 0 {
			k = fmt.Sprint("c", rng.IntN(200))
		} else {
			k = fmt.Sprint("k", rng.IntN(60000+op/2))
		}
		h := hash(k)
		s, i := tb.find(&ar, h, k)
		ref, ok := model[k]
		if (i >= 0) != ok || (ok && s.slots[i].ref != ref) {
			t.Fatalf("op %d: find %q = %d, model has it: %v", op, k, i, ok)
		}
		if rng.IntN(3) > 0 {
			if !ok {
				ref := ar.put(k, "")
				tb.insert(h, ref)
				model[k] = ref
			}
		} else if ok {
			tb.delete(s, i)
			ar.release(ref)
			delete(model, k)
		}
		if op%50000 == 0 || op == 249999 {
			check(op)
		}
	}
	if tb.depth < 4 {
		t.Errorf("directory depth %d: the test did not split much", tb.depth)
	}
}
