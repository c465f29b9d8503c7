package meta

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

const blankTestSize = 1 << 20

// newBlankEnv is one agent with one 1 GiB memory segment and blank pools of
// depth 4. Nothing runs in the background: the tests call refillBlanks and
// sweepBlanks themselves.
func newBlankEnv(t *testing.T) *env {
	t.Helper()
	return newEnv(t, 1, 1, 1<<30, Config{BlankPool: 4})
}

// warmBlanks puts two objects of size (a size gets blanks from its second
// put on a segment; the tests' env has one) and fills the pool.
func (e *env) warmBlanks(t *testing.T, size uint64) {
	t.Helper()
	for _, k := range []string{"first", "again"} {
		e.put(t, PutSpec{Key: fmt.Sprintf("%s/%d", k, size), Size: size})
	}
	e.s.refillBlanks(context.Background())
}

// writeAs does what a client's write does at the agent: it binds each
// replica's allocation to the identity its write token names (an agent
// checks the token's signature first; so does this).
func (e *env) writeAs(t testing.TB, descs []*masterv1.ReplicaDescriptor) {
	t.Helper()
	for _, d := range descs {
		c, err := token.Parse(d.GetToken(), e.s.keys.Keys()...)
		if err != nil {
			t.Fatalf("write token of replica %d: %v", d.GetReplicaId(), err)
		}
		if c.SegmentID != d.GetSegmentId() || c.AllocationID != d.GetAllocationId() || c.ReplicaID != d.GetReplicaId() {
			t.Fatalf("write token names %s/%d replica %d; the descriptor %s/%d replica %d",
				c.SegmentID, c.AllocationID, c.ReplicaID, d.GetSegmentId(), d.GetAllocationId(), d.GetReplicaId())
		}
		if err := e.c.Agents.Bind(c.SegmentID, c.AllocationID, c.Tenant, c.Key, c.ReplicaID, c.Group, c.HardPin); err != nil {
			t.Fatalf("bind replica %d: %v", d.GetReplicaId(), err)
		}
	}
}

// TestBlankSkipsReserve: the first put of a size reserves at the agent and
// starts a pool; once the pool is filled (one Reserve for all of it), a put
// of that size takes a blank with no Reserve of its own, its write token
// names the whole replica, and the object it makes is what the agent's
// table shows after the write and the seal.
func TestBlankSkipsReserve(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	f := &follower{set: map[rkey]bool{}}
	e.put(t, PutSpec{Key: "first", Size: blankTestSize})
	e.s.refillBlanks(ctx)
	if n, _ := e.s.BlankStats(); n != 0 {
		t.Fatalf("after one put of the size: %d blanks, want none (a size gets blanks from its second put)", n)
	}
	e.put(t, PutSpec{Key: "again", Size: blankTestSize})
	if r, _, _ := e.c.Agents.Calls(); r != 2 {
		t.Fatalf("two puts: %d Reserves, want 2", r)
	}
	e.s.refillBlanks(ctx)
	if r, _, _ := e.c.Agents.Calls(); r != 3 {
		t.Fatalf("refill: %d Reserves in all, want 3 (one for the whole pool)", r)
	}
	if n, bytes := e.s.BlankStats(); n != 4 || bytes != 4*blankTestSize {
		t.Fatalf("after a refill: %d blanks of %d bytes, want 4 of %d", n, bytes, 4*blankTestSize)
	}
	checkInvariants(t, e, f)

	descs, err := e.s.PutStart(ctx, PutSpec{Key: "second", Size: blankTestSize, ClientID: "w", Group: "g", HardPin: true})
	if err != nil {
		t.Fatal(err)
	}
	if r, _, _ := e.c.Agents.Calls(); r != 3 {
		t.Fatalf("a put that found a blank sent a Reserve (%d in all, want 3)", r)
	}
	if al := e.c.Agents.Live()[metatest.Ref{Segment: descs[0].GetSegmentId(), ID: descs[0].GetAllocationId()}]; !al.Blank {
		t.Fatalf("the put's allocation %d is not one of the blanks: %+v", descs[0].GetAllocationId(), al)
	}
	if got, res := e.s.blanksTaken.Load(), e.s.reservesSent.Load(); got != 1 || res != 2 {
		t.Fatalf("replicas placed on blanks %d, reserved %d; want 1 and 2", got, res)
	}
	e.writeAs(t, descs)
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "second", ClientID: "w", Checksum: 7}); err != nil {
		t.Fatal(err)
	}
	al := e.c.Agents.Live()[metatest.Ref{Segment: descs[0].GetSegmentId(), ID: descs[0].GetAllocationId()}]
	if !al.Sealed || al.Tenant != DefaultTenant || al.Key != "second" || al.ReplicaID != descs[0].GetReplicaId() || al.Group != "g" || !al.HardPin {
		t.Fatalf("the agent holds %+v; want sealed, %s/second, replica %d, group g, hard pin", al, DefaultTenant, descs[0].GetReplicaId())
	}
	if n, _ := e.s.BlankStats(); n != 3 {
		t.Fatalf("%d blanks left, want 3", n)
	}
	checkInvariants(t, e, f)
}

// TestBlankDroppedWhenSegmentCannotSeal: an agent that answers a seal
// SEGMENT_UNAVAILABLE (its disk journal cannot be written) would fail every
// put its segment's blanks go to, so the master gives those blanks back:
// the next put of the size reserves, which such a segment refuses.
func TestBlankDroppedWhenSegmentCannotSeal(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	e.warmBlanks(t, blankTestSize)
	if n, _ := e.s.BlankStats(); n != 4 {
		t.Fatalf("%d blanks after warming, want 4", n)
	}
	e.c.Agents.FailSeal = func(*masterv1.SealItem) error {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "disk segment journal: no space left on device")
	}
	descs, err := e.s.PutStart(ctx, PutSpec{Key: "k", Size: blankTestSize, ClientID: "w"})
	if err != nil {
		t.Fatal(err)
	}
	e.writeAs(t, descs)
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "k", ClientID: "w", Checksum: 7}); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("PutEnd = %v, want SEGMENT_UNAVAILABLE", err)
	}
	if n, _ := e.s.BlankStats(); n != 0 {
		t.Fatalf("%d blanks left on a segment that cannot seal, want none", n)
	}
	for ref, al := range e.c.Agents.Live() {
		if al.Blank {
			t.Fatalf("blank %v still reserved at the agent", ref)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestBlankUnboundRefusesSeal: a put whose client never wrote cannot be
// sealed on a blank (the agent refuses to seal a blank no write bound),
// and the put fails rather than publishing an object with no identity.
func TestBlankUnboundRefusesSeal(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	e.warmBlanks(t, blankTestSize)
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "unwritten", Size: blankTestSize, ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "unwritten", ClientID: "w", Checksum: 7}); err == nil {
		t.Fatal("PutEnd of a put whose blank no write bound: accepted")
	}
	if readableSet(e.s)[rkey{DefaultTenant, "unwritten", masterv1.Medium_MEDIUM_MEMORY}] {
		t.Fatal("the unwritten object is readable")
	}
}

// TestBlankAgeAndSweep: a blank is handed out only while younger than
// BlankMaxAge; the sweep releases older ones at the agent, and drops a pool
// nobody used for that long.
func TestBlankAgeAndSweep(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	e.warmBlanks(t, blankTestSize)
	live := len(e.c.Agents.Live())
	e.clk.Advance(e.s.cfg.BlankMaxAge)
	r0, _, _ := e.c.Agents.Calls()
	e.put(t, PutSpec{Key: "late", Size: blankTestSize})
	if r, _, _ := e.c.Agents.Calls(); r != r0+1 {
		t.Fatalf("a put after BlankMaxAge took a stale blank (Reserves %d, want %d)", r, r0+1)
	}
	e.s.sweepBlanks(ctx)
	if n, _ := e.s.BlankStats(); n != 0 {
		t.Fatalf("%d blanks after the sweep, want 0", n)
	}
	if got := len(e.c.Agents.Live()); got != live+1-4 {
		t.Fatalf("agent holds %d allocations, want %d (the 4 stale blanks released)", got, live+1-4)
	}
	if p := e.c.Agents.Problems(); len(p) > 0 {
		t.Fatal(p)
	}
	e.clk.Advance(e.s.cfg.BlankMaxAge)
	e.s.sweepBlanks(ctx)
	e.s.refillBlanks(ctx)
	if n, _ := e.s.BlankStats(); n != 0 {
		t.Fatalf("a pool unused for BlankMaxAge was refilled: %d blanks", n)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestBlankDroppedOnRegistration: when the agent registers again (after a
// restart it holds no RESERVED allocation), its segments' blanks are
// forgotten, and a put reserves as before.
func TestBlankDroppedOnRegistration(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	e.warmBlanks(t, blankTestSize)
	sg, _ := e.c.Reg.Segment("seg-0-0")
	e.s.Reconcile(ctx, "agent-0", []cluster.Segment{sg}, e.c.Agents.Table("agent-0"))
	if n, bytes := e.s.BlankStats(); n != 0 || bytes != 0 {
		t.Fatalf("after the agent registered: %d blanks of %d bytes, want none", n, bytes)
	}
	r0, _, _ := e.c.Agents.Calls()
	e.put(t, PutSpec{Key: "after", Size: blankTestSize})
	if r, _, _ := e.c.Agents.Calls(); r != r0+1 {
		t.Fatalf("put after registration: Reserves %d, want %d", r, r0+1)
	}
}

// TestBlankHeldAcrossRegistration: a put placed on a blank whose agent
// registers again before the put's write binds it keeps its replica (the
// agent's table lists the blank flagged, with no object), so the write and
// PutEnd that follow succeed; an unbound blank no put holds is left alone
// (for the agent's grace).
func TestBlankHeldAcrossRegistration(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	e.warmBlanks(t, blankTestSize)
	descs, err := e.s.PutStart(ctx, PutSpec{Key: "across", Size: blankTestSize, ClientID: "w"})
	if err != nil {
		t.Fatal(err)
	}
	sg, _ := e.c.Reg.Segment("seg-0-0")
	table := e.c.Agents.Table("agent-0")
	var blanks int
	for _, a := range table {
		if a.GetBlank() {
			blanks++
		}
	}
	if blanks != 4 { // the put's and the three left in the pool
		t.Fatalf("the agent's table lists %d blanks, want 4", blanks)
	}
	if rel := e.s.Reconcile(ctx, "agent-0", []cluster.Segment{sg}, table); len(rel) != 0 {
		t.Fatalf("reconcile returned %v for release; blanks are left to the agent's grace", rel)
	}
	e.writeAs(t, descs)
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "across", ClientID: "w", Checksum: 7}); err != nil {
		t.Fatalf("PutEnd after the agent registered again: %v", err)
	}
	if !readableSet(e.s)[rkey{DefaultTenant, "across", masterv1.Medium_MEDIUM_MEMORY}] {
		t.Fatal("the put is not readable")
	}
}

// TestBlankRoom: a pool holds at most 1/64 of its segment, blanks count as
// used when placing, and a refill never takes a segment past the low
// watermark.
func TestBlankRoom(t *testing.T) {
	e := newEnv(t, 1, 1, 1024*blankTestSize, Config{BlankPool: 64, HighWatermark: 0.2, LowWatermark: 0.1})
	ctx := context.Background()
	e.warmBlanks(t, blankTestSize)
	if n, _ := e.s.BlankStats(); n != 16 {
		t.Fatalf("refill of a 1 GiB segment's 1 MiB pool: %d blanks, want 16 (1/64 of the segment)", n)
	}
	for i := range 99 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: blankTestSize})
	}
	e.s.refillBlanks(ctx)
	n, bytes := e.s.BlankStats()
	// 101 MiB placed; the low watermark is at 102.4 MiB.
	if n != 1 {
		t.Fatalf("refill on a segment with 101 of 102.4 MiB under the low watermark used: %d blanks, want 1", n)
	}
	sg, _ := e.c.Reg.Segment("seg-0-0")
	if got, want := e.s.segs.get(0).used(sg), int64(101*blankTestSize)+bytes; got != want {
		t.Fatalf("segment used %d, want %d (objects and blanks)", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestBlankGivesWayToPuts: a put that finds no room releases the blanks
// of its medium before it evicts (they are no object's, and sit where a
// contiguous hole must form), and succeeds.
func TestBlankGivesWayToPuts(t *testing.T) {
	const small = 256 << 10
	e := newEnv(t, 1, 1, 64<<20, Config{BlankPool: 4})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "s1", Size: small})
	e.put(t, PutSpec{Key: "s2", Size: small})
	e.s.refillBlanks(ctx)
	if n, _ := e.s.BlankStats(); n != 4 {
		t.Fatalf("%d blanks of 256 KiB, want 4", n)
	}
	var blanks []metatest.Ref
	for r, al := range e.c.Agents.Live() {
		if al.Blank {
			blanks = append(blanks, r)
		}
	}
	for i := range 8 { // 64 MiB of 8 MiB objects: the last ones find no room
		e.put(t, PutSpec{Key: fmt.Sprintf("big%d", i), Size: 8 << 20})
	}
	if n, bytes := e.s.BlankStats(); n != 0 || bytes != 0 {
		t.Fatalf("after puts that found no room: %d blanks of %d bytes held, want none", n, bytes)
	}
	live := e.c.Agents.Live()
	for _, r := range blanks {
		if _, ok := live[r]; ok {
			t.Fatalf("blank %v still reserved at the agent", r)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestBlankOff: with BlankPool negative no pool is kept and every put
// reserves.
func TestBlankOff(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<30, Config{BlankPool: -1})
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c"} {
		e.put(t, PutSpec{Key: k, Size: blankTestSize})
		e.s.refillBlanks(ctx)
	}
	if r, _, _ := e.c.Agents.Calls(); r != 3 {
		t.Fatalf("%d Reserves, want 3", r)
	}
	if n, _ := e.s.BlankStats(); n != 0 {
		t.Fatalf("%d blanks with the pool off", n)
	}
}

// TestBlankRunRefills: Run's loop refills a pool that a put found low, in
// the background, with no call of the put's waiting on it.
func TestBlankRunRefills(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e := newBlankEnv(t)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.s.Run(ctx) }()
		defer func() { cancel(); <-done }()
		e.put(t, PutSpec{Key: "first", Size: blankTestSize})
		e.put(t, PutSpec{Key: "again", Size: blankTestSize})
		synctest.Wait() // Run's loop has taken the second put's kick and refilled
		if n, _ := e.s.BlankStats(); n != 4 {
			t.Fatalf("%d blanks once the refill the put asked for is done, want 4", n)
		}
	})
}

// TestBlankConcurrent: puts of two sizes from many goroutines while the
// blank loop refills and the sweep ages blanks out (the clock jumps past
// BlankMaxAge now and then): every put succeeds, and afterwards every
// allocation at the agent is an object's replica or a blank in a pool,
// none released twice or unknown. (A registration's effect on pools is
// TestBlankHeldAcrossRegistration's: the fake agents answer Reserves at
// any moment, where a registering agent's segments take no placements, so
// a registration here would race in ways a cluster does not.)
func TestBlankConcurrent(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<30, Config{BlankPool: 4, BlankMaxAge: time.Second})
	// Pools of both sizes first, so that some puts certainly take blanks
	// (the fake agents answer faster than the loop refills; one segment,
	// so the second put of a size finds the first one's pool).
	for _, size := range []uint64{blankTestSize, 4 << 10} {
		e.put(t, PutSpec{Key: fmt.Sprintf("warm/%d", size), Size: size})
		e.s.refillBlanks(context.Background())
		e.put(t, PutSpec{Key: fmt.Sprintf("warm/%d/blank", size), Size: size})
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			for i := range 40 {
				size := uint64(blankTestSize)
				if (g+i)%3 == 0 {
					size = 4 << 10
				}
				e.put(t, PutSpec{Key: fmt.Sprintf("g%d/%d", g, i), Size: size})
			}
		})
	}
	wg.Go(func() {
		for range 20 {
			e.clk.Advance(300 * time.Millisecond)
			e.s.kickBlanks()
			time.Sleep(time.Millisecond)
		}
	})
	wg.Wait()
	cancel()
	<-done
	f := &follower{set: map[rkey]bool{}}
	checkInvariants(t, e, f)
	if len(f.set) != 6*40+4 {
		t.Fatalf("%d objects readable, want %d", len(f.set), 6*40+4)
	}
	if b, r := e.s.PutReservations(); b == 0 || r == 0 {
		t.Fatalf("blanks taken %d, reserved %d: want both", b, r)
	}
}
