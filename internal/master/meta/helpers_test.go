package meta

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newClock is the tests' fake clock, reading 2026-01-01 until advanced.
func newClock() *testutil.Clock {
	return testutil.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
}

type env struct {
	s   *Store
	c   *metatest.Cluster
	clk *testutil.Clock
}

func newEnv(t testing.TB, hosts, segs int, capacity uint64, cfg Config) *env {
	t.Helper()
	if cfg.BlankPool == 0 {
		// Blank reservations are off unless a test asks for them: a
		// background refill would otherwise change what the agents hold
		// at moments the test does not choose.
		cfg.BlankPool = -1
	}
	c := metatest.NewCluster(hosts, segs, capacity)
	clk := newClock()
	c.Agents.NowMs = func() int64 { return clk.Now().UnixMilli() }
	s, err := New(cfg, Deps{
		Registry: c.Reg, Agents: c.Agents, Now: clk.Now,
		Identity: cluster.Identity{MasterID: "m1", Epoch: 42, Keys: token.NewRing(0, nil)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &env{s: s, c: c, clk: clk}
}

// rkey is one readable (tenant, key, medium).
type rkey struct {
	tenant, key string
	medium      masterv1.Medium
}

// readableSet computes the readable set straight from the objects.
func readableSet(s *Store) map[rkey]bool {
	out := map[rkey]bool{}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for t, objs := range sh.tenants {
			for k, o := range objs.all() {
				for _, r := range o.replicas {
					if r.status == stComplete {
						out[rkey{s.tenants.get(t).name, k, masterv1.Medium(r.medium)}] = true
					}
				}
			}
		}
		sh.mu.Unlock()
	}
	return out
}

// follower applies the change log to a set, as a subscriber would.
type follower struct {
	rev uint64
	set map[rkey]bool
}

// fataler is what testing.TB and *rapid.T share.
type fataler interface {
	Helper()
	Fatalf(format string, args ...any)
}

func (f *follower) catchUp(t fataler, l *changelog.Log) {
	t.Helper()
	recs, _, _, err := l.Read(f.rev, 0, nil)
	if err != nil {
		t.Fatalf("read change log from %d: %v", f.rev, err)
	}
	for _, r := range recs {
		if r.Revision != f.rev+1 {
			t.Fatalf("revision gap: got %d after %d", r.Revision, f.rev)
		}
		f.rev = r.Revision
		switch r.Type {
		case changelog.Stored:
			f.set[rkey{r.Tenant, r.Key, r.Medium}] = true
		case changelog.Removed:
			delete(f.set, rkey{r.Tenant, r.Key, r.Medium})
		case changelog.Cleared:
			for k := range f.set {
				if k.tenant == r.Tenant {
					delete(f.set, k)
				}
			}
		}
	}
}

// checkInvariants asserts the three invariants of the issue: (a) the change
// log applied to a set gives exactly the readable set, (b) each tenant's
// quota usage equals the sum of its live objects' sizes, (c) the fake agents
// hold exactly the allocations the metadata references (no leak) and saw no
// double or unknown release. It also checks the per-segment accounting.
func checkInvariants(t fataler, e *env, f *follower) {
	t.Helper()
	f.catchUp(t, e.s.log)
	want := readableSet(e.s)
	if !maps.Equal(f.set, want) {
		t.Fatalf("(a) change log set differs from readable set:\n log: %v\nwant: %v", sortedKeys(f.set), sortedKeys(want))
	}
	type usage struct{ bytes, objects uint64 }
	sums := map[uint32]usage{}
	refs := map[metatest.Ref]bool{}
	placed := map[uint32]int64{}
	pending := 0
	for i := range e.s.shards {
		sh := &e.s.shards[i]
		sh.mu.Lock()
		groups, pinned := map[uint32]uint32{}, 0
		for tn, objs := range sh.tenants {
			if tp := e.s.tenants.get(tn); tp.id != tn || tp.retired.Load() {
				sh.mu.Unlock()
				t.Fatalf("(d) objects under tenant id %#x, which the table does not hold", tn)
			}
			for _, o := range objs.all() {
				if len(o.replicas) == 0 {
					sh.mu.Unlock()
					t.Fatalf("object %q has no replicas but is in the map", o.key)
				}
				u := sums[tn]
				u.bytes += o.size
				u.objects++
				sums[tn] = u
				groups[o.group]++
				if o.flags&flagSoftPin != 0 {
					pinned++
					if _, ok := sh.pins[o]; !ok {
						sh.mu.Unlock()
						t.Fatalf("object %q is soft pinned with no expiry", o.key)
					}
				}
				for _, r := range o.replicas {
					placed[r.seg] += int64(o.size)
					if r.pending {
						pending++
						continue
					}
					ref := metatest.Ref{Segment: e.s.segs.get(r.seg).id, ID: r.allocID}
					if refs[ref] {
						sh.mu.Unlock()
						t.Fatalf("(c) allocation %v referenced twice", ref)
					}
					refs[ref] = true
				}
			}
		}
		// The shard's group table and pin map hold exactly what its
		// objects reference: nothing leaks when objects go.
		if pinned != len(sh.pins) {
			sh.mu.Unlock()
			t.Fatalf("shard %d: %d soft-pinned objects, %d pin expiries held", i, pinned, len(sh.pins))
		}
		delete(groups, 0)
		if sh.groups.Len() != len(groups) {
			sh.mu.Unlock()
			t.Fatalf("shard %d: objects use %d groups, the table holds %d", i, len(groups), sh.groups.Len())
		}
		for g, n := range groups {
			if sh.groups.Refs(g) != n {
				sh.mu.Unlock()
				t.Fatalf("shard %d: group %q counted %d, used by %d objects", i, sh.groups.Name(g), sh.groups.Refs(g), n)
			}
		}
		sh.mu.Unlock()
	}
	for _, tn := range e.s.tenants.all() {
		q := tn.quota()
		if got := sums[tn.id]; q.UsedBytes != got.bytes || q.UsedObjects != got.objects {
			t.Fatalf("(b) tenant %q usage: got %d bytes %d objects, want %d bytes %d objects", tn.name, q.UsedBytes, q.UsedObjects, got.bytes, got.objects)
		}
		if q.UsedObjects == 0 && q.MaxBytes == 0 && q.MaxObjects == 0 && tn.pins.Load() == 0 {
			t.Fatalf("(d) tenant %q holds nothing and has no quota but was not dropped", tn.name)
		}
	}
	for i, se := range e.s.segs.all() {
		if got, want := se.placed.Load(), placed[uint32(i)]; got != want {
			t.Fatalf("segment %s placed bytes: got %d, want %d", se.id, got, want)
		}
	}
	if pending != 0 {
		t.Fatalf("%d replicas still pending between operations", pending)
	}
	// The blank reservations are the master's too, pooled or leased as
	// spares, and each segment's blank bytes are what its pools and
	// leases hold.
	leased := map[uint32]int64{}
	e.s.spares.mu.Lock()
	for k, l := range e.s.spares.by {
		ref := metatest.Ref{Segment: e.s.segs.get(k.seg).id, ID: k.alloc}
		if refs[ref] {
			e.s.spares.mu.Unlock()
			t.Fatalf("(c) spare %v is also a replica's allocation", ref)
		}
		refs[ref] = true
		leased[k.seg] += int64(l.size)
	}
	e.s.spares.mu.Unlock()
	for i, se := range e.s.segs.all() {
		bytes := leased[uint32(i)]
		se.blanks.mu.Lock()
		for size, p := range se.blanks.bySize {
			for _, b := range p.blanks {
				ref := metatest.Ref{Segment: se.id, ID: b.alloc}
				if refs[ref] {
					se.blanks.mu.Unlock()
					t.Fatalf("(c) blank %v is also a replica's allocation", ref)
				}
				refs[ref] = true
				bytes += int64(size)
			}
		}
		se.blanks.mu.Unlock()
		if got := se.blankBytes.Load(); got != bytes {
			t.Fatalf("segment %s blank bytes: got %d, pools hold %d", se.id, got, bytes)
		}
	}
	live := e.c.Agents.Live()
	for r := range live {
		if !refs[r] {
			t.Fatalf("(c) allocation %v leaked: live at the agent, unknown to the metadata", r)
		}
	}
	for r := range refs {
		if _, ok := live[r]; !ok {
			t.Fatalf("(c) metadata references allocation %v the agent does not hold", r)
		}
	}
	if p := e.c.Agents.Problems(); len(p) > 0 {
		t.Fatalf("(c) agent saw misuse: %v", p)
	}
	checkRecencyLists(t, e.s)
	listedPuts(t, e.s) // (d') the put lists hold exactly the puts in progress
}

// checkRecencyLists asserts that every shard's recency list holds exactly
// the shard's objects, each once, linked both ways, in non-decreasing
// access order.
func checkRecencyLists(t fataler, s *Store) {
	t.Helper()
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		err := recencyListErr(sh)
		sh.mu.Unlock()
		if err != "" {
			t.Fatalf("shard %d recency list: %s", i, err)
		}
	}
}

// recencyListErr describes what is wrong with sh's list ("" when nothing).
// sh must be locked.
func recencyListErr(sh *shard) string {
	inMaps := 0
	for _, objs := range sh.tenants {
		inMaps += objs.len()
	}
	seen := map[*object]bool{}
	var prev *object
	for o := sh.head; o != nil; prev, o = o, o.next {
		switch {
		case seen[o]:
			return fmt.Sprintf("object %q twice (a cycle)", o.key)
		case len(seen) >= inMaps:
			return fmt.Sprintf("longer than the %d objects in the maps", inMaps)
		case o.prev != prev:
			return fmt.Sprintf("object %q: prev link broken", o.key)
		case sh.getLocked(o.tenant, o.key) != o:
			return fmt.Sprintf("object %q listed but not in the maps", o.key)
		case prev != nil && prev.accessMs > o.accessMs:
			return fmt.Sprintf("object %q (access %d) after %q (access %d)", o.key, o.accessMs, prev.key, prev.accessMs)
		}
		seen[o] = true
	}
	if sh.tail != prev {
		return "tail is not the last object"
	}
	if len(seen) != inMaps {
		return fmt.Sprintf("%d objects listed, %d in the maps", len(seen), inMaps)
	}
	return ""
}

func sortedKeys(m map[rkey]bool) []string {
	var out []string
	for k := range m {
		out = append(out, fmt.Sprintf("%s/%s/%d", k.tenant, k.key, k.medium))
	}
	sort.Strings(out)
	return slices.Compact(out)
}

// completeOn counts COMPLETE replicas on a segment.
func completeOn(s *Store, segID string) int {
	idx, ok := s.segs.lookup(segID)
	if !ok {
		return 0
	}
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for _, objs := range sh.tenants {
			for _, o := range objs.all() {
				for _, r := range o.replicas {
					if r.seg == idx && r.status == stComplete {
						n++
					}
				}
			}
		}
		sh.mu.Unlock()
	}
	return n
}
