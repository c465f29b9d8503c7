package link

import (
	"strconv"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

const testSeg = "0b0e7a52-6d1c-4c1e-9a8e-3f1f2d0c9b11"

func testIDs(b []byte) (string, bool) {
	if string(b) == testSeg {
		return testSeg, true
	}
	return "", false
}

// decodeBoth decodes b through the codec into a plain ConnectResponse and
// into the fast-path wrapper.
func decodeBoth(b []byte) (plain, fast *masterv1.ConnectResponse, plainErr, fastErr error) {
	plain = &masterv1.ConnectResponse{}
	plainErr = rpccodec.New().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, plain)
	w := &connectResponse{ConnectResponse: &masterv1.ConnectResponse{}, ids: testIDs}
	fastErr = newConnectCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, w)
	return plain, w.ConnectResponse, plainErr, fastErr
}

// TestConnectCodecPieces decodes a command received in several buffers.
func TestConnectCodecPieces(t *testing.T) {
	b := marshal(t, reserveMsg(40))
	want := &masterv1.ConnectResponse{}
	if err := rpccodec.Unmarshal(b, want); err != nil {
		t.Fatal(err)
	}
	w := &connectResponse{ConnectResponse: &masterv1.ConnectResponse{}, ids: testIDs}
	data := mem.BufferSlice{mem.SliceBuffer(b[:100]), mem.SliceBuffer(b[100:1000]), mem.SliceBuffer(b[1000:])}
	if err := newConnectCodec().Unmarshal(data, w); err != nil || !proto.Equal(w.ConnectResponse, want) {
		t.Fatalf("Unmarshal of 3 pieces = %v, %v; want %v", err, w.ConnectResponse, want)
	}
}

func checkSame(t *testing.T, b []byte) {
	t.Helper()
	plain, fast, plainErr, fastErr := decodeBoth(b)
	if (plainErr == nil) != (fastErr == nil) || (plainErr != nil && plainErr.Error() != fastErr.Error()) {
		t.Fatalf("decode of %x: generated err %v, fast path err %v", b, plainErr, fastErr)
	}
	if plainErr == nil && !proto.Equal(plain, fast) {
		t.Fatalf("decode of %x:\ngenerated %v\nfast path %v", b, plain, fast)
	}
	// The wrapper alone, under rpccodec (its UnmarshalVT).
	w := &connectResponse{ConnectResponse: &masterv1.ConnectResponse{}, ids: testIDs}
	err := rpccodec.New().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, w)
	if (plainErr == nil) != (err == nil) || (plainErr != nil && plainErr.Error() != err.Error()) || (err == nil && !proto.Equal(plain, w.ConnectResponse)) {
		t.Fatalf("decode of %x by UnmarshalVT: %v, %v; want %v, %v", b, w.ConnectResponse, err, plain, plainErr)
	}
}

func marshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := rpccodec.AppendMarshal(nil, m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func reserveMsg(n int) *masterv1.ConnectResponse {
	items := make([]*masterv1.ReserveItem, n)
	for i := range items {
		items[i] = &masterv1.ReserveItem{SegmentId: testSeg, Size: 4096 + uint64(i), Tenant: "tenant", Key: "bench/object-" + strconv.Itoa(i),
			ReplicaId: uint32(i % 3), GroupId: []string{"", "g"}[i%2], HardPin: i%5 == 0, SoftPinUntilUnixMs: int64(i) - 3}
	}
	// A blank reservation (no object), then two odd items.
	items = append(items, &masterv1.ReserveItem{SegmentId: testSeg, Size: 4096, Blank: true},
		&masterv1.ReserveItem{SegmentId: "other-segment", Key: "k"}, &masterv1.ReserveItem{})
	return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 7, Epoch: 3, Items: items}}}
}

func seedMessages(t testing.TB) [][]byte {
	seal := &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 1 << 40, Epoch: 2, Items: []*masterv1.SealItem{
		{SegmentId: testSeg, AllocationId: 1, Checksum: 1<<64 - 1, SoftPinUntilUnixMs: -1}, {SegmentId: "x", AllocationId: 2}, {},
	}}}}
	release := &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: 9, Items: []*masterv1.AllocationRef{
		{SegmentId: testSeg, AllocationId: 5}, {AllocationId: 6}, {SegmentId: "y"},
	}}}}
	settings := &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: &masterv1.Settings{Epoch: 4, HeartbeatInterval: durationpb.New(1), TokenKeys: []*masterv1.TokenKey{{Id: 1, Key: []byte("k")}},
		MasterTime: timestamppb.New(time.Unix(1796000000, 5))}}}
	empty := &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{}}}
	var seeds [][]byte
	for _, m := range []proto.Message{reserveMsg(3), seal, release, settings, empty, &masterv1.ConnectResponse{}} {
		seeds = append(seeds, marshal(t, m))
	}
	r, s := marshal(t, reserveMsg(2)), marshal(t, seal)
	// Two oneof fields (the second wins, or merges when the same).
	seeds = append(seeds, append(append([]byte(nil), r...), s...), append(append([]byte(nil), r...), r...))
	// An unknown field inside an item, and at the top level.
	item := protowire.AppendTag(nil, 1, protowire.BytesType)
	item = protowire.AppendString(item, testSeg)
	item = protowire.AppendTag(item, 99, protowire.VarintType)
	item = protowire.AppendVarint(item, 1)
	body := protowire.AppendTag(nil, 3, protowire.BytesType)
	body = protowire.AppendBytes(body, item)
	msg := protowire.AppendTag(nil, fieldSeal, protowire.BytesType)
	msg = protowire.AppendBytes(msg, body)
	seeds = append(seeds, msg, append(protowire.AppendVarint(protowire.AppendTag(nil, 42, protowire.VarintType), 1), r...))
	// A known field with the wrong wire type; invalid UTF-8 in a key.
	wrong := protowire.AppendTag(nil, 2, protowire.BytesType)
	wrong = protowire.AppendString(wrong, "x")
	seeds = append(seeds, protowire.AppendBytes(protowire.AppendTag(nil, fieldRelease, protowire.BytesType),
		protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), wrong)))
	bad := marshal(t, &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{Items: []*masterv1.ReserveItem{{Key: "abc"}}}}})
	bad[len(bad)-1] = 0xff
	seeds = append(seeds, bad)
	// Invalid UTF-8 in a seal item's segment id, and in a tenant that the
	// next item repeats.
	badSeg := marshal(t, &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{Items: []*masterv1.SealItem{{SegmentId: "seg\xc3"}}}}})
	badTenant := marshal(t, &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{Items: []*masterv1.ReserveItem{
		{Tenant: "t\xe2\x82", Key: "a"}, {Tenant: "t\xe2\x82", Key: "b"}, {Tenant: "ok", GroupId: "\x80"},
	}}}})
	seeds = append(seeds, badSeg, badTenant)
	seeds = append(seeds, blankSeeds()...)
	return append(seeds, traceSeeds(t)...)
}

// blankSeeds are reserve commands whose item sets blank (field 9) in odd
// but valid encodings (a value other than 1, the field twice: the last
// wins) and in a malformed one (the wrong wire type).
func blankSeeds() [][]byte {
	item := func(fields ...[]byte) []byte {
		b := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), testSeg)
		b = protowire.AppendVarint(protowire.AppendTag(b, 2, protowire.VarintType), 4096)
		for _, f := range fields {
			b = append(b, f...)
		}
		body := protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), b)
		return protowire.AppendBytes(protowire.AppendTag(nil, fieldReserve, protowire.BytesType), body)
	}
	blank := func(v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), v)
	}
	return [][]byte{
		item(blank(1)),
		item(blank(2)),
		item(blank(1<<63 + 1)),
		item(blank(1), blank(0)),
		item(blank(0), blank(1)),
		item(protowire.AppendString(protowire.AppendTag(nil, 9, protowire.BytesType), "x")),
	}
}

const testParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// traceSeeds are commands with trace contexts: plain, with links (which
// the fast path leaves to the generated decoder), given twice (merged),
// and malformed inside.
func traceSeeds(t testing.TB) [][]byte {
	tc := &masterv1.TraceContext{Traceparent: testParent, Tracestate: "v=1"}
	var seeds [][]byte
	for _, m := range []*masterv1.ConnectResponse{
		{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 1, Items: reserveMsg(2).GetReserve().GetItems(), TraceContext: tc}}},
		{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 2, Items: []*masterv1.SealItem{{SegmentId: testSeg}}, TraceContext: &masterv1.TraceContext{Traceparent: testParent}}}},
		{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: 3, Items: []*masterv1.AllocationRef{{SegmentId: testSeg}}, TraceContext: &masterv1.TraceContext{}}}},
		{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: 4, TraceContext: tc, TraceLinks: []*masterv1.TraceContext{tc, {}}}}},
		{Msg: &masterv1.ConnectResponse_Copy{Copy: &masterv1.CopyRequest{RequestId: 5, TraceContext: tc}}},
	} {
		seeds = append(seeds, marshal(t, m))
	}
	wrap := func(fields ...[]byte) []byte {
		body := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 8)
		for _, f := range fields {
			body = protowire.AppendBytes(protowire.AppendTag(body, fieldTraceContext, protowire.BytesType), f)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, fieldSeal, protowire.BytesType), body)
	}
	str := func(num protowire.Number, v string) []byte {
		return protowire.AppendString(protowire.AppendTag(nil, num, protowire.BytesType), v)
	}
	unknown := protowire.AppendVarint(protowire.AppendTag(str(1, testParent), 3, protowire.VarintType), 1)
	wrongType := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 1)
	return append(seeds,
		wrap(str(1, testParent), str(2, "a=b")),          // two occurrences, merged
		wrap(append(str(1, "x"), str(1, testParent)...)), // a field twice: the last wins
		wrap(str(1, "\xff\xfe")),                         // invalid UTF-8
		wrap(str(2, "ok\xc3")),
		wrap(unknown),   // an unknown field inside
		wrap(wrongType), // a known field with the wrong wire type
	)
}

// TestConnectResponseDecode checks the fast path against the generated
// decoder on valid commands, odd but valid encodings and malformed ones.
func TestConnectResponseDecode(t *testing.T) {
	for _, b := range seedMessages(t) {
		checkSame(t, b)
		for i := range b { // every truncation
			checkSame(t, b[:i])
		}
	}
	// The fast path is taken for a command: the items share one array,
	// segment ids and the repeated tenant are not copied.
	b := marshal(t, reserveMsg(128))
	allocs := testing.AllocsPerRun(20, func() {
		w := &connectResponse{ConnectResponse: &masterv1.ConnectResponse{}, ids: testIDs}
		if err := newConnectCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, w); err != nil {
			t.Fatal(err)
		}
	})
	// 128 keys, the other segment's id and its key, one tenant, one
	// group, the arrays, the request, the oneof wrapper, the wrapper.
	if allocs > 140 {
		t.Fatalf("decoding 130 reserve items took %v allocations, want about one per key", allocs)
	}
}

// TestReserveBlankFastPath: a reserve command with blank items takes the
// fast path and decodes the field as the generated decoder does.
func TestReserveBlankFastPath(t *testing.T) {
	seeds := blankSeeds()[:5]
	wantBlank := []bool{true, true, true, false, true}
	seeds, wantBlank = append(seeds, marshal(t, reserveMsg(2))), append(wantBlank, false)
	for i, b := range seeds {
		want := &masterv1.ConnectResponse{}
		if err := proto.Unmarshal(b, want); err != nil {
			t.Fatalf("seed %d: proto.Unmarshal: %v", i, err)
		}
		w := &connectResponse{ConnectResponse: &masterv1.ConnectResponse{}, ids: testIDs}
		if !w.fast(b, true) {
			t.Fatalf("seed %d: the fast path declined a blank reservation", i)
		}
		if !proto.Equal(w.ConnectResponse, want) {
			t.Fatalf("seed %d: fast path %v, want %v", i, w.ConnectResponse, want)
		}
		items := w.GetReserve().GetItems()
		if got := items[0].GetBlank(); got != wantBlank[i] {
			t.Fatalf("seed %d: first item blank = %v, want %v", i, got, wantBlank[i])
		}
		if i == len(seeds)-1 && !items[2].GetBlank() {
			t.Fatalf("reserveMsg's blank item decoded as %v", items[2])
		}
		if w.held != nil {
			w.held.release()
		}
	}
}

// TestTracedCommandFastPath: a command with a trace context (and no
// links) still takes the fast path, and decodes its field.
func TestTracedCommandFastPath(t *testing.T) {
	for i, b := range traceSeeds(t)[:3] {
		w := &connectResponse{ConnectResponse: &masterv1.ConnectResponse{}, ids: testIDs}
		if !w.fast(b, true) {
			t.Fatalf("seed %d: the fast path declined a traced command", i)
		}
		if i < 2 && tracectxParent(w.ConnectResponse) != testParent {
			t.Fatalf("seed %d: decoded trace context %v", i, w.ConnectResponse)
		}
		if w.held != nil {
			w.held.release()
		}
	}
}

func tracectxParent(m *masterv1.ConnectResponse) string {
	switch v := m.GetMsg().(type) {
	case *masterv1.ConnectResponse_Reserve:
		return v.Reserve.GetTraceContext().GetTraceparent()
	case *masterv1.ConnectResponse_Seal:
		return v.Seal.GetTraceContext().GetTraceparent()
	case *masterv1.ConnectResponse_Release:
		return v.Release.GetTraceContext().GetTraceparent()
	}
	return ""
}

// FuzzConnectResponseDecode: whatever the bytes, the fast path decodes (or
// refuses) exactly as the generated decoder does.
func FuzzConnectResponseDecode(f *testing.F) {
	for _, b := range seedMessages(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkSame(t, b) })
}
