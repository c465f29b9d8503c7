package meta

import (
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// TestReconcileRefusesImpossibleBounds: a registration claiming sealed
// allocations larger than their segment, or ending past it (sizes up to
// 2^64-1, which int64 accounting would turn negative), has them returned
// for release instead of adopted; a sane one beside them is adopted.
func TestReconcileRefusesImpossibleBounds(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	segs := e.c.Reg.Segments()
	sealed := masterv1.AllocationState_ALLOCATION_STATE_SEALED
	allocs := []*masterv1.Allocation{
		{SegmentId: "seg-0-0", AllocationId: 1, Size: 1<<64 - 1, State: sealed, Key: "huge", SealedUnixMs: 1},
		{SegmentId: "seg-0-0", AllocationId: 2, Size: 1 << 63, State: sealed, Key: "neg", SealedUnixMs: 1},
		{SegmentId: "seg-0-0", AllocationId: 3, Size: 1 << 20, Offset: 1, State: sealed, Key: "past", SealedUnixMs: 1},
		{SegmentId: "seg-0-0", AllocationId: 4, Size: 10, Offset: 1<<64 - 5, State: sealed, Key: "wrap", SealedUnixMs: 1},
		{SegmentId: "seg-0-0", AllocationId: 5, Size: 100, Offset: 4096, State: sealed, Key: "ok", SealedUnixMs: 1},
	}
	back := e.s.Reconcile(t.Context(), "agent-0", segs, allocs)
	got := map[uint64]bool{}
	for _, r := range back {
		got[r.GetAllocationId()] = true
	}
	for id := uint64(1); id <= 4; id++ {
		if !got[id] {
			t.Fatalf("allocation %d (impossible bounds) not returned for release: %v", id, back)
		}
	}
	if got[5] {
		t.Fatal("the sane allocation was returned for release")
	}
	objects, bytes, _ := e.s.Stats()
	if objects != 1 || bytes != 100 {
		t.Fatalf("Stats: %d objects %d bytes, want 1 and 100", objects, bytes)
	}
	if q, _ := e.s.TenantQuota(t.Context(), ""); q.GetUsedBytes() != 100 {
		t.Fatalf("quota used bytes: got %d, want 100", q.GetUsedBytes())
	}
}
