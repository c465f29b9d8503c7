package client

import (
	"unicode/utf8"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/durationpb"
)

// lookupReply is what a coalesced Get's lookup (getLookup) receives its
// BatchGetReplicaListResponse into: decoded as the codec decodes one,
// except that decodeLookup decodes the encodings a master sends
// (rpccodec.FastDecoder).
//
// Why: the generated decoder allocates, per item, a result, a response, a
// lease duration, a descriptor per replica and its five strings and token:
// decoding the lookup response was 5% of the whole process's CPU in
// BenchmarkSingleOps get-c64 (issue 18, item 1). decodeLookup takes the
// structs from one array per kind for the whole response, the tokens
// from one buffer, and allocates each distinct string once per response
// (a batch's replicas share a few agents, hosts and segments). The bytes
// on the wire are the same; anything a conforming master does not send
// (an unknown field, a message field twice, a wrong wire type, a string
// that is not UTF-8, more nested messages than budget) declines, and the
// codec then decodes it as it always did.
type lookupReply struct {
	masterv1.BatchGetReplicaListResponse
}

// DecodeFast implements rpccodec.FastDecoder.
func (m *lookupReply) DecodeFast(b []byte, budget int) bool {
	res, ok := decodeLookup(b, budget)
	if ok {
		m.Results = res
	}
	return ok
}

// lookupDecoder holds the arrays one response is decoded into.
type lookupDecoder struct {
	budget   int
	results  []masterv1.GetReplicaListResult
	lists    []masterv1.GetReplicaListResponse
	ttls     []durationpb.Duration
	statuses []masterv1.ItemStatus
	descs    []masterv1.ReplicaDescriptor
	reps     []*masterv1.ReplicaDescriptor // every response's Replicas, in order
	tokens   []byte
	strs     map[string]string
	n        int // results in the response
}

// decodeLookup decodes a BatchGetReplicaListResponse exactly as the codec
// would, or declines (false).
func decodeLookup(b []byte, budget int) ([]*masterv1.GetReplicaListResult, bool) {
	// First pass: how many of each message, so that each array is
	// allocated once and to size.
	var n, lists, statuses, descs int
	for p := b; len(p) > 0; n++ {
		num, typ, v, _, rest, ok := field(p)
		if !ok || num != 1 || typ != protowire.BytesType {
			return nil, false
		}
		p = rest
		for len(v) > 0 {
			num, typ, l, _, rest, ok := field(v)
			if !ok || typ != protowire.BytesType {
				return nil, false
			}
			v = rest
			switch num {
			case 1:
				statuses++
			case 2:
				lists++
				for len(l) > 0 {
					num, typ, _, _, rest, ok := field(l)
					if !ok {
						return nil, false
					}
					l = rest
					if num == 3 && typ == protowire.BytesType {
						descs++
					}
				}
			}
		}
	}
	if n == 0 {
		return nil, true
	}
	d := &lookupDecoder{budget: budget, n: n,
		results:  make([]masterv1.GetReplicaListResult, n),
		lists:    make([]masterv1.GetReplicaListResponse, 0, lists),
		ttls:     make([]durationpb.Duration, 0, lists),
		statuses: make([]masterv1.ItemStatus, 0, statuses),
		descs:    make([]masterv1.ReplicaDescriptor, 0, descs),
		reps:     make([]*masterv1.ReplicaDescriptor, 0, descs)}
	out := make([]*masterv1.GetReplicaListResult, n)
	for i := range out {
		_, _, v, _, rest, _ := field(b)
		b = rest
		if !d.take() || !d.result(v, &d.results[i]) {
			return nil, false
		}
		out[i] = &d.results[i]
	}
	return out, true
}

// take spends one nested message of the budget (as the codec's check does).
func (d *lookupDecoder) take() bool {
	d.budget--
	return d.budget >= 0
}

// push appends a zero T to *arena and returns a pointer to it. The arenas
// are sized by decodeLookup's first pass, so an append never moves one
// and the pointers handed out before stay valid.
func push[T any](arena *[]T) *T {
	var zero T
	*arena = append(*arena, zero)
	return &(*arena)[len(*arena)-1]
}

// field reads one field's tag and, for a length-delimited one, its bytes
// (v) or, for a varint, its value (x); rest is what follows. ok is false
// on a malformed field or another wire type.
func field(b []byte) (num protowire.Number, typ protowire.Type, v []byte, x uint64, rest []byte, ok bool) {
	num, typ, k := protowire.ConsumeTag(b)
	if k < 0 {
		return 0, 0, nil, 0, nil, false
	}
	b = b[k:]
	switch typ {
	case protowire.BytesType:
		v, k = protowire.ConsumeBytes(b)
	case protowire.VarintType:
		x, k = protowire.ConsumeVarint(b)
	default:
		return 0, 0, nil, 0, nil, false
	}
	if k < 0 {
		return 0, 0, nil, 0, nil, false
	}
	return num, typ, v, x, b[k:], true
}

// str is v as a string, one allocation per distinct value in a response
// (the replicas' segments, agents, hosts and endpoints).
func (d *lookupDecoder) str(v []byte) (string, bool) {
	if len(v) == 0 {
		return "", true
	}
	if s, ok := d.strs[string(v)]; ok {
		return s, true
	}
	if !utf8.Valid(v) {
		return "", false
	}
	if d.strs == nil {
		d.strs = make(map[string]string, 8)
	}
	s := string(v)
	d.strs[s] = s
	return s, true
}

// plainString is v as a string of its own (an error's reason and
// message: rare, and each different).
func plainString(v []byte) (string, bool) {
	if !utf8.Valid(v) {
		return "", false
	}
	return string(v), true
}

// bytes is a copy of v, from a buffer shared by the response's tokens
// (capacity cut, so an append to one never reaches the next).
func (d *lookupDecoder) bytes(v []byte) []byte {
	if len(v) == 0 {
		return []byte{} // as the generated decoder: present, empty
	}
	if cap(d.tokens)-len(d.tokens) < len(v) {
		d.tokens = make([]byte, 0, max(len(v), 64*d.n))
	}
	at := len(d.tokens)
	d.tokens = append(d.tokens, v...)
	return d.tokens[at:len(d.tokens):len(d.tokens)]
}

func (d *lookupDecoder) result(b []byte, r *masterv1.GetReplicaListResult) bool {
	for len(b) > 0 {
		num, typ, v, _, rest, ok := field(b)
		if !ok || typ != protowire.BytesType {
			return false
		}
		b = rest
		switch num {
		case 1:
			if r.Status != nil || !d.take() {
				return false
			}
			r.Status = push(&d.statuses)
			if !d.status(v, r.Status) {
				return false
			}
		case 2:
			if r.ReplicaList != nil || !d.take() {
				return false
			}
			r.ReplicaList = push(&d.lists)
			if !d.list(v, r.ReplicaList) {
				return false
			}
		default:
			return false
		}
	}
	return true
}

func (d *lookupDecoder) status(b []byte, st *masterv1.ItemStatus) bool {
	for len(b) > 0 {
		num, typ, v, x, rest, ok := field(b)
		if !ok {
			return false
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.VarintType:
			st.Code = int32(x)
		case num == 2 && typ == protowire.BytesType:
			if st.Reason, ok = plainString(v); !ok {
				return false
			}
		case num == 3 && typ == protowire.BytesType:
			if st.Message, ok = plainString(v); !ok {
				return false
			}
		default:
			return false
		}
	}
	return true
}

func (d *lookupDecoder) list(b []byte, l *masterv1.GetReplicaListResponse) bool {
	first := len(d.reps)
	for len(b) > 0 {
		num, typ, v, x, rest, ok := field(b)
		if !ok {
			return false
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.VarintType:
			l.Size = x
		case num == 2 && typ == protowire.VarintType:
			l.Checksum = x
		case num == 3 && typ == protowire.BytesType:
			if !d.take() {
				return false
			}
			rd := push(&d.descs)
			if !d.desc(v, rd) {
				return false
			}
			d.reps = append(d.reps, rd)
		case num == 4 && typ == protowire.BytesType:
			if l.LeaseTtl != nil || !d.take() {
				return false
			}
			l.LeaseTtl = push(&d.ttls)
			if !duration(v, l.LeaseTtl) {
				return false
			}
		case num == 5 && typ == protowire.BytesType:
			if l.GroupId, ok = d.str(v); !ok {
				return false
			}
		default:
			return false
		}
	}
	if len(d.reps) > first {
		l.Replicas = d.reps[first:len(d.reps):len(d.reps)]
	}
	return true
}

func duration(b []byte, t *durationpb.Duration) bool {
	for len(b) > 0 {
		num, typ, _, x, rest, ok := field(b)
		if !ok || typ != protowire.VarintType {
			return false
		}
		b = rest
		switch num {
		case 1:
			t.Seconds = int64(x)
		case 2:
			t.Nanos = int32(x)
		default:
			return false
		}
	}
	return true
}

func (d *lookupDecoder) desc(b []byte, r *masterv1.ReplicaDescriptor) bool {
	for len(b) > 0 {
		num, typ, v, x, rest, ok := field(b)
		if !ok {
			return false
		}
		b = rest
		if typ == protowire.VarintType {
			switch num {
			case 1:
				r.ReplicaId = uint32(x)
			case 6:
				r.AllocationId = x
			case 7:
				r.Offset = x
			case 8:
				r.Size = x
			case 9:
				r.Medium = masterv1.Medium(int32(x))
			case 10:
				r.Status = masterv1.ReplicaStatus(int32(x))
			case 12:
				r.TokenExpiryUnixMs = int64(x)
			default:
				return false
			}
			continue
		}
		var s *string
		switch num {
		case 2:
			s = &r.SegmentId
		case 3:
			s = &r.AgentId
		case 4:
			s = &r.HostId
		case 5:
			s = &r.DataEndpoint
		case 13:
			s = &r.TransferEndpoint
		case 11:
			r.Token = d.bytes(v)
			continue
		default:
			return false
		}
		if *s, ok = d.str(v); !ok {
			return false
		}
	}
	return true
}
