package objectsvc

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// FuzzRequests decodes arbitrary bytes as ObjectService requests and runs
// them through the handlers: malformed input must never panic, and every
// failure must be a gRPC status with a Crescent reason.
func FuzzRequests(f *testing.F) {
	for _, m := range []proto.Message{
		&masterv1.PutStartRequest{Key: "k", Size: 10, Config: &masterv1.ReplicateConfig{ReplicaNum: 2, PreferredSegments: []string{"seg-0-0"}}},
		&masterv1.BatchPutStartRequest{Items: []*masterv1.PutStartRequest{{Key: "a", Size: 1}, {Key: "", Size: 0}}},
		// Sizes past any segment, past int64 (OBJECT_TOO_LARGE).
		&masterv1.PutStartRequest{Key: "k", Size: 1<<64 - 1, Upsert: true, Config: &masterv1.ReplicateConfig{ReplicaNum: 16}},
		&masterv1.BatchPutStartRequest{Items: []*masterv1.PutStartRequest{{Key: "a", Size: 1 << 63}, {Key: "b", Size: 1 << 62}, {Key: "c", Size: 1<<20 + 1}}},
		&masterv1.RemoveByRegexRequest{Regex: "a(", Force: true},
		&masterv1.ListObjectsRequest{PageToken: "!!", PageSize: 3},
		&masterv1.ObjectServiceCopyRequest{Keys: []string{"k", "k", ""}, Target: &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_Medium{Medium: 9}}},
		&masterv1.ObjectServiceMoveRequest{Keys: []string{"k", "x"}, FromSegmentId: "seg-0-0", Target: &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_SegmentId{SegmentId: "seg-1-0"}}},
		&masterv1.PrefetchRequest{Keys: []string{"k", "x", "k"}, Wait: true},
		&masterv1.PrefetchRequest{Tenant: "t", Keys: []string{"k"}},
		&masterv1.CallStreamRequest{RequestId: 3, TimeoutMs: 1, Call: &masterv1.CallStreamRequest_BatchGetReplicaList{
			BatchGetReplicaList: &masterv1.BatchGetReplicaListRequest{Items: []*masterv1.GetReplicaListRequest{{Key: "k"}, {Key: ""}}}}},
		&masterv1.CallStreamRequest{RequestId: 4, Call: &masterv1.CallStreamRequest_PutStart{PutStart: &masterv1.PutStartRequest{Key: "n", Size: 10, ClientId: "w"}}},
		&masterv1.CallStreamRequest{RequestId: 5, Call: &masterv1.CallStreamRequest_PutEnd{PutEnd: &masterv1.PutEndRequest{Key: "k", ClientId: "w", Checksum: 1}}},
		&masterv1.CallStreamRequest{RequestId: 6, Call: &masterv1.CallStreamRequest_BatchPutStart{BatchPutStart: &masterv1.BatchPutStartRequest{
			Items: []*masterv1.PutStartRequest{{Key: "a", Size: 1}, {Key: "k", Size: 2, Upsert: true}}}}},
		&masterv1.CallStreamRequest{RequestId: 7, Call: &masterv1.CallStreamRequest_BatchPutEnd{BatchPutEnd: &masterv1.BatchPutEndRequest{
			Items: []*masterv1.PutEndRequest{{Key: "k", ClientId: "w"}, {Key: "zz"}}}}},
		// Spares: asked for beyond the caps, and commits of spares never
		// leased, of odd sizes and configs.
		&masterv1.PutStartRequest{Key: "s", Size: 1 << 20, ClientId: "w", Spares: 1 << 31},
		&masterv1.PutEndRequest{Key: "s", ClientId: "w", Checksum: 7, Spares: 9, SealReceipts: [][]byte{{2, 0, 0, 0, 1}},
			Spare: &masterv1.SpareCommit{SegmentId: "seg-0-0", AllocationId: 1, Size: 1 << 20}},
		&masterv1.CallStreamRequest{RequestId: 11, Call: &masterv1.CallStreamRequest_BatchPutEnd{BatchPutEnd: &masterv1.BatchPutEndRequest{
			Items: []*masterv1.PutEndRequest{
				{Key: "a", ClientId: "w", Spare: &masterv1.SpareCommit{SegmentId: "nope", Size: 1<<64 - 1, Config: &masterv1.ReplicateConfig{ReplicaNum: 16}}},
				{Key: "b", ClientId: "w", Spares: 2, Spare: &masterv1.SpareCommit{SegmentId: "seg-0-0", AllocationId: 1 << 63, Upsert: true}},
			}}}},
		&masterv1.CallStreamRequest{RequestId: 8, Call: &masterv1.CallStreamRequest_GetReplicaList{GetReplicaList: &masterv1.GetReplicaListRequest{Key: "k"}}},
		&masterv1.CallStreamRequest{RequestId: 9, Call: &masterv1.CallStreamRequest_Exist{Exist: &masterv1.ExistRequest{Key: "k"}}},
		&masterv1.CallStreamRequest{RequestId: 10, Call: &masterv1.CallStreamRequest_BatchExist{BatchExist: &masterv1.BatchExistRequest{
			Items: []*masterv1.ExistRequest{{Key: "k"}, {Key: ""}}}}},
	} {
		b, _ := proto.Marshal(m)
		for kind := range byte(12) {
			f.Add(kind, b)
		}
	}
	f.Fuzz(func(t *testing.T, kind byte, b []byte) {
		c := metatest.NewCluster(2, 1, 1<<20)
		store, err := meta.New(meta.Config{Shards: 2}, meta.Deps{Registry: c.Reg, Agents: c.Agents, Identity: cluster.Identity{Keys: token.NewRingWithKey(tokenKey)}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := New(Config{MaxBatch: 64}, store)
		ctx := context.Background()
		if _, err := s.PutStart(ctx, &masterv1.PutStartRequest{Key: "k", Size: 1, ClientId: "w"}); err != nil {
			t.Fatal(err)
		}
		var callErr error
		switch kind % 12 {
		case 0:
			var r masterv1.PutStartRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.PutStart(ctx, &r)
			}
		case 1:
			var r masterv1.BatchPutStartRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.BatchPutStart(ctx, &r)
			}
		case 2:
			var r masterv1.PutEndRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.PutEnd(ctx, &r)
			}
		case 3:
			var r masterv1.BatchGetReplicaListRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.BatchGetReplicaList(ctx, &r)
			}
		case 4:
			var r masterv1.RemoveByRegexRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.RemoveByRegex(ctx, &r)
			}
		case 5:
			var r masterv1.ListObjectsRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.ListObjects(ctx, &r)
			}
		case 6:
			var r masterv1.BatchRemoveRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.BatchRemove(ctx, &r)
			}
		case 7:
			var r masterv1.RemoveAllRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.RemoveAll(ctx, &r)
			}
		case 8:
			var r masterv1.ObjectServiceCopyRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.Copy(ctx, &r)
			}
		case 9:
			var r masterv1.ObjectServiceMoveRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.Move(ctx, &r)
			}
		case 10:
			var r masterv1.PrefetchRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = s.Prefetch(ctx, &r)
			}
		case 11:
			// A call carried on CallStream, as one worker answers it.
			var r masterv1.CallStreamRequest
			if proto.Unmarshal(b, &r) == nil {
				m := s.answer(ctx, &r)
				if m.GetRequestId() != r.GetRequestId() {
					t.Fatalf("answered as request %d, asked as %d", m.GetRequestId(), r.GetRequestId())
				}
				if (m.GetCode() == 0) != (m.GetAnswer() != nil) {
					t.Fatalf("code %d with answer %v", m.GetCode(), m.GetAnswer())
				}
				// A call the master does not know has no reason to give.
				if m.GetCode() != int32(codes.Unimplemented) && m.GetCode() != 0 {
					callErr = status.ErrorProto(&spb.Status{Code: m.GetCode(), Message: m.GetMessage(), Details: m.GetDetails()})
				}
			}
		}
		if callErr != nil {
			if _, ok := status.FromError(callErr); !ok || rpcerr.Reason(callErr) == "" {
				t.Fatalf("error without status or reason: %v", callErr)
			}
		}
		if p := c.Agents.Problems(); len(p) > 0 {
			t.Fatalf("agent problems: %v", p)
		}
	})
}
