package rpccodec

import (
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// getResponse is a BatchGetReplicaList answer for n 4 KiB objects, as the
// master sends it to a client.
func getResponse(n int) *masterv1.BatchGetReplicaListResponse {
	r := &masterv1.BatchGetReplicaListResponse{}
	for i := range n {
		r.Results = append(r.Results, &masterv1.GetReplicaListResult{
			Status: &masterv1.ItemStatus{},
			ReplicaList: &masterv1.GetReplicaListResponse{
				Size: 4096, Checksum: 0x1234567890abcdef, LeaseTtl: durationpb.New(10e9),
				Replicas: []*masterv1.ReplicaDescriptor{{
					ReplicaId: 1, SegmentId: "864d6964-900e-4574-a42a-2f0f82c4223c", AgentId: "host-a:50052", HostId: "host-a",
					DataEndpoint: "127.0.0.1:50052", TransferEndpoint: "127.0.0.1:50054", AllocationId: uint64(i) * 7, Offset: uint64(i) * 4096,
					Size: 4096, Medium: masterv1.Medium_MEDIUM_MEMORY, Status: masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE,
					Token: make([]byte, 96), TokenExpiryUnixMs: 1795957503682,
				}},
			},
		})
	}
	return r
}

func putRequest(n int) *masterv1.BatchPutStartRequest {
	r := &masterv1.BatchPutStartRequest{}
	for i := range n {
		r.Items = append(r.Items, &masterv1.PutStartRequest{Tenant: "default", Key: fmt.Sprintf("bench/61f148/%08d", i), Size: 4096, ClientId: "crescentctl-1234", Config: &masterv1.ReplicateConfig{ReplicaNum: 1}})
	}
	return r
}

func benchCodecs(b *testing.B, msg proto.Message, fresh func() proto.Message) {
	std := New().fallback
	for _, c := range []struct {
		name  string
		codec interface {
			Marshal(any) (mem.BufferSlice, error)
			Unmarshal(mem.BufferSlice, any) error
		}
	}{{"proto", std}, {"vt", New()}} {
		b.Run(c.name+"/marshal", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				d, err := c.codec.Marshal(msg)
				if err != nil {
					b.Fatal(err)
				}
				d.Free()
			}
		})
		d, _ := New().fallback.Marshal(msg)
		b.Run(c.name+"/unmarshal", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := c.codec.Unmarshal(d, fresh()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkGetResponse128(b *testing.B) {
	benchCodecs(b, getResponse(128), func() proto.Message { return new(masterv1.BatchGetReplicaListResponse) })
}

func BenchmarkPutStartRequest128(b *testing.B) {
	benchCodecs(b, putRequest(128), func() proto.Message { return new(masterv1.BatchPutStartRequest) })
}
