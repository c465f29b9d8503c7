package meta

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// recencyKeys is shard sh's recency list as tenant/key, least recent first.
func recencyKeys(s *Store, sh int) []string {
	shd := &s.shards[sh]
	shd.mu.Lock()
	defer shd.mu.Unlock()
	var out []string
	for o := shd.head; o != nil; o = o.next {
		out = append(out, s.tenants.get(o.tenant).name+"/"+o.key)
	}
	return out
}

func keysOf(prefix string, ks ...int) []string {
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = fmt.Sprintf("%sk%d", prefix, k)
	}
	return out
}

// TestRecencyListReadsAndReconcile follows one shard's recency list through
// completions, reads (each lease grant moves the object to its place by the
// new clock: the tail, or further in after the clock stepped back) and a
// rebuild by Reconcile from two agents whose sealed times come in no order
// (objects already there stay where their clocks put them; a newer version
// that wins takes its sealed time).
func TestRecencyListReadsAndReconcile(t *testing.T) {
	ctx := t.Context()
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 1})
	d := "default/"
	for i := range 6 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Preferred: []string{"seg-0-0"}})
		e.clk.Advance(time.Second)
	}
	if got, want := recencyKeys(e.s, 0), keysOf(d, 0, 1, 2, 3, 4, 5); !slices.Equal(got, want) {
		t.Fatalf("after puts: %v, want %v", got, want)
	}
	for _, k := range []string{"k3", "k0"} {
		if _, err := e.s.Get(ctx, GetSpec{Key: k}); err != nil {
			t.Fatal(err)
		}
		e.clk.Advance(time.Second)
	}
	e.s.BatchGet(ctx, []GetSpec{{Key: "k1"}, {Key: "nope"}})
	e.clk.Advance(time.Second)
	if got, want := recencyKeys(e.s, 0), keysOf(d, 2, 4, 5, 3, 0, 1); !slices.Equal(got, want) {
		t.Fatalf("after reads: %v, want %v", got, want)
	}
	// The clock steps back to between k4's and k5's completion: a read
	// then lands before k5, a completion too.
	e.clk.Advance(-time.Duration(e.clk.Now().UnixMilli()-sealedOf(t, e.s, "k4")-500) * time.Millisecond)
	if _, err := e.s.Get(ctx, GetSpec{Key: "k0"}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(100 * time.Millisecond)
	e.put(t, PutSpec{Key: "k6", Preferred: []string{"seg-0-0"}})
	if got, want := recencyKeys(e.s, 0), keysOf(d, 2, 4, 0, 6, 5, 3, 1); !slices.Equal(got, want) {
		t.Fatalf("after reads with the clock stepped back: %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	// Adoption: sealed times in no order, from two agents, between and
	// around the clocks of the objects already there. k2 comes in a newer
	// version (it wins and takes its sealed time), k5 in an older one (it
	// loses and stays where it is).
	access := map[string]int64{}
	for _, k := range []string{"k0", "k1", "k2", "k3", "k4", "k5", "k6"} {
		_ = e.s.withObject(DefaultTenant, k, func(_ *shard, o *object) error { access[k] = o.accessMs; return nil })
	}
	at := func(k string, d int64) int64 { return access[k] + d }
	a0 := []*masterv1.Allocation{
		alloc("seg-0-0", 901, "", "a3", 1, at("k3", 10)),
		alloc("seg-0-0", 902, "", "a0", 1, at("k2", -5000)),
		alloc("seg-0-0", 903, "", "k2", 99, at("k1", 2000)),
		alloc("seg-0-0", 904, "", "a2", 1, at("k5", -10)),
	}
	a1 := []*masterv1.Allocation{
		alloc("seg-1-0", 911, "", "a4", 1, at("k1", 1000)),
		alloc("seg-1-0", 912, "t", "a1", 1, at("k4", 10)),
		alloc("seg-1-0", 913, "", "k5", 98, at("k5", -60_000)),
		alloc("seg-1-0", 914, "", "a5", 1, at("k2", -6000)),
	}
	e.s.Reconcile(ctx, "agent-1", segsOf(e.c, "agent-1"), a1)
	e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), append(e.c.Agents.Table("agent-0"), a0...))
	want := []string{d + "a5", d + "a0", d + "k4", "t/a1", d + "k0", d + "k6", d + "a2", d + "k5", d + "k3", d + "a3", d + "k1", d + "a4", d + "k2"}
	if got := recencyKeys(e.s, 0); !slices.Equal(got, want) {
		t.Fatalf("after reconcile: %v, want %v", got, want)
	}
	checkRecencyLists(t, e.s)
}

func sealedOf(t *testing.T, s *Store, key string) int64 {
	t.Helper()
	var ms int64
	if err := s.withObject(DefaultTenant, key, func(_ *shard, o *object) error { ms = o.sealedMs; return nil }); err != nil {
		t.Fatal(err)
	}
	return ms
}

// TestRecencyListRebuildAtScale rebuilds a store of a few thousand objects
// from three agents' tables in random sealed order, then reads at random
// with a clock that goes back and forth, checking every list after each
// step.
func TestRecencyListRebuildAtScale(t *testing.T) {
	ctx := t.Context()
	rng := rand.New(rand.NewPCG(3, 4))
	e := newEnv(t, 3, 2, 1<<30, Config{Shards: 8})
	base := e.clk.Now().UnixMilli()
	// Each agent's table: its own objects, and for some of the others' the
	// same version (a second replica) or a newer one, which wins.
	tables := make([][]*masterv1.Allocation, 3)
	var keys []string
	id := uint64(1000)
	for h := range 3 {
		for i := range 1500 {
			k := fmt.Sprintf("h%d-%d", h, i)
			keys = append(keys, k)
			sealed := base - int64(rng.IntN(1_000_000))
			id++
			tables[h] = append(tables[h], alloc(fmt.Sprintf("seg-%d-%d", h, i%2), id, "", k, 1, sealed))
			other := (h + 1 + rng.IntN(2)) % 3
			switch rng.IntN(10) {
			case 0:
				id++
				tables[other] = append(tables[other], alloc(fmt.Sprintf("seg-%d-%d", other, i%2), id, "", k, 1, sealed))
			case 1:
				id++
				tables[other] = append(tables[other], alloc(fmt.Sprintf("seg-%d-%d", other, i%2), id, "", k, 2, sealed+int64(rng.IntN(2_000_000))-1_000_000))
			}
		}
	}
	for h, allocs := range tables {
		rng.Shuffle(len(allocs), func(i, j int) { allocs[i], allocs[j] = allocs[j], allocs[i] })
		agent := fmt.Sprintf("agent-%d", h)
		e.s.Reconcile(ctx, agent, segsOf(e.c, agent), allocs)
		checkRecencyLists(t, e.s)
	}
	if n, _, _ := e.s.Stats(); n != uint64(len(keys)) {
		t.Fatalf("%d objects after reconcile, want %d", n, len(keys))
	}
	for range 2000 {
		e.clk.Advance(time.Duration(rng.IntN(2000)-900) * time.Millisecond)
		k := keys[rng.IntN(len(keys))]
		if _, err := e.s.Get(ctx, GetSpec{Key: k}); err != nil {
			t.Fatal(err)
		}
	}
	checkRecencyLists(t, e.s)
}

// TestEvictPassWalksPrefixes checks what the recency lists are for: a pass
// that evicts a sixth of 20k objects over 256 shards visits a small
// multiple of what it evicts, not every object. (With ~12 victims a shard,
// the shard that reaches its budget first stops short of the runs' end, so
// the pass takes a second round, up to that end.)
func TestEvictPassWalksPrefixes(t *testing.T) {
	const n, size = 20_000, 1000
	// One segment at 95 % with n objects: eviction to 80 % takes ~16 %.
	e := newEnv(t, 1, 1, n*size*100/95, Config{})
	specs := make([]PutSpec, 0, 200)
	ends := make([]PutEndSpec, 0, 200)
	for lo := 0; lo < n; lo += 200 {
		specs, ends = specs[:0], ends[:0]
		for i := lo; i < lo+200; i++ {
			k := fmt.Sprintf("k%05d", i)
			specs = append(specs, PutSpec{Key: k, Size: size, ClientID: "w"})
			ends = append(ends, PutEndSpec{Key: k, ClientID: "w"})
		}
		for _, r := range e.s.BatchPutStart(t.Context(), specs) {
			if r.Err != nil {
				t.Fatal(r.Err)
			}
		}
		for _, err := range e.s.BatchPutEnd(t.Context(), ends) {
			if err != nil {
				t.Fatal(err)
			}
		}
		e.clk.Advance(time.Millisecond)
	}
	before, _, _ := e.s.Stats()
	e.s.evictOverHigh(t.Context())
	after, _, _ := e.s.Stats()
	st := e.s.lastPass
	evicted := int(before - after)
	t.Logf("evicted %d of %d objects, walked %d in %d rounds", evicted, before, st.walked, st.rounds)
	if evicted < n/10 || st.walked > 4*evicted || st.rounds > 2 {
		t.Fatalf("evicted %d of %d objects, walked %d in %d rounds: want 10+ %% evicted, at most 4× walked, in two rounds at most", evicted, before, st.walked, st.rounds)
	}
	// The oldest went: each batch of 200 shares a clock, so every batch
	// before the one at the boundary is gone and every one after it left.
	for i := range n {
		_, err := e.s.GetSize(t.Context(), DefaultTenant, fmt.Sprintf("k%05d", i))
		if gone := err != nil; i/200 != evicted/200 && gone != (i/200 < evicted/200) {
			t.Fatalf("object %d of %d: gone %v (err %v), want the oldest %d gone", i, n, gone, err, evicted)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestEvictWalksPastSoftPinned: soft-pinned objects at the head of a list
// do not count towards a shard's budget, so the walk goes on to the
// unpinned ones behind them (with one or two shards, the first round's
// budget is already the whole need and nothing checks the walk after).
func TestEvictWalksPastSoftPinned(t *testing.T) {
	for _, shards := range []int{1, 2} {
		t.Run(fmt.Sprint(shards), func(t *testing.T) {
			e := newEnv(t, 1, 1, 1<<20, Config{Shards: shards})
			for i := range 8 {
				e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100, SoftPin: i < 4, SoftPinTTL: time.Hour})
				e.clk.Advance(time.Second)
			}
			e.clk.Advance(time.Minute) // past the leases
			if n := e.s.evict(t.Context(), []evictTarget{{seg: 0, need: 150}}); n != 2 {
				t.Fatalf("evicted %d, want 2", n)
			}
			for i := range 8 {
				_, err := e.s.GetSize(t.Context(), DefaultTenant, fmt.Sprintf("k%d", i))
				if gone := err != nil; gone != (i == 4 || i == 5) {
					t.Fatalf("k%d gone %v, want k4 and k5 gone", i, gone)
				}
			}
			checkInvariants(t, e, &follower{set: map[rkey]bool{}})
		})
	}
}

// TestRelinkPlacesBatches: relinkLocked places a batch in order whether it
// lies among the list's newest accesses, its oldest (a lagging agent's
// registration) or across the whole list, with ties and duplicates, and
// the list stays whole and ordered.
func TestRelinkPlacesBatches(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 300 {
		sh := &shard{tenants: map[uint32]*objMap{0: newObjMap(0)}}
		n := rng.IntN(40)
		for i := range n {
			sh.insertLocked(&object{key: fmt.Sprint("a", i), accessMs: int64(rng.IntN(100))})
		}
		var xs []*object
		lo, span := int64(rng.IntN(120)-10), int64(1+rng.IntN(30))
		for i := range rng.IntN(20) {
			o := &object{key: fmt.Sprint("b", i), accessMs: lo + rng.Int64N(span)}
			sh.tenants[0].put(o) // in the maps, not yet in the list (mut.touchLater)
			xs = append(xs, o)
		}
		if len(xs) > 0 && rng.IntN(3) == 0 {
			xs = append(xs, xs[0]) // a duplicate
		}
		sh.relinkLocked(xs)
		var got int
		var prev *object
		for o := sh.head; o != nil; o = o.next {
			if o.prev != prev || prev != nil && prev.accessMs > o.accessMs {
				t.Fatalf("round %d: list out of order or badly linked at %s", round, o.key)
			}
			prev, got = o, got+1
		}
		if sh.tail != prev || got != sh.tenants[0].len() {
			t.Fatalf("round %d: %d objects listed (tail %v), want %d", round, got, sh.tail, sh.tenants[0].len())
		}
	}
}

// TestForShardsGroups: for batches below and above the counting sort's
// threshold, forShards calls f once per shard present, in shard order,
// with that shard's items in their batch order.
func TestForShardsGroups(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 1, 2, 255, 256, 1000, 5000} {
		items := make([]int, n)
		for i := range items {
			items[i] = rng.IntN(300)*10000 + i // shard*10000 + position
		}
		var got [][]int
		forShards(items, func(it int) int { return it / 10000 }, func(sh int, group []int) {
			got = append(got, slices.Clone(group))
		})
		want := map[int][]int{}
		for _, it := range items {
			want[it/10000] = append(want[it/10000], it)
		}
		prev := -1
		for _, g := range got {
			sh := g[0] / 10000
			if sh <= prev || !slices.Equal(g, want[sh]) {
				t.Fatalf("n=%d: group for shard %d: got %v, want %v (after shard %d)", n, sh, g, want[sh], prev)
			}
			prev = sh
		}
		if len(got) != len(want) {
			t.Fatalf("n=%d: %d groups, want %d", n, len(got), len(want))
		}
	}
}
