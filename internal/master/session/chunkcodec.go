package session

import (
	"strings"
	"unicode/utf8"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/encoding/protowire"
)

// connectRequest is what the master receives a Connect or Follow stream's
// messages into: a ConnectRequest, decoded as the codec decodes one,
// except that a message holding one RegisterChunk is decoded by
// decodeRegisterChunk (rpccodec.FastDecoder).
//
// Why: a restarted master's rebuild decodes every agent's whole table. The
// codec first walks each message to check it (UTF-8, the nested-message
// budget), then the generated decoder allocates an Allocation and three
// strings per allocation: at 4M objects, a third of the master's CPU in the
// rebuild and most of its fresh heap (issue 15, item 1). The fast path
// walks the chunk once, checking as it decodes, puts the Allocations in
// blocks of allocBlock, and allocates the segment, tenant and group strings
// (the same in most of a chunk) once per run of equal values: two thirds
// of the time per allocation (BenchmarkDecodeRegisterChunk). The bytes are the same protobuf
// encoding either way; agents of any version send what they always sent.
//
// A stream's receiver (recvLoop) hands the fast path the arrays to decode
// into (bufs) and reuses them two chunks later: a rebuild then decodes
// millions of allocations into the same few MiB instead of fresh heap, and
// on a VM whose page faults are slow, fresh heap was what the master paid
// for most.
type connectRequest struct {
	masterv1.ConnectRequest
	// bufs, when set, is where a chunk's Allocations go; used reports
	// that they went there.
	bufs *allocBufs
	used bool
}

// DecodeFast implements rpccodec.FastDecoder.
func (m *connectRequest) DecodeFast(b []byte, budget int) bool {
	bufs := m.bufs
	if bufs == nil {
		bufs = &allocBufs{}
	}
	ch, ok := decodeChunkRequest(b, budget, bufs)
	if ok {
		m.Msg = &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}
		m.used = len(ch.Allocations) > 0
	}
	return ok
}

// allocBufs holds Allocations in blocks of allocBlock, taken in order and
// reused from the start by reset.
type allocBufs struct {
	blocks [][]masterv1.Allocation
	next   int // the next one taken, counting over the blocks
	// fresh is how many of the first Allocations have never been used.
	fresh int
}

// reset makes every Allocation available again (their previous contents
// are cleared as they are taken).
func (ab *allocBufs) reset() { ab.next = 0 }

// take returns the next Allocation, empty.
func (ab *allocBufs) take() *masterv1.Allocation {
	bi, i := ab.next/allocBlock, ab.next%allocBlock
	if bi == len(ab.blocks) {
		ab.blocks = append(ab.blocks, make([]masterv1.Allocation, allocBlock))
	}
	a := &ab.blocks[bi][i]
	if ab.next < ab.fresh {
		a.Reset()
	} else {
		ab.fresh = ab.next + 1
	}
	ab.next++
	return a
}

// ConnectRequest's field number of register_chunk.
const registerChunkField = 9

// allocBlock is how many Allocations are allocated at once.
const allocBlock = 1024

// decodeChunkRequest decodes the encoding of a ConnectRequest made of
// exactly one register_chunk field, holding at most budget nested
// messages; it declines (false) anything else.
func decodeChunkRequest(b []byte, budget int, bufs *allocBufs) (*masterv1.RegisterChunk, bool) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || num != registerChunkField || typ != protowire.BytesType {
		return nil, false
	}
	body, m := protowire.ConsumeBytes(b[n:])
	if m < 0 || n+m != len(b) {
		return nil, false
	}
	return decodeRegisterChunk(body, budget-1, bufs)
}

// decodeRegisterChunk decodes a RegisterChunk as the codec would (each
// allocation by the generated decoder), or declines: a field it does not
// expect (unknown, or of the wrong wire type) in the chunk or in an
// allocation, a string that is not UTF-8, more than budget or
// MaxRegisterChunk allocations, anything malformed. The Allocations are taken from bufs, reset first.
func decodeRegisterChunk(b []byte, budget int, bufs *allocBufs) (*masterv1.RegisterChunk, bool) {
	ch := &masterv1.RegisterChunk{}
	var own owner
	bufs.reset()
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, false
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, m := protowire.ConsumeBytes(b)
			// Past MaxRegisterChunk the chunk is refused anyway; the
			// generated decoder takes it, so the reused sets stay small.
			if m < 0 || len(ch.Allocations) >= min(budget, MaxRegisterChunk) {
				return nil, false
			}
			b = b[m:]
			if ch.Allocations == nil {
				ch.Allocations = make([]*masterv1.Allocation, 0, min(len(b)/32+1, budget, 1<<16))
			}
			a := bufs.take()
			// The unsafe decoder's strings point into b: each is checked
			// and copied (or shared with an equal one already copied).
			if a.UnmarshalVTUnsafe(v) != nil || len(a.ProtoReflect().GetUnknown()) > 0 || !utf8.ValidString(a.Key) {
				return nil, false
			}
			a.Key = strings.Clone(a.Key)
			var ok1, ok2, ok3 bool
			a.SegmentId, ok1 = own.str(a.SegmentId, &own.seg)
			a.Tenant, ok2 = own.str(a.Tenant, &own.tenant)
			a.GroupId, ok3 = own.str(a.GroupId, &own.group)
			if !ok1 || !ok2 || !ok3 {
				return nil, false
			}
			ch.Allocations = append(ch.Allocations, a)
		case num == 2 && typ == protowire.VarintType:
			v, m := protowire.ConsumeVarint(b)
			if m < 0 {
				return nil, false
			}
			b = b[m:]
			ch.Last = v != 0
		case num == 3 && typ == protowire.BytesType:
			v, m := protowire.ConsumeBytes(b)
			if m < 0 || !utf8.Valid(v) {
				return nil, false
			}
			b = b[m:]
			ch.SegmentId = string(v)
		default:
			return nil, false
		}
	}
	return ch, true
}

// owner copies strings out of a message's buffer, checking each is UTF-8,
// and shares one copy among a run of equal values.
type owner struct{ seg, tenant, group string }

func (o *owner) str(s string, last *string) (string, bool) {
	if s != *last {
		if !utf8.ValidString(s) {
			return "", false
		}
		*last = strings.Clone(s)
	}
	return *last, true
}
