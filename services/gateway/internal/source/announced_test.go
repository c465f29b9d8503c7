package source

import (
	"fmt"
	"math/rand/v2"
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
	a := newAnnouncedSet()
	model := map[key]string{}
	for i := range 20000 {
		k := key{fmt.Sprint("t", rng.IntN(3)), fmt.Sprint("k", rng.IntN(40)), media[rng.IntN(2)]}
		switch r := rng.IntN(100); {
		case r < 50:
			g := fmt.Sprint("g", rng.IntN(3))
			a.store(k.tenant, k.key, k.medium, g)
			model[k] = g
		case r < 98:
			want := model[k]
			if got := a.remove(k.tenant, k.key, k.medium); got != want {
				t.Fatalf("op %d: remove %v = %q, want %q", i, k, got, want)
			}
			delete(model, k)
		default:
			a.clear(k.tenant)
			for mk := range model {
				if mk.tenant == k.tenant {
					delete(model, mk)
				}
			}
		}
		if a.size() != len(model) {
			t.Fatalf("op %d: size %d, want %d", i, a.size(), len(model))
		}
		n := 0
		for tn, ts := range a.tenants {
			if ts.len() == 0 {
				t.Fatalf("op %d: tenant %q kept with no objects", i, tn)
			}
			for mi := range ts.byMedium {
				for kk, g := range ts.byMedium[mi].all {
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

// TestObjectsCollisions drives objects with a hash of 2 bits, so most keys
// share their hash with another, against a plain map.
func TestObjectsCollisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var o objects
	model := map[string]string{}
	h := func(k string) uint64 { return uint64(k[len(k)-1]) % 4 }
	for i := range 20000 {
		k := fmt.Sprint("k", rng.IntN(12))
		switch rng.IntN(3) {
		case 0:
			g := fmt.Sprint("g", rng.IntN(3))
			_, had := model[k]
			if added := o.set(h(k), k, g); added == had {
				t.Fatalf("op %d: set %q added=%v, model had it: %v", i, k, added, had)
			}
			model[k] = g
		case 1:
			g, ok := o.del(h(k), k)
			if mg, mok := model[k]; g != mg || ok != mok {
				t.Fatalf("op %d: del %q = %q %v, want %q %v", i, k, g, ok, mg, mok)
			}
			delete(model, k)
		default:
			g, ok := o.get(h(k), k)
			if mg, mok := model[k]; g != mg || ok != mok {
				t.Fatalf("op %d: get %q = %q %v, want %q %v", i, k, g, ok, mg, mok)
			}
		}
		if o.len() != len(model) {
			t.Fatalf("op %d: len %d, want %d", i, o.len(), len(model))
		}
		seen := map[string]bool{}
		for k, g := range o.all {
			if seen[k] || model[k] != g {
				t.Fatalf("op %d: all yields %q=%q (seen %v), model %q", i, k, g, seen[k], model[k])
			}
			seen[k] = true
		}
	}
	if len(o.overflow) == 0 {
		t.Fatal("no key ever went to overflow")
	}
}
