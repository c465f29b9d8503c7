package session

import (
	"fmt"
	"testing"
	"unsafe"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/protobuf/proto"
)

func chunkRequest(n int, seg string) *masterv1.ConnectRequest {
	ch := &masterv1.RegisterChunk{SegmentId: seg, Last: n%2 == 0}
	for i := range n {
		ch.Allocations = append(ch.Allocations, &masterv1.Allocation{
			AllocationId: uint64(i + 1), Offset: uint64(i) * 64, Size: 64, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED,
			Tenant: []string{"default", "default", "t1"}[i%3], Key: fmt.Sprintf("key-%d", i), ReplicaId: uint32(i % 3),
			Checksum: uint64(i) * 0x9e3779b97f4a7c15, GroupId: []string{"", "g"}[i%2], HardPin: i%5 == 0,
			SoftPinUntilUnixMs: int64(i % 7), CreatedUnixMs: 1_800_000_000_000, SealedUnixMs: 1_800_000_000_001 + int64(i),
		})
	}
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}}
}

// decodeAsServer marshals want and decodes it as the master's server codec
// decodes a Connect stream's message, into a connectRequest, which must
// equal want; it returns it and the bytes.
func decodeAsServer(t *testing.T, want *masterv1.ConnectRequest) (*connectRequest, []byte) {
	t.Helper()
	b, err := proto.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	got := &connectRequest{}
	if err := rpccodec.UnmarshalLimited(b, got); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&got.ConnectRequest, want) {
		t.Fatalf("decoded %v, want %v", &got.ConnectRequest, want)
	}
	return got, b
}

// TestConnectRequestDecodesChunksFast: a ConnectRequest holding one
// RegisterChunk, received through the server's codec, decodes to exactly
// what the generated decoder makes of it, its allocations in one array
// (the fast path taken) and its strings not pointing into the buffer.
func TestConnectRequestDecodesChunksFast(t *testing.T) {
	for _, n := range []int{0, 1, 7, 1000} {
		want := chunkRequest(n, "seg-1")
		got, b := decodeAsServer(t, want)
		allocs := got.GetRegisterChunk().GetAllocations()
		for i := 1; i < len(allocs); i++ {
			if uintptr(unsafe.Pointer(allocs[i]))-uintptr(unsafe.Pointer(allocs[i-1])) != unsafe.Sizeof(*allocs[0]) {
				t.Fatalf("%d allocations: not decoded into one array (the fast path was not taken)", n)
			}
		}
		clear(b) // the buffer is gRPC's to reuse: nothing may point into it
		if !proto.Equal(&got.ConnectRequest, want) {
			t.Fatalf("%d allocations: the decoded message changed with its buffer", n)
		}
	}
}

// TestConnectRequestOtherMessages: everything else decodes as before.
func TestConnectRequestOtherMessages(t *testing.T) {
	for _, want := range []*masterv1.ConnectRequest{
		{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: 3}}},
		{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a1", withAllocations(&masterv1.Allocation{SegmentId: "a1-mem-0", AllocationId: 1, Key: "k"}))}},
		{},
	} {
		decodeAsServer(t, want)
	}
}

// FuzzDecodeRegisterChunk: for any bytes, the fast decoder either declines
// or decodes exactly what the generated decoder does, and the server
// codec decodes into connectRequest exactly what it decodes into a
// ConnectRequest.
func FuzzDecodeRegisterChunk(f *testing.F) {
	for _, n := range []int{0, 1, 3} {
		b, err := proto.Marshal(chunkRequest(n, "s"))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x4a, 0x02, 0x0a, 0x00})
	f.Add([]byte{0x4a, 0x04, 0x0a, 0x02, 0x38, 0x01, 0x4a, 0x00})
	blank, err := proto.Marshal(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: &masterv1.RegisterChunk{
		SegmentId: "s", Allocations: []*masterv1.Allocation{{AllocationId: 1, Size: 64, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Blank: true}}}}})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(blank)
	// Every input is decoded into Allocations that held another chunk
	// (a stream's receiver reuses them): nothing of it may remain.
	prev, err := proto.Marshal(chunkRequest(2500, "prev"))
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 1<<16 {
			return
		}
		var bufs allocBufs
		if _, ok := decodeChunkRequest(prev, rpccodec.MessageBudget(len(prev)), &bufs); !ok {
			t.Fatal("the fast path declined a plain chunk")
		}
		if ch, ok := decodeChunkRequest(b, rpccodec.MessageBudget(len(b)), &bufs); ok {
			var want masterv1.ConnectRequest
			if err := want.UnmarshalVT(b); err != nil {
				t.Fatalf("fast path decoded what the generated decoder refuses (%v)", err)
			}
			if got := (&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}}); !proto.Equal(got, &want) {
				t.Fatalf("fast path decoded %v, generated decoder %v", got, &want)
			}
		}
		var want masterv1.ConnectRequest
		wantErr := rpccodec.UnmarshalLimited(b, &want)
		var got connectRequest
		gotErr := rpccodec.UnmarshalLimited(b, &got)
		if (gotErr == nil) != (wantErr == nil) {
			t.Fatalf("codec into connectRequest: error %v, into ConnectRequest: %v", gotErr, wantErr)
		}
		if gotErr == nil && !proto.Equal(&got.ConnectRequest, &want) {
			t.Fatalf("codec decoded %v into connectRequest, %v into ConnectRequest", &got.ConnectRequest, &want)
		}
	})
}

// BenchmarkDecodeRegisterChunk: one chunk of 16,384 allocations as agents
// send it, through the server codec into a ConnectRequest (the generated
// decoder) and into connectRequest (the fast path).
func BenchmarkDecodeRegisterChunk(b *testing.B) {
	msg := chunkRequest(16384, "")
	for i, a := range msg.GetRegisterChunk().GetAllocations() {
		a.Tenant, a.GroupId, a.Key = "default", "", fmt.Sprintf("restart/%08d", i)
	}
	buf, err := proto.Marshal(msg)
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		new  func() proto.Message
	}{
		{"generated", func() proto.Message { return new(masterv1.ConnectRequest) }},
		{"fast", func() proto.Message { return new(connectRequest) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				if err := rpccodec.UnmarshalLimited(buf, c.new()); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/16384, "ns/allocation")
		})
	}
}

// TestOversizedChunkNotBuffered: a chunk of more allocations than
// MaxRegisterChunk (refused by the handler anyway) is decoded by the
// generated decoder, not into a stream's reused sets, which so stay within
// MaxRegisterChunk Allocations however large a message an agent sends.
func TestOversizedChunkNotBuffered(t *testing.T) {
	var bufs allocBufs
	want := chunkRequest(MaxRegisterChunk+1, "seg-1")
	b, err := proto.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	got := &connectRequest{bufs: &bufs}
	if err := rpccodec.UnmarshalLimited(b, got); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&got.ConnectRequest, want) {
		t.Fatal("the oversized chunk decoded differently")
	}
	if got.used || len(bufs.blocks) > MaxRegisterChunk/allocBlock {
		t.Fatalf("used the reused sets (%v), %d blocks of %d", got.used, len(bufs.blocks), allocBlock)
	}
}
