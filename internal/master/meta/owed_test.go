package meta

import (
	"context"
	"log/slog"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
)

// TestReleaseRefusedIsOwed: an agent that answers a Release but cannot
// release some allocations (a disk segment whose journal cannot be
// written) keeps them sealed. The master owes them: a reconcile of the
// agent's table returns them instead of adopting the removed object back,
// and they are sent again (retryOwed, every put sweep) until the agent
// takes them. Before, the item's failure was ignored: the allocation
// stayed at the agent, its space leaked, and the agent's next
// registration brought the removed object back.
func TestReleaseRefusedIsOwed(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "gone", Size: 100})
	e.put(t, PutSpec{Key: "kept", Size: 100})
	refuse := true
	e.c.Agents.FailRelease = func(*masterv1.AllocationRef) error {
		if refuse {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "disk segment journal: no space left on device")
		}
		return nil
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "gone"}); err != nil {
		t.Fatal(err)
	}
	if n := len(e.c.Agents.Live()); n != 2 {
		t.Fatalf("the agent holds %d allocations, want 2 (the release was refused)", n)
	}
	// The agent registers again (it restarted) with the allocation
	// still in its table: returned, not adopted.
	back := e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), e.c.Agents.Table("agent-0"))
	if len(back) != 1 {
		t.Fatalf("reconcile returned %d allocations, want the removed object's", len(back))
	}
	if ok, err := e.s.Exist(ctx, DefaultTenant, "gone"); err != nil || ok {
		t.Fatalf("Exist of the removed object after the reconcile = %v, %v; want false (not adopted back)", ok, err)
	}

	// Without a registration: sent again until the agent takes it.
	if err := e.s.Remove(ctx, RemoveSpec{Key: "kept"}); err != nil {
		t.Fatal(err)
	}
	e.s.retryOwed(ctx)
	live := len(e.c.Agents.Live())
	if n := e.s.OwedReleases(); n != 1 {
		t.Fatalf("OwedReleases = %d while the agent refuses, want 1 (kept's; gone's went back with the reconcile)", n)
	}
	refuse = false
	e.s.retryOwed(ctx)
	if n := e.s.OwedReleases(); n != 0 {
		t.Fatalf("OwedReleases = %d once the agent took them, want 0", n)
	}
	if got := len(e.c.Agents.Live()); live < 1 || got != live-1 {
		t.Fatalf("the agent held %d allocations while refusing and %d after the retry; want one fewer", live, got)
	}
	e.s.retryOwed(ctx) // nothing owed: nothing sent twice
	if p := e.c.Agents.Problems(); len(p) != 0 {
		t.Fatalf("agent problems: %v", p)
	}
}

// TestRefusedReleasesLogged: an agent that keeps refusing the releases
// sent again is logged once when it starts, not every second, and once
// when it takes them.
func TestRefusedReleasesLogged(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	var logs testutil.LogBuffer
	e.s.lg = slog.New(slog.NewTextHandler(&logs, nil))
	ctx := context.Background()
	e.put(t, PutSpec{Key: "k", Size: 100})
	refuse := true
	e.c.Agents.FailRelease = func(*masterv1.AllocationRef) error {
		if refuse {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "disk segment journal: no space left on device")
		}
		return nil
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		e.s.retryOwed(ctx)
	}
	refuse = false
	e.s.retryOwed(ctx)
	e.s.retryOwed(ctx)
	if n := logs.Count("agent refuses releases"); n != 1 {
		t.Fatalf("%d WARN lines for an agent refusing 5 times in a row, want 1:\n%s", n, logs.String())
	}
	if n := logs.Count("agent took the releases it had refused"); n != 1 {
		t.Fatalf("%d lines for the recovery, want 1:\n%s", n, logs.String())
	}
}

// TestReleaseFailedAfterSegmentGone: a release that fails once its
// memory segment is gone for good — the agent restarted meanwhile and
// registered a new one, so the master dropped the old segment and, at the
// reconcile, forgot it and what was owed on it — owes nothing: the
// allocation went with the segment. Before, the failure was owed after
// that forgetting, on a segment retryOwed skips, and stayed owed for good
// (the soak's "the leader owes 83 releases at rest", every agent empty).
func TestReleaseFailedAfterSegmentGone(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "k", Size: 100})
	old := segsOf(e.c, "agent-0")[0]
	restarted := false
	e.c.Agents.BeforeRelease = func() {
		if restarted {
			return
		}
		restarted = true
		// The agent restarts while the release is on its way: its new
		// instance registers a new memory segment, the old one is
		// unmounted (dropped, then UNMOUNTED) and the reconcile forgets it.
		e.c.Agents.Unmount(old.ID)
		e.c.Reg.Add(cluster.Segment{ID: "seg-0-new", AgentID: "agent-0", HostID: old.HostID, DataEndpoint: old.DataEndpoint, Capacity: old.Capacity})
		e.s.DropSegments(ctx, []string{old.ID})
		if err := e.c.Reg.SetLifecycle(old.ID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED); err != nil {
			t.Fatal(err)
		}
		e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), e.c.Agents.Table("agent-0"))
		// The release, sent to the old instance, fails.
		e.c.Agents.SetDown("agent-0", true)
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	e.c.Agents.SetDown("agent-0", false)
	e.s.retryOwed(ctx)
	if n := e.s.OwedReleases(); n != 0 {
		t.Fatalf("OwedReleases = %d after the release failed on a segment that is gone, want 0", n)
	}
	if p := e.c.Agents.Problems(); len(p) != 0 {
		t.Fatalf("agent problems: %v", p)
	}
}

// TestOwedOnDetachedSegment: releases owed on a detached segment stay
// owed while it may come back (a reconcile returns them rather than adopt
// them), and are forgotten once it is forgotten (detachedRetention).
func TestOwedOnDetachedSegment(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	e.withDisk(0, 1<<20)
	e.put(t, PutSpec{Key: "k", Size: 100, Medium: masterv1.Medium_MEDIUM_DISK})
	e.c.Reg.SetHealth("disk-0", masterv1.SegmentHealth_SEGMENT_HEALTH_SUSPECTED)
	if err := e.s.Remove(ctx, RemoveSpec{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	e.s.DropSegments(ctx, []string{"disk-0"})
	if err := e.c.Reg.SetLifecycle("disk-0", masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED); err != nil {
		t.Fatal(err)
	}
	e.s.retryOwed(ctx)
	if n := e.s.OwedReleases(); n != 1 {
		t.Fatalf("OwedReleases = %d while the disk segment is detached, want 1", n)
	}
	e.clk.Advance(detachedRetention + time.Minute)
	e.s.tombs.expire(e.s.nowMs())
	e.s.retryOwed(ctx)
	if n := e.s.OwedReleases(); n != 0 {
		t.Fatalf("OwedReleases = %d once the detached segment is forgotten, want 0", n)
	}
}
