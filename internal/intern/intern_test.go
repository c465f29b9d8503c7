package intern

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestTableCountsAndFrees runs random interns and releases against a
// reference count and checks names, counts, the free list's reuse and
// that the table holds exactly the strings still referenced.
func TestTableCountsAndFrees(t *testing.T) {
	var tab Table
	rng := rand.New(rand.NewPCG(1, 2))
	type held struct {
		s string
		i uint32
	}
	var refs []held
	for step := range 20000 {
		if len(refs) > 0 && rng.IntN(2) == 0 {
			j := rng.IntN(len(refs))
			tab.Release(refs[j].i)
			refs[j] = refs[len(refs)-1]
			refs = refs[:len(refs)-1]
		} else {
			s := ""
			if rng.IntN(5) > 0 {
				s = fmt.Sprint("g", rng.IntN(100))
			}
			refs = append(refs, held{s, tab.Intern(s)})
		}
		count := map[string]uint32{}
		for _, h := range refs {
			if got := tab.Name(h.i); got != h.s {
				t.Fatalf("step %d: index %d names %q, want %q", step, h.i, got, h.s)
			}
			if h.s != "" {
				count[h.s]++
			}
		}
		if tab.Len() != len(count) {
			t.Fatalf("step %d: table holds %d strings, %d referenced", step, tab.Len(), len(count))
		}
		for _, h := range refs {
			if h.s != "" && tab.Refs(h.i) != count[h.s] {
				t.Fatalf("step %d: %q counted %d, referenced %d", step, h.s, tab.Refs(h.i), count[h.s])
			}
		}
	}
	if len(tab.names) > 101 {
		t.Fatalf("%d slots for at most 100 strings at once: freed slots are not reused", len(tab.names))
	}
}
