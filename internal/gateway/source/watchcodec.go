package source

import (
	"unicode/utf8"
	"unsafe"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/grpc/encoding"
	grpcmem "google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// watchCodec is the gRPC codec of the source's Watch calls (a per-call
// option, so it applies whatever codec the connection has). It decodes a
// WatchResponse with a decoder written for the one shape the master sends,
// and everything else (the request, any response with a field or wire type
// that shape does not expect, or malformed) with rpccodec, which accepts
// and refuses exactly what proto.Unmarshal does.
//
// Why: the source spends most of its decoding in allocation, three per
// change (the Change, its tenant and its key), and in rpccodec's separate
// UTF-8 pass. This decoder copies the message once into a buffer of its
// own, points every string into it (checking UTF-8 as it goes), and reuses
// the Change messages of the response it decodes into: a response costs
// one allocation instead of three per change.
//
// So: the strings of a decoded response share one buffer, which stays
// alive while any of them is referenced (the announced set clones what it
// keeps); and decoding into a response overwrites the Change messages it
// held, so a caller that receives into the same response again must be
// done with them.
//
// Measured against the library (issue 12; interleaved runs in one sitting,
// benchstat medians ± their 95% interval): vtprotobuf's pool (ResetVT keeps
// the Change messages) and unmarshal_unsafe (strings point into the
// buffer) options, behind rpccodec's check, also make one allocation per
// response, but BenchmarkWatchDecode takes 185µs ± 12% against this
// decoder's 134µs ± 12% for 1,024 changes (24.0µs ± 12% against 16.8µs ± 9%
// for 128): the separate check pass is the difference. In
// BenchmarkPipeline/resp=1024/subs=0 that is 768 ± 7% against 712 ± 7%
// cpu-ns/event (p=0.009, n=16), and nothing measurable in live50k. The
// generated decoder as configured (no pool, copying) takes 2.1 times this
// decoder's time and 3,084 allocations for 1,024 changes. So it stays.
type watchCodec struct {
	fallback encoding.CodecV2
}

func newWatchCodec() watchCodec { return watchCodec{fallback: rpccodec.New()} }

// Name implements encoding.CodecV2: the standard content subtype.
func (watchCodec) Name() string { return rpccodec.Name }

// Marshal implements encoding.CodecV2.
func (c watchCodec) Marshal(v any) (grpcmem.BufferSlice, error) { return c.fallback.Marshal(v) }

// Unmarshal implements encoding.CodecV2.
func (c watchCodec) Unmarshal(data grpcmem.BufferSlice, v any) error {
	resp, ok := v.(*masterv1.WatchResponse)
	if !ok {
		return c.fallback.Unmarshal(data, v)
	}
	b := data.Materialize() // ours: the strings point into it
	if decodeWatchResponse(b, resp) {
		return nil
	}
	return rpccodec.Unmarshal(b, resp)
}

// decodeWatchResponse decodes b into m, replacing its contents, and
// reports whether b had the expected shape: only known fields, each with
// its declared wire type, valid varints and UTF-8 strings. On false, m is
// left in an unspecified state and the caller decodes b the standard way.
func decodeWatchResponse(b []byte, m *masterv1.WatchResponse) bool {
	spare, held := m.Changes[:cap(m.Changes)], len(m.Changes)
	m.Changes = m.Changes[:0]
	m.Links = nil
	var epoch, head, compact uint64
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			var ch *masterv1.Change
			if i := len(m.Changes); i < len(spare) && spare[i] != nil {
				ch = spare[i]
				*ch = masterv1.Change{}
			} else {
				ch = new(masterv1.Change)
			}
			if !decodeChange(v, ch) {
				return false
			}
			m.Changes = append(m.Changes, ch)
		case num == 5 && typ == protowire.BytesType:
			// A link to a span that recorded some of the changes (only
			// with tracing on): parsed and bounded by the source.
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			tc := &masterv1.TraceContext{}
			if !decodeTraceContext(v, tc) {
				return false
			}
			m.Links = append(m.Links, tc)
		case num >= 2 && num <= 4 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 2:
				epoch = v
			case 3:
				head = v
			default:
				compact = v
			}
		default:
			return false
		}
	}
	// Changes held before beyond the new end keep nothing alive.
	for _, ch := range spare[min(len(m.Changes), held):held] {
		if ch != nil {
			*ch = masterv1.Change{}
		}
	}
	m.Epoch, m.HeadRevision, m.CompactRevision = epoch, head, compact
	return true
}

// consumeString reads one length-prefixed UTF-8 string field value at the
// start of b, aliasing b (no copy), and its length in bytes; n < 0 when it
// is malformed or not UTF-8.
func consumeString(b []byte) (s string, n int) {
	v, n := protowire.ConsumeBytes(b)
	if n < 0 || !utf8.Valid(v) {
		return "", -1
	}
	if len(v) > 0 {
		s = unsafe.String(&v[0], len(v))
	}
	return s, n
}

// decodeTraceContext decodes b into the zero TraceContext tc.
func decodeTraceContext(b []byte, tc *masterv1.TraceContext) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || (num != 1 && num != 2) || typ != protowire.BytesType {
			return false
		}
		b = b[n:]
		s, n := consumeString(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		if num == 1 {
			tc.Traceparent = s
		} else {
			tc.Tracestate = s
		}
	}
	return true
}

// decodeChange decodes b into the zero Change ch.
func decodeChange(b []byte, ch *masterv1.Change) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch num {
		case 1, 2, 5, 7:
			if typ != protowire.VarintType {
				return false
			}
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 1:
				ch.Revision = v
			case 2:
				ch.Type = masterv1.ChangeType(int32(v))
			case 5:
				ch.Medium = masterv1.Medium(int32(v))
			default:
				ch.TimestampUnixMs = int64(v)
			}
		case 3, 4, 6:
			if typ != protowire.BytesType {
				return false
			}
			s, n := consumeString(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 3:
				ch.Tenant = s
			case 4:
				ch.Key = s
			default:
				ch.GroupId = s
			}
		default:
			return false
		}
	}
	return true
}
