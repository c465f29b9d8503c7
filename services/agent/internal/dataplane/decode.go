package dataplane

import (
	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"google.golang.org/protobuf/encoding/protowire"
)

// transferRequest is what a transfer connection decodes each request header
// into (xfer.ReadFrame): a *agentv1.TransferRequest whose UnmarshalVT takes
// a fast path. The generated decoder allocates every item, its segment id
// and its token (three allocations per 4 KiB object of a batch); the fast
// path allocates the items as one array and the tokens as one buffer, and
// takes segment ids from the mounted segments.
//
// internal/rpccodec still checks UTF-8 and the wire format before UnmarshalVT and
// falls back to proto.Unmarshal after a failure, and the fast path only
// handles fields it knows with their declared wire types: anything else is
// decoded again from the start by the generated UnmarshalVT, so every header
// is accepted or refused, and decoded, exactly as before.
//
// xfer.ReadFrameLimit counts a header's items on the raw bytes and refuses
// more than xfer.MaxItems before either decoder runs, so the arrays below
// never hold more than that.
//
// A connection decodes one request at a time and is done with it before the
// next, so the item arrays and the token buffer are reused from request to
// request (up to maxKeptItems items).
type transferRequest struct {
	*agentv1.TransferRequest
	ids func([]byte) (string, bool) // a mounted segment's id, without allocating

	arr    []agentv1.TransferItem
	ptrs   []*agentv1.TransferItem
	tokens []byte
}

// maxKeptItems bounds the per-item arrays a connection keeps for its next
// request.
const maxKeptItems = 1024

// reuse returns s[:n] zeroed, or a new slice when s is too short; a slice of
// more than maxKeptItems is not kept in *s.
func reuse[S ~[]T, T any](s *S, n int) S {
	if cap(*s) >= n {
		out := (*s)[:n]
		clear(out)
		return out
	}
	out := make(S, n)
	if n <= maxKeptItems {
		*s = out
	}
	return out
}

// UnmarshalVT decodes b into the embedded message, which the codec reset.
func (m *transferRequest) UnmarshalVT(b []byte) error {
	if m.fast(b) {
		return nil
	}
	m.TransferRequest.Reset()
	return m.TransferRequest.UnmarshalVT(b)
}

// TransferRequest and TransferItem field numbers (transfer.proto).
const (
	fieldOp    = 1
	fieldItems = 2
)

func (m *transferRequest) fast(b []byte) bool {
	n := 0
	for rest := b; len(rest) > 0; {
		num, typ, k := protowire.ConsumeTag(rest)
		if k < 0 {
			return false
		}
		rest = rest[k:]
		switch {
		case num == fieldOp && typ == protowire.VarintType:
		case num == fieldItems && typ == protowire.BytesType:
			n++
		default:
			return false
		}
		if k = protowire.ConsumeFieldValue(num, typ, rest); k < 0 {
			return false
		}
		rest = rest[k:]
	}
	arr := reuse(&m.arr, n)
	items := reuse(&m.ptrs, n)
	// Every token fits: they are parts of b.
	tokens := m.tokens[:0]
	if cap(tokens) < len(b) {
		tokens = make([]byte, 0, len(b))
		if n <= maxKeptItems {
			m.tokens = tokens
		}
	}
	d := transferDecoder{ids: m.ids, tokens: tokens}
	i := 0
	for len(b) > 0 {
		num, _, k := protowire.ConsumeTag(b)
		b = b[k:]
		if num == fieldOp {
			v, k := protowire.ConsumeVarint(b)
			b = b[k:]
			m.Op = agentv1.TransferOp(int32(v))
			continue
		}
		v, k := protowire.ConsumeBytes(b)
		b = b[k:]
		if !d.item(v, &arr[i]) {
			return false
		}
		items[i] = &arr[i]
		i++
	}
	m.Items = items
	return true
}

type transferDecoder struct {
	ids     func([]byte) (string, bool)
	lastSeg string
	tokens  []byte
}

// transferItemTypes are TransferItem's wire types by field number.
var transferItemTypes = [...]protowire.Type{1: protowire.BytesType, 2: protowire.VarintType, 3: protowire.BytesType,
	4: protowire.VarintType, 5: protowire.VarintType}

func (d *transferDecoder) item(b []byte, it *agentv1.TransferItem) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num < 1 || int(num) >= len(transferItemTypes) || typ != transferItemTypes[num] {
			return false
		}
		b = b[n:]
		var v uint64
		var p []byte
		if typ == protowire.VarintType {
			v, n = protowire.ConsumeVarint(b)
		} else {
			p, n = protowire.ConsumeBytes(b)
		}
		if n < 0 {
			return false
		}
		b = b[n:]
		switch num {
		case 1:
			it.SegmentId = d.segmentID(p)
		case 2:
			it.AllocationId = v
		case 3:
			start := len(d.tokens)
			d.tokens = append(d.tokens, p...)
			it.Token = d.tokens[start:len(d.tokens):len(d.tokens)]
		case 4:
			it.Offset = v
		case 5:
			it.Length = v
		}
	}
	return true
}

// segmentID returns b as a string, a mounted segment's own when it is one.
func (d *transferDecoder) segmentID(b []byte) string {
	if string(b) == d.lastSeg {
		return d.lastSeg
	}
	if id, ok := d.ids(b); ok {
		d.lastSeg = id
		return id
	}
	return string(b)
}
