package testcluster_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestPutSealReceipts (issue 18 item 2): a put through the bulk path is
// sealed by its agent on write and committed by PutEnd with the agent's
// seal receipt, no Seal sent; without a receipt the master's Seal seals it
// as before; a forged, altered, misapplied or stale receipt is refused
// with its code, and the put's sealed allocation is released.
func TestPutSealReceipts(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	store := c.Master().Store
	objects := masterv1.NewObjectServiceClient(c.Conn())
	pool := xfer.NewPool(xfer.Config{})
	t.Cleanup(func() { _ = pool.Close() })
	data := bytes.Repeat([]byte("receipt "), 128<<10) // 1 MiB
	sum := checksum.Sum(data)

	seals := func() (uint64, uint64) { return store.PutSeals() }
	wantSeals := func(t *testing.T, r0, s0, dr, ds uint64) {
		t.Helper()
		if r, s := seals(); r-r0 != dr || s-s0 != ds {
			t.Fatalf("seals via receipt, via Seal: +%d, +%d; want +%d, +%d", r-r0, s-s0, dr, ds)
		}
	}
	readable := func(t *testing.T, key string) bool {
		t.Helper()
		_, err := objects.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: key})
		if err != nil && status.Code(err) != codes.NotFound {
			t.Fatalf("GetReplicaList %q: %v", key, err)
		}
		return err == nil
	}
	// allocation reports the state of an allocation at the agents.
	allocation := func(seg string, id uint64) (masterv1.AllocationState, bool) {
		for i := range c.Agents() {
			if sg, ok := c.Agent(i).Segments().Get(seg); ok {
				if a, ok := sg.Lookup(id); ok {
					return a.GetState(), true
				}
			}
		}
		return 0, false
	}
	waitReleased := func(t *testing.T, d *masterv1.ReplicaDescriptor) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			st, ok := allocation(d.GetSegmentId(), d.GetAllocationId())
			if !ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("allocation %d of %s is still %v", d.GetAllocationId(), d.GetSegmentId(), st)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	// start runs a PutStart as a raw client and writes the replicas on
	// the bulk path, asking for seals on write when seal is set.
	start := func(t *testing.T, key string, seal bool, sum uint64) ([]*masterv1.ReplicaDescriptor, [][]byte) {
		t.Helper()
		resp, err := objects.PutStart(ctx, &masterv1.PutStartRequest{Key: key, Size: uint64(len(data)), ClientId: "raw"})
		if err != nil {
			t.Fatalf("PutStart %q: %v", key, err)
		}
		var receipts [][]byte
		for _, d := range resp.GetReplicas() {
			it := &agentv1.TransferItem{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken()}
			if seal {
				it.SealChecksum = &sum
			}
			res, err := pool.WriteSealed(ctx, d.GetTransferEndpoint(), []*agentv1.TransferItem{it}, [][]byte{data})
			if err != nil {
				t.Fatalf("write %q: %v", key, err)
			}
			if res[0].Err != nil {
				t.Fatalf("write %q: %v", key, res[0].Err)
			}
			if seal != (res[0].Receipt != nil) {
				t.Fatalf("write %q with seal=%v: receipt %x", key, seal, res[0].Receipt)
			}
			st, _ := allocation(d.GetSegmentId(), d.GetAllocationId())
			if want := map[bool]masterv1.AllocationState{true: masterv1.AllocationState_ALLOCATION_STATE_SEALED,
				false: masterv1.AllocationState_ALLOCATION_STATE_RESERVED}[seal]; st != want {
				t.Fatalf("after the write the allocation is %v, want %v", st, want)
			}
			if res[0].Receipt != nil {
				receipts = append(receipts, res[0].Receipt)
			}
		}
		return resp.GetReplicas(), receipts
	}
	end := func(key string, receipts [][]byte) error {
		_, err := objects.PutEnd(ctx, &masterv1.PutEndRequest{Key: key, ClientId: "raw", Checksum: sum, SealReceipts: receipts})
		return err
	}

	t.Run("sdk put commits by receipt", func(t *testing.T) {
		r0, s0 := seals()
		cl := c.Client(t)
		if err := cl.Put(ctx, "sdk", data); err != nil {
			t.Fatal(err)
		}
		wantSeals(t, r0, s0, 1, 0)
		got, err := cl.Get(ctx, "sdk")
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("Get = %d bytes, %v", len(got), err)
		}
	})
	t.Run("sdk put without the bulk path is sealed by Seal", func(t *testing.T) {
		r0, s0 := seals()
		cl := c.Client(t, func(cfg *client.Config) { cfg.DisableTransfer = true })
		if err := cl.Put(ctx, "grpc", data); err != nil {
			t.Fatal(err)
		}
		wantSeals(t, r0, s0, 0, 1)
		if !readable(t, "grpc") {
			t.Fatal("not readable")
		}
	})
	t.Run("sdk put with DisableSealOnWrite is sealed by Seal", func(t *testing.T) {
		r0, s0 := seals()
		cl := c.Client(t, func(cfg *client.Config) { cfg.DisableSealOnWrite = true })
		if err := cl.Put(ctx, "no-seal-on-write", data); err != nil {
			t.Fatal(err)
		}
		wantSeals(t, r0, s0, 0, 1)
		if !readable(t, "no-seal-on-write") {
			t.Fatal("not readable")
		}
	})
	t.Run("raw put with a receipt", func(t *testing.T) {
		r0, s0 := seals()
		_, receipts := start(t, "raw-ok", true, sum)
		if err := end("raw-ok", receipts); err != nil {
			t.Fatal(err)
		}
		wantSeals(t, r0, s0, 1, 0)
		if !readable(t, "raw-ok") {
			t.Fatal("not readable")
		}
		// A retried PutEnd is answered OK, as before receipts.
		if err := end("raw-ok", receipts); err != nil {
			t.Fatalf("retried PutEnd: %v", err)
		}
	})
	t.Run("raw put without a receipt falls back to Seal", func(t *testing.T) {
		r0, s0 := seals()
		start(t, "raw-seal", false, sum)
		if err := end("raw-seal", nil); err != nil {
			t.Fatal(err)
		}
		wantSeals(t, r0, s0, 0, 1)
		if !readable(t, "raw-seal") {
			t.Fatal("not readable")
		}
	})
	t.Run("sealed on write but the receipt withheld: Seal of a sealed allocation is OK", func(t *testing.T) {
		r0, s0 := seals()
		start(t, "raw-withheld", true, sum)
		if err := end("raw-withheld", nil); err != nil {
			t.Fatal(err)
		}
		wantSeals(t, r0, s0, 0, 1)
	})

	t.Run("another put's receipt is skipped; Seal seals the put's own replica", func(t *testing.T) {
		// A receipt that holds but names no replica of the put vouches for
		// nothing it commits (its replica dropped meanwhile, say: meta
		// TestPutEndReceipts). The other put is not touched.
		r0, s0 := seals()
		start(t, "own", true, sum)
		otherReps, other := start(t, "other", true, sum)
		if err := end("own", other); err != nil {
			t.Fatalf("PutEnd with another put's receipt = %v, want it skipped", err)
		}
		wantSeals(t, r0, s0, 0, 1)
		if !readable(t, "own") {
			t.Fatal("not readable")
		}
		if st, _ := allocation(otherReps[0].GetSegmentId(), otherReps[0].GetAllocationId()); st != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			t.Fatalf("the other put's allocation is %v, want SEALED (its put not ended yet)", st)
		}
		if err := end("other", other); err != nil || !readable(t, "other") {
			t.Fatalf("the other put's PutEnd = %v, readable %v", err, readable(t, "other"))
		}
	})

	ring := c.Master().Identity.Keys
	epoch := c.Master().Identity.Epoch
	refused := []struct {
		name   string
		code   codes.Code
		reason masterv1.ErrorReason
		forge  func(t *testing.T, d *masterv1.ReplicaDescriptor, r []byte) [][]byte
	}{
		{"altered mac", codes.PermissionDenied, masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN,
			func(t *testing.T, _ *masterv1.ReplicaDescriptor, r []byte) [][]byte {
				r = bytes.Clone(r)
				r[len(r)-1] ^= 1
				return [][]byte{r}
			}},
		{"forged under another key", codes.PermissionDenied, masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN,
			func(t *testing.T, d *masterv1.ReplicaDescriptor, _ []byte) [][]byte {
				k := token.SigningKey{ID: ring.Keys()[0].ID, Secret: token.NewKey()}
				return [][]byte{token.SignReceipt(k, token.Receipt{SegmentID: d.GetSegmentId(), AllocationID: d.GetAllocationId(), Size: uint64(len(data)), Checksum: sum, Epoch: epoch})}
			}},
		{"a token as a receipt", codes.InvalidArgument, masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			func(t *testing.T, d *masterv1.ReplicaDescriptor, _ []byte) [][]byte { return [][]byte{d.GetToken()} }},
		{"stale epoch", codes.FailedPrecondition, masterv1.ErrorReason_ERROR_REASON_STALE_EPOCH,
			func(t *testing.T, d *masterv1.ReplicaDescriptor, _ []byte) [][]byte {
				return [][]byte{token.SignReceipt(ring.Keys()[0], token.Receipt{SegmentID: d.GetSegmentId(), AllocationID: d.GetAllocationId(), Size: uint64(len(data)), Checksum: sum, Epoch: epoch - 1})}
			}},
		{"twice", codes.InvalidArgument, masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			func(t *testing.T, _ *masterv1.ReplicaDescriptor, r []byte) [][]byte { return [][]byte{r, r} }},
		{"another checksum", codes.InvalidArgument, masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			func(t *testing.T, d *masterv1.ReplicaDescriptor, _ []byte) [][]byte {
				return [][]byte{token.SignReceipt(ring.Keys()[0], token.Receipt{SegmentID: d.GetSegmentId(), AllocationID: d.GetAllocationId(), Size: uint64(len(data)), Checksum: sum + 1, Epoch: epoch})}
			}},
	}
	for _, tt := range refused {
		t.Run("refused "+tt.name, func(t *testing.T) {
			r0, s0 := seals()
			key := "refused-" + tt.name
			reps, receipts := start(t, key, true, sum)
			err := end(key, tt.forge(t, reps[0], receipts[0]))
			if got := status.Code(err); got != tt.code {
				t.Fatalf("PutEnd = %v, want code %v", err, tt.code)
			}
			if !errors.Is(rpcerr.FromStatus(err), rpcerr.Errorf(tt.reason, "")) {
				t.Fatalf("PutEnd = %v, want reason %v", err, tt.reason)
			}
			wantSeals(t, r0, s0, 0, 0)
			if readable(t, key) {
				t.Fatal("the refused put's object is readable")
			}
			waitReleased(t, reps[0]) // sealed on write, released with the put
		})
	}

	t.Run("revoked put releases its sealed allocation", func(t *testing.T) {
		reps, receipts := start(t, "revoked", true, sum)
		if _, err := objects.PutRevoke(ctx, &masterv1.PutRevokeRequest{Key: "revoked", ClientId: "raw"}); err != nil {
			t.Fatal(err)
		}
		waitReleased(t, reps[0])
		if err := end("revoked", receipts); err == nil || readable(t, "revoked") {
			t.Fatalf("PutEnd after the revoke = %v; readable %v", err, readable(t, "revoked"))
		}
	})
	t.Run("checksum mismatch on write fails the item and seals nothing", func(t *testing.T) {
		resp, err := objects.PutStart(ctx, &masterv1.PutStartRequest{Key: "mismatch", Size: uint64(len(data)), ClientId: "raw"})
		if err != nil {
			t.Fatal(err)
		}
		d := resp.GetReplicas()[0]
		bad := sum + 1
		res, err := pool.WriteSealed(ctx, d.GetTransferEndpoint(), []*agentv1.TransferItem{{
			SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(), SealChecksum: &bad}}, [][]byte{data})
		if err != nil {
			t.Fatal(err)
		}
		if rpcerr.Reason(res[0].Err) != "CHECKSUM_MISMATCH" || res[0].Receipt != nil {
			t.Fatalf("write = %v, receipt %x; want CHECKSUM_MISMATCH and none", res[0].Err, res[0].Receipt)
		}
		if st, _ := allocation(d.GetSegmentId(), d.GetAllocationId()); st != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
			t.Fatalf("allocation is %v, want RESERVED", st)
		}
		// A partial item may not ask for a seal.
		res, err = pool.WriteSealed(ctx, d.GetTransferEndpoint(), []*agentv1.TransferItem{{
			SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(), SealChecksum: &sum}}, [][]byte{data[:1000]})
		if err != nil {
			t.Fatal(err)
		}
		if rpcerr.Reason(res[0].Err) != "INVALID_PARAMS" {
			t.Fatalf("partial sealed write = %v, want INVALID_PARAMS", res[0].Err)
		}
		if _, err := objects.PutRevoke(ctx, &masterv1.PutRevokeRequest{Key: "mismatch", ClientId: "raw"}); err != nil {
			t.Fatal(err)
		}
	})
}
