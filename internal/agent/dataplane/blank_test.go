package dataplane

import (
	"bytes"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// Blank reservations (issue 18 item 2): the master reserves space with no
// object, and the write token of the put it later places there names the
// object and replica; the first write that opens the blank binds it.

// reserveBlank reserves a blank of size bytes in seg.
func reserveBlank(t testing.TB, seg *segment.Segment, size uint64) uint64 {
	t.Helper()
	a, err := seg.Reserve(&masterv1.ReserveItem{SegmentId: seg.ID(), Size: size, Blank: true}, now)
	if err != nil {
		t.Fatal(err)
	}
	return a.GetAllocationId()
}

// blankTok signs a token for tenant t's key in allocation id of seg, with
// the replica identity the master signs into write tokens.
func blankTok(k token.SigningKey, seg *segment.Segment, id uint64, mode token.Mode, key string) []byte {
	return token.Sign(k, token.Claims{Mode: mode, Tenant: "t", Key: key, SegmentID: seg.ID(), AllocationID: id,
		Expiry: now.Add(time.Minute), ReplicaID: 3, Group: "grp", HardPin: true})
}

// wantBound checks that allocation id of seg holds key's object, replica 3
// of group grp, hard-pinned, in state st.
func wantBound(t *testing.T, seg *segment.Segment, id uint64, key string, st masterv1.AllocationState) {
	t.Helper()
	a, ok := seg.Lookup(id)
	if !ok || a.GetTenant() != "t" || a.GetKey() != key || a.GetReplicaId() != 3 || a.GetGroupId() != "grp" || !a.GetHardPin() || a.GetState() != st {
		t.Fatalf("allocation %d = %v, want t/%s replica 3 group grp hard-pinned %v", id, a, key, st)
	}
}

// wantReceipt checks a seal receipt names allocation id of seg, sealed
// with data's checksum.
func wantReceipt(t *testing.T, k token.SigningKey, receipt []byte, seg *segment.Segment, id uint64, data []byte) {
	t.Helper()
	r, err := token.NewReceiptKeys(k).Open(receipt)
	if err != nil || r.SegmentID != seg.ID() || r.AllocationID != id || r.Size != uint64(len(data)) || r.Checksum != checksum.Sum(data) {
		t.Fatalf("seal receipt = %+v, %v; want allocation %d of %s, %d bytes, checksum %#x", r, err, id, seg.ID(), len(data), checksum.Sum(data))
	}
}

// TestBlankWriteGRPC: DataService.Write and BatchWrite bind a blank to
// their token's object, which then seals and reads back; a token for
// another object is refused on the bound allocation, for writes and reads.
func TestBlankWriteGRPC(t *testing.T) {
	e := start(t)
	ctx := t.Context()
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		t.Run(seg.Medium().String(), func(t *testing.T) {
			data := randBytes(3<<20 + 5)
			id := reserveBlank(t, seg, uint64(len(data)))
			// The first half binds the blank, the second half and another
			// object's write meet a bound allocation.
			hdr := func(key string, off uint64) *agentv1.WriteHeader {
				return &agentv1.WriteHeader{SegmentId: seg.ID(), AllocationId: id, Token: blankTok(e.key, seg, id, token.Write, key), Offset: off}
			}
			half := uint64(len(data) / 2)
			if n, err := e.write(ctx, hdr("k", 0), data[:half], 1<<20); err != nil || n != half {
				t.Fatalf("Write of a blank = %d, %v", n, err)
			}
			wantBound(t, seg, id, "k", masterv1.AllocationState_ALLOCATION_STATE_RESERVED)
			_, err := e.write(ctx, hdr("other", half), data[half:], 1<<20)
			wantErr(t, err, codes.PermissionDenied, "INVALID_TOKEN")
			if n, err := e.write(ctx, hdr("k", half), data[half:], 1<<20); err != nil || n != uint64(len(data))-half {
				t.Fatalf("second Write of the bound blank = %d, %v", n, err)
			}
			wantBound(t, seg, id, "k", masterv1.AllocationState_ALLOCATION_STATE_RESERVED)
			seal(t, seg, id, data)
			wantBound(t, seg, id, "k", masterv1.AllocationState_ALLOCATION_STATE_SEALED)

			got, first, _, err := e.read(ctx, &agentv1.ReadRequest{SegmentId: seg.ID(), AllocationId: id, Token: blankTok(e.key, seg, id, token.Read, "k")})
			if err != nil || !bytes.Equal(got, data) || first.GetChecksum() != checksum.Sum(data) {
				t.Fatalf("Read of the sealed blank: %d bytes, equal %v, err %v", len(got), bytes.Equal(got, data), err)
			}
			_, _, _, err = e.read(ctx, &agentv1.ReadRequest{SegmentId: seg.ID(), AllocationId: id, Token: blankTok(e.key, seg, id, token.Read, "other")})
			wantErr(t, err, codes.PermissionDenied, "INVALID_TOKEN")
		})
	}

	// BatchWrite: a blank bound by its item, and another object's item
	// onto it refused.
	data := randBytes(1000)
	id := reserveBlank(t, e.mem, uint64(len(data)))
	resp, err := e.client.BatchWrite(ctx, &agentv1.BatchWriteRequest{Items: []*agentv1.BatchWriteItem{
		{SegmentId: e.mem.ID(), AllocationId: id, Token: blankTok(e.key, e.mem, id, token.Write, "batch"), Data: data},
		{SegmentId: e.mem.ID(), AllocationId: id, Token: blankTok(e.key, e.mem, id, token.Write, "other"), Data: make([]byte, len(data))},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.GetResults(); r[0].GetCode() != 0 || r[1].GetReason() != "INVALID_TOKEN" {
		t.Fatalf("BatchWrite results = %v, want OK then INVALID_TOKEN", r)
	}
	seal(t, e.mem, id, data)
	wantBound(t, e.mem, id, "batch", masterv1.AllocationState_ALLOCATION_STATE_SEALED)
	rresp, err := e.client.BatchRead(ctx, &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{
		{SegmentId: e.mem.ID(), AllocationId: id, Token: blankTok(e.key, e.mem, id, token.Read, "batch")},
	}})
	if err != nil || !bytes.Equal(rresp.GetResults()[0].GetData(), data) {
		t.Fatalf("BatchRead of the sealed blank = %v, %v", rresp.GetResults(), err)
	}
}

// TestBlankWriteTransfer: the bulk transfer listener binds a blank to its
// item's token, seals it on write (memory: from the checksum computed on
// receipt; disk: Seal) with a receipt, and it reads back; a token for
// another object is refused on a bound allocation.
func TestBlankWriteTransfer(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		t.Run(seg.Medium().String(), func(t *testing.T) {
			data := randBytes(1<<20 + 3)
			id := reserveBlank(t, seg, uint64(len(data)))
			it := &agentv1.TransferItem{SegmentId: seg.ID(), AllocationId: id, Token: blankTok(e.key, seg, id, token.Write, "k"), SealChecksum: proto.Uint64(checksum.Sum(data))}
			res, err := e.pool.WriteSealed(ctx, e.addr, []*agentv1.TransferItem{it}, [][]byte{data})
			if err != nil || res[0].Err != nil {
				t.Fatalf("WriteSealed of a blank = %v, %v", res, err)
			}
			wantReceipt(t, e.key, res[0].Receipt, seg, id, data)
			wantBound(t, seg, id, "k", masterv1.AllocationState_ALLOCATION_STATE_SEALED)
			dst := make([]byte, len(data))
			rres, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{{SegmentId: seg.ID(), AllocationId: id, Token: blankTok(e.key, seg, id, token.Read, "k")}}, [][]byte{dst})
			if err != nil || rres[0].Err != nil || !bytes.Equal(dst, data) {
				t.Fatalf("Read of the sealed blank = %v, %v", rres, err)
			}

			// Bound by a plain write, still RESERVED: another object's
			// write is refused.
			id2 := reserveBlank(t, seg, 4096)
			item := func(key string) *agentv1.TransferItem {
				return &agentv1.TransferItem{SegmentId: seg.ID(), AllocationId: id2, Token: blankTok(e.key, seg, id2, token.Write, key)}
			}
			errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{item("k2"), item("other")}, [][]byte{data[:4096], data[:4096]})
			if err != nil || errs[0] != nil || rpcerr.Reason(errs[1]) != "INVALID_TOKEN" {
				t.Fatalf("Write = %v, %v; want OK then INVALID_TOKEN", errs, err)
			}
			wantBound(t, seg, id2, "k2", masterv1.AllocationState_ALLOCATION_STATE_RESERVED)
			seal(t, seg, id2, data[:4096])
		})
	}
}

// TestBlankWriteShm: the shared-memory socket binds a blank to its item's
// token when it grants the write, seals it on release with a receipt, and
// it reads back; a token for another object is refused on a bound
// allocation.
func TestBlankWriteShm(t *testing.T) {
	e := startShm(t, ShmConfig{})
	ctx := t.Context()
	data := randBytes(1<<20 + 3)
	id := reserveBlank(t, e.shared, uint64(len(data)))
	it := &agentv1.TransferItem{SegmentId: e.shared.ID(), AllocationId: id, Token: blankTok(e.key, e.shared, id, token.Write, "k"), SealChecksum: proto.Uint64(checksum.Sum(data))}
	res, err := e.client.WriteSealed(ctx, []*agentv1.TransferItem{it}, [][]byte{data})
	if err != nil || res[0].Err != nil {
		t.Fatalf("WriteSealed of a blank = %v, %v", res, err)
	}
	wantReceipt(t, e.key, res[0].Receipt, e.shared, id, data)
	wantBound(t, e.shared, id, "k", masterv1.AllocationState_ALLOCATION_STATE_SEALED)
	dst := make([]byte, len(data))
	rres, err := e.client.Read(ctx, []*agentv1.TransferItem{{SegmentId: e.shared.ID(), AllocationId: id, Token: blankTok(e.key, e.shared, id, token.Read, "k")}}, [][]byte{dst})
	if err != nil || rres[0].Err != nil || !bytes.Equal(dst, data) {
		t.Fatalf("Read of the sealed blank = %v, %v", rres, err)
	}

	id2 := reserveBlank(t, e.shared, 4096)
	item := func(key string) *agentv1.TransferItem {
		return &agentv1.TransferItem{SegmentId: e.shared.ID(), AllocationId: id2, Token: blankTok(e.key, e.shared, id2, token.Write, key)}
	}
	errs, err := e.client.Write(ctx, []*agentv1.TransferItem{item("k2")}, [][]byte{data[:4096]})
	if err != nil || errs[0] != nil {
		t.Fatalf("Write of a blank = %v, %v", errs, err)
	}
	errs, err = e.client.Write(ctx, []*agentv1.TransferItem{item("other")}, [][]byte{data[:4096]})
	if err != nil || rpcerr.Reason(errs[0]) != "INVALID_TOKEN" {
		t.Fatalf("Write of another object onto the bound blank = %v, %v; want INVALID_TOKEN", errs, err)
	}
	wantBound(t, e.shared, id2, "k2", masterv1.AllocationState_ALLOCATION_STATE_RESERVED)
	seal(t, e.shared, id2, data[:4096])
}
