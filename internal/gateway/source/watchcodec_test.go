package source

import (
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/grpc/encoding"
	grpcmem "google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

func watchResponse(n int, group string) *masterv1.WatchResponse {
	r := &masterv1.WatchResponse{Epoch: 7, HeadRevision: 1 << 40, CompactRevision: 3}
	for i := range n {
		typ := masterv1.ChangeType_CHANGE_TYPE_STORED
		if i%3 == 2 {
			typ = masterv1.ChangeType_CHANGE_TYPE_REMOVED
		}
		r.Changes = append(r.Changes, &masterv1.Change{
			Revision: uint64(100 + i), Type: typ, Tenant: "default", Key: "bench/61f148/0000000" + string(rune('0'+i%10)),
			Medium: masterv1.Medium(i % 3), GroupId: group, TimestampUnixMs: 1795957503682,
		})
	}
	return r
}

// withLinks adds n trace-context links to r (as a traced master sends).
func withLinks(r *masterv1.WatchResponse, n int) *masterv1.WatchResponse {
	for i := range n {
		tc := &masterv1.TraceContext{Traceparent: fmt.Sprintf("00-4bf92f3577b34da6a3ce929d0e0e47%02x-00f067aa0ba902b7-01", i)}
		if i%2 == 1 {
			tc.Tracestate = "v=1"
		}
		r.Links = append(r.Links, tc)
	}
	return r
}

func mustMarshal(t testing.TB, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestWatchCodecFastPath: what the master sends takes the fast path, in
// one buffer or several, into a fresh response or one that held more or
// fewer changes before, and equals proto.Unmarshal's result.
func TestWatchCodecFastPath(t *testing.T) {
	c := newWatchCodec()
	into := &masterv1.WatchResponse{}
	for _, tc := range []struct {
		n     int
		group string
		links int
	}{{5, "g", 0}, {1, "", 2}, {300, "group-1", 8}, {0, "", 0}, {64, "", 1}, {3, "", 0}} {
		want := withLinks(watchResponse(tc.n, tc.group), tc.links)
		b := mustMarshal(t, want)
		if !decodeWatchResponse(b, &masterv1.WatchResponse{}) {
			t.Fatalf("%d changes: the master's shape did not take the fast path", tc.n)
		}
		held := into.Changes[:cap(into.Changes)]
		var data grpcmem.BufferSlice
		for len(b) > 0 { // split, as gRPC may hand a message over
			k := min(len(b), 100)
			data = append(data, grpcmem.SliceBuffer(b[:k]))
			b = b[k:]
		}
		if err := c.Unmarshal(data, into); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(into, want) {
			t.Fatalf("%d changes: decoded %v, want %v", tc.n, into, want)
		}
		for i, ch := range held[min(len(into.Changes), len(held)):] {
			if ch != nil && !proto.Equal(ch, &masterv1.Change{}) {
				t.Fatalf("%d changes: a change held before beyond the end (%d) still holds %v", tc.n, i, ch)
			}
		}
	}
}

// TestWatchCodecFallback: shapes the fast path does not take are decoded
// (or refused) exactly as proto.Unmarshal does.
func TestWatchCodecFallback(t *testing.T) {
	good := mustMarshal(t, watchResponse(2, "g"))
	unknown := protowire.AppendVarint(protowire.AppendTag(append([]byte(nil), good...), 9, protowire.VarintType), 5)
	change := protowire.AppendString(protowire.AppendTag(nil, 3, protowire.BytesType), "t\xff")
	badUTF8 := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), change)
	wrongType := protowire.AppendFixed64(protowire.AppendTag(append([]byte(nil), good...), 2, protowire.Fixed64Type), 9)
	link := func(inner []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(append([]byte(nil), good...), 5, protowire.BytesType), inner)
	}
	linkUnknown := link(protowire.AppendVarint(protowire.AppendTag(nil, 3, protowire.VarintType), 1))
	linkUTF8 := link(protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "00-\xc3"))
	linkWrongType := link(protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1))
	linkVarint := protowire.AppendVarint(protowire.AppendTag(append([]byte(nil), good...), 5, protowire.VarintType), 1)
	for name, b := range map[string][]byte{
		"unknown field": unknown, "invalid UTF-8": badUTF8, "wrong wire type": wrongType, "truncated": good[:len(good)-3],
		"link with an unknown field": linkUnknown, "link not UTF-8": linkUTF8, "link field of the wrong type": linkWrongType,
		"links as a varint": linkVarint,
	} {
		if decodeWatchResponse(b, &masterv1.WatchResponse{}) {
			t.Errorf("%s: took the fast path", name)
		}
		checkLikeProto(t, b)
	}
}

func checkLikeProto(t *testing.T, b []byte) {
	t.Helper()
	want := &masterv1.WatchResponse{}
	werr := proto.Unmarshal(b, want)
	got := withLinks(watchResponse(3, "stale"), 2) // decoding replaces what it held
	gerr := newWatchCodec().Unmarshal(grpcmem.BufferSlice{grpcmem.SliceBuffer(b)}, got)
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("%x: watchCodec err %v, proto.Unmarshal err %v", b, gerr, werr)
	}
	if werr == nil && !proto.Equal(known(got), known(want)) {
		t.Fatalf("%x: watchCodec decoded %v, proto.Unmarshal %v", b, got, want)
	}
}

// known drops unknown fields: the fallback, rpccodec, keeps them as sent
// where proto.Unmarshal re-encodes their tags; only known fields count.
func known(m *masterv1.WatchResponse) *masterv1.WatchResponse {
	m.ProtoReflect().SetUnknown(nil)
	for _, ch := range m.Changes {
		ch.ProtoReflect().SetUnknown(nil)
	}
	for _, l := range m.Links {
		l.ProtoReflect().SetUnknown(nil)
	}
	return m
}

// FuzzWatchCodec: watchCodec accepts and refuses what proto.Unmarshal
// does, and decodes the same response.
func FuzzWatchCodec(f *testing.F) {
	f.Add(mustMarshal(f, watchResponse(3, "g")))
	f.Add(mustMarshal(f, watchResponse(1, "")))
	f.Add([]byte{})
	f.Add(mustMarshal(f, withLinks(watchResponse(2, ""), 3)))
	f.Add(protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1<<63))
	f.Fuzz(func(t *testing.T, b []byte) { checkLikeProto(t, b) })
}

// BenchmarkWatchDecode decodes, into a reused response, what the master
// sends in BenchmarkPipeline (stored changes of one tenant, 21-byte keys,
// no group) with watchCodec and with the generated decoder behind rpccodec.
// Issue 12 compared it with vtprotobuf's pool and unmarshal_unsafe options
// too (see watchCodec), which gen/ does not enable:
//
//	go test -run '^$' -bench WatchDecode -count 10 ./services/gateway/internal/source/
func BenchmarkWatchDecode(b *testing.B) {
	for _, n := range []int{1024, 128} {
		r := &masterv1.WatchResponse{Epoch: 1, HeadRevision: 1 << 30}
		for i := range n {
			r.Changes = append(r.Changes, &masterv1.Change{Revision: uint64(1<<20 + i), Type: masterv1.ChangeType_CHANGE_TYPE_STORED,
				Tenant: "default", Key: fmt.Sprintf("bench/61f148/%08d", i), Medium: masterv1.Medium_MEDIUM_MEMORY, TimestampUnixMs: 1795957503682})
		}
		msg := mustMarshal(b, r)
		for _, v := range []struct {
			name  string
			codec encoding.CodecV2
		}{{"hand", newWatchCodec()}, {"generated", rpccodec.New()}} {
			b.Run(fmt.Sprintf("changes=%d/%s", n, v.name), func(b *testing.B) {
				resp := &masterv1.WatchResponse{}
				data := grpcmem.BufferSlice{grpcmem.SliceBuffer(msg)}
				b.SetBytes(int64(len(msg)))
				b.ReportAllocs()
				for b.Loop() {
					if err := v.codec.Unmarshal(data, resp); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/change")
			})
		}
	}
}
