package announced

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// TestRangeMatchesAll: Range yields the entries All does (arena records,
// and keys too large for the arena), each once, without allocating, and
// stops when told to.
func TestRangeMatchesAll(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	a := New()
	for i := range 20000 {
		key := fmt.Sprint("key/", rng.IntN(30000))
		if i%1000 == 0 {
			key = strings.Repeat("x", maxRecord) + key // overflow
		}
		m := media[rng.IntN(2)]
		if rng.IntN(10) == 0 {
			a.Remove(fmt.Sprint("t", i%3), key, m)
			continue
		}
		a.Store(fmt.Sprint("t", i%3), key, m, fmt.Sprint("g", rng.IntN(3)))
	}
	type entry struct {
		tenant, key string
		m           kvevent.Medium
	}
	want := map[entry]string{}
	for e := range a.All() {
		want[entry{e.Tenant, e.Key, e.Medium}] = e.GroupID
	}
	if len(want) != a.Len() {
		t.Fatalf("All: %d entries, Len %d", len(want), a.Len())
	}
	got := map[entry]string{}
	a.Range(func(tenant string, m kvevent.Medium, key, group []byte) bool {
		e := entry{tenant, string(key), m}
		if _, dup := got[e]; dup {
			t.Fatalf("%v twice", e)
		}
		got[e] = string(group)
		return true
	})
	if len(got) != len(want) {
		t.Fatalf("Range: %d entries, want %d", len(got), len(want))
	}
	for e, g := range want {
		if got[e] != g {
			t.Fatalf("%v: group %q, want %q", e, got[e], g)
		}
	}

	n := 0
	a.Range(func(string, kvevent.Medium, []byte, []byte) bool { n++; return n < 100 })
	if n != 100 {
		t.Fatalf("Range went on after false: %d calls", n)
	}

	small := New()
	for i := range 10000 {
		small.Store("t", fmt.Sprint("k", i), kvevent.MediumCPU, "g")
	}
	var total int
	if allocs := testing.AllocsPerRun(5, func() {
		small.Range(func(_ string, _ kvevent.Medium, key, group []byte) bool {
			total += len(key) + len(group)
			return true
		})
	}); allocs > 2 {
		t.Fatalf("Range of 10000 entries: %v allocations", allocs)
	}
}
