package meta

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/rpcerr"
)

func TestCheapestRun(t *testing.T) {
	x := func(off, size uint64, ok, pinned bool, access int64, key string) extent {
		return extent{off: off, end: off + size, ok: ok, evictCand: evictCand{key: key, size: size, access: access, pinned: pinned}}
	}
	tests := []struct {
		name  string
		xs    []extent
		cap   uint64
		want  uint64
		run   []string // keys of the run; nil for an existing gap or none
		noRun bool
		cost  holeCost
	}{
		{name: "existing gap", cap: 100, want: 30, xs: []extent{x(0, 10, true, false, 1, "a"), x(50, 10, true, false, 1, "b")}},
		{name: "tail gap", cap: 100, want: 40, xs: []extent{x(0, 10, true, false, 1, "a"), x(20, 40, true, false, 1, "b")}},
		{name: "evict one to join gaps", cap: 100, want: 50, run: []string{"b"}, cost: holeCost{access: 5, bytes: 10},
			xs: []extent{x(0, 20, false, false, 1, "a"), x(40, 10, true, false, 5, "b"), x(70, 30, false, false, 1, "c")}},
		{name: "least recent run wins", cap: 100, want: 45, run: []string{"c"}, cost: holeCost{access: 2, bytes: 20},
			xs: []extent{x(0, 20, true, false, 9, "a"), x(30, 20, false, false, 1, "b"), x(60, 20, true, false, 2, "c")}},
		{name: "soft-pinned only as last resort", cap: 100, want: 45, run: []string{"c"}, cost: holeCost{access: 9, bytes: 20},
			xs: []extent{x(0, 20, true, true, 1, "a"), x(30, 20, false, false, 1, "b"), x(60, 20, true, false, 9, "c")}},
		{name: "blocked by unevictable", cap: 100, want: 60, noRun: true,
			xs: []extent{x(10, 20, true, false, 1, "a"), x(40, 20, false, false, 1, "b"), x(70, 20, true, false, 1, "c")}},
		{name: "two neighbours", cap: 100, want: 70, run: []string{"b", "c"}, cost: holeCost{access: 4, bytes: 40},
			xs: []extent{x(0, 10, false, false, 1, "a"), x(20, 20, true, false, 3, "b"), x(50, 20, true, false, 4, "c"), x(85, 15, false, false, 1, "d")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, run := cheapestRun(tt.xs, tt.cap, tt.want)
			if tt.noRun {
				if c.pinned >= 0 {
					t.Fatalf("got run %v cost %+v, want none", run, c)
				}
				return
			}
			var keys []string
			for _, e := range run {
				keys = append(keys, e.key)
			}
			if !slices.Equal(keys, tt.run) || c != tt.cost {
				t.Fatalf("got run %v cost %+v, want %v cost %+v", keys, c, tt.run, tt.cost)
			}
		})
	}
}

// TestPutStartOnFragmentedSegment: free bytes are plenty but scattered in
// small extents; the agent's report steers placement away, eviction makes
// a contiguous hole, and the retried put lands in it.
func TestPutStartOnFragmentedSegment(t *testing.T) {
	e := newEnv(t, 1, 1, 256<<10, Config{Shards: 4})
	e.c.Agents.Extents = true
	ctx := t.Context()
	for i := range 32 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%02d", i), Size: 8 << 10})
	}
	for i := 0; i < 32; i += 2 {
		if err := e.s.Remove(ctx, RemoveSpec{Key: fmt.Sprintf("k%02d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	// Lease most survivors so only a few scattered ones may go.
	for i := 1; i < 32; i += 2 {
		if i == 3 || i == 5 || i == 27 {
			continue
		}
		if _, err := e.s.Get(ctx, GetSpec{Key: fmt.Sprintf("k%02d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	// A heartbeat newer than the last free (one in the same millisecond
	// might have been sent before the agent applied it).
	e.clk.Advance(time.Millisecond)
	e.c.Agents.Report()
	if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.LargestFreeExtent != 8<<10 {
		t.Fatalf("largest free extent: got %d, want 8 KiB", sg.LargestFreeExtent)
	}
	before, _, _ := e.c.Agents.Calls()
	e.put(t, PutSpec{Key: "big", Size: 24 << 10})
	// The report steered the first round away (no Reserve); only the
	// retry after eviction reserved.
	if after, _, _ := e.c.Agents.Calls(); after-before != 1 {
		t.Fatalf("Reserve calls for big: got %d, want 1", after-before)
	}
	var off uint64
	_ = e.s.withObject(DefaultTenant, "big", func(_ *shard, o *object) error { off = o.replicas[0].offset; return nil })
	if off != 16<<10 {
		t.Fatalf("big placed at %d, want 16 KiB (the hole left by k02..k06)", off)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
	// With every survivor leased there is no hole to make.
	e.clk.Advance(time.Millisecond)
	e.c.Agents.Report()
	for i := 1; i < 32; i += 2 {
		_, _ = e.s.Get(ctx, GetSpec{Key: fmt.Sprintf("k%02d", i)})
	}
	_, err := e.s.PutStart(ctx, PutSpec{Key: "big2", Size: 100 << 10, ClientID: "w"})
	if got := rpcerr.Reason(err); got != "NO_AVAILABLE_HANDLE" {
		t.Fatalf("big2: got %q (%v), want NO_AVAILABLE_HANDLE", got, err)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestPutStartAfterEvictionWithStaleHeartbeat: a heartbeat the agent sent
// before it applied an eviction's release, received after the metadata
// removed the victims, must not hide the room the eviction made (it did:
// the put that evicted found "no segment has N free bytes", seen in e2e
// under load).
func TestPutStartAfterEvictionWithStaleHeartbeat(t *testing.T) {
	e := newEnv(t, 1, 1, 64<<10, Config{Shards: 4})
	for i := range 8 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 8 << 10})
	}
	e.clk.Advance(time.Millisecond)
	e.c.Agents.Report() // the agent reports the segment full
	e.c.Agents.BeforeRelease = func() {
		e.clk.Advance(time.Millisecond)
		e.c.Agents.Report() // still full: sent before the release
	}
	e.clk.Advance(time.Millisecond)
	e.put(t, PutSpec{Key: "new", Size: 8 << 10})
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}
