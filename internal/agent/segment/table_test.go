package segment

import (
	"maps"
	"slices"
	"testing"

	"pgregory.net/rapid"
)

// checkTable compares t with the model and checks the ring's invariants.
func checkTable(t *rapid.T, tb *table, model map[uint64]*entry) {
	if tb.len() != len(model) {
		t.Fatalf("len = %d, model %d", tb.len(), len(model))
	}
	n := uint64(len(tb.ring))
	if n == 0 || n&(n-1) != 0 {
		t.Fatalf("ring length %d is not a power of two", n)
	}
	inRing := 0
	for i, e := range tb.ring {
		if e == nil {
			continue
		}
		inRing++
		if e.id < tb.base || e.id-tb.base >= n || e.id&(n-1) != uint64(i) {
			t.Fatalf("id %d in slot %d of a ring of %d from base %d", e.id, i, n, tb.base)
		}
	}
	if inRing != tb.inRing {
		t.Fatalf("inRing = %d, counted %d", tb.inRing, inRing)
	}
	for id := range tb.old {
		if id >= tb.base {
			t.Fatalf("old id %d is not below base %d", id, tb.base)
		}
	}
	got := map[uint64]*entry{}
	for e := range tb.all() {
		if _, dup := got[e.id]; dup {
			t.Fatalf("all yields id %d twice", e.id)
		}
		got[e.id] = e
	}
	if !maps.Equal(got, model) {
		t.Fatalf("all = %v ids, model %v", slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(model)))
	}
}

// TestTableModel drives the table like a segment does (increasing new ids,
// deletes of any live id, lookups of any id, occasional jumps of the next id
// as after a restart) and compares it with a map.
func TestTableModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		tb := newTable()
		model := map[uint64]*entry{}
		next := uint64(1)
		// A restored segment starts with arbitrary ids below its next id.
		if rapid.Bool().Draw(t, "restored") {
			ids := rapid.SliceOfDistinct(rapid.Uint64Range(1, 5000), rapid.ID).Draw(t, "restoredIDs")
			slices.Sort(ids)
			for _, id := range ids {
				e := &entry{id: id}
				tb.put(e)
				model[id] = e
				next = max(next, id+1)
			}
			next += rapid.Uint64Range(0, 3000).Draw(t, "limitGap")
		}
		checkTable(t, &tb, model)
		for range rapid.IntRange(1, 400).Draw(t, "ops") {
			switch op := rapid.IntRange(0, 9).Draw(t, "op"); {
			case op < 4 || len(model) == 0:
				// A burst of new ids, as a Reserve batch.
				for range rapid.IntRange(1, 300).Draw(t, "burst") {
					e := &entry{id: next}
					tb.put(e)
					model[next] = e
					next++
				}
			case op < 8:
				// Release: mostly the oldest ids, sometimes any.
				ids := slices.Sorted(maps.Keys(model))
				k := rapid.IntRange(1, len(ids)).Draw(t, "releases")
				if rapid.Bool().Draw(t, "fifo") {
					ids = ids[:k]
				} else {
					ids = rapid.SliceOfNDistinct(rapid.SampledFrom(ids), 1, k, rapid.ID).Draw(t, "released")
				}
				for _, id := range ids {
					if !tb.del(id) {
						t.Fatalf("del(%d) of a live id = false", id)
					}
					delete(model, id)
				}
			default:
				id := rapid.Uint64Range(0, next+2000).Draw(t, "lookup")
				e, ok := tb.get(id)
				want, wantOK := model[id]
				if ok != wantOK || e != want {
					t.Fatalf("get(%d) = %v, %v; want %v, %v", id, e, ok, want, wantOK)
				}
				if !wantOK && tb.del(id) {
					t.Fatalf("del(%d) of an absent id = true", id)
				}
			}
			checkTable(t, &tb, model)
		}
		for id, want := range model {
			if e, ok := tb.get(id); !ok || e != want {
				t.Fatalf("get(%d) = %v, %v at the end", id, e, ok)
			}
		}
		// The ring stays within a small multiple of the live entries it
		// ever held (it only doubles when more than half full).
		if n := len(tb.ring); n > minRing && n > 4*int(next) {
			t.Fatalf("ring of %d slots for %d ids", n, next)
		}
	})
}

// TestTableSlidesLongLivedIDsOut keeps a few ids while many newer ones come
// and go: the ring must not grow with the span of ids.
func TestTableSlidesLongLivedIDsOut(t *testing.T) {
	tb := newTable()
	keep := map[uint64]*entry{}
	var live []uint64
	for id := uint64(1); id <= 1<<20; id++ {
		e := &entry{id: id}
		tb.put(e)
		if id%100_000 == 0 {
			keep[id] = e
			continue
		}
		live = append(live, id)
		if len(live) > 3000 {
			if !tb.del(live[0]) {
				t.Fatalf("del(%d) = false", live[0])
			}
			live = live[1:]
		}
	}
	if len(tb.ring) > 8192 {
		t.Fatalf("ring grew to %d slots for about %d live ids", len(tb.ring), 3000+len(keep))
	}
	for id, want := range keep {
		if e, ok := tb.get(id); !ok || e != want {
			t.Fatalf("long-lived id %d lost: %v, %v", id, e, ok)
		}
	}
	if tb.len() != len(live)+len(keep) {
		t.Fatalf("len = %d, want %d", tb.len(), len(live)+len(keep))
	}
}
