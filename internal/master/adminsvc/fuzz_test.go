package adminsvc

import (
	"context"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// FuzzSegmentRequests decodes arbitrary bytes as the segment requests
// (DrainSegment with its no_evict, UndrainSegment, GetSegment) and runs them
// through the handlers over a real registry and metadata store: malformed
// input must never panic, and every failure must be a gRPC status with a
// Crescent reason.
func FuzzSegmentRequests(f *testing.F) {
	for _, m := range []proto.Message{
		&masterv1.DrainSegmentRequest{SegmentId: "mem-a", NoEvict: true},
		&masterv1.DrainSegmentRequest{SegmentId: "mem-c"},
		&masterv1.DrainSegmentRequest{SegmentId: strings.Repeat("x", maxIDLen+1)},
		&masterv1.UndrainSegmentRequest{SegmentId: "mem-a"},
		&masterv1.GetSegmentRequest{SegmentId: "disk-a"},
	} {
		b, _ := proto.Marshal(m)
		for kind := range byte(3) {
			f.Add(kind, b)
		}
	}
	f.Fuzz(func(t *testing.T, kind byte, b []byte) {
		lg := testutil.Logger()
		reg, err := registry.New(registry.Config{}, registry.Deps{}, lg)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range []struct {
			agent string
			segs  []*masterv1.SegmentInfo
		}{
			{"a", []*masterv1.SegmentInfo{{SegmentId: "mem-a", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 20}, {SegmentId: "disk-a", Medium: masterv1.Medium_MEDIUM_DISK, Capacity: 1 << 20}}},
			{"c", []*masterv1.SegmentInfo{{SegmentId: "mem-c", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 20}}},
		} {
			gen, _, err := reg.Register(registry.Registration{AgentID: a.agent, HostID: "host-" + a.agent, DataEndpoint: a.agent + ":50052", Segments: a.segs})
			if err != nil {
				t.Fatal(err)
			}
			reg.Activate(a.agent, gen)
		}
		store, err := meta.New(meta.Config{Shards: 2}, meta.Deps{Registry: reg, Agents: metatest.NewAgents(metatest.NewRegistry()),
			Identity: cluster.Identity{Keys: token.NewRing(0, nil)}}, lg)
		if err != nil {
			t.Fatal(err)
		}
		svc, err := New(Deps{Registry: reg, Meta: store}, lg)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		var callErr error
		switch kind % 3 {
		case 0:
			var r masterv1.DrainSegmentRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = svc.DrainSegment(ctx, &r)
			}
		case 1:
			var r masterv1.UndrainSegmentRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = svc.UndrainSegment(ctx, &r)
			}
		case 2:
			var r masterv1.GetSegmentRequest
			if proto.Unmarshal(b, &r) == nil {
				_, callErr = svc.GetSegment(ctx, &r)
			}
		}
		if callErr != nil {
			if _, ok := status.FromError(callErr); !ok || rpcerr.Reason(callErr) == "" {
				t.Fatalf("failure without a status and reason: %v", callErr)
			}
		}
		if _, err := svc.ListSegments(ctx, &masterv1.ListSegmentsRequest{}); err != nil {
			t.Fatalf("ListSegments: %v", err)
		}
	})
}
