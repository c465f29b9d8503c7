package adminsvc

import (
	"net"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestUndrainSegmentRoundTrip drives DrainSegment and UndrainSegment
// through the real metadata and segment registry on 127.0.0.1:0:
// OK → DRAINED → OK (and OK again, idempotent), refusals for an unmounted
// and an unknown segment, and the service still answering afterwards.
func TestUndrainSegmentRoundTrip(t *testing.T) {
	lg := testutil.Logger()
	reg, err := registry.New(registry.Config{}, registry.Deps{}, lg)
	if err != nil {
		t.Fatal(err)
	}
	gen, _, err := reg.Register(registry.Registration{AgentID: "a", HostID: "h", DataEndpoint: "a:1", Segments: []*masterv1.SegmentInfo{
		{SegmentId: "mem-a", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1000},
		{SegmentId: "mem-b", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1000},
	}})
	if err != nil {
		t.Fatal(err)
	}
	reg.Activate("a", gen)
	reg.Unmount("a", gen, []string{"mem-b"})
	reg.MarkUnmounted([]string{"mem-b"})
	store, err := meta.New(meta.Config{Shards: 4}, meta.Deps{
		Registry: reg, Agents: metatest.NewAgents(metatest.NewRegistry()),
		Identity: cluster.Identity{MasterID: "m", Epoch: 1, Keys: token.NewRing(0, nil)},
	}, lg)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := New(Deps{Identity: cluster.Identity{MasterID: "m", Epoch: 1}, Registry: reg, Meta: store}, lg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(rpccodec.ServerOption())
	masterv1.RegisterAdminServiceServer(gs, svc)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), rpccodec.DialOption(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		gs.Stop()
		<-done
	})
	cli := masterv1.NewAdminServiceClient(conn)
	ctx := t.Context()

	d, err := cli.DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: "mem-a"})
	if err != nil || d.GetSegment().GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED || d.GetSegment().GetCanAllocate() {
		t.Fatalf("drain: got %v, %v; want DRAINED, not allocating", d.GetSegment(), err)
	}
	for range 2 {
		u, err := cli.UndrainSegment(ctx, &masterv1.UndrainSegmentRequest{SegmentId: "mem-a"})
		if err != nil {
			t.Fatalf("undrain: %v", err)
		}
		if s := u.GetSegment(); s.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK || !s.GetCanAllocate() {
			t.Fatalf("undrain: got %v, want OK and allocating", s)
		}
	}
	for _, tc := range []struct {
		id     string
		code   codes.Code
		reason string
	}{
		{"mem-b", codes.FailedPrecondition, "SEGMENT_UNAVAILABLE"},
		{"nope", codes.NotFound, "SEGMENT_NOT_FOUND"},
		{"", codes.InvalidArgument, "INVALID_PARAMS"},
	} {
		_, err := cli.UndrainSegment(ctx, &masterv1.UndrainSegmentRequest{SegmentId: tc.id})
		if status.Code(err) != tc.code || rpcerr.Reason(err) != tc.reason {
			t.Errorf("undrain %q: got %v (%s), want %v / %s", tc.id, status.Code(err), rpcerr.Reason(err), tc.code, tc.reason)
		}
	}
	if g, err := cli.GetSegment(ctx, &masterv1.GetSegmentRequest{SegmentId: "mem-a"}); err != nil || g.GetSegment().GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK {
		t.Fatalf("get after the refusals: %v, %v", g, err)
	}
}
