package meta

import (
	"context"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

const spareSum = 0x5a5a

// leaseOne warms the pool of blankTestSize and leases client "w" of tenant
// "t" one spare.
func (e *env) leaseOne(t *testing.T) *masterv1.ReplicaDescriptor {
	t.Helper()
	e.warmBlanks(t, blankTestSize)
	ds := e.s.LeaseSpares("w", "t", blankTestSize, 1)
	if len(ds) != 1 {
		t.Fatalf("LeaseSpares: %d spares, want 1", len(ds))
	}
	return ds[0]
}

// writeSpare does what the agent does for a spare's write: the token is
// checked (a spare: no key) and the allocation bound to the item's key; it
// returns the version 2 receipt the agent answers.
func (e *env) writeSpare(t *testing.T, d *masterv1.ReplicaDescriptor, key string) []byte {
	t.Helper()
	c, err := token.Parse(d.GetToken(), e.s.keys.Keys()...)
	if err != nil {
		t.Fatalf("spare token: %v", err)
	}
	if !c.Spare || c.Key != "" || c.Mode != token.Write || c.SegmentID != d.GetSegmentId() || c.AllocationID != d.GetAllocationId() {
		t.Fatalf("spare token claims %+v", c)
	}
	if err := e.c.Agents.Bind(c.SegmentID, c.AllocationID, c.Tenant, key, c.ReplicaID, "", false); err != nil {
		t.Fatalf("bind spare: %v", err)
	}
	return token.SignReceipt(e.s.keys.Keys()[0], token.Receipt{SegmentID: d.GetSegmentId(), AllocationID: d.GetAllocationId(),
		Size: blankTestSize, Checksum: spareSum, Epoch: e.s.Epoch(), Tenant: c.Tenant, Key: key})
}

func commitSpec(d *masterv1.ReplicaDescriptor, key string, receipt []byte) PutEndSpec {
	return PutEndSpec{Tenant: "t", Key: key, ClientID: "w", Checksum: spareSum, Receipts: [][]byte{receipt},
		Spare: &SpareSpec{SegmentID: d.GetSegmentId(), AllocationID: d.GetAllocationId(), Put: PutSpec{Size: blankTestSize}}}
}

// TestSpareCommit: a leased spare, written under a key and committed by
// one PutEnd, is a complete object on the spare's allocation; the master
// sends the agent neither Reserve nor Seal for it, and the change log says
// stored.
func TestSpareCommit(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	f := &follower{set: map[rkey]bool{}}
	d := e.leaseOne(t)
	if held, leased, _, _ := e.s.SpareStats(); held != 1 || leased != 1 {
		t.Fatalf("SpareStats: %d held, %d leased; want 1, 1", held, leased)
	}
	checkInvariants(t, e, f)
	r0, s0, _ := e.c.Agents.Calls()
	rc := e.writeSpare(t, d, "spare/k")
	if err := e.s.PutEnd(ctx, commitSpec(d, "spare/k", rc)); err != nil {
		t.Fatalf("commit: %v", err)
	}
	if r, s, _ := e.c.Agents.Calls(); r != r0 || s != s0 {
		t.Fatalf("commit sent %d Reserves and %d Seals, want none", r-r0, s-s0)
	}
	rl, err := e.s.Get(ctx, GetSpec{Tenant: "t", Key: "spare/k"})
	if err != nil || len(rl.GetReplicas()) != 1 {
		t.Fatalf("GetReplicaList = %v, %v", rl, err)
	}
	if got := rl.GetReplicas()[0]; got.GetSegmentId() != d.GetSegmentId() || got.GetAllocationId() != d.GetAllocationId() {
		t.Fatalf("replica on %s/%d, want the spare %s/%d", got.GetSegmentId(), got.GetAllocationId(), d.GetSegmentId(), d.GetAllocationId())
	}
	if held, _, committed, _ := e.s.SpareStats(); held != 0 || committed != 1 {
		t.Fatalf("SpareStats after commit: %d held, %d committed; want 0, 1", held, committed)
	}
	checkInvariants(t, e, f)
	if !f.set[rkey{"t", "spare/k", masterv1.Medium_MEDIUM_MEMORY}] {
		t.Fatal("the change log did not record the committed object as stored")
	}
	// A second commit of the same spare: the lease is gone.
	if err := e.s.PutEnd(ctx, commitSpec(d, "spare/k2", rc)); rpcerr.Reason(err) != "PUT_EXPIRED" {
		t.Fatalf("second commit of the spare = %v, want PUT_EXPIRED", err)
	}
	checkInvariants(t, e, f)
}

// TestSpareRefusals: a commit the master refuses after taking the lease
// releases the spare's allocation; one whose lease is not the caller's
// touches nothing.
func TestSpareRefusals(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name     string
		reason   string
		released bool // the allocation is released (else still leased)
		commit   func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec
	}{
		{"another client", "PUT_EXPIRED", false, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			sp := commitSpec(d, "k", e.writeSpare(t, d, "k"))
			sp.ClientID = "intruder"
			return sp
		}},
		{"another tenant", "PUT_EXPIRED", false, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			sp := commitSpec(d, "k", e.writeSpare(t, d, "k"))
			sp.Tenant = "other"
			return sp
		}},
		{"another size", "INVALID_PARAMS", false, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			sp := commitSpec(d, "k", e.writeSpare(t, d, "k"))
			sp.Spare.Put.Size++
			return sp
		}},
		{"two replicas", "INVALID_PARAMS", false, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			sp := commitSpec(d, "k", e.writeSpare(t, d, "k"))
			sp.Spare.Put.ReplicaNum = 2
			return sp
		}},
		{"no receipt", "INVALID_PARAMS", false, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			sp := commitSpec(d, "k", nil)
			sp.Receipts = nil
			return sp
		}},
		{"receipt for another key", "INVALID_TOKEN", true, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			return commitSpec(d, "k", e.writeSpare(t, d, "other-key"))
		}},
		{"receipt not bound to an object", "INVALID_PARAMS", true, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			e.writeSpare(t, d, "k")
			return commitSpec(d, "k", token.SignReceipt(e.s.keys.Keys()[0], token.Receipt{SegmentID: d.GetSegmentId(),
				AllocationID: d.GetAllocationId(), Size: blankTestSize, Checksum: spareSum, Epoch: e.s.Epoch()}))
		}},
		{"key exists", "OBJECT_ALREADY_EXISTS", true, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			e.put(t, PutSpec{Tenant: "t", Key: "k", Size: 64})
			return commitSpec(d, "k", e.writeSpare(t, d, "k"))
		}},
		{"expired", "PUT_EXPIRED", false, func(e *env, d *masterv1.ReplicaDescriptor) PutEndSpec {
			sp := commitSpec(d, "k", e.writeSpare(t, d, "k"))
			e.clk.Advance(e.s.cfg.BlankMaxAge + time.Second)
			return sp
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newBlankEnv(t)
			d := e.leaseOne(t)
			sp := tt.commit(e, d)
			_, _, rel0 := e.c.Agents.Calls()
			err := e.s.PutEnd(ctx, sp)
			if got := rpcerr.Reason(err); got != tt.reason {
				t.Fatalf("commit = %v (reason %q), want %s", err, got, tt.reason)
			}
			_, _, rel := e.c.Agents.Calls()
			ref := metatest.Ref{Segment: d.GetSegmentId(), ID: d.GetAllocationId()}
			_, live := e.c.Agents.Live()[ref]
			held, _, _, _ := e.s.SpareStats()
			switch {
			case tt.released && (rel == rel0 || live || held != 0):
				t.Fatalf("refused commit: %d Releases, allocation live %v, %d leases held; want it released", rel-rel0, live, held)
			case !tt.released && (rel != rel0 || !live):
				t.Fatalf("commit not the lease's: %d Releases, allocation live %v; want nothing touched", rel-rel0, live)
			}
			if got := readableSet(e.s)[rkey{"t", "k", masterv1.Medium_MEDIUM_MEMORY}]; got && tt.reason != "OBJECT_ALREADY_EXISTS" {
				t.Fatal("a refused commit made the object readable")
			}
			if tt.name == "expired" {
				// The sweep releases an expired lease's allocation.
				e.s.sweepBlanks(ctx)
				if _, live := e.c.Agents.Live()[ref]; live {
					t.Fatal("expired spare not released by the sweep")
				}
			}
			if tt.released || tt.name == "expired" {
				checkInvariants(t, e, &follower{set: map[rkey]bool{}})
			}
		})
	}
}

// TestSpareLeaseLimits: a client holds at most maxSparesHeld leases, asks
// for at most maxSparesAsked at once; a following store and a size without
// a pool lease none.
func TestSpareLeaseLimits(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<30, Config{BlankPool: 8})
	e.warmBlanks(t, blankTestSize)
	if got := len(e.s.LeaseSpares("w", "t", blankTestSize, 5)); got != maxSparesAsked {
		t.Fatalf("asked 5: %d spares, want %d", got, maxSparesAsked)
	}
	e.s.refillBlanks(context.Background())
	total := maxSparesAsked
	for range 3 {
		total += len(e.s.LeaseSpares("w", "t", blankTestSize, 2))
		e.s.refillBlanks(context.Background())
	}
	if total != maxSparesHeld {
		t.Fatalf("client holds %d spares, want at most %d", total, maxSparesHeld)
	}
	if got := len(e.s.LeaseSpares("w2", "t", 12345, 2)); got != 0 {
		t.Fatalf("a size without a pool: %d spares", got)
	}
	if got := len(e.s.LeaseSpares("", "t", blankTestSize, 2)); got != 0 {
		t.Fatalf("no client id: %d spares", got)
	}
	// A lease is not a put's use of a size: one put of a size and a
	// lease of it leave the size unpooled (pools start at the second put).
	n0, _ := e.s.BlankStats()
	e.put(t, PutSpec{Key: "once", Size: 4096})
	if got := len(e.s.LeaseSpares("w3", "t", 4096, 2)); got != 0 {
		t.Fatalf("a size put once: %d spares", got)
	}
	e.s.refillBlanks(context.Background())
	if n, _ := e.s.BlankStats(); n != n0 {
		t.Fatalf("a size put once and leased: blanks %d -> %d, want it unpooled", n0, n)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestSpareAcrossRegistration: an agent's registration keeps the leases
// its table lists — a written, sealed spare is not adopted, and its
// client's commit still places it — and ends those it does not (the agent
// restarted: a commit is then PUT_EXPIRED).
func TestSpareAcrossRegistration(t *testing.T) {
	e := newBlankEnv(t)
	ctx := context.Background()
	f := &follower{set: map[rkey]bool{}}
	e.warmBlanks(t, blankTestSize)
	ds := e.s.LeaseSpares("w", "t", blankTestSize, 2)
	if len(ds) != 2 {
		t.Fatalf("LeaseSpares: %d spares, want 2", len(ds))
	}
	written, unwritten := ds[0], ds[1]
	rc := e.writeSpare(t, written, "k")
	// The agent sealed it on write.
	if st, err := e.c.Agents.Seal(ctx, "agent-0", []*masterv1.SealItem{{SegmentId: written.GetSegmentId(),
		AllocationId: written.GetAllocationId(), Checksum: spareSum}}); err != nil || st[0].GetCode() != 0 {
		t.Fatalf("seal the written spare at the fake agent: %v %v", st, err)
	}
	sg, _ := e.c.Reg.Segment("seg-0-0")
	table := e.c.Agents.Table("agent-0")
	e.s.Reconcile(ctx, "agent-0", []cluster.Segment{sg}, table)
	if held, _, _, lapsed := e.s.SpareStats(); held != 2 || lapsed != 0 {
		t.Fatalf("after a registration that listed both: %d leases held, %d lapsed; want 2, 0", held, lapsed)
	}
	if readableSet(e.s)[rkey{"t", "k", masterv1.Medium_MEDIUM_MEMORY}] {
		t.Fatal("the registration adopted a leased spare as an object")
	}
	if err := e.s.PutEnd(ctx, commitSpec(written, "k", rc)); err != nil {
		t.Fatalf("commit after the registration: %v", err)
	}
	if rl, err := e.s.Get(ctx, GetSpec{Tenant: "t", Key: "k"}); err != nil || len(rl.GetReplicas()) != 1 ||
		rl.GetReplicas()[0].GetAllocationId() != written.GetAllocationId() {
		t.Fatalf("after the commit: %v, %v; want one replica on the spare's allocation %d", rl, err, written.GetAllocationId())
	}

	// The agent restarted: its table lacks the unwritten spare.
	var rest []*masterv1.Allocation
	for _, a := range e.c.Agents.Table("agent-0") {
		if a.GetAllocationId() != unwritten.GetAllocationId() {
			rest = append(rest, a)
		}
	}
	e.s.Reconcile(ctx, "agent-0", []cluster.Segment{sg}, rest)
	if held, _, _, lapsed := e.s.SpareStats(); held != 0 || lapsed != 1 {
		t.Fatalf("after a registration without it: %d leases held, %d lapsed; want 0, 1", held, lapsed)
	}
	rc2 := e.writeSpare(t, unwritten, "k2")
	if err := e.s.PutEnd(ctx, commitSpec(unwritten, "k2", rc2)); rpcerr.Reason(err) != "PUT_EXPIRED" {
		t.Fatalf("commit of a spare its agent no longer listed = %v, want PUT_EXPIRED", err)
	}
	// (The fake agent still holds it and the pools' blanks the
	// registrations forgot; a restarted one would not, so the invariants'
	// allocation check does not apply here.)
	f.catchUp(t, e.s.log)
	if got := completeOn(e.s, written.GetSegmentId()); got != 3 {
		t.Fatalf("%d COMPLETE replicas on the segment, want 3 (two warm-up puts and the spare)", got)
	}
	if !f.set[rkey{"t", "k", masterv1.Medium_MEDIUM_MEMORY}] {
		t.Fatal("the committed spare is not recorded as stored")
	}
}
