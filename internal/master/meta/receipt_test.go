package meta

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

// TestPutEndReceipts: PutEnd commits a replica with a valid seal receipt
// without a Seal and seals the others (a put of two replicas, one
// receipted); a receipt that does not hold fails the put and releases
// every replica.
func TestPutEndReceipts(t *testing.T) {
	ctx := context.Background()
	const size, sum = 100, 0xabc
	start := func(t *testing.T, e *env, key string) []*masterv1.ReplicaDescriptor {
		t.Helper()
		reps, err := e.s.PutStart(ctx, PutSpec{Tenant: "t", Key: key, Size: size, ReplicaNum: 2, ClientID: "w"})
		if err != nil || len(reps) != 2 {
			t.Fatalf("PutStart = %d replicas, %v", len(reps), err)
		}
		return reps
	}
	receipt := func(e *env, d *masterv1.ReplicaDescriptor, mod func(*token.Receipt)) []byte {
		r := token.Receipt{SegmentID: d.GetSegmentId(), AllocationID: d.GetAllocationId(), Size: size, Checksum: sum, Epoch: e.s.Epoch()}
		if mod != nil {
			mod(&r)
		}
		return token.SignReceipt(e.s.keys.Keys()[0], r)
	}
	t.Run("one receipted, one sealed", func(t *testing.T) {
		e := newEnv(t, 2, 1, 1<<20, Config{})
		reps := start(t, e, "k")
		_, seal0, _ := e.c.Agents.Calls()
		err := e.s.PutEnd(ctx, PutEndSpec{Tenant: "t", Key: "k", ClientID: "w", Checksum: sum, Receipts: [][]byte{receipt(e, reps[0], nil)}})
		if err != nil {
			t.Fatal(err)
		}
		if _, seal, _ := e.c.Agents.Calls(); seal-seal0 != 1 {
			t.Fatalf("%d Seal calls, want 1 (the replica without a receipt)", seal-seal0)
		}
		if r, s := e.s.PutSeals(); r != 1 || s != 1 {
			t.Fatalf("PutSeals = %d, %d; want 1, 1", r, s)
		}
		if got := completeOn(e.s, reps[0].GetSegmentId()) + completeOn(e.s, reps[1].GetSegmentId()); got != 2 {
			t.Fatalf("%d COMPLETE replicas, want 2", got)
		}
	})
	for _, tt := range []struct {
		name   string
		reason string
		bad    func(e *env, reps []*masterv1.ReplicaDescriptor) []byte
		twice  bool // the receipt is passed twice
	}{
		{"malformed", "INVALID_PARAMS", func(*env, []*masterv1.ReplicaDescriptor) []byte { return []byte{1, 2, 3} }, false},
		{"forged", "INVALID_TOKEN", func(e *env, reps []*masterv1.ReplicaDescriptor) []byte {
			return token.SignReceipt(token.SigningKey{ID: e.s.keys.Keys()[0].ID, Secret: token.NewKey()},
				token.Receipt{SegmentID: reps[0].GetSegmentId(), AllocationID: reps[0].GetAllocationId(), Size: size, Checksum: sum, Epoch: e.s.Epoch()})
		}, false},
		{"stale epoch", "STALE_EPOCH", func(e *env, reps []*masterv1.ReplicaDescriptor) []byte {
			return receipt(e, reps[0], func(r *token.Receipt) { r.Epoch-- })
		}, false},
		{"another size", "INVALID_PARAMS", func(e *env, reps []*masterv1.ReplicaDescriptor) []byte {
			return receipt(e, reps[0], func(r *token.Receipt) { r.Size++ })
		}, false},
		{"named twice", "INVALID_PARAMS", func(e *env, reps []*masterv1.ReplicaDescriptor) []byte {
			return receipt(e, reps[0], nil)
		}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, 2, 1, 1<<20, Config{})
			reps := start(t, e, "k")
			_, seal0, rel0 := e.c.Agents.Calls()
			receipts := [][]byte{tt.bad(e, reps)}
			if tt.twice {
				receipts = append(receipts, receipts[0])
			}
			err := e.s.PutEnd(ctx, PutEndSpec{Tenant: "t", Key: "k", ClientID: "w", Checksum: sum, Receipts: receipts})
			if got := rpcerr.Reason(err); got != tt.reason {
				t.Fatalf("PutEnd = %v (reason %q), want %s", err, got, tt.reason)
			}
			_, seal, rel := e.c.Agents.Calls()
			if seal != seal0 || rel == rel0 {
				t.Fatalf("Seal calls +%d, Release calls +%d; want none and some", seal-seal0, rel-rel0)
			}
			if live := e.c.Agents.Live(); len(live) != 0 {
				t.Fatalf("allocations left at the agents: %v", live)
			}
			if o, _, _ := e.s.Stats(); o != 0 {
				t.Fatalf("%d objects left, want 0", o)
			}
		})
	}
	// A receipt that holds but names no replica of the put — the replica's
	// segment was dropped while the bytes were on the way (an agent frozen
	// past --unmount-after seals the write when it wakes; make soak) — is
	// skipped: the other replica commits. It used to fail the whole put
	// INVALID_PARAMS.
	for _, tt := range []struct {
		name string
		bad  func(e *env, reps []*masterv1.ReplicaDescriptor) []byte
		drop bool // reps[1]'s segment is dropped before PutEnd
	}{
		{"replica dropped meanwhile", func(e *env, reps []*masterv1.ReplicaDescriptor) []byte { return receipt(e, reps[1], nil) }, true},
		{"another allocation", func(e *env, reps []*masterv1.ReplicaDescriptor) []byte {
			return receipt(e, reps[0], func(r *token.Receipt) { r.AllocationID += 1000 })
		}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, 2, 1, 1<<20, Config{})
			reps := start(t, e, "k")
			receipts := [][]byte{receipt(e, reps[0], nil), tt.bad(e, reps)}
			want := 2
			if tt.drop {
				e.s.DropSegments(ctx, []string{reps[1].GetSegmentId()})
				want = 1
			}
			if err := e.s.PutEnd(ctx, PutEndSpec{Tenant: "t", Key: "k", ClientID: "w", Checksum: sum, Receipts: receipts}); err != nil {
				t.Fatalf("PutEnd with a receipt naming no replica of the put = %v, want it skipped", err)
			}
			if got := completeOn(e.s, reps[0].GetSegmentId()) + completeOn(e.s, reps[1].GetSegmentId()); got != want {
				t.Fatalf("%d COMPLETE replicas, want %d", got, want)
			}
		})
	}
}
