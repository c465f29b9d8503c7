package dataplane

import (
	"path/filepath"
	"sync"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// corrupt flips a byte of sealed allocation id in place: in a memory
// segment's mapping, or in a disk segment's data file.
func corrupt(t *testing.T, seg *segment.Segment, id uint64) {
	t.Helper()
	a, ok := seg.Lookup(id)
	if !ok {
		t.Fatalf("no allocation %d", id)
	}
	if seg.Medium() == masterv1.Medium_MEDIUM_DISK {
		testutil.FlipByte(t, filepath.Join(seg.Name(), "segment.data"), a.GetOffset()+a.GetSize()/2)
		return
	}
	h, err := seg.OpenRead(id)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	b, err := h.Bytes(0, h.Size())
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0xff
}

// TestTransferVerify: a VERIFY of an intact allocation answers OK with its
// size and checksum and drops nothing; one whose bytes were changed in
// place (memory or disk) answers DATA_LOSS CHECKSUM_MISMATCH, and the
// allocation is gone (reported to the lost sink once, reads refused). A
// write token does not verify; an allocation found intact is not read
// again for a while (answered OK from memory).
func TestTransferVerify(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	var mu sync.Mutex
	var lost []segment.LostAllocation
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		seg.SetLostSink(func(l segment.LostAllocation) { mu.Lock(); lost = append(lost, l); mu.Unlock() })
	}
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		t.Run(seg.Medium().String(), func(t *testing.T) {
			data := randBytes(300 << 10)
			put := func() uint64 {
				id := e.reserve(t, seg, uint64(len(data)))
				if errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(seg, id, token.Write)}, [][]byte{data}); err != nil || errs[0] != nil {
					t.Fatalf("Write = %v, %v", errs, err)
				}
				seal(t, seg, id, data)
				return id
			}
			verify := func(it *agentv1.TransferItem) error {
				t.Helper()
				errs, err := e.pool.Verify(ctx, e.addr, []*agentv1.TransferItem{it})
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				return errs[0]
			}
			mu.Lock()
			lost = nil
			mu.Unlock()

			good := put()
			if err := verify(e.item(seg, good, token.Read)); err != nil {
				t.Fatalf("Verify of an intact allocation = %v", err)
			}
			if err := verify(e.item(seg, good, token.Write)); rpcerr.Reason(err) != "INVALID_TOKEN" {
				t.Fatalf("Verify with a write token = %v, want INVALID_TOKEN", err)
			}
			// Found intact a moment ago: not read again, so a change made
			// since is not seen yet.
			corrupt(t, seg, good)
			if err := verify(e.item(seg, good, token.Read)); err != nil {
				t.Fatalf("Verify again within the fresh window = %v, want OK from memory", err)
			}

			bad := put()
			corrupt(t, seg, bad)
			if err := verify(e.item(seg, bad, token.Read)); rpcerr.Reason(err) != "CHECKSUM_MISMATCH" {
				t.Fatalf("Verify of a corrupted allocation = %v, want CHECKSUM_MISMATCH", err)
			}
			if _, ok := seg.Lookup(bad); ok {
				t.Fatal("the corrupted allocation is still in the table")
			}
			res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{e.item(seg, bad, token.Read)}, [][]byte{make([]byte, len(data))})
			if err != nil || rpcerr.Reason(res[0].Err) != "CHECKSUM_MISMATCH" {
				t.Fatalf("Read after the drop = %+v, %v; want CHECKSUM_MISMATCH", res, err)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(lost) != 1 || lost[0].Allocation.GetAllocationId() != bad || lost[0].Medium != seg.Medium() || lost[0].Err != nil {
				t.Fatalf("lost = %+v, want allocation %d on %v", lost, bad, seg.Medium())
			}
		})
	}
}

// TestTransferVerifyBounds: more than MaxVerifyItems items refuse the
// request (and the pool refuses to send them), and a VERIFY answered while
// verifyWorkers verifications run says LIMIT_EXCEEDED.
func TestTransferVerifyBounds(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	many := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_VERIFY}
	for range xfer.MaxVerifyItems + 1 {
		many.Items = append(many.Items, &agentv1.TransferItem{})
	}
	c := rawConn(t, e.addr)
	if _, err := c.Write(append([]byte(xfer.Preamble), frame(t, many)...)); err != nil {
		t.Fatal(err)
	}
	if err := refusal(t, c); rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("VERIFY of %d items refused with %v, want INVALID_PARAMS", len(many.Items), err)
	}
	if _, err := e.pool.Verify(t.Context(), e.addr, many.Items); rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("Pool.Verify of %d items = %v, want INVALID_PARAMS", len(many.Items), err)
	}

	id := e.reserve(t, e.mem, 100)
	seal(t, e.mem, id, make([]byte, 100))
	for range verifyWorkers {
		e.srv.verify.sem <- struct{}{}
	}
	errs, err := e.pool.Verify(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Read)})
	if err != nil || rpcerr.Reason(errs[0]) != "LIMIT_EXCEEDED" {
		t.Fatalf("Verify while the workers are busy = %v, %v; want LIMIT_EXCEEDED", errs, err)
	}
	for range verifyWorkers {
		<-e.srv.verify.sem
	}
	if errs, err := e.pool.Verify(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Read)}); err != nil || errs[0] != nil {
		t.Fatalf("Verify after = %v, %v", errs, err)
	}
}
