package meta

import (
	"context"
	"maps"
	"regexp"
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
	tb.record("t", "k", 10, true)
	if !tb.removedSince(3, "t", "k", false) || tb.removedSince(3, "t", "other", false) || tb.removedSince(4, "t", "k", false) {
		t.Fatal("removedSince wrong while detached")
	}
	tb.expire(detachedRetention.Milliseconds())
	if !tb.active.Load() {
		t.Fatal("forgotten before its retention")
	}
	tb.expire(detachedRetention.Milliseconds() + 1)
	if tb.active.Load() || tb.removedSince(3, "t", "k", false) {
		t.Fatal("kept after its retention")
	}
	tb.detach(1, 0, "a", false)
	for i := range maxTombstones + 5 {
		tb.record("t", strconv.Itoa(i), 1, false)
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

// TestTombstonePatterns: a RemoveByPrefix, RemoveByRegex or RemoveAll
// while a segment is detached covers the keys on that segment, which it
// could not find; one without force does not cover a hard-pinned
// allocation. Patterns are bounded, regexes more tightly.
func TestTombstonePatterns(t *testing.T) {
	var tb tombstones
	tb.recordPattern("t", "a/", nil, 5, true)
	if tb.patterns != nil {
		t.Fatal("a pattern recorded with no segment detached")
	}
	tb.detach(3, 10, "a", false)
	tb.recordPattern("t", "a/", nil, 5, true) // before the detachment
	rx := regexp.MustCompile(`^b/[0-9]+$`)
	tb.recordPattern("t", "", rx, 20, false)
	tb.recordPattern("all", "", nil, 20, false)
	for _, tt := range []struct {
		tenant, key string
		hardPin     bool
		want        bool
	}{
		{"t", "a/1", false, false}, // removed before the segment left
		{"t", "b/12", false, true},
		{"t", "b/12", true, false}, // hard-pinned: the regex removal had no force
		{"t", "b/x", false, false},
		{"u", "b/12", false, false}, // another tenant
		{"all", "anything", false, true},
		{"all", "anything", true, false},
	} {
		if got := tb.removedSince(3, tt.tenant, tt.key, tt.hardPin); got != tt.want {
			t.Errorf("removedSince(%s/%s, hard pin %v) = %v, want %v", tt.tenant, tt.key, tt.hardPin, got, tt.want)
		}
	}
	tb.recordPattern("t", "a/", nil, 30, true) // again, now with force: covers hard pins
	tb.recordPattern("all", "", nil, 30, true)
	if !tb.removedSince(3, "t", "a/1", true) || !tb.removedSince(3, "all", "x", true) {
		t.Fatal("a pattern recorded again (with force) does not cover what it removed")
	}
	if len(tb.patterns) != 3 {
		t.Fatalf("%d patterns, want 3 (a repeated one is updated, not added)", len(tb.patterns))
	}
	for i := range maxRegexTombs + 3 {
		tb.recordPattern("t", "", regexp.MustCompile("^r"+strconv.Itoa(i)), 40, true)
	}
	for i := range maxPatternTombs {
		tb.recordPattern("t", "p"+strconv.Itoa(i), nil, 40, true)
	}
	// One regex was there: 63 more fit and 4 are dropped; then 3 + 63
	// patterns were there, and that many of the 1024 prefixes are dropped.
	want := uint64(4 + 3 + maxRegexTombs - 1)
	if n, r, d := len(tb.patterns), tb.regexes, tb.dropped.Load(); n != maxPatternTombs || r != maxRegexTombs || d != want {
		t.Fatalf("%d patterns (%d regexes), %d dropped; want %d (%d), %d", n, r, d, maxPatternTombs, maxRegexTombs, want)
	}
	tb.expire(detachedRetention.Milliseconds() + 11)
	if tb.patterns != nil || tb.regexes != 0 {
		t.Fatal("patterns kept once no segment is detached")
	}
}

// TestRemovedByPatternWhileDetached: RemoveByPrefix, RemoveByRegex and
// RemoveAll while a segment is detached find nothing there, yet the
// objects they would have removed do not come back with the segment: the
// reconcile returns their allocations. A removal without force keeps a
// hard-pinned one, as it would have; a tenant whose objects all lived on
// the segment (it left the table) is covered too.
func TestRemovedByPatternWhileDetached(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	for _, k := range []string{"p/1", "p/2", "p/pinned", "r/1", "keep"} {
		e.put(t, PutSpec{Key: k, Size: 100, HardPin: k == "p/pinned"})
	}
	e.put(t, PutSpec{Tenant: "gone", Key: "x", Size: 100})
	const agent, away = "agent-0", "seg-0-0"
	table := e.c.Agents.Table(agent)
	e.s.DropSegments(ctx, []string{away})
	e.clk.Advance(time.Second)
	if _, _, _, err := e.s.RemoveByPrefix(ctx, DefaultTenant, "p/", false, ""); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := e.s.RemoveByRegex(ctx, DefaultTenant, `^r/\d$`, true, ""); err != nil {
		t.Fatal(err)
	}
	if _, _, err := e.s.RemoveAll(ctx, "gone", false); err != nil {
		t.Fatal(err)
	}
	back := e.s.Reconcile(ctx, agent, segsOf(e.c, agent), table)
	returned := map[string]bool{}
	for _, r := range back {
		for _, a := range table {
			if a.GetAllocationId() == r.AllocationId {
				returned[a.GetTenant()+"/"+a.GetKey()] = true
			}
		}
	}
	want := map[string]bool{"default/p/1": true, "default/p/2": true, "default/r/1": true, "gone/x": true}
	if !maps.Equal(returned, want) {
		t.Fatalf("returned %v, want %v", returned, want)
	}
	for _, k := range []string{"keep", "p/pinned"} {
		if ok, _ := e.s.Exist(ctx, DefaultTenant, k); !ok {
			t.Fatalf("%s was not adopted back", k)
		}
	}
}

// TestRemovedDuringReconcile: a client removes a key while the detached
// segment that holds a copy of it is being reconciled back, after the
// reconcile checked that key's tombstones and before it adopted the copy
// (the soak, seed 653709438: an agent frozen past the unmount window came
// back while the key, with a replica on another agent, was removed). The
// removal found the object without the detached copy and recorded a
// tombstone; the reconcile must honour it under the shard lock.
func TestRemovedDuringReconcile(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "k", Size: 100, ReplicaNum: 2})
	segs := segsOf(e.c, "agent-0")
	table := e.c.Agents.Table("agent-0")
	e.s.DropSegments(ctx, []string{segs[0].ID}) // detached; "k" keeps its other replica
	e.clk.Advance(time.Second)
	e.s.hooks.beforeAdopt = func() {
		e.s.hooks.beforeAdopt = nil
		if err := e.s.Remove(ctx, RemoveSpec{Key: "k"}); err != nil {
			t.Errorf("remove during the reconcile: %v", err)
		}
	}
	back := e.s.Reconcile(ctx, "agent-0", segs, table)
	if ok, _ := e.s.Exist(ctx, DefaultTenant, "k"); ok {
		t.Fatal("the key removed during the reconcile exists after it: adopted back from the returning segment")
	}
	if len(back) != 1 {
		t.Fatalf("the reconcile returned %d allocations, want the removed key's copy", len(back))
	}
}
