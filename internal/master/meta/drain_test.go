package meta

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

func TestDrainMovesReplicas(t *testing.T) {
	e := newEnv(t, 3, 1, 1000, Config{Shards: 4})
	ctx := t.Context()
	for i := range 5 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 50, Preferred: []string{"seg-0-0"}, HardPin: i == 0})
	}
	e.put(t, PutSpec{Key: "two", Size: 50, ReplicaNum: 2, Preferred: []string{"seg-0-0", "seg-1-0"}})
	if err := e.s.DrainSegment(ctx, "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	sg, _ := e.c.Reg.Segment("seg-0-0")
	if sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
		t.Fatalf("lifecycle: got %v, want DRAINED", sg.Lifecycle)
	}
	if n := e.s.SegmentReplicaCounts()["seg-0-0"]; n != 0 {
		t.Fatalf("replicas left on the drained segment: %d", n)
	}
	for _, r := range e.records(t) {
		if r[:7] == "removed" {
			t.Fatalf("drain with room recorded %s; want no visibility change", r)
		}
	}
	v := views(e.s)
	if got := v[ObjectRef{DefaultTenant, "two"}].readableOnSegs; got != "[seg-1-0 seg-2-0]" {
		t.Fatalf("two: readable on %s, want seg-1-0 and seg-2-0", got)
	}
	if !v[ObjectRef{DefaultTenant, "k0"}].hard {
		t.Fatal("k0 lost its hard pin in the move")
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed || al.Checksum != 350 {
			t.Fatalf("allocation %v: sealed %v checksum %d, want sealed with 350", r, al.Sealed, al.Checksum)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	_ = e.s.DrainSegment(ctx, "nope")
	if err := e.s.DrainSegment(ctx, "nope"); rpcerr.Reason(err) != "SEGMENT_NOT_FOUND" {
		t.Fatalf("drain unknown: got %v, want SEGMENT_NOT_FOUND", err)
	}
}

func TestDrainWithoutRoomRemoves(t *testing.T) {
	e := newEnv(t, 2, 1, 100, Config{Shards: 4})
	e.put(t, PutSpec{Key: "a", Size: 60, Preferred: []string{"seg-0-0"}})
	e.put(t, PutSpec{Key: "b", Size: 60, Preferred: []string{"seg-1-0"}})
	if err := e.s.DrainSegment(t.Context(), "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	if got, want := e.records(t), []string{"stored:default/a", "stored:default/b", "removed:default/a"}; !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainCopyBatchedPerItemFailures: a drain sends each chunk's copies
// in one batched Copy call, and an item that fails is handled alone,
// exactly as a failed copy was: its target is released (no half-visible
// replica, no allocation left behind), its source removed (recording
// `removed`), while the chunk's other items move.
func TestDrainCopyBatchedPerItemFailures(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	n := drainChunk + 44
	for i := range n {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%03d", i), Size: 10, Preferred: []string{"seg-0-0"}})
	}
	seen := 0
	e.c.Agents.FailCopy = func(*masterv1.CopyItem) error {
		seen++
		if seen%3 == 0 {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "target stopped")
		}
		return nil
	}
	if err := e.s.DrainSegment(t.Context(), "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	if got := e.c.Agents.CopyCalls(); got != 2 {
		t.Fatalf("Copy calls: got %d, want 2 (one per chunk)", got)
	}
	failed := n / 3
	counts := e.s.SegmentReplicaCounts()
	if counts["seg-0-0"] != 0 || counts["seg-1-0"] != uint64(n-failed) {
		t.Fatalf("replicas: got %v, want none on seg-0-0 and %d on seg-1-0", counts, n-failed)
	}
	removed := 0
	for _, r := range e.records(t) {
		if strings.HasPrefix(r, "removed") {
			removed++
		}
	}
	if removed != failed {
		t.Fatalf("removed records: got %d, want %d (one per failed copy)", removed, failed)
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed {
			t.Fatalf("allocation %v left reserved: a failed copy's target must be released", r)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainCopyCallsBoundedInBytes: a chunk of large objects is copied in
// several calls of at most drainCopyBytes each (one object larger than
// that alone), so no call has more bytes to move than its timeout allows.
func TestDrainCopyCallsBoundedInBytes(t *testing.T) {
	const gib = 1 << 30
	e := newEnv(t, 2, 1, 64*gib, Config{Shards: 4, MaxObjectSize: 8 * gib})
	for i, size := range []uint64{3 * gib, 1 * gib, 5 * gib, 1, 2} {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: size, Preferred: []string{"seg-0-0"}})
	}
	if err := e.s.DrainSegment(t.Context(), "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	// Placement order is the scan's (map order): at least 5 GiB alone and
	// 3+1 together, so 2 or 3 calls; never one.
	if got := e.c.Agents.CopyCalls(); got < 2 || got > 4 {
		t.Fatalf("Copy calls: got %d, want 2 to 4 for 9 GiB in calls of at most 4 GiB", got)
	}
	if n := e.s.SegmentReplicaCounts()["seg-1-0"]; n != 5 {
		t.Fatalf("replicas moved: got %d, want 5", n)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}
