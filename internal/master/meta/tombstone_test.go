package meta

import (
	"context"
	"strconv"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// TestRemovedWhileDiskDetached: a disk segment is dropped (its agent was
// lost or stopped: DropSegments) and comes back with its sealed
// allocations. An object a client removed while it was detached is
// returned to the agent, not adopted back; one removed before it was
// detached, or never removed, is adopted as before; once the segment is
// back, removals record nothing more.
func TestRemovedWhileDiskDetached(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	e.withDisk(0, 1<<20)
	ctx := context.Background()
	for _, k := range []string{"gone", "kept", "again"} {
		e.put(t, PutSpec{Key: k, Size: 100, Medium: masterv1.Medium_MEDIUM_DISK})
	}
	table := e.c.Agents.Table("agent-0") // what the disk still holds
	e.s.DropSegments(ctx, []string{"disk-0"})
	if ok, _ := e.s.Exist(ctx, DefaultTenant, "gone"); ok {
		t.Fatal("an object only on the dropped disk segment still exists")
	}
	e.clk.Advance(time.Second)
	// Removed while detached; "again" is put again elsewhere and removed.
	e.put(t, PutSpec{Key: "again", Size: 100})
	for _, k := range []string{"gone", "again"} {
		if err := e.s.Remove(ctx, RemoveSpec{Key: k, Force: true}); err != nil && k == "again" {
			t.Fatal(err)
		}
	}
	// "gone" was no longer there to remove: recorded all the same (it
	// lives on the detached segment).
	if n := len(e.s.tombs.removed); n != 2 {
		t.Fatalf("%d tombstones, want 2 (\"again\", and \"gone\" though not found)", n)
	}
	back := e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), table)
	returned := map[uint64]bool{}
	for _, r := range back {
		returned[r.AllocationId] = true
	}
	for _, a := range table {
		if a.GetSegmentId() != "disk-0" {
			continue
		}
		removed := a.GetKey() == "gone" || a.GetKey() == "again"
		if returned[a.GetAllocationId()] != removed {
			t.Fatalf("%s: returned %v, want %v", a.GetKey(), returned[a.GetAllocationId()], removed)
		}
		if ok, _ := e.s.Exist(ctx, DefaultTenant, a.GetKey()); ok == removed {
			t.Fatalf("%s exists %v after the segment came back; want %v", a.GetKey(), ok, !removed)
		}
	}
	if e.s.tombs.active.Load() || e.s.tombs.removed != nil {
		t.Fatal("tombstones kept after the only detached segment came back")
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "kept", Force: true}); err != nil {
		t.Fatal(err)
	}
	if e.s.tombs.removed != nil {
		t.Fatal("a removal recorded a tombstone with no segment detached")
	}
}

// TestDetachedForgotten: a segment detached for longer than
// detachedRetention is forgotten, and its tombstones with it.
func TestDetachedForgotten(t *testing.T) {
	var tb tombstones
	tb.detach(3, 0, "a", false)
	tb.record("t", "k", 10)
	if !tb.removedSince(3, "t", "k") || tb.removedSince(3, "t", "other") || tb.removedSince(4, "t", "k") {
		t.Fatal("removedSince wrong while detached")
	}
	tb.expire(detachedRetention.Milliseconds())
	if !tb.active.Load() {
		t.Fatal("forgotten before its retention")
	}
	tb.expire(detachedRetention.Milliseconds() + 1)
	if tb.active.Load() || tb.removedSince(3, "t", "k") {
		t.Fatal("kept after its retention")
	}
	tb.detach(1, 0, "a", false)
	for i := range maxTombstones + 5 {
		tb.record("t", strconv.Itoa(i), 1)
	}
	if n, d := len(tb.removed), tb.dropped.Load(); n != maxTombstones || d != 5 {
		t.Fatalf("%d tombstones, %d dropped; want %d and 5", n, d, maxTombstones)
	}
}

// TestRemovedWhileMemoryDetached (found by make soak): an agent cut off or
// stalled past --unmount-after comes back with its memory segment, same
// id, same sealed allocations. An object removed while it was away — found
// and removed elsewhere, not found at all (its only replica was on the
// dropped segment), or removed before the drop with its release still
// owed — is returned, not adopted back; the others come back. A memory
// segment the agent no longer lists when it registers (it restarted) is
// forgotten, with the releases owed on it.
func TestRemovedWhileMemoryDetached(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	for _, k := range []string{"gone", "owed", "kept"} {
		e.put(t, PutSpec{Key: k, Size: 100})
	}
	const agent, away = "agent-0", "seg-0-0"
	table := e.c.Agents.Table(agent)
	// "owed" is removed while its agent cannot take the release.
	e.c.Agents.SetDown(agent, true)
	if err := e.s.Remove(ctx, RemoveSpec{Key: "owed", Force: true}); err != nil {
		t.Fatal(err)
	}
	e.s.DropSegments(ctx, []string{away})
	e.clk.Advance(time.Second)
	if err := e.s.Remove(ctx, RemoveSpec{Key: "gone", Force: true}); rpcerr.Reason(err) != "OBJECT_NOT_FOUND" {
		t.Fatalf("Remove of an object only on a dropped segment = %v, want OBJECT_NOT_FOUND", err)
	}
	e.c.Agents.SetDown(agent, false)
	back := e.s.Reconcile(ctx, agent, segsOf(e.c, agent), table)
	returned := map[uint64]bool{}
	for _, r := range back {
		returned[r.AllocationId] = true
	}
	for _, a := range table {
		removed := a.GetKey() == "gone" || a.GetKey() == "owed"
		if returned[a.GetAllocationId()] != removed {
			t.Fatalf("%s: returned %v, want %v", a.GetKey(), returned[a.GetAllocationId()], removed)
		}
		if ok, _ := e.s.Exist(ctx, DefaultTenant, a.GetKey()); ok == removed {
			t.Fatalf("%s exists %v after the memory segment came back; want %v", a.GetKey(), ok, !removed)
		}
	}
	if e.s.tombs.active.Load() {
		t.Fatal("tombstones kept after the only detached segment came back")
	}

	restarted(t, e, agent, away, func() { _ = e.s.Reconcile(ctx, agent, nil, nil) })
}

// TestGoneMemorySegmentForgotten: a memory segment dropped while its agent
// was away is forgotten, with the releases owed on it, when the agent
// registers again without it, also by a resumed registration (TakeOwed: a
// standby that followed the agent through its restart, then leads).
func TestGoneMemorySegmentForgotten(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	for _, k := range []string{"a", "kept"} {
		e.put(t, PutSpec{Key: k, Size: 100})
	}
	restarted(t, e, "agent-0", "seg-0-0", func() { _ = e.s.TakeOwed("agent-0", []string{"seg-new"}) })
}

// restarted removes "kept" while agent's only segment, away, cannot take
// the release, drops the segment, and checks that register (the agent
// registering again with a new memory segment) forgets it and what was
// owed on it.
func restarted(t *testing.T, e *env, agent, away string, register func()) {
	t.Helper()
	ctx := context.Background()
	e.c.Agents.SetDown(agent, true)
	if err := e.s.Remove(ctx, RemoveSpec{Key: "kept", Force: true}); err != nil {
		t.Fatal(err)
	}
	if e.s.OwedReleases() == 0 {
		t.Fatal("no release owed for a removal the agent could not take")
	}
	e.s.DropSegments(ctx, []string{away})
	if d, _, _ := e.s.tombs.stats(); d != 1 {
		t.Fatalf("%d detached segments, want 1", d)
	}
	e.c.Agents.SetDown(agent, false)
	register()
	if d, _, _ := e.s.tombs.stats(); d != 0 || e.s.tombs.active.Load() {
		t.Fatalf("%d detached segments after the agent registered without its memory segment, want 0", d)
	}
	if n := e.s.OwedReleases(); n != 0 {
		t.Fatalf("%d releases owed on a memory segment that is gone for good, want 0", n)
	}
}
