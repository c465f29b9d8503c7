package meta

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
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

// TestDrainMakesRoom: with no room below the high watermark on any other
// segment, a drain evicts other objects to make room and says so; an
// object that cannot be evicted (hard-pinned) leaves none, and the replica
// is dropped; with NoEvict it evicts nothing, drops nothing, and stops
// with NO_AVAILABLE_HANDLE (RESOURCE_EXHAUSTED), the counts in the error,
// the segment still DRAINING.
func TestDrainMakesRoom(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hardPin bool
		noEvict bool
		want    *masterv1.DrainCounts
		records []string
		state   masterv1.DrainState
	}{
		{"evicts", false, false, &masterv1.DrainCounts{Total: 1, Moved: 1, Evicted: 1},
			[]string{"stored:default/a", "stored:default/b", "removed:default/b"}, masterv1.DrainState_DRAIN_STATE_DONE},
		{"drops", true, false, &masterv1.DrainCounts{Total: 1, Dropped: 1},
			[]string{"stored:default/a", "stored:default/b", "removed:default/a"}, masterv1.DrainState_DRAIN_STATE_DONE},
		{"no_evict", false, true, &masterv1.DrainCounts{Total: 1, Left: 1},
			[]string{"stored:default/a", "stored:default/b"}, masterv1.DrainState_DRAIN_STATE_STOPPED},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 2, 1, 100, Config{Shards: 4})
			e.put(t, PutSpec{Key: "a", Size: 60, Preferred: []string{"seg-0-0"}})
			e.put(t, PutSpec{Key: "b", Size: 60, Preferred: []string{"seg-1-0"}, HardPin: tc.hardPin})
			got, err := e.s.Drain(t.Context(), "seg-0-0", DrainOptions{NoEvict: tc.noEvict})
			wantLC := masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED
			if tc.noEvict {
				wantStatus(t, err, codes.ResourceExhausted, "NO_AVAILABLE_HANDLE")
				if md := rpcerr.Metadata(rpcerr.Status(err)); md["left"] != "1" || md["moved"] != "0" {
					t.Fatalf("error metadata: got %v, want left 1 and moved 0", md)
				}
				wantLC = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING
			} else if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tc.want) {
				t.Fatalf("counts: got %v, want %v", got, tc.want)
			}
			if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.Lifecycle != wantLC {
				t.Fatalf("lifecycle: got %v, want %v", sg.Lifecycle, wantLC)
			}
			if got := e.records(t); !slices.Equal(got, tc.records) {
				t.Fatalf("changes: got %v, want %v", got, tc.records)
			}
			p := e.s.DrainProgress()["seg-0-0"]
			if p.GetState() != tc.state || !proto.Equal(p.GetCounts(), tc.want) || p.GetNoEvict() != tc.noEvict || p.GetFinishedUnixMs() == 0 {
				t.Fatalf("progress: got %v, want state %v and the same counts", p, tc.state)
			}
			checkInvariants(t, e, &follower{set: map[rkey]bool{}})
		})
	}
}

// TestDrainOffloadsToMakeRoom: with a disk segment present (and the
// default evict policy, offload), the object a drain evicts from the
// target memory segment to make room goes to disk instead of being
// dropped: counted as offloaded, still readable, its log stored(disk)
// before removed(memory).
func TestDrainOffloadsToMakeRoom(t *testing.T) {
	e := newEnv(t, 2, 1, 100, Config{Shards: 4})
	e.withDisk(1, 1000)
	e.put(t, PutSpec{Key: "a", Size: 60, Preferred: []string{"seg-0-0"}})
	e.put(t, PutSpec{Key: "b", Size: 60, Preferred: []string{"seg-1-0"}})
	got, err := e.s.Drain(t.Context(), "seg-0-0", DrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := (&masterv1.DrainCounts{Total: 1, Moved: 1, Offloaded: 1}); !proto.Equal(got, want) {
		t.Fatalf("counts: got %v, want %v", got, want)
	}
	if segs := replicaSegs(t, e.s, "b"); !slices.Equal(segs, []string{"disk-1/complete"}) {
		t.Fatalf("b's replicas: %v, want one on disk-1", segs)
	}
	var media []string
	recs, _, _, _ := e.s.log.Read(0, 0, nil)
	for _, r := range recs {
		media = append(media, fmt.Sprintf("%d:%s/%v", r.Type, r.Key, r.Medium))
	}
	want := []string{"1:a/MEDIUM_MEMORY", "1:b/MEDIUM_MEMORY", "1:b/MEDIUM_DISK", "2:b/MEDIUM_MEMORY"}
	if !slices.Equal(media, want) {
		t.Fatalf("changes: got %v, want %v", media, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainNoEvictStopsWhenFull: with NoEvict the drain moves what fits
// below the high watermark (in chunks), then stops at the first chunk with
// a replica that finds no room; nothing is evicted or dropped, every object
// stays readable, and the segment stays DRAINING. A drain without NoEvict
// then finishes it, saying how many it evicted.
func TestDrainNoEvictStopsWhenFull(t *testing.T) {
	// Two segments of 10 000 bytes, high watermark 0.9: the target takes
	// 899 objects of 10 bytes below it.
	e := newEnv(t, 2, 1, 10000, Config{Shards: 4})
	for i := range 600 {
		e.put(t, PutSpec{Key: fmt.Sprintf("src%03d", i), Preferred: []string{"seg-0-0"}})
		e.put(t, PutSpec{Key: fmt.Sprintf("dst%03d", i), Preferred: []string{"seg-1-0"}})
	}
	got, err := e.s.Drain(t.Context(), "seg-0-0", DrainOptions{NoEvict: true})
	wantStatus(t, err, codes.ResourceExhausted, "NO_AVAILABLE_HANDLE")
	if got.GetTotal() != 600 || got.GetMoved() != 299 || got.GetLeft() != 301 || got.GetEvicted() != 0 || got.GetDropped() != 0 {
		t.Fatalf("counts: got %v, want total 600, moved 299, left 301, nothing evicted or dropped", got)
	}
	if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		t.Fatalf("lifecycle: got %v, want DRAINING", sg.Lifecycle)
	}
	for _, r := range e.records(t) {
		if strings.HasPrefix(r, "removed") {
			t.Fatalf("a drain with NoEvict recorded %s", r)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	got, err = e.s.Drain(t.Context(), "seg-0-0", DrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetTotal() != 301 || got.GetMoved() != 301 || got.GetEvicted() == 0 || got.GetDropped() != 0 || got.GetLeft() != 0 {
		t.Fatalf("counts: got %v, want the 301 moved, some evicted, none dropped", got)
	}
	if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
		t.Fatalf("lifecycle: got %v, want DRAINED", sg.Lifecycle)
	}
	// Every removal is an eviction the counts report (least recently
	// used first: replicas the first drain moved are among them).
	removed := 0
	for _, r := range e.records(t) {
		if strings.HasPrefix(r, "removed") {
			removed++
		}
	}
	if uint64(removed) != got.GetEvicted() {
		t.Fatalf("removed records: got %d, want %d (evicted)", removed, got.GetEvicted())
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainCopyBatchedPerItemFailures: a drain sends each chunk's copies
// in one batched Copy call, and an item that fails is handled alone: its
// target is released (no half-visible replica, no allocation left
// behind) and its source kept, so the next pass moves it. Nothing is
// removed.
func TestDrainCopyBatchedPerItemFailures(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	n := drainChunk + 44
	for i := range n {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%03d", i), Size: 10, Preferred: []string{"seg-0-0"}})
	}
	seen := 0
	failedOnce := map[string]bool{}
	e.c.Agents.FailCopy = func(it *masterv1.CopyItem) error {
		seen++
		if seen <= n && seen%3 == 0 {
			failedOnce[it.GetSource().String()] = true
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "target stopped")
		}
		return nil
	}
	got, err := e.s.Drain(t.Context(), "seg-0-0", DrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	failed := n / 3
	if want := (&masterv1.DrainCounts{Total: uint64(n), Moved: uint64(n), Failed: uint64(failed)}); !proto.Equal(got, want) {
		t.Fatalf("counts: got %v, want %v", got, want)
	}
	if got := e.c.Agents.CopyCalls(); got != 3 {
		t.Fatalf("Copy calls: got %d, want 3 (one per chunk, then one for the retries)", got)
	}
	if counts := e.s.SegmentReplicaCounts(); counts["seg-0-0"] != 0 || counts["seg-1-0"] != uint64(n) {
		t.Fatalf("replicas: got %v, want none on seg-0-0 and %d on seg-1-0", counts, n)
	}
	for _, r := range e.records(t) {
		if strings.HasPrefix(r, "removed") {
			t.Fatalf("a drain whose failed copies succeed on retry recorded %s", r)
		}
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed {
			t.Fatalf("allocation %v left reserved: a failed copy's target must be released", r)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainCopyKeepsFailing: a replica whose copy fails on every pass stays
// where it is, readable; the drain ends after its passes with the segment
// still DRAINING and the counts saying one is left.
func TestDrainCopyKeepsFailing(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	for i := range 5 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Preferred: []string{"seg-0-0"}})
	}
	bad := e.allocOf(t, "k3", "seg-0-0")
	e.c.Agents.FailCopy = func(it *masterv1.CopyItem) error {
		if it.GetSource().GetAllocationId() == bad {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "bad bytes")
		}
		return nil
	}
	got, err := e.s.Drain(t.Context(), "seg-0-0", DrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Pass 1 moves 4 and fails k3; pass 2 fails it again and moves
	// nothing, which ends the passes.
	if want := (&masterv1.DrainCounts{Total: 5, Moved: 4, Failed: 2, Left: 1}); !proto.Equal(got, want) {
		t.Fatalf("counts: got %v, want %v", got, want)
	}
	if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		t.Fatalf("lifecycle: got %v, want DRAINING", sg.Lifecycle)
	}
	if got := views(e.s)[ObjectRef{DefaultTenant, "k3"}].readableOnSegs; got != "[seg-0-0]" {
		t.Fatalf("k3: readable on %s, want seg-0-0 (its source kept)", got)
	}
	if p := e.s.DrainProgress()["seg-0-0"]; p.GetState() != masterv1.DrainState_DRAIN_STATE_INCOMPLETE {
		t.Fatalf("progress: got %v, want INCOMPLETE", p)
	}
	for _, r := range e.records(t) {
		if strings.HasPrefix(r, "removed") {
			t.Fatalf("drain recorded %s", r)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainWaitsForWrites: a write in progress on the draining segment
// (allocated before the drain) is waited for and moved once it ends; one
// that never ends is waited for until it expires, and is not moved.
func TestDrainWaitsForWrites(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Key: "done", Preferred: []string{"seg-0-0"}})
	for _, k := range []string{"ends", "expires"} {
		if _, err := e.s.PutStart(ctx, PutSpec{Key: k, Size: 10, ClientID: "w", Preferred: []string{"seg-0-0"}}); err != nil {
			t.Fatal(err)
		}
	}
	type outcome struct {
		c   *masterv1.DrainCounts
		err error
	}
	drained := make(chan outcome, 1)
	go func() {
		c, err := e.s.Drain(ctx, "seg-0-0", DrainOptions{})
		drained <- outcome{c, err}
	}()
	// The first pass moves "done", then the drain waits.
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		p := e.s.DrainProgress()["seg-0-0"]
		if p.GetCounts().GetMoved() != 1 || p.GetState() != masterv1.DrainState_DRAIN_STATE_RUNNING {
			return fmt.Errorf("progress %v, want 1 moved and running", p)
		}
		return nil
	})
	if p := e.s.DrainProgress()["seg-0-0"]; p.GetCounts().GetTotal() != 3 || p.GetCounts().GetWritesWaited() != 2 {
		t.Fatalf("progress: got %v, want total 3 with 2 writes waited for", p)
	}
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "ends", ClientID: "w", Checksum: 70}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(e.s.cfg.PutPreemptAfter + time.Second)
	if n := e.s.expirePuts(ctx); n != 1 {
		t.Fatalf("expired puts: got %d, want 1", n)
	}
	o := <-drained
	if o.err != nil {
		t.Fatal(o.err)
	}
	if want := (&masterv1.DrainCounts{Total: 3, Moved: 2, WritesWaited: 2}); !proto.Equal(o.c, want) {
		t.Fatalf("counts: got %v, want %v", o.c, want)
	}
	if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
		t.Fatalf("lifecycle: got %v, want DRAINED", sg.Lifecycle)
	}
	if got := views(e.s)[ObjectRef{DefaultTenant, "ends"}].readableOnSegs; got != "[seg-1-0]" {
		t.Fatalf("ends: readable on %s, want seg-1-0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestDrainJoinsRunningDrain: a second Drain of a segment while one runs
// starts no second drain; it waits and answers the first one's outcome.
func TestDrainJoinsRunningDrain(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Key: "done", Preferred: []string{"seg-0-0"}})
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "w", Size: 10, ClientID: "w", Preferred: []string{"seg-0-0"}}); err != nil {
		t.Fatal(err)
	}
	first := make(chan *masterv1.DrainCounts, 1)
	go func() {
		c, _ := e.s.Drain(ctx, "seg-0-0", DrainOptions{})
		first <- c
	}()
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		if p := e.s.DrainProgress()["seg-0-0"]; p.GetCounts().GetMoved() != 1 {
			return fmt.Errorf("progress %v, want 1 moved", p)
		}
		return nil
	})
	second := make(chan *masterv1.DrainCounts, 1)
	go func() {
		c, _ := e.s.Drain(ctx, "seg-0-0", DrainOptions{NoEvict: true})
		second <- c
	}()
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "w", ClientID: "w", Checksum: 70}); err != nil {
		t.Fatal(err)
	}
	a, b := <-first, <-second
	if !proto.Equal(a, b) || a.GetMoved() != 2 {
		t.Fatalf("first drain %v, second %v: want the same, 2 moved", a, b)
	}
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

// TestDrainEvictsOnlyWhereItCanPlace: a drain evicts for room only on the
// segments that could take the replica, never on one that already holds a
// replica of the object (placement avoids it, so evicting there frees
// nothing the drain can use).
func TestDrainEvictsOnlyWhereItCanPlace(t *testing.T) {
	e := newEnv(t, 3, 1, 100, Config{Shards: 4})
	e.put(t, PutSpec{Key: "x", Size: 40, ReplicaNum: 2, Preferred: []string{"seg-0-0", "seg-1-0"}})
	e.put(t, PutSpec{Key: "z", Size: 50, Preferred: []string{"seg-1-0"}}) // seg-1-0: 90, above the low watermark
	e.put(t, PutSpec{Key: "y", Size: 60, Preferred: []string{"seg-2-0"}}) // seg-2-0: no room for x below the high one
	got, err := e.s.Drain(t.Context(), "seg-0-0", DrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := (&masterv1.DrainCounts{Total: 1, Moved: 1, Evicted: 1}); !proto.Equal(got, want) {
		t.Fatalf("counts: got %v, want %v", got, want)
	}
	if got, want := e.records(t), []string{"stored:default/x", "stored:default/z", "stored:default/y", "removed:default/y"}; !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v (y evicted, z kept)", got, want)
	}
	if got := views(e.s)[ObjectRef{DefaultTenant, "x"}].readableOnSegs; got != "[seg-1-0 seg-2-0]" {
		t.Fatalf("x: readable on %s, want seg-1-0 and seg-2-0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}
