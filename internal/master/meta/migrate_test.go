package meta

import (
	"fmt"
	"slices"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// mediumRecords returns the change records as "type:key:medium".
func (e *env) mediumRecords(t testing.TB) []string {
	t.Helper()
	recs, _, _, err := e.s.log.Read(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range recs {
		typ := map[changelog.Type]string{changelog.Stored: "stored", changelog.Removed: "removed", changelog.Cleared: "cleared"}[r.Type]
		med := map[masterv1.Medium]string{masterv1.Medium_MEDIUM_MEMORY: "cpu", masterv1.Medium_MEDIUM_DISK: "disk"}[r.Medium]
		out = append(out, typ+":"+r.Key+":"+med)
	}
	return out
}

// withDisk adds a disk segment "disk-h" on host h (agent-h).
func (e *env) withDisk(h int, capacity uint64) {
	e.c.Reg.Add(cluster.Segment{ID: fmt.Sprintf("disk-%d", h), AgentID: fmt.Sprintf("agent-%d", h), HostID: fmt.Sprintf("host-%d", h),
		DataEndpoint: fmt.Sprintf("10.0.0.%d:50052", h+1), Capacity: capacity, Medium: masterv1.Medium_MEDIUM_DISK})
}

// replicaSegs lists an object's replicas as "segment/status".
func replicaSegs(t testing.TB, s *Store, key string) []string {
	t.Helper()
	r, err := s.QueryRoute(t.Context(), "", key)
	if err != nil {
		t.Fatalf("QueryRoute %s: %v", key, err)
	}
	var out []string
	for _, rep := range r.GetReplicas() {
		st := "processing"
		if rep.GetStatus() == masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE {
			st = "complete"
		}
		out = append(out, rep.GetSegmentId()+"/"+st)
	}
	return out
}

func migrate(t testing.TB, e *env, sp MigrateSpec) []MigrateResult {
	t.Helper()
	res, err := e.s.Migrate(t.Context(), sp)
	if err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if len(res) != len(sp.Keys) {
		t.Fatalf("results: got %d, want %d", len(res), len(sp.Keys))
	}
	return res
}

func wantItemReason(t testing.TB, err error, reason string) {
	t.Helper()
	if got := rpcerr.Reason(err); got != reason {
		t.Fatalf("reason: got %q (%v), want %q", got, err, reason)
	}
}

// TestCopyAddsReplica: Copy adds a COMPLETE replica on the target segment,
// host or medium and keeps the source; a copy to disk records stored(disk)
// and a copy within memory records nothing; a second copy to the same
// target is OBJECT_ALREADY_EXISTS.
func TestCopyAddsReplica(t *testing.T) {
	e := newEnv(t, 3, 1, 1000, Config{Shards: 4})
	e.withDisk(2, 1000)
	for _, k := range []string{"a", "b", "c"} {
		e.put(t, PutSpec{Key: k, Size: 50, Preferred: []string{"seg-0-0"}})
	}
	res := migrate(t, e, MigrateSpec{Keys: []string{"a", "b"}, Target: MigrateTarget{SegmentID: "seg-1-0"}})
	for _, r := range res {
		if r.Err != nil || r.Replica.GetSegmentId() != "seg-1-0" || r.Source != "seg-0-0" || r.Replica.GetSize() != 50 {
			t.Fatalf("copy %s: got %+v", r.Key, r)
		}
	}
	if got, want := replicaSegs(t, e.s, "a"), []string{"seg-0-0/complete", "seg-1-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("a: got %v, want %v", got, want)
	}
	res = migrate(t, e, MigrateSpec{Keys: []string{"a"}, Target: MigrateTarget{HostID: "host-2"}})
	if res[0].Err != nil || res[0].Replica.GetSegmentId() != "seg-2-0" {
		t.Fatalf("copy to host-2: got %+v, want seg-2-0 (memory, as the source)", res[0])
	}
	res = migrate(t, e, MigrateSpec{Keys: []string{"c"}, Target: MigrateTarget{Medium: masterv1.Medium_MEDIUM_DISK}})
	if res[0].Err != nil || res[0].Replica.GetSegmentId() != "disk-2" || res[0].Replica.GetMedium() != masterv1.Medium_MEDIUM_DISK {
		t.Fatalf("copy to disk: got %+v", res[0])
	}
	want := []string{"stored:a:cpu", "stored:b:cpu", "stored:c:cpu", "stored:c:disk"}
	if got := e.mediumRecords(t); !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	// Already there: by segment, by host, by medium.
	for _, tg := range []MigrateTarget{{SegmentID: "seg-1-0"}, {HostID: "host-0"}, {Medium: masterv1.Medium_MEDIUM_MEMORY}} {
		res = migrate(t, e, MigrateSpec{Keys: []string{"a"}, Target: tg})
		wantItemReason(t, res[0].Err, "OBJECT_ALREADY_EXISTS")
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed || al.Checksum != 350 {
			t.Fatalf("allocation %v: sealed %v checksum %d, want sealed with 350", r, al.Sealed, al.Checksum)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestMoveRecordsTargetBeforeSource: a move from memory to disk records
// stored(disk) before removed(cpu), leaves the object only on disk, and
// moves a leased object (the lease protects readers; the target is
// readable before the source goes). FromSegment chooses among replicas.
func TestMoveRecordsTargetBeforeSource(t *testing.T) {
	e := newEnv(t, 2, 1, 1000, Config{Shards: 4})
	e.withDisk(1, 1000)
	e.put(t, PutSpec{Key: "a", Size: 50, Preferred: []string{"seg-0-0"}})
	if _, err := e.s.Get(t.Context(), GetSpec{Key: "a"}); err != nil { // takes a lease
		t.Fatal(err)
	}
	res := migrate(t, e, MigrateSpec{Keys: []string{"a"}, Move: true, Target: MigrateTarget{Medium: masterv1.Medium_MEDIUM_DISK}})
	if res[0].Err != nil || res[0].Source != "seg-0-0" || res[0].Replica.GetSegmentId() != "disk-1" {
		t.Fatalf("move: got %+v", res[0])
	}
	if got, want := replicaSegs(t, e.s, "a"), []string{"disk-1/complete"}; !slices.Equal(got, want) {
		t.Fatalf("a: got %v, want %v", got, want)
	}
	want := []string{"stored:a:cpu", "stored:a:disk", "removed:a:cpu"}
	if got := e.mediumRecords(t); !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v (target stored before source removed)", got, want)
	}

	// Two replicas: FromSegment picks the one to move; without it, the
	// first COMPLETE one not on the target.
	e.put(t, PutSpec{Key: "two", Size: 50, ReplicaNum: 2, Preferred: []string{"seg-0-0", "seg-1-0"}})
	res = migrate(t, e, MigrateSpec{Keys: []string{"two"}, Move: true, FromSegment: "seg-1-0", Target: MigrateTarget{SegmentID: "disk-1"}})
	if res[0].Err != nil || res[0].Source != "seg-1-0" {
		t.Fatalf("move from seg-1-0: got %+v", res[0])
	}
	if got, want := replicaSegs(t, e.s, "two"), []string{"seg-0-0/complete", "disk-1/complete"}; !slices.Equal(got, want) {
		t.Fatalf("two: got %v, want %v", got, want)
	}
	res = migrate(t, e, MigrateSpec{Keys: []string{"two"}, Move: true, FromSegment: "seg-1-0", Target: MigrateTarget{SegmentID: "seg-1-0"}})
	wantItemReason(t, res[0].Err, "OBJECT_NOT_FOUND") // no replica on seg-1-0 any more
	res = migrate(t, e, MigrateSpec{Keys: []string{"two"}, Move: true, Target: MigrateTarget{SegmentID: "seg-1-0"}})
	if res[0].Err != nil || res[0].Source != "seg-0-0" {
		t.Fatalf("move without FromSegment: got %+v, want from seg-0-0", res[0])
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestMigrateFailures: every refusal or failure is answered for its key
// alone, the other keys proceed, and a failed copy or seal leaves no
// target behind (its PROCESSING replica removed, its allocation released,
// no change recorded) and the source in place.
func TestMigrateFailures(t *testing.T) {
	e := newEnv(t, 3, 1, 1000, Config{Shards: 4})
	e.c.Reg.Add(cluster.Segment{ID: "tiny", AgentID: "agent-2", HostID: "host-2", DataEndpoint: "10.0.0.3:50052", Capacity: 40})
	for _, k := range []string{"ok", "copyfails", "sealfails", "big", "pinned"} {
		e.put(t, PutSpec{Key: k, Size: 50, Preferred: []string{"seg-0-0"}, HardPin: k == "pinned"})
	}
	e.put(t, PutSpec{Key: "small", Size: 10, Preferred: []string{"seg-0-0"}})
	if _, err := e.s.PutStart(t.Context(), PutSpec{Key: "writing", Size: 10, ClientID: "w", Preferred: []string{"seg-0-0"}}); err != nil {
		t.Fatal(err)
	}
	before := e.mediumRecords(t)
	e.c.Agents.BadChecksum("sealfails")
	e.c.Agents.FailCopy = func(it *masterv1.CopyItem) error {
		if it.GetSource().GetAllocationId() == e.allocOf(t, "copyfails", "seg-0-0") {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "target stopped")
		}
		return nil
	}
	for _, move := range []bool{false, true} {
		res := migrate(t, e, MigrateSpec{Keys: []string{"ok", "copyfails", "sealfails", "missing", "writing", "pinned"}, Move: move,
			Target: MigrateTarget{SegmentID: "seg-1-0"}})
		if move {
			wantItemReason(t, res[0].Err, "OBJECT_ALREADY_EXISTS") // copied by the first round
			wantItemReason(t, res[5].Err, "OBJECT_BUSY")           // hard-pinned: not moved
		} else {
			if res[0].Err != nil {
				t.Fatalf("ok: %v", res[0].Err)
			}
			if res[5].Err != nil {
				t.Fatalf("pinned copy: %v (a copy of a hard-pinned object is allowed)", res[5].Err)
			}
		}
		wantItemReason(t, res[1].Err, "AGENT_UNAVAILABLE")
		wantItemReason(t, res[2].Err, "CHECKSUM_MISMATCH")
		wantItemReason(t, res[3].Err, "OBJECT_NOT_FOUND")
		wantItemReason(t, res[4].Err, "OBJECT_BUSY")
		for _, k := range []string{"copyfails", "sealfails"} {
			if got, want := replicaSegs(t, e.s, k), []string{"seg-0-0/complete"}; !slices.Equal(got, want) {
				t.Fatalf("%s after failed copy (move %v): got %v, want only the source", k, move, got)
			}
		}
	}
	// Target full, and too small for the object: no eviction, no target.
	res := migrate(t, e, MigrateSpec{Keys: []string{"big", "small"}, Target: MigrateTarget{SegmentID: "tiny"}})
	wantItemReason(t, res[0].Err, "NO_AVAILABLE_HANDLE")
	if res[1].Err != nil {
		t.Fatalf("small to tiny: %v", res[1].Err)
	}
	res = migrate(t, e, MigrateSpec{Keys: []string{"ok"}, Move: true, Target: MigrateTarget{SegmentID: "tiny"}})
	wantItemReason(t, res[0].Err, "NO_AVAILABLE_HANDLE")
	// An unknown tenant is not created.
	res = migrate(t, e, MigrateSpec{Tenant: "ghost", Keys: []string{"ok"}, Target: MigrateTarget{SegmentID: "seg-1-0"}})
	wantItemReason(t, res[0].Err, "OBJECT_NOT_FOUND")
	if _, ok := e.s.tenants.lookup("ghost"); ok {
		t.Fatal("Migrate created the tenant it was asked about")
	}
	// Whole-request errors.
	_, err := e.s.Migrate(t.Context(), MigrateSpec{Keys: []string{"ok"}, Target: MigrateTarget{SegmentID: "nope"}})
	wantItemReason(t, err, "SEGMENT_NOT_FOUND")
	_, err = e.s.Migrate(t.Context(), MigrateSpec{Keys: []string{"ok"}, Target: MigrateTarget{SegmentID: "seg-1-0", HostID: "host-1"}})
	wantItemReason(t, err, "INVALID_PARAMS")

	// Only the successful copies were recorded (none: memory to memory),
	// and no failed target left an allocation reserved.
	if got := e.mediumRecords(t); !slices.Equal(got, before) {
		t.Fatalf("changes: got %v, want %v", got, before)
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed && al.Key != "writing" {
			t.Fatalf("allocation %v (%s) left reserved by a failed copy", r, al.Key)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// allocOf is the allocation of key's replica on segment seg.
func (e *env) allocOf(t testing.TB, key, seg string) uint64 {
	r, err := e.s.QueryRoute(t.Context(), "", key)
	if err != nil {
		t.Fatal(err)
	}
	for _, rep := range r.GetReplicas() {
		if rep.GetSegmentId() == seg {
			return rep.GetAllocationId()
		}
	}
	t.Fatalf("%s has no replica on %s", key, seg)
	return 0
}
