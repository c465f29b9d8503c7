package rpccodec

import (
	"errors"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// FuzzUnmarshal decodes arbitrary bytes as the messages the hot paths
// receive from the network, with the generated decoder (and its UTF-8 check)
// and with proto.Unmarshal. They must agree: both refuse, or both accept
// and decode equal messages. It must never panic. Equal means equal known
// fields: vtprotobuf's well-known types (the Duration in ReplicateConfig
// and GetReplicaListResponse) drop unknown fields that proto.Unmarshal
// keeps, and unknown fields mean nothing to a peer of the same schema.
func FuzzUnmarshal(f *testing.F) {
	for _, m := range samples() {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(badKey())
	types := []func() proto.Message{
		func() proto.Message { return new(masterv1.BatchPutStartRequest) },
		func() proto.Message { return new(masterv1.BatchGetReplicaListResponse) },
		func() proto.Message { return new(masterv1.BatchPutStartResponse) },
		func() proto.Message { return new(masterv1.PutStartRequest) },
		func() proto.Message { return new(agentv1.TransferRequest) },
		func() proto.Message { return new(agentv1.TransferResponse) },
		func() proto.Message { return new(masterv1.WatchResponse) },
		func() proto.Message { return new(masterv1.ConnectRequest) },
		func() proto.Message { return new(masterv1.ConnectResponse) },
	}
	f.Add(hostileRegister(FreeMessages + 1))
	c, sc := New(), NewServer()
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, newMsg := range types {
			want, got := newMsg(), newMsg()
			werr := proto.Unmarshal(b, want)
			gerr := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, got)
			if (werr == nil) != (gerr == nil) {
				t.Fatalf("%T: proto.Unmarshal: %v; codec: %v", want, werr, gerr)
			}
			if werr == nil && !proto.Equal(known(t, want), known(t, got)) {
				t.Fatalf("%T: decoded differently:\nproto %v\ncodec %v", want, want, got)
			}
			// The server's codec refuses what is over its budget, and
			// otherwise agrees with proto.Unmarshal.
			limited := newMsg()
			lerr := sc.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, limited)
			if errors.Is(lerr, ErrTooManyMessages) {
				continue
			}
			if (werr == nil) != (lerr == nil) || werr == nil && !proto.Equal(known(t, want), known(t, limited)) {
				t.Fatalf("%T: server codec: %v (%v); proto.Unmarshal: %v", want, lerr, limited, werr)
			}
		}
	})
}

// known returns m without unknown fields, at any depth.
func known(t *testing.T, m proto.Message) proto.Message {
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatalf("re-marshal %T: %v", m, err)
	}
	out := m.ProtoReflect().New().Interface()
	if err := (proto.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, out); err != nil {
		t.Fatalf("re-unmarshal %T: %v", m, err)
	}
	return out
}
