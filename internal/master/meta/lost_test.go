package meta

import (
	"context"
	"fmt"
	"slices"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// allocRef is the reference of key's allocation on segment seg at the
// fake agents.
func allocRef(t testing.TB, e *env, key, seg string) metatest.Ref {
	t.Helper()
	for r, al := range e.c.Agents.Live() {
		if al.Key == key && r.Segment == seg {
			return r
		}
	}
	t.Fatalf("no allocation of %q on %s", key, seg)
	return metatest.Ref{}
}

// TestLost: an agent reports allocations it dropped (AllocationsLost).
// The replicas that point at them go through the mutation path: an
// object keeps its other replicas, `removed` is recorded where a medium
// stops being readable, an object left without replicas is erased and
// its tenant refunded. Nothing is released at the agent. Allocations on
// another agent's segment, or that no replica points at, change nothing.
func TestLost(t *testing.T) {
	tests := []struct {
		name string
		key  string
		seg  string
		// lose: the agent dropped it (else the report names an allocation
		// it does not hold as a replica's).
		lose    bool
		id      uint64 // when set, the reported allocation id instead
		removed int
		records []string // new change records
		segs    string   // the object's readable segments after; "" when erased
	}{
		{name: "one of two replicas", key: "two", seg: "seg-0-0", lose: true, removed: 1, segs: "[seg-1-0]"},
		{name: "last on its medium", key: "mixed", seg: "disk-0", lose: true, removed: 1, records: []string{"removed:mixed:disk"}, segs: "[seg-1-0]"},
		{name: "last replica", key: "one", seg: "seg-0-0", lose: true, removed: 1, records: []string{"removed:one:cpu"}},
		{name: "another agent's segment", key: "other", seg: "seg-1-0", segs: "[seg-1-0]"},
		{name: "no replica has it", key: "one", seg: "seg-0-0", id: 1 << 40, segs: "[seg-0-0]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, 2, 1, 1000, Config{Shards: 4})
			e.withDisk(0, 1000)
			e.put(t, PutSpec{Key: "two", Size: 50, ReplicaNum: 2})
			e.put(t, PutSpec{Key: "mixed", Size: 50, Preferred: []string{"seg-1-0"}})
			migrate(t, e, MigrateSpec{Keys: []string{"mixed"}, Target: MigrateTarget{SegmentID: "disk-0"}})
			e.put(t, PutSpec{Key: "one", Size: 50, Preferred: []string{"seg-0-0"}})
			e.put(t, PutSpec{Key: "other", Size: 50, Preferred: []string{"seg-1-0"}})
			f := &follower{set: map[rkey]bool{}}
			checkInvariants(t, e, f)
			before := e.mediumRecords(t)
			_, _, releases := e.c.Agents.Calls()

			ref := allocRef(t, e, tt.key, tt.seg)
			a := &masterv1.Allocation{SegmentId: ref.Segment, AllocationId: ref.ID, Tenant: "", Key: tt.key, ReplicaId: 1}
			if tt.lose {
				a = e.c.Agents.Lose(ref)
			}
			if tt.id != 0 {
				a.AllocationId = tt.id
			}
			if got := e.s.Lost(t.Context(), "agent-0", segsOf(e.c, "agent-0"), []*masterv1.Allocation{a}); got != tt.removed {
				t.Fatalf("Lost removed %d replicas, want %d", got, tt.removed)
			}

			if got := e.mediumRecords(t)[len(before):]; !slices.Equal(got, tt.records) {
				t.Fatalf("new change records: got %v, want %v", got, tt.records)
			}
			v, ok := views(e.s)[ObjectRef{DefaultTenant, tt.key}]
			if got := map[bool]string{true: v.readableOnSegs}[ok]; got != tt.segs {
				t.Fatalf("%s readable on %q after, want %q", tt.key, got, tt.segs)
			}
			if _, _, got := e.c.Agents.Calls(); got != releases {
				t.Fatalf("Lost sent %d Release calls, want none", got-releases)
			}
			if got := promtest.ToFloat64(e.s.lost); got != float64(tt.removed) {
				t.Fatalf("crescent_master_replicas_lost_total = %v, want %d", got, tt.removed)
			}
			checkInvariants(t, e, f) // quota refunded, nothing leaked or released twice
		})
	}
}

// TestLostForgetsOwedRelease: a release the master owes for an
// allocation the agent then reports lost is moot (the agent let it go
// itself): it is forgotten, not sent again.
func TestLostForgetsOwedRelease(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "gone", Size: 100})
	e.c.Agents.FailRelease = func(*masterv1.AllocationRef) error {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "disk segment journal: no space left on device")
	}
	ref := allocRef(t, e, "gone", "seg-0-0")
	if err := e.s.Remove(ctx, RemoveSpec{Key: "gone"}); err != nil {
		t.Fatal(err)
	}
	if n := len(e.s.owed); n != 1 {
		t.Fatalf("%d releases owed, want 1", n)
	}
	e.c.Agents.FailRelease = nil
	a := e.c.Agents.Lose(ref)
	if got := e.s.Lost(ctx, "agent-0", segsOf(e.c, "agent-0"), []*masterv1.Allocation{a}); got != 0 {
		t.Fatalf("Lost removed %d replicas of a removed object, want 0", got)
	}
	if n := len(e.s.owed); n != 0 {
		t.Fatalf("%d releases still owed after the allocation was lost, want 0", n)
	}
	e.s.retryOwed(ctx)
	if p := e.c.Agents.Problems(); len(p) != 0 {
		t.Fatalf("agent problems: %v", p)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestLostBatch: one report of many allocations across shards removes
// each replica once, whatever the order, and a repeated report removes
// nothing more.
func TestLostBatch(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 8})
	ctx := context.Background()
	var lost []*masterv1.Allocation
	for i := range 40 {
		k := fmt.Sprintf("k%d", i)
		e.put(t, PutSpec{Key: k, Size: 10})
		if i%2 == 0 {
			lost = append(lost, e.c.Agents.Lose(allocRef(t, e, k, "seg-0-0")))
		}
	}
	slices.Reverse(lost)
	segs := segsOf(e.c, "agent-0")
	if got := e.s.Lost(ctx, "agent-0", segs, lost); got != len(lost) {
		t.Fatalf("Lost removed %d replicas, want %d", got, len(lost))
	}
	if got := e.s.Lost(ctx, "agent-0", segs, lost); got != 0 {
		t.Fatalf("a repeated report removed %d replicas, want 0", got)
	}
	if objects, _, _ := e.s.Stats(); objects != 20 {
		t.Fatalf("%d objects left, want 20", objects)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}
