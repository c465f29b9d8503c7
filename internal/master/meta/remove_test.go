package meta

import (
	"slices"
	"testing"
)

// TestRemoveAllClearedAfterTenantReadded drives the interleaving that made
// TestConcurrentOverlappingKeys fail now and then: RemoveAll's removal pass
// takes the tenant's last object, so the tenant retires; a put then re-adds
// the tenant under a new id and completes (`stored`); RemoveAll's final
// check, looking only under the old id, found the tenant empty and recorded
// `cleared`, which a follower applies to the name, dropping the new object
// that is readable.
func TestRemoveAllClearedAfterTenantReadded(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Tenant: "y", Key: "a"})
	old, _ := e.s.tenants.lookup("y")
	ran := false
	e.s.hooks.beforeLockAll = func() {
		e.s.hooks.beforeLockAll = nil
		ran = true
		if e.s.tenants.lookupLive("y") != nil {
			t.Fatal("the removal pass took the tenant's last object: want it retired")
		}
		e.put(t, PutSpec{Tenant: "y", Key: "b"})
		if cur, _ := e.s.tenants.lookup("y"); cur == old {
			t.Fatalf("want the tenant re-added under a new id, got the old one %#x", cur)
		}
	}
	removed, skipped, err := e.s.RemoveAll(ctx, "y", true)
	if err != nil || removed != 1 || skipped != 0 {
		t.Fatalf("RemoveAll: removed %d skipped %d err %v, want 1 0 nil", removed, skipped, err)
	}
	if !ran {
		t.Fatal("hook did not run")
	}
	want := []string{"stored:y/a", "removed:y/a", "stored:y/b"}
	if got := e.records(t); !slices.Equal(got, want) {
		t.Fatalf("change log: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	// Without a racing put, RemoveAll still records `cleared`.
	if _, _, err := e.s.RemoveAll(ctx, "y", true); err != nil {
		t.Fatal(err)
	}
	want = append(want, "removed:y/b", "cleared:y/")
	if got := e.records(t); !slices.Equal(got, want) {
		t.Fatalf("change log: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestSnapshotAfterTenantReadded: a tenant's Snapshot resolved the tenant's
// id before locking the shards; when the tenant retired and was re-added
// under a new id in between, the copy missed the new id's objects although
// their `stored` records are before the revision it answered, so a
// subscriber resyncing from it (then watching from that revision) never
// learnt of them.
func TestSnapshotAfterTenantReadded(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Tenant: "y", Key: "a"})
	old, _ := e.s.tenants.lookup("y")
	e.s.hooks.beforeLockAll = func() {
		e.s.hooks.beforeLockAll = nil
		if err := e.s.Remove(ctx, RemoveSpec{Tenant: "y", Key: "a"}); err != nil {
			t.Fatal(err)
		}
		e.put(t, PutSpec{Tenant: "y", Key: "b"})
		if cur, _ := e.s.tenants.lookup("y"); cur == old {
			t.Fatalf("want the tenant re-added under a new id, got the old one %#x", cur)
		}
	}
	rev, entries, err := e.s.Snapshot(ctx, "y")
	if err != nil {
		t.Fatal(err)
	}
	if e.s.hooks.beforeLockAll != nil {
		t.Fatal("hook did not run")
	}
	// A subscriber resyncs from the snapshot, then follows the log from its
	// revision: it must end with the readable set.
	f := &follower{rev: rev, set: map[rkey]bool{}}
	for _, en := range entries {
		f.set[rkey{en.Tenant, en.Key, en.Medium}] = true
	}
	checkInvariants(t, e, f)
}
