package link

import (
	"sync"
	"unicode/utf8"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/encoding/protowire"
)

// connectResponse is what the receive loop decodes each master message
// into: a *masterv1.ConnectResponse whose UnmarshalVT takes a fast path for
// the batched commands of the put path (Reserve, Seal, Release).
//
// The generated decoder allocates each item and each of its strings: with
// batches of 4 KiB objects that was 8 of the agent's 20 allocations per
// object (ReserveItem, its segment id, tenant and key; SealItem and its
// segment id; AllocationRef and its segment id). The fast path allocates a
// batch's items as one array, takes segment ids from the mounted segments
// (they are nearly always one of them), reuses the previous item's tenant
// and group when they repeat, and so allocates only each key.
//
// The codec (internal/rpccodec) still runs its UTF-8 and wire-format check
// before UnmarshalVT and falls back to proto.Unmarshal after a failure, and
// the fast path handles only what it fully understands: one oneof field
// holding one of the three commands, whose fields all have their declared
// wire types. Anything else (another message, unknown fields, a repeated
// oneof field, a malformed varint) is decoded again from the start by the
// generated UnmarshalVT, so every input is accepted or refused, and decoded,
// exactly as before.
//
// The item arrays come from pools: held is set when the message's items
// are in pooled arrays, which the receiver releases once the command has
// run (nothing keeps an item after Set.Reserve, Seal or Release return).
type connectResponse struct {
	*masterv1.ConnectResponse
	ids  func([]byte) (string, bool) // a mounted segment's id, without allocating
	held releaser
}

// releaser gives pooled arrays back.
type releaser interface{ release() }

// maxKeptItems bounds the arrays a pool keeps.
const maxKeptItems = 1024

// batchArrays are the items of one decoded command and their pointers.
type batchArrays[T any] struct {
	pool *sync.Pool
	arr  []T
	ptrs []*T
}

var reservePool, sealPool, releasePool sync.Pool

// getArrays returns arrays of n zero items from pool.
func getArrays[T any](pool *sync.Pool, n int) *batchArrays[T] {
	a, _ := pool.Get().(*batchArrays[T])
	if a == nil {
		a = &batchArrays[T]{pool: pool}
	}
	if cap(a.arr) < n {
		a.arr, a.ptrs = make([]T, n), make([]*T, n)
	} else {
		a.arr, a.ptrs = a.arr[:n], a.ptrs[:n]
	}
	return a
}

// release clears the arrays (their items and strings may be collected) and
// gives them back to their pool. The items must not be used any more.
func (a *batchArrays[T]) release() {
	if cap(a.arr) > maxKeptItems {
		return
	}
	clear(a.arr[:cap(a.arr)])
	clear(a.ptrs[:cap(a.ptrs)])
	a.pool.Put(a)
}

// UnmarshalVT decodes b into the embedded message, which the codec reset.
func (m *connectResponse) UnmarshalVT(b []byte) error {
	if m.fast(b, false) {
		return nil
	}
	m.ConnectResponse.Reset()
	return m.ConnectResponse.UnmarshalVT(b)
}

// ConnectResponse field numbers (segment.proto).
const (
	fieldReserve = 2
	fieldRelease = 3
	fieldSeal    = 4
)

// fast decodes b into the (reset) message when it is one of the three
// commands in their plain form, and reports whether it did; it leaves m
// partly filled when not. With checkUTF8 it also refuses (false) a string
// field that is not UTF-8, so an accepted b is one internal/rpccodec's check
// accepts.
func (m *connectResponse) fast(b []byte, checkUTF8 bool) bool {
	m.held = nil
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || typ != protowire.BytesType {
		return false
	}
	body, k := protowire.ConsumeBytes(b[n:])
	if k < 0 || n+k != len(b) {
		return false // malformed, or more than one field
	}
	d := itemDecoder{ids: m.ids, checkUTF8: checkUTF8}
	switch num {
	case fieldReserve:
		r := &masterv1.ReserveRequest{}
		if m.held = decodeBatch(body, &r.RequestId, &r.Epoch, &r.TraceContext, &r.Items, &reservePool, &d, d.reserveItem); m.held == nil {
			return false
		}
		m.Msg = &masterv1.ConnectResponse_Reserve{Reserve: r}
	case fieldSeal:
		r := &masterv1.SealRequest{}
		if m.held = decodeBatch(body, &r.RequestId, &r.Epoch, &r.TraceContext, &r.Items, &sealPool, &d, d.sealItem); m.held == nil {
			return false
		}
		m.Msg = &masterv1.ConnectResponse_Seal{Seal: r}
	case fieldRelease:
		r := &masterv1.ReleaseRequest{}
		if m.held = decodeBatch(body, &r.RequestId, &r.Epoch, &r.TraceContext, &r.Items, &releasePool, &d, d.allocationRef); m.held == nil {
			return false
		}
		m.Msg = &masterv1.ConnectResponse_Release{Release: r}
	default:
		return false
	}
	return true
}

// decodeBatch decodes a ReserveRequest, SealRequest or ReleaseRequest (all
// request_id = 1, epoch = 2, repeated items = 3, trace_context = 4). The
// items are in arrays from pool, which it returns (their releaser); nil for
// anything but known fields with their wire types. trace_links (5), which
// only a batch of several traced callers carries, is left to the generated
// decoder.
func decodeBatch[T any](b []byte, requestID, epoch *uint64, tc **masterv1.TraceContext, items *[]*T, pool *sync.Pool, d *itemDecoder, item func([]byte, *T) bool) releaser {
	n := 0
	for rest := b; len(rest) > 0; {
		num, typ, k := protowire.ConsumeTag(rest)
		if k < 0 {
			return nil
		}
		rest = rest[k:]
		switch {
		case (num == 1 || num == 2) && typ == protowire.VarintType:
			k = protowire.ConsumeFieldValue(num, typ, rest)
		case num == 3 && typ == protowire.BytesType:
			k = protowire.ConsumeFieldValue(num, typ, rest)
			n++
		case num == fieldTraceContext && typ == protowire.BytesType:
			k = protowire.ConsumeFieldValue(num, typ, rest)
		default:
			return nil
		}
		if k < 0 {
			return nil
		}
		rest = rest[k:]
	}
	held := getArrays[T](pool, n)
	arr, ptrs := held.arr, held.ptrs
	i := 0
	for len(b) > 0 {
		num, typ, k := protowire.ConsumeTag(b)
		b = b[k:]
		if typ == protowire.VarintType {
			v, k := protowire.ConsumeVarint(b)
			b = b[k:]
			if num == 1 {
				*requestID = v
			} else {
				*epoch = v
			}
			continue
		}
		v, k := protowire.ConsumeBytes(b)
		b = b[k:]
		if num == fieldTraceContext {
			// A message field given twice is merged, as the generated
			// decoder does: each string the later one holds replaces.
			if *tc == nil {
				*tc = &masterv1.TraceContext{}
			}
			if !d.traceContext(v, *tc) {
				held.release()
				return nil
			}
			continue
		}
		if !item(v, &arr[i]) {
			held.release()
			return nil
		}
		ptrs[i] = &arr[i]
		i++
	}
	*items = ptrs
	return held
}

// fieldTraceContext is the trace_context field of the three commands.
const fieldTraceContext = 4

// traceContext decodes a TraceContext (traceparent = 1, tracestate = 2,
// both strings) into tc; false for anything else. The values are bounded
// and parsed later (tracectx.ParseCommand), not here.
func (d *itemDecoder) traceContext(b []byte, tc *masterv1.TraceContext) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || (num != 1 && num != 2) {
			return false
		}
		_, p, k, ok := fieldValue(b[n:], typ, protowire.BytesType)
		if !ok {
			return false
		}
		b = b[n+k:]
		s, ok := d.newString(p)
		if !ok {
			return false
		}
		if num == 1 {
			tc.Traceparent = s
		} else {
			tc.Tracestate = s
		}
	}
	return true
}

// itemDecoder decodes the items of one batch.
type itemDecoder struct {
	ids                            func([]byte) (string, bool)
	checkUTF8                      bool
	lastSeg, lastTenant, lastGroup string
}

// newString returns b as a new string; false when UTF-8 is checked and b
// is not.
func (d *itemDecoder) newString(b []byte) (string, bool) {
	if d.checkUTF8 && !utf8.Valid(b) {
		return "", false
	}
	return string(b), true
}

// segmentID returns b as a string, a mounted segment's own when it is one
// (valid UTF-8, as every id the agent makes).
func (d *itemDecoder) segmentID(b []byte) (string, bool) {
	if string(b) == d.lastSeg {
		return d.lastSeg, true
	}
	if d.ids != nil {
		if id, ok := d.ids(b); ok {
			d.lastSeg = id
			return id, true
		}
	}
	return d.newString(b)
}

// again returns last when b spells it, else b as a new string (kept as
// last).
func (d *itemDecoder) again(last *string, b []byte) (string, bool) {
	if string(b) != *last {
		s, ok := d.newString(b)
		if !ok {
			return "", false
		}
		*last = s
	}
	return *last, true
}

// fieldValue reads one field's value of the expected wire type: v for
// varints, p for bytes. ok is false for another type or a malformed value.
func fieldValue(b []byte, typ, want protowire.Type) (v uint64, p []byte, n int, ok bool) {
	if typ != want {
		return 0, nil, 0, false
	}
	if want == protowire.VarintType {
		v, n = protowire.ConsumeVarint(b)
	} else {
		p, n = protowire.ConsumeBytes(b)
	}
	return v, p, n, n >= 0
}

// reserveItemTypes are ReserveItem's wire types by field number.
var reserveItemTypes = [...]protowire.Type{1: protowire.BytesType, 2: protowire.VarintType, 3: protowire.BytesType, 4: protowire.BytesType,
	5: protowire.VarintType, 6: protowire.BytesType, 7: protowire.VarintType, 8: protowire.VarintType, 9: protowire.VarintType}

func (d *itemDecoder) reserveItem(b []byte, it *masterv1.ReserveItem) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num < 1 || int(num) >= len(reserveItemTypes) {
			return false
		}
		v, p, k, ok := fieldValue(b[n:], typ, reserveItemTypes[num])
		if !ok {
			return false
		}
		b = b[n+k:]
		switch num {
		case 1:
			it.SegmentId, ok = d.segmentID(p)
		case 2:
			it.Size = v
		case 3:
			it.Tenant, ok = d.again(&d.lastTenant, p)
		case 4:
			it.Key, ok = d.newString(p)
		case 5:
			it.ReplicaId = uint32(v)
		case 6:
			it.GroupId, ok = d.again(&d.lastGroup, p)
		case 7:
			it.HardPin = v != 0
		case 8:
			it.SoftPinUntilUnixMs = int64(v)
		case 9:
			it.Blank = v != 0
		}
		if !ok {
			return false
		}
	}
	return true
}

// sealItemTypes are SealItem's wire types by field number.
var sealItemTypes = [...]protowire.Type{1: protowire.BytesType, 2: protowire.VarintType, 3: protowire.VarintType, 4: protowire.VarintType}

func (d *itemDecoder) sealItem(b []byte, it *masterv1.SealItem) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num < 1 || int(num) >= len(sealItemTypes) {
			return false
		}
		v, p, k, ok := fieldValue(b[n:], typ, sealItemTypes[num])
		if !ok {
			return false
		}
		b = b[n+k:]
		switch num {
		case 1:
			if it.SegmentId, ok = d.segmentID(p); !ok {
				return false
			}
		case 2:
			it.AllocationId = v
		case 3:
			it.Checksum = v
		case 4:
			it.SoftPinUntilUnixMs = int64(v)
		}
	}
	return true
}

func (d *itemDecoder) allocationRef(b []byte, it *masterv1.AllocationRef) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || (num != 1 && num != 2) {
			return false
		}
		want := protowire.VarintType
		if num == 1 {
			want = protowire.BytesType
		}
		v, p, k, ok := fieldValue(b[n:], typ, want)
		if !ok {
			return false
		}
		b = b[n+k:]
		if num == 1 {
			if it.SegmentId, ok = d.segmentID(p); !ok {
				return false
			}
		} else {
			it.AllocationId = v
		}
	}
	return true
}
