package dataplane

import (
	"path/filepath"
	"sync"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
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

// TestVerify: DataService.Verify, the gRPC data path's VERIFY, answers as
// the transfer op does (one verifyItem): an intact allocation OK with its
// size and checksum, nothing dropped; a write token INVALID_TOKEN; one
// changed in place (memory or disk) DATA_LOSS CHECKSUM_MISMATCH, the
// allocation gone (reported to the lost sink once, reads refused); busy
// workers LIMIT_EXCEEDED. More than MaxVerifyItems items refuse the call
// with InvalidArgument before any item is read. Failures count under the
// method label "verify".
func TestVerify(t *testing.T) {
	e := start(t)
	ctx := t.Context()
	var mu sync.Mutex
	var lost []segment.LostAllocation
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		seg.SetLostSink(func(l segment.LostAllocation) { mu.Lock(); lost = append(lost, l); mu.Unlock() })
	}
	errCount := func(reason string) float64 { return promtest.ToFloat64(e.srv.errs.WithLabelValues("verify", reason)) }
	item := func(seg *segment.Segment, id uint64, mode token.Mode) *agentv1.BatchReadItem {
		return &agentv1.BatchReadItem{SegmentId: seg.ID(), AllocationId: id, Token: e.tok(seg, id, mode)}
	}
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		t.Run(seg.Medium().String(), func(t *testing.T) {
			data := randBytes(300 << 10)
			put := func() uint64 {
				t.Helper()
				id := e.reserve(t, seg, uint64(len(data)))
				resp, err := e.client.BatchWrite(ctx, &agentv1.BatchWriteRequest{Items: []*agentv1.BatchWriteItem{
					{SegmentId: seg.ID(), AllocationId: id, Token: e.tok(seg, id, token.Write), Data: data}}})
				if err != nil || resp.GetResults()[0].GetCode() != 0 {
					t.Fatalf("BatchWrite = %v, %v", resp, err)
				}
				seal(t, seg, id, data)
				return id
			}
			verify := func(items ...*agentv1.BatchReadItem) []*agentv1.VerifyResult {
				t.Helper()
				resp, err := e.client.Verify(ctx, &agentv1.VerifyRequest{Items: items})
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				if got := len(resp.GetResults()); got != len(items) {
					t.Fatalf("Verify of %d items: got %d results", len(items), got)
				}
				return resp.GetResults()
			}
			mu.Lock()
			lost = nil
			mu.Unlock()

			good := put()
			r := verify(item(seg, good, token.Read), item(seg, good, token.Write))
			if r[0].GetStatus().GetCode() != 0 || r[0].GetObjectSize() != uint64(len(data)) || r[0].GetChecksum() != checksum.Sum(data) {
				t.Fatalf("Verify of an intact allocation = %v, want OK, size %d, its checksum", r[0], len(data))
			}
			if got := r[1].GetStatus().GetReason(); got != "INVALID_TOKEN" {
				t.Fatalf("Verify with a write token = %v, want INVALID_TOKEN", r[1].GetStatus())
			}
			if _, ok := seg.Lookup(good); !ok {
				t.Fatal("the intact allocation was dropped")
			}

			bad := put()
			corrupt(t, seg, bad)
			many := make([]*agentv1.BatchReadItem, xfer.MaxVerifyItems+1)
			for i := range many {
				many[i] = item(seg, bad, token.Read)
			}
			before := errCount("INVALID_PARAMS")
			_, err := e.client.Verify(ctx, &agentv1.VerifyRequest{Items: many})
			wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
			if got := errCount("INVALID_PARAMS"); got != before+1 {
				t.Fatalf("verify INVALID_PARAMS errors = %v, want %v", got, before+1)
			}
			if _, ok := seg.Lookup(bad); !ok {
				t.Fatal("a refused Verify of too many items read them: the corrupted allocation is gone")
			}

			for range verifyWorkers {
				e.srv.verify.sem <- struct{}{}
			}
			r = verify(item(seg, bad, token.Read))
			for range verifyWorkers {
				<-e.srv.verify.sem
			}
			if got := r[0].GetStatus().GetReason(); got != "LIMIT_EXCEEDED" {
				t.Fatalf("Verify while the workers are busy = %v, want LIMIT_EXCEEDED", r[0].GetStatus())
			}

			before = errCount("CHECKSUM_MISMATCH")
			r = verify(item(seg, bad, token.Read))
			if st := r[0].GetStatus(); st.GetReason() != "CHECKSUM_MISMATCH" || codes.Code(st.GetCode()) != codes.DataLoss {
				t.Fatalf("Verify of a corrupted allocation = %v, want DATA_LOSS CHECKSUM_MISMATCH", st)
			}
			if got := errCount("CHECKSUM_MISMATCH"); got != before+1 {
				t.Fatalf("verify CHECKSUM_MISMATCH errors = %v, want %v", got, before+1)
			}
			if _, ok := seg.Lookup(bad); ok {
				t.Fatal("the corrupted allocation is still in the table")
			}
			rr, err := e.client.BatchRead(ctx, &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{item(seg, bad, token.Read)}})
			if err != nil || rr.GetResults()[0].GetStatus().GetReason() != "CHECKSUM_MISMATCH" {
				t.Fatalf("BatchRead after the drop = %v, %v; want CHECKSUM_MISMATCH", rr.GetResults(), err)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(lost) != 1 || lost[0].Allocation.GetAllocationId() != bad || lost[0].Medium != seg.Medium() || lost[0].Err != nil {
				t.Fatalf("lost = %+v, want allocation %d on %v", lost, bad, seg.Medium())
			}
		})
	}
}
