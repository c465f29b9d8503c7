package dataplane

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// Spares (put leases): a blank the master leased to a client, whose write
// token has the spare flag and names tenant t and replica 5 but no key.
// The bulk transfer item names the key; the agent binds (t, key), seals on
// write and answers a receipt bound to the object (version 2).

// spareTok signs a spare's write token for allocation id of seg.
func spareTok(k token.SigningKey, seg *segment.Segment, id uint64) []byte {
	return token.Sign(k, token.Claims{Mode: token.Write, Tenant: "t", SegmentID: seg.ID(), AllocationID: id,
		Expiry: now.Add(time.Minute), ReplicaID: 5, Spare: true})
}

// spareItem is a sealed WRITE item of data into spare id of seg, naming key.
func spareItem(k token.SigningKey, seg *segment.Segment, id uint64, key string, data []byte) *agentv1.TransferItem {
	return &agentv1.TransferItem{SegmentId: seg.ID(), AllocationId: id, Token: spareTok(k, seg, id), Key: key,
		Length: uint64(len(data)), SealChecksum: proto.Uint64(checksum.Sum(data))}
}

// wantSpareBound checks that allocation id of seg holds t/key, replica 5,
// no group, not hard-pinned, in state st.
func wantSpareBound(t *testing.T, seg *segment.Segment, id uint64, key string, st masterv1.AllocationState) {
	t.Helper()
	a, ok := seg.Lookup(id)
	if !ok || a.GetBlank() || a.GetTenant() != "t" || a.GetKey() != key || a.GetReplicaId() != 5 || a.GetGroupId() != "" || a.GetHardPin() || a.GetState() != st {
		t.Fatalf("allocation %d = %v, want t/%s replica 5, no group, not hard-pinned, %v", id, a, key, st)
	}
}

// wantBlank checks that allocation id of seg is still an unbound blank.
func wantBlank(t *testing.T, seg *segment.Segment, id uint64) {
	t.Helper()
	if a, ok := seg.Lookup(id); !ok || !a.GetBlank() || a.GetKey() != "" || a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
		t.Fatalf("allocation %d = %v, want an unbound blank", id, a)
	}
}

// TestSpareWriteTransfer: a spare's write binds the blank to the token's
// tenant and the item's key before it seals it, and answers a version 2
// receipt that opens only with that tenant and key; the object reads back
// with an ordinary read token, and the spare token reads nothing.
func TestSpareWriteTransfer(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	rk := token.NewReceiptKeys(e.key)
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		t.Run(seg.Medium().String(), func(t *testing.T) {
			data := randBytes(1<<20 + 3)
			id := reserveBlank(t, seg, uint64(len(data)))
			// Beside it, an ordinary sealed write: its receipt stays
			// version 1.
			plain := randBytes(4096)
			pid := e.reserve(t, seg, uint64(len(plain)))
			pit := e.item(seg, pid, token.Write)
			pit.Length, pit.SealChecksum = uint64(len(plain)), proto.Uint64(checksum.Sum(plain))
			key := "obj/" + strings.Repeat("é", (MaxSpareKeyLen-4)/2) // the longest key: 1024 bytes
			res, err := e.pool.WriteSealed(ctx, e.addr, []*agentv1.TransferItem{spareItem(e.key, seg, id, key, data), pit}, [][]byte{data, plain})
			if err != nil || res[0].Err != nil || res[1].Err != nil {
				t.Fatalf("WriteSealed of a spare and a plain item = %+v, %v", res, err)
			}
			wantSpareBound(t, seg, id, key, masterv1.AllocationState_ALLOCATION_STATE_SEALED)

			r, err := rk.OpenObject(res[0].Receipt, "t", key)
			want := token.Receipt{KeyID: e.key.ID, SegmentID: seg.ID(), AllocationID: id, Size: uint64(len(data)), Checksum: checksum.Sum(data), Tenant: "t", Key: key}
			if err != nil || r != want {
				t.Fatalf("OpenObject(spare receipt) = %+v, %v; want %+v", r, err, want)
			}
			for _, obj := range [][2]string{{"t", "obj/2"}, {"u", key}, {"", ""}} {
				if _, err := rk.OpenObject(res[0].Receipt, obj[0], obj[1]); !errors.Is(err, token.ErrSignature) {
					t.Fatalf("OpenObject(spare receipt, %q, %q) = %v, want %v", obj[0], obj[1], err, token.ErrSignature)
				}
			}
			if _, err := rk.Open(res[0].Receipt); !errors.Is(err, token.ErrSignature) {
				t.Fatalf("Open(spare receipt) = %v, want %v", err, token.ErrSignature)
			}
			if r, err := rk.Open(res[1].Receipt); err != nil || r.AllocationID != pid || r.Key != "" || res[1].Receipt[0] != 1 {
				t.Fatalf("Open(plain receipt %x) = %+v, %v; want version 1 for allocation %d", res[1].Receipt, r, err, pid)
			}

			dst := make([]byte, len(data))
			readTok := token.Sign(e.key, token.Claims{Mode: token.Read, Tenant: "t", Key: key, SegmentID: seg.ID(), AllocationID: id, Expiry: now.Add(time.Minute)})
			rres, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{{SegmentId: seg.ID(), AllocationId: id, Token: readTok}}, [][]byte{dst})
			if err != nil || rres[0].Err != nil || !bytes.Equal(dst, data) {
				t.Fatalf("Read of the sealed spare = %+v, %v", rres, err)
			}
			// The spare's token reads nothing.
			rres, err = e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{{SegmentId: seg.ID(), AllocationId: id, Token: spareTok(e.key, seg, id)}}, [][]byte{dst})
			if err != nil || rpcerr.Reason(rres[0].Err) != "INVALID_TOKEN" {
				t.Fatalf("Read with the spare's token = %+v, %v; want INVALID_TOKEN", rres, err)
			}
			spareRead := token.Sign(e.key, token.Claims{Mode: token.Read, Tenant: "t", SegmentID: seg.ID(), AllocationID: id, Expiry: now.Add(time.Minute), Spare: true})
			rres, err = e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{{SegmentId: seg.ID(), AllocationId: id, Token: spareRead}}, [][]byte{dst})
			if err != nil || rpcerr.Reason(rres[0].Err) != "INVALID_TOKEN" {
				t.Fatalf("Read with a spare read token = %+v, %v; want INVALID_TOKEN", rres, err)
			}
			// Written and sealed: another write of the spare is refused.
			res, err = e.pool.WriteSealed(ctx, e.addr, []*agentv1.TransferItem{spareItem(e.key, seg, id, "obj/2", data)}, [][]byte{data})
			if err != nil || rpcerr.Reason(res[0].Err) != "ALLOCATION_STATE" {
				t.Fatalf("second write of the sealed spare = %+v, %v; want ALLOCATION_STATE", res, err)
			}
		})
	}

	// A spare bound by a write whose bytes did not match its checksum
	// stays RESERVED, bound: another key's write is refused.
	data := randBytes(8192)
	id := reserveBlank(t, e.mem, uint64(len(data)))
	it := spareItem(e.key, e.mem, id, "a", data)
	it.SealChecksum = proto.Uint64(checksum.Sum(data) + 1)
	res, err := e.pool.WriteSealed(ctx, e.addr, []*agentv1.TransferItem{it}, [][]byte{data})
	if err != nil || rpcerr.Reason(res[0].Err) != "CHECKSUM_MISMATCH" || res[0].Receipt != nil {
		t.Fatalf("spare write with a wrong checksum = %+v, %v; want CHECKSUM_MISMATCH", res, err)
	}
	wantSpareBound(t, e.mem, id, "a", masterv1.AllocationState_ALLOCATION_STATE_RESERVED)
	res, err = e.pool.WriteSealed(ctx, e.addr, []*agentv1.TransferItem{spareItem(e.key, e.mem, id, "b", data)}, [][]byte{data})
	if err != nil || rpcerr.Reason(res[0].Err) != "INVALID_TOKEN" {
		t.Fatalf("spare write of another key onto a bound spare = %+v, %v; want INVALID_TOKEN", res, err)
	}
	wantSpareBound(t, e.mem, id, "a", masterv1.AllocationState_ALLOCATION_STATE_RESERVED)
}

// TestSpareWriteRefused: a spare's item without a key, with an over-long
// key or without seal_checksum, and a key on an ordinary token's item,
// fail INVALID_PARAMS before any byte lands (the blank stays unbound) and
// leave the connection in step; a key that is not UTF-8 does not decode
// (the whole request is refused).
func TestSpareWriteRefused(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	data := randBytes(4096)
	for _, tt := range []struct {
		name string
		mut  func(it *agentv1.TransferItem, id uint64)
		msg  string
	}{
		{"no key", func(it *agentv1.TransferItem, _ uint64) { it.Key = "" }, "must name the object's key"},
		{"key over 1024 bytes", func(it *agentv1.TransferItem, _ uint64) { it.Key = strings.Repeat("k", MaxSpareKeyLen+1) }, "at most 1024"},
		{"no seal_checksum", func(it *agentv1.TransferItem, _ uint64) { it.SealChecksum = nil }, "must carry seal_checksum"},
		{"key with an ordinary token", func(it *agentv1.TransferItem, id uint64) {
			it.Token = blankTok(e.key, e.mem, id, token.Write, "k")
		}, "key is only for a spare's write"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			id := reserveBlank(t, e.mem, uint64(len(data)))
			it := spareItem(e.key, e.mem, id, "k", data)
			tt.mut(it, id)
			res, err := e.pool.WriteSealed(ctx, e.addr, []*agentv1.TransferItem{it}, [][]byte{data})
			if err != nil {
				t.Fatal(err)
			}
			wantErr(t, res[0].Err, codes.InvalidArgument, "INVALID_PARAMS")
			if !strings.Contains(res[0].Err.Error(), tt.msg) {
				t.Fatalf("error %q does not say %q", res[0].Err, tt.msg)
			}
			wantBlank(t, e.mem, id)
			e.roundTrip(t)
		})
	}

	t.Run("key not UTF-8", func(t *testing.T) {
		id := reserveBlank(t, e.mem, uint64(len(data)))
		c := rawConn(t, e.addr)
		wire := append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE,
			Items: []*agentv1.TransferItem{spareItem(e.key, e.mem, id, "k\xff", data)}})...)
		if _, err := c.Write(wire); err != nil {
			t.Fatal(err)
		}
		wantRefusal(t, c, codes.InvalidArgument, "INVALID_PARAMS")
		wantBlank(t, e.mem, id)
		e.roundTrip(t)
	})

	// Past the decoder (which refuses it first), the item check refuses a
	// key that is not UTF-8 too.
	t.Run("key not UTF-8, item check", func(t *testing.T) {
		id := reserveBlank(t, e.mem, uint64(len(data)))
		var h segment.Handle
		err := e.srv.openItemWrite(&h, spareItem(e.key, e.mem, id, "k\xff", data), now, "")
		wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
		wantBlank(t, e.mem, id)
	})
}

// TestSpareTokenOtherPaths: gRPC Write and BatchWrite and the
// shared-memory socket carry no key: they refuse a spare's token
// (INVALID_TOKEN) and leave the blank unbound; the socket refuses an item
// that names a key (INVALID_PARAMS).
func TestSpareTokenOtherPaths(t *testing.T) {
	t.Run("grpc", func(t *testing.T) {
		e := start(t)
		ctx := t.Context()
		data := randBytes(1000)
		id := reserveBlank(t, e.mem, uint64(len(data)))
		_, err := e.write(ctx, &agentv1.WriteHeader{SegmentId: e.mem.ID(), AllocationId: id, Token: spareTok(e.key, e.mem, id)}, data, 1<<20)
		wantErr(t, err, codes.PermissionDenied, "INVALID_TOKEN")
		if !strings.Contains(err.Error(), "bulk transfer listener") {
			t.Fatalf("Write error %q does not name the bulk transfer listener", err)
		}
		resp, err := e.client.BatchWrite(ctx, &agentv1.BatchWriteRequest{Items: []*agentv1.BatchWriteItem{
			{SegmentId: e.mem.ID(), AllocationId: id, Token: spareTok(e.key, e.mem, id), Data: data},
		}})
		if err != nil || resp.GetResults()[0].GetReason() != "INVALID_TOKEN" {
			t.Fatalf("BatchWrite of a spare = %v, %v; want INVALID_TOKEN", resp.GetResults(), err)
		}
		wantBlank(t, e.mem, id)
	})
	t.Run("shm", func(t *testing.T) {
		e := startShm(t, ShmConfig{})
		ctx := t.Context()
		data := randBytes(4096)
		id := reserveBlank(t, e.shared, uint64(len(data)))
		it := spareItem(e.key, e.shared, id, "", data)
		res, err := e.client.WriteSealed(ctx, []*agentv1.TransferItem{it}, [][]byte{data})
		if err != nil || rpcerr.Reason(res[0].Err) != "INVALID_TOKEN" {
			t.Fatalf("shm WriteSealed of a spare = %+v, %v; want INVALID_TOKEN", res, err)
		}
		it.Key = "k"
		res, err = e.client.WriteSealed(ctx, []*agentv1.TransferItem{it}, [][]byte{data})
		if err != nil || rpcerr.Reason(res[0].Err) != "INVALID_PARAMS" {
			t.Fatalf("shm WriteSealed of a spare naming a key = %+v, %v; want INVALID_PARAMS", res, err)
		}
		it.Token = blankTok(e.key, e.shared, id, token.Write, "k")
		res, err = e.client.WriteSealed(ctx, []*agentv1.TransferItem{it}, [][]byte{data})
		if err != nil || rpcerr.Reason(res[0].Err) != "INVALID_PARAMS" {
			t.Fatalf("shm WriteSealed naming a key = %+v, %v; want INVALID_PARAMS", res, err)
		}
		wantBlank(t, e.shared, id)
	})
}
