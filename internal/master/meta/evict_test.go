package meta

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
)

func TestEvictionOrder(t *testing.T) {
	// One 1000-byte segment, 100-byte objects: 9 objects reach the 90 %
	// watermark; eviction goes down to 80 %.
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	ctx := t.Context()
	for i := range 9 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100, HardPin: i == 0, SoftPin: i == 1})
		e.clk.Advance(time.Second)
	}
	// k2 is leased (read now); k3 was read long ago, which refreshes its
	// clock past k4..k8's completion.
	e.clk.Advance(-20 * time.Second)
	if _, err := e.s.Get(ctx, GetSpec{Key: "k3"}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(40 * time.Second)
	if _, err := e.s.Get(ctx, GetSpec{Key: "k2"}); err != nil {
		t.Fatal(err)
	}
	e.s.evictOverHigh(ctx)
	gone := func() []string {
		var out []string
		for i := range 9 {
			if _, err := e.s.GetSize(ctx, DefaultTenant, fmt.Sprintf("k%d", i)); err != nil {
				out = append(out, fmt.Sprintf("k%d", i))
			}
		}
		return out
	}
	// Needs 100 bytes: the least recently used unpinned, unleased one is k3.
	if got, want := gone(), []string{"k3"}; !slices.Equal(got, want) {
		t.Fatalf("evicted: got %v, want %v", got, want)
	}
	// Ask for much more: every unpinned candidate goes before the soft-pinned
	// k1; the hard-pinned k0 and leased k2 never go.
	e.s.evict(ctx, []evictTarget{{seg: 0, need: 450}})
	if got, want := gone(), []string{"k3", "k4", "k5", "k6", "k7", "k8"}; !slices.Equal(got, want) {
		t.Fatalf("evicted: got %v, want %v", got, want)
	}
	e.s.evict(ctx, []evictTarget{{seg: 0, need: 1000}})
	if got, want := gone(), []string{"k1", "k3", "k4", "k5", "k6", "k7", "k8"}; !slices.Equal(got, want) {
		t.Fatalf("evicted: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

func TestPutStartEvictsWhenFull(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	for i := range 10 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100})
	}
	// Full: the next put evicts (down to the low watermark) and retries.
	e.put(t, PutSpec{Key: "new", Size: 100})
	if used := e.c.Agents.Used("seg-0-0"); used > 900 {
		t.Fatalf("segment use after eviction: got %d, want <= 900", used)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
	// Everything hard-pinned: no room, and the put fails cleanly.
	e2 := newEnv(t, 1, 1, 300, Config{Shards: 4})
	for i := range 3 {
		e2.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 100, HardPin: true})
	}
	_, err := e2.s.PutStart(t.Context(), PutSpec{Key: "x", Size: 100, ClientID: "w"})
	if got := rpcerr.Reason(err); got != "NO_AVAILABLE_HANDLE" {
		t.Fatalf("put on a pinned-full segment: got %q, want NO_AVAILABLE_HANDLE", got)
	}
	checkInvariants(t, e2, &follower{set: map[rkey]bool{}})
}

func TestRunEvictsInBackground(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4, EvictInterval: time.Hour})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	for i := range 10 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 95})
	}
	testutil.Eventually(t, 5*time.Second, func() bool { return e.c.Agents.Used("seg-0-0") <= 800 },
		"background eviction to bring seg-0-0 to 800 bytes")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := e.s.Close(); err != nil {
		t.Fatal(err)
	}
	_ = e.s.Close()
}
