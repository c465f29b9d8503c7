package announced

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// TestAnnouncedSetMatchesModel applies random stores, removes and clears
// to the announced set and to a plain map, and compares them after each.
func TestAnnouncedSetMatchesModel(t *testing.T) {
	type key struct {
		tenant, key string
		medium      kvevent.Medium
	}
	rng := rand.New(rand.NewPCG(3, 4))
	a := New()
	model := map[key]string{}
	for i := range 5000 {
		k := key{fmt.Sprint("t", rng.IntN(3)), fmt.Sprint("k", rng.IntN(40)), media[rng.IntN(2)]}
		switch r := rng.IntN(100); {
		case r < 50:
			g := fmt.Sprint("g", rng.IntN(3))
			a.Store(k.tenant, k.key, k.medium, g)
			model[k] = g
		case r < 98:
			want := model[k]
			if got := a.Remove(k.tenant, k.key, k.medium); got != want {
				t.Fatalf("op %d: remove %v = %q, want %q", i, k, got, want)
			}
			delete(model, k)
		default:
			a.Clear(k.tenant)
			for mk := range model {
				if mk.tenant == k.tenant {
					delete(model, mk)
				}
			}
		}
		if a.Len() != len(model) {
			t.Fatalf("op %d: size %d, want %d", i, a.Len(), len(model))
		}
		n := 0
		for tn, ts := range a.tenants {
			if ts.len() == 0 {
				t.Fatalf("op %d: tenant %q kept with no objects", i, tn)
			}
			for mi := range ts.byMedium {
				for kk, g := range ts.byMedium[mi].all(&a.ar) {
					n++
					if mg, ok := model[key{tn, kk, media[mi]}]; !ok || mg != g {
						t.Fatalf("op %d: set has %s/%s/%v=%q, model %q (%v)", i, tn, kk, media[mi], g, mg, ok)
					}
				}
			}
		}
		if n != len(model) {
			t.Fatalf("op %d: %d entries, want %d", i, n, len(model))
		}
	}
}

// TestObjectsModel drives four objects tables sharing one arena against
// plain maps, with a hash of 2 bits (most keys share their hash with
// another), keys and groups of many sizes (records of many size classes,
// groups that change class, records too large for the arena), and checks
// every table after each operation.
func TestObjectsModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var ar arena
	var tables [4]objects
	var models [4]map[string]string
	for i := range models {
		models[i] = map[string]string{}
	}
	h := func(k string) uint64 { return uint64(k[0]) % 4 }
	str := func(prefix string, id int) string {
		n := rng.IntN(40)
		if rng.IntN(200) == 0 {
			n = maxRecord + rng.IntN(100) // too large for the arena
		}
		return fmt.Sprint(id%10, prefix, id, strings.Repeat("x", n))
	}
	keys := make([]string, 30)
	for i := range keys {
		keys[i] = str("k", i)
	}
	for i := range 30000 {
		ti := rng.IntN(len(tables))
		o, model := &tables[ti], models[ti]
		k := keys[rng.IntN(len(keys))]
		switch rng.IntN(3) {
		case 0:
			g := ""
			if rng.IntN(3) > 0 {
				g = str("g", rng.IntN(4))
			}
			_, had := model[k]
			if added := o.set(&ar, h(k), k, g); added == had {
				t.Fatalf("op %d: set %.20q added=%v, model had it: %v", i, k, added, had)
			}
			model[k] = g
		case 1:
			g, ok := o.del(&ar, h(k), k)
			if mg, mok := model[k]; g != mg || ok != mok {
				t.Fatalf("op %d: del %.20q = %.20q %v, want %.20q %v", i, k, g, ok, mg, mok)
			}
			delete(model, k)
		default:
			g, ok := o.get(&ar, h(k), k)
			if mg, mok := model[k]; g != mg || ok != mok {
				t.Fatalf("op %d: get %.20q = %.20q %v, want %.20q %v", i, k, g, ok, mg, mok)
			}
		}
		for ti := range tables {
			o, model := &tables[ti], models[ti]
			if o.len() != len(model) {
				t.Fatalf("op %d: table %d len %d, want %d", i, ti, o.len(), len(model))
			}
			seen := map[string]bool{}
			for k, g := range o.all(&ar) {
				if mg, ok := model[k]; seen[k] || !ok || mg != g {
					t.Fatalf("op %d: table %d yields %.20q=%.20q (seen %v), model %.20q %v", i, ti, k, g, seen[k], mg, ok)
				}
				seen[k] = true
			}
		}
	}
	overflowed := 0
	for _, o := range tables {
		overflowed += len(o.overflow)
	}
	if overflowed == 0 {
		t.Error("no key ever went to overflow")
	}
	if len(ar.chunks) != 1 {
		t.Errorf("the arena has %d chunks for at most %d small records: released records are not reused", len(ar.chunks), 4*len(keys))
	}
}

// TestArenaReuse: records released are reused by records of their size,
// so a set that stores and removes keys of one size does not grow.
func TestArenaReuse(t *testing.T) {
	a := New()
	for round := range 10 {
		for i := range 5000 {
			a.Store("t", fmt.Sprintf("bench/%06d/%08d", round, i), kvevent.MediumCPU, "")
		}
		for i := range 5000 {
			a.Remove("t", fmt.Sprintf("bench/%06d/%08d", round, i), kvevent.MediumCPU)
		}
	}
	if a.Len() != 0 || len(a.tenants) != 0 {
		t.Fatalf("size %d, %d tenants after removing everything", a.Len(), len(a.tenants))
	}
	if want := 5000*recordSize(21, 0)/chunkSize + 1; len(a.ar.chunks) > want {
		t.Errorf("arena has %d chunks after 10 rounds of 5000 records, want at most %d", len(a.ar.chunks), want)
	}
}

// TestClone: a clone holds the same entries (enough to split subtables,
// so the directory's sharing is exercised) and is independent: changing
// either afterwards, arena reuse included, leaves the other as it was.
func TestClone(t *testing.T) {
	a := New()
	for i := range 20000 {
		a.Store(fmt.Sprint("t", i%3), fmt.Sprintf("key/%06d", i), media[i%2], fmt.Sprint("g", i%5))
	}
	entries := func(s *Set) map[string]string {
		out := map[string]string{}
		for ev := range s.All() {
			out[fmt.Sprintf("%s/%s/%v", ev.Tenant, ev.Key, ev.Medium)] = ev.GroupID
		}
		return out
	}
	want := entries(a)
	c := a.Clone()
	if got := entries(c); !maps.Equal(got, want) || c.Len() != a.Len() {
		t.Fatalf("clone has %d entries (Len %d), want %d", len(got), c.Len(), len(want))
	}
	for i := range 10000 { // removals free records; the stores reuse them
		a.Remove(fmt.Sprint("t", i%3), fmt.Sprintf("key/%06d", i), media[i%2])
		a.Store("t0", fmt.Sprintf("new/%06d", i), kvevent.MediumCPU, "other")
	}
	c.Clear("t1")
	if got := entries(a); len(got) != len(want) {
		t.Fatalf("original has %d entries after its own changes, want %d", len(got), len(want))
	}
	for k, g := range entries(c) {
		if want[k] != g {
			t.Fatalf("clone entry %s = %q changed, want %q", k, g, want[k])
		}
	}
	for k := range want {
		if strings.HasPrefix(k, "t1/") {
			continue
		}
		if g, ok := c.Get(k[:2], k[3:len(k)-len("/cpu")], kvevent.MediumCPU); strings.HasSuffix(k, "/cpu") && (!ok || g != want[k]) {
			t.Fatalf("clone lost %s after the original changed", k)
		}
	}
}
