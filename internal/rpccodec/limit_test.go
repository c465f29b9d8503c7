package rpccodec

import (
	"errors"
	"net"
	"runtime"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// emptyEntries appends n empty messages in field name of m's type: two
// bytes each on the wire, a whole struct each once decoded.
func emptyEntries(b []byte, m proto.Message, name protoreflect.Name, n int) []byte {
	num := m.ProtoReflect().Descriptor().Fields().ByName(name).Number()
	for range n {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		b = protowire.AppendVarint(b, 0)
	}
	return b
}

// hostileRegister is a ConnectRequest whose Register claims n empty
// allocations (2n bytes that would decode into n structs).
func hostileRegister(n int) []byte {
	reg := emptyEntries(nil, &masterv1.Register{}, "allocations", n)
	num := (&masterv1.ConnectRequest{}).ProtoReflect().Descriptor().Fields().ByName("register").Number()
	b := protowire.AppendTag(nil, num, protowire.BytesType)
	return protowire.AppendBytes(b, reg)
}

// A request packed with empty nested messages is refused before anything
// is decoded; the same bytes decode without the budget (clients, which
// trust their server, keep proto.Unmarshal's behaviour).
func TestBudgetRefusesAmplification(t *testing.T) {
	const n = 4 << 20 // 8 MiB on the wire, ~1 GiB of structs decoded
	b := hostileRegister(n)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err := UnmarshalLimited(b, new(masterv1.ConnectRequest))
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrTooManyMessages) {
		t.Fatalf("UnmarshalLimited(%d empty allocations) = %v, want ErrTooManyMessages", n, err)
	}
	if d := after.TotalAlloc - before.TotalAlloc; d > 1<<20 {
		t.Fatalf("refusing allocated %d bytes, want < 1 MiB", d)
	}
	// Within the budget, the same shape decodes.
	small := hostileRegister(FreeMessages - 1)
	var m masterv1.ConnectRequest
	if err := UnmarshalLimited(small, &m); err != nil || len(m.GetRegister().GetAllocations()) != FreeMessages-1 {
		t.Fatalf("UnmarshalLimited(%d) = %v, %d allocations", FreeMessages-1, err, len(m.GetRegister().GetAllocations()))
	}
}

// What the system really sends fits the budget: an agent's Register of
// 200,000 allocations and a 10,000-item batch with one-byte keys.
func TestBudgetAcceptsRealMessages(t *testing.T) {
	reg := &masterv1.Register{AgentId: "host-a:50052", HostId: "host-a"}
	for i := range 200_000 {
		reg.Allocations = append(reg.Allocations, &masterv1.Allocation{
			SegmentId: "0b8f4c1e-6a77-4a3b-9d3c-2f0f6d1c9e11", AllocationId: uint64(i), Offset: uint64(i) * 64, Size: 64,
			State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k", ReplicaId: 1, Checksum: 1,
		})
	}
	batch := &masterv1.BatchPutStartRequest{}
	for range 10_000 {
		batch.Items = append(batch.Items, &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{ReplicaNum: 1}})
	}
	for _, m := range []proto.Message{&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: reg}}, batch} {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got := m.ProtoReflect().New().Interface()
		if err := UnmarshalLimited(b, got); err != nil || !proto.Equal(m, got) {
			t.Fatalf("%T of %d bytes: %v", m, len(b), err)
		}
	}
}

// Over gRPC, a server with ServerOption refuses the hostile request with a
// status naming the limit, and serves the next one.
func TestBudgetOverGRPC(t *testing.T) {
	gs := grpc.NewServer(ServerOption())
	masterv1.RegisterObjectServiceServer(gs, objectServer{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), DialOption(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	raw := emptyEntries(nil, &masterv1.BatchPutStartRequest{}, "items", 1<<20)
	err = cc.Invoke(t.Context(), masterv1.ObjectService_BatchPutStart_FullMethodName, &raw, new(masterv1.BatchPutStartResponse),
		grpc.ForceCodecV2(rawCodec{New()}))
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "nested messages") {
		t.Fatalf("hostile batch: %v, want Internal naming the nested-message limit", err)
	}
	resp, err := masterv1.NewObjectServiceClient(cc).BatchPutStart(t.Context(), putRequest(4))
	if err != nil || len(resp.GetResults()) != 4 {
		t.Fatalf("after the hostile request: %v, %v", resp, err)
	}
}
