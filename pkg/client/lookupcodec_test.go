package client

import (
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// lookupResponse is a response as a master sends one: n items over two
// agents, every fifth one an error, some with two replicas.
func lookupResponse(n int) *masterv1.BatchGetReplicaListResponse {
	r := &masterv1.BatchGetReplicaListResponse{}
	for i := range n {
		if i%5 == 4 {
			r.Results = append(r.Results, &masterv1.GetReplicaListResult{Status: &masterv1.ItemStatus{
				Code: 5, Reason: "ERROR_REASON_OBJECT_NOT_FOUND", Message: fmt.Sprintf("object %d not found", i)}})
			continue
		}
		l := &masterv1.GetReplicaListResponse{Size: 4096, Checksum: uint64(i) * 0x9e3779b97f4a7c15, LeaseTtl: durationpb.New(5e9)}
		for k := range 1 + i%3/2 {
			a := (i + k) % 2
			l.Replicas = append(l.Replicas, &masterv1.ReplicaDescriptor{
				ReplicaId: uint32(k), SegmentId: fmt.Sprintf("5c0e1d52-8f1a-4d7e-9a55-00000000000%d", a), AgentId: fmt.Sprintf("agent-%d", a),
				HostId: "host-a", DataEndpoint: fmt.Sprintf("127.0.0.1:70%02d", a), AllocationId: uint64(1000 + i), Offset: uint64(i) << 12,
				Size: 4096, Medium: masterv1.Medium(1), Status: masterv1.ReplicaStatus(2), Token: []byte(fmt.Sprintf("token-of-item-%d-%d-0123456789abcdef0123456789", i, k)),
				TokenExpiryUnixMs: 1_800_000_000_000 + int64(i), TransferEndpoint: fmt.Sprintf("127.0.0.1:71%02d", a),
			})
		}
		if i%7 == 3 {
			l.GroupId = "group-1"
		}
		r.Results = append(r.Results, &masterv1.GetReplicaListResult{ReplicaList: l})
	}
	return r
}

func TestDecodeLookupMatchesTheCodec(t *testing.T) {
	for _, n := range []int{0, 1, 2, 5, 33} {
		want := lookupResponse(n)
		b, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		got := &lookupReply{}
		if !got.DecodeFast(b, rpccodec.MessageBudget(len(b))) {
			t.Fatalf("n=%d: the fast path declined a master's response", n)
		}
		if !proto.Equal(&got.BatchGetReplicaListResponse, want) {
			t.Fatalf("n=%d: decoded\n%v\nwant\n%v", n, &got.BatchGetReplicaListResponse, want)
		}
		// Nothing decoded refers to b (gRPC reuses it).
		clear(b)
		if !proto.Equal(&got.BatchGetReplicaListResponse, want) {
			t.Fatalf("n=%d: the decoded response changed with the bytes it was decoded from", n)
		}
		// Through the codec, as gRPC calls it.
		b, _ = proto.Marshal(want)
		viaCodec := &lookupReply{}
		if err := rpccodec.Unmarshal(b, viaCodec); err != nil || !proto.Equal(&viaCodec.BatchGetReplicaListResponse, want) {
			t.Fatalf("n=%d: codec: %v", n, err)
		}
	}
}

func TestDecodeLookupKeepsEachReplicaListItsOwn(t *testing.T) {
	want := lookupResponse(6)
	b, _ := proto.Marshal(want)
	got := &lookupReply{}
	if !got.DecodeFast(b, 1<<20) {
		t.Fatal("declined")
	}
	// orderReplicas sorts a list in place, and a caller may append: never
	// into the next item's.
	l0, l1 := got.Results[1].ReplicaList, got.Results[2].ReplicaList
	before := l1.Replicas[0]
	_ = append(l0.Replicas, &masterv1.ReplicaDescriptor{})
	tok := got.Results[1].ReplicaList.Replicas[0].Token
	_ = append(tok, 'x')
	if l1.Replicas[0] != before || !proto.Equal(&got.BatchGetReplicaListResponse, want) {
		t.Fatal("an append to one item's replicas or token reached another's")
	}
}

func TestDecodeLookupDeclinesWhatTheCodecDecidesOtherwise(t *testing.T) {
	b, _ := proto.Marshal(lookupResponse(3))
	cases := map[string][]byte{
		// An unknown field the generated decoder keeps.
		"unknown top-level field": protowire.AppendVarint(protowire.AppendTag(append([]byte(nil), b...), 2, protowire.VarintType), 7),
		"not UTF-8": mustMarshal(t, &masterv1.BatchGetReplicaListResponse{Results: []*masterv1.GetReplicaListResult{{
			ReplicaList: &masterv1.GetReplicaListResponse{GroupId: "g\xffg"}}}}),
		"truncated": b[:len(b)-1],
	}
	// A replica with a field from the future (number 99).
	rd := protowire.AppendTag(nil, 2, protowire.BytesType)
	rd = protowire.AppendString(rd, "seg")
	rd = protowire.AppendVarint(protowire.AppendTag(rd, 99, protowire.VarintType), 1)
	list := protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), rd)
	res := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), list)
	cases["unknown replica field"] = protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), res)
	// A message field twice (proto merges them).
	twice := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), list)
	twice = protowire.AppendBytes(protowire.AppendTag(twice, 2, protowire.BytesType), list)
	cases["replica list twice"] = protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), twice)

	for name, b := range cases {
		if (&lookupReply{}).DecodeFast(b, 1<<20) {
			t.Errorf("%s: the fast path decoded it", name)
		}
		// The codec then decides, as for any message.
		want := &masterv1.BatchGetReplicaListResponse{}
		werr := proto.Unmarshal(b, want)
		got := &lookupReply{}
		gerr := rpccodec.Unmarshal(b, got)
		if (werr == nil) != (gerr == nil) || (werr == nil && !proto.Equal(&got.BatchGetReplicaListResponse, want)) {
			t.Errorf("%s: codec gave %v, %v; proto.Unmarshal %v, %v", name, &got.BatchGetReplicaListResponse, gerr, want, werr)
		}
	}
	// Over budget: 3 results with a list, a ttl and a replica or two each.
	if (&lookupReply{}).DecodeFast(b, 5) {
		t.Error("decoded more nested messages than the budget")
	}
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{}.Marshal(m)
	if err != nil {
		// A string that is not UTF-8: marshal the field by hand.
		b = nil
		for _, r := range m.(*masterv1.BatchGetReplicaListResponse).Results {
			l := protowire.AppendString(protowire.AppendTag(nil, 5, protowire.BytesType), r.ReplicaList.GroupId)
			res := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), l)
			b = protowire.AppendBytes(protowire.AppendTag(b, 1, protowire.BytesType), res)
		}
	}
	return b
}

// FuzzDecodeLookup: whatever the fast path decodes, proto.Unmarshal
// decodes the same (and it declines whatever proto.Unmarshal refuses).
func FuzzDecodeLookup(f *testing.F) {
	for _, n := range []int{0, 1, 3, 6} {
		b, _ := proto.Marshal(lookupResponse(n))
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got := &lookupReply{}
		if !got.DecodeFast(b, rpccodec.MessageBudget(len(b))) {
			return
		}
		want := &masterv1.BatchGetReplicaListResponse{}
		if err := proto.Unmarshal(b, want); err != nil {
			t.Fatalf("fast path decoded what proto.Unmarshal refuses (%v)", err)
		}
		if !proto.Equal(&got.BatchGetReplicaListResponse, want) {
			t.Fatalf("fast path: %v\nproto.Unmarshal: %v", &got.BatchGetReplicaListResponse, want)
		}
	})
}

// BenchmarkDecodeLookup is the client's decode of a 32-item lookup
// response: the codec's generated decoder, and the fast path.
//
//	go test ./pkg/client -run '^$' -bench DecodeLookup -benchmem
func BenchmarkDecodeLookup(b *testing.B) {
	enc, _ := proto.Marshal(lookupResponse(32))
	b.Run("generated", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := rpccodec.Unmarshal(enc, &masterv1.BatchGetReplicaListResponse{}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("fast", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := rpccodec.Unmarshal(enc, &lookupReply{}); err != nil {
				b.Fatal(err)
			}
		}
	})
}
