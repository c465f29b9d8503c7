package rpccodec

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// samples are messages of every shape the hot paths carry: nested
// messages, repeated messages, strings, bytes, enums, well-known types,
// oneofs and maps where the schema has them.
func samples() []proto.Message {
	return []proto.Message{
		putRequest(3),
		getResponse(3),
		&masterv1.BatchPutStartResponse{Results: []*masterv1.PutStartResult{
			{Status: &masterv1.ItemStatus{Code: 8, Reason: "NO_AVAILABLE_HANDLE", Message: "no room — äöü"}},
			{Status: &masterv1.ItemStatus{}, Replicas: getResponse(1).Results[0].ReplicaList.Replicas},
		}},
		&masterv1.PutStartRequest{Tenant: "t", Key: "k/ü/日本", Size: 1, Config: &masterv1.ReplicateConfig{
			ReplicaNum: 2, PreferredSegments: []string{"a", "b"}, SoftPin: true, SoftPinTtl: durationpb.New(3e9), GroupId: "g",
		}},
		&agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{{Token: []byte{1, 2, 3}, Length: 7}}},
		&agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Status: &agentv1.ItemResult{}, Length: 4096, Checksum: 9}}},
		&masterv1.BatchPutStartRequest{}, // empty
	}
}

// Both directions agree with the standard codec byte for byte in meaning:
// what one encodes the other decodes to an equal message.
func TestMatchesStandardCodec(t *testing.T) {
	std := encoding.GetCodecV2("proto")
	vt := New()
	for _, m := range samples() {
		name := string(m.ProtoReflect().Descriptor().FullName())
		t.Run(name, func(t *testing.T) {
			for _, dir := range []struct {
				name     string
				enc, dec encoding.CodecV2
			}{{"vt→std", vt, std}, {"std→vt", std, vt}, {"vt→vt", vt, vt}} {
				data, err := dir.enc.Marshal(m)
				if err != nil {
					t.Fatalf("%s: marshal: %v", dir.name, err)
				}
				got := m.ProtoReflect().New().Interface()
				// Stale contents must be replaced, not merged.
				proto.Merge(got, m)
				if err := dir.dec.Unmarshal(data, got); err != nil {
					t.Fatalf("%s: unmarshal: %v", dir.name, err)
				}
				data.Free()
				if !proto.Equal(got, m) {
					t.Fatalf("%s: got %v, want %v", dir.name, got, m)
				}
			}
			b, err := AppendMarshal([]byte("pre"), m)
			if err != nil || !strings.HasPrefix(string(b), "pre") {
				t.Fatalf("AppendMarshal: %q, %v", b, err)
			}
			got := m.ProtoReflect().New().Interface()
			if err := Unmarshal(b[3:], got); err != nil || !proto.Equal(got, m) {
				t.Fatalf("Unmarshal(AppendMarshal): %v, %v", got, err)
			}
		})
	}
}

// A large message leaves in a pooled buffer and arrives split over several
// buffers (as gRPC hands over a message spanning frames).
func TestLargeAndSplit(t *testing.T) {
	m := getResponse(2000)
	data, err := New().Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	flat := data.Materialize()
	data.Free()
	var split mem.BufferSlice
	for len(flat) > 0 {
		n := min(len(flat), 16384)
		split = append(split, mem.SliceBuffer(flat[:n]))
		flat = flat[n:]
	}
	got := &masterv1.BatchGetReplicaListResponse{}
	if err := New().Unmarshal(split, got); err != nil || !proto.Equal(got, m) {
		t.Fatalf("split unmarshal: equal=%v err=%v", proto.Equal(got, m), err)
	}
}

// badKey is a PutStartRequest whose key is not UTF-8, nested one level down
// in a BatchPutStartRequest: proto.Marshal cannot produce it, a peer can.
func badKey() []byte {
	var item []byte
	item = protowire.AppendTag(item, 1, protowire.BytesType)
	item = protowire.AppendString(item, "default")
	item = protowire.AppendTag(item, 2, protowire.BytesType)
	item = protowire.AppendBytes(item, []byte{'k', 0xff, 0xfe})
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	return protowire.AppendBytes(b, item)
}

func TestRefusesInvalidUTF8LikeProto(t *testing.T) {
	b := badKey()
	if err := proto.Unmarshal(b, &masterv1.BatchPutStartRequest{}); err == nil {
		t.Fatal("proto.Unmarshal accepted a non-UTF-8 key; the premise of the check is gone")
	}
	if err := New().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, &masterv1.BatchPutStartRequest{}); !errors.Is(err, errInvalidUTF8) {
		t.Fatalf("codec: %v, want %v", err, errInvalidUTF8)
	}
	if err := Unmarshal(b, &masterv1.BatchPutStartRequest{}); !errors.Is(err, errInvalidUTF8) {
		t.Fatalf("Unmarshal: %v, want %v", err, errInvalidUTF8)
	}
	// The same bytes are fine where the field is bytes, not string.
	var tr []byte
	tr = protowire.AppendTag(tr, 2, protowire.BytesType)
	var item []byte
	item = protowire.AppendTag(item, 3, protowire.BytesType) // token
	item = protowire.AppendBytes(item, []byte{0xff})
	tr = protowire.AppendBytes(tr, item)
	if err := Unmarshal(tr, &agentv1.TransferRequest{}); err != nil {
		t.Fatalf("bytes field refused: %v", err)
	}
}

// rawCodec sends pre-encoded bytes, to put on the wire what no marshaller
// would produce.
type rawCodec struct{ encoding.CodecV2 }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}

type objectServer struct {
	masterv1.UnimplementedObjectServiceServer
}

func (objectServer) BatchPutStart(_ context.Context, r *masterv1.BatchPutStartRequest) (*masterv1.BatchPutStartResponse, error) {
	out := &masterv1.BatchPutStartResponse{}
	for _, it := range r.GetItems() {
		out.Results = append(out.Results, &masterv1.PutStartResult{Status: &masterv1.ItemStatus{Message: it.GetKey()}})
	}
	return out, nil
}

// Over a real gRPC connection, a server and a client with this codec talk
// to peers with the standard codec, and a non-UTF-8 key is refused with the
// code the standard codec gives.
func TestOverGRPC(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	for _, srvOpts := range [][]grpc.ServerOption{{ServerOption()}, nil} {
		gs := grpc.NewServer(srvOpts...)
		masterv1.RegisterObjectServiceServer(gs, objectServer{})
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = gs.Serve(lis) }()
		for _, dialOpts := range [][]grpc.DialOption{{DialOption()}, nil} {
			cc, err := grpc.NewClient(lis.Addr().String(), append(dialOpts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := masterv1.NewObjectServiceClient(cc).BatchPutStart(t.Context(), putRequest(4))
			if err != nil || len(resp.GetResults()) != 4 || resp.GetResults()[3].GetStatus().GetMessage() != putRequest(4).Items[3].Key {
				t.Fatalf("server vt=%v client vt=%v: %v, %v", srvOpts != nil, dialOpts != nil, resp, err)
			}
			raw := badKey()
			err = cc.Invoke(t.Context(), masterv1.ObjectService_BatchPutStart_FullMethodName, &raw, new(masterv1.BatchPutStartResponse),
				grpc.ForceCodecV2(rawCodec{New()}))
			if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "invalid UTF-8") {
				t.Fatalf("server vt=%v: non-UTF-8 key: %v, want Internal invalid UTF-8", srvOpts != nil, err)
			}
			_ = cc.Close()
		}
		gs.Stop()
	}
	_ = lis.Close()
}
