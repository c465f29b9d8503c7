package client

import (
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// callResponses are answers as a master sends them: lookups, an error
// with its ErrorInfo (details: the fast path declines), an error without.
func callResponses() []*masterv1.CallStreamResponse {
	st := status.Convert(rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "not the leader"))).Proto()
	return []*masterv1.CallStreamResponse{
		{RequestId: 1, Answer: &masterv1.CallStreamResponse_BatchGetReplicaList{BatchGetReplicaList: lookupResponse(0)}},
		{RequestId: 2, Answer: &masterv1.CallStreamResponse_BatchGetReplicaList{BatchGetReplicaList: lookupResponse(6)}},
		{RequestId: 1 << 40, Code: st.GetCode(), Message: st.GetMessage(), Details: st.GetDetails()},
		{RequestId: 4, Code: 12, Message: "call stream: unknown call"},
		{RequestId: 5, Code: 3, Details: []*anypb.Any{{TypeUrl: "x"}}},
		{RequestId: 6, Answer: &masterv1.CallStreamResponse_PutStart{PutStart: &masterv1.PutStartResponse{
			Replicas: lookupResponse(1).GetResults()[0].GetReplicaList().GetReplicas()}}},
	}
}

// asReply is m as the stream receives it.
func asReply(m *masterv1.CallStreamResponse) *callReply {
	r := &callReply{}
	b, _ := proto.Marshal(m)
	if err := rpccodec.Unmarshal(b, r); err != nil {
		panic(err)
	}
	return r
}

// TestAnswerInto: an answer goes into the message the unary call would
// have filled, and an answer of another type is refused.
func TestAnswerInto(t *testing.T) {
	rs := callResponses()
	lookup := &lookupReply{}
	if err := asReply(rs[1]).answerInto(lookup); err != nil || !proto.Equal(&lookup.BatchGetReplicaListResponse, rs[1].GetBatchGetReplicaList()) {
		t.Fatalf("lookup: %v, %v", &lookup.BatchGetReplicaListResponse, err)
	}
	ps := &masterv1.PutStartResponse{}
	if err := asReply(rs[5]).answerInto(ps); err != nil || !proto.Equal(ps, rs[5].GetPutStart()) {
		t.Fatalf("PutStart: %v, %v", ps, err)
	}
	for _, wrong := range []any{&masterv1.PutEndResponse{}, &lookupReply{}} {
		if err := asReply(rs[5]).answerInto(wrong); status.Code(err) != codes.Internal {
			t.Errorf("a PutStart answer into %T: %v, want INTERNAL", wrong, err)
		}
	}
	if err := asReply(rs[3]).answerInto(ps); status.Code(err) != codes.Internal {
		t.Errorf("no answer: %v, want INTERNAL", err)
	}
}

// TestDecodeCallReply: the fast path decodes what the codec decodes, and
// declines only an error's details.
func TestDecodeCallReply(t *testing.T) {
	for i, m := range callResponses() {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got := &callReply{}
		ok := got.DecodeFast(b, rpccodec.MessageBudget(len(b)))
		// Details and answers other than a lookup go to the codec.
		if want := len(m.GetDetails()) == 0 && m.GetPutStart() == nil; ok != want {
			t.Fatalf("response %d: fast path %v, want %v", i, ok, want)
		}
		if !ok {
			continue
		}
		if !proto.Equal(&got.CallStreamResponse, m) {
			t.Fatalf("response %d: fast path %v, want %v", i, &got.CallStreamResponse, m)
		}
		// And through the codec, as the stream receives it.
		viaCodec := &callReply{}
		if err := rpccodec.Unmarshal(b, viaCodec); err != nil || !proto.Equal(&viaCodec.CallStreamResponse, m) {
			t.Fatalf("response %d through the codec: %v, %v", i, &viaCodec.CallStreamResponse, err)
		}
	}
}

// FuzzDecodeCallReply: whatever the fast path decodes, proto.Unmarshal
// decodes the same (and it declines whatever proto.Unmarshal refuses).
func FuzzDecodeCallReply(f *testing.F) {
	for _, m := range callResponses() {
		b, _ := proto.Marshal(m)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got := &callReply{}
		if !got.DecodeFast(b, rpccodec.MessageBudget(len(b))) {
			return
		}
		want := &masterv1.CallStreamResponse{}
		if err := proto.Unmarshal(b, want); err != nil {
			t.Fatalf("fast path decoded what proto.Unmarshal refuses (%v)", err)
		}
		if !proto.Equal(&got.CallStreamResponse, want) {
			t.Fatalf("fast path: %v\nproto.Unmarshal: %v", &got.CallStreamResponse, want)
		}
	})
}
