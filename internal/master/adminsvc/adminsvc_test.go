package adminsvc

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeMeta is a hand-written Meta.
type fakeMeta struct {
	reg *registry.Registry

	mu      sync.Mutex
	quotas  map[string]*masterv1.TenantQuota
	drainFn func(ctx context.Context, id string) error
	drains  map[string]*masterv1.DrainProgress
	// migrations are the specs Migrate was called with (migrate_test.go).
	migrations []migration
}

func (f *fakeMeta) DrainSegmentCounts(ctx context.Context, id string, noEvict bool) (*masterv1.DrainCounts, error) {
	if f.drainFn != nil {
		return nil, f.drainFn(ctx, id)
	}
	if err := f.reg.SetLifecycle(id, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING); err != nil {
		return nil, err
	}
	c := &masterv1.DrainCounts{Total: 3, Moved: 2, Evicted: 1, Dropped: 1}
	f.mu.Lock()
	f.drains = map[string]*masterv1.DrainProgress{id: {State: masterv1.DrainState_DRAIN_STATE_DONE, Counts: c, NoEvict: noEvict}}
	f.mu.Unlock()
	return c, f.reg.SetLifecycle(id, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED)
}

func (f *fakeMeta) DrainProgress() map[string]*masterv1.DrainProgress {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.drains
}

// UndrainSegment behaves as the metadata's: OK is a no-op, DRAINING and
// DRAINED return to OK, anything else is the registry's refusal.
func (f *fakeMeta) UndrainSegment(_ context.Context, id string) error {
	d, ok := f.reg.Detail(id)
	if !ok {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", id)
	}
	if d.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK {
		return nil
	}
	return f.reg.SetLifecycle(id, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK)
}

func (f *fakeMeta) SetTenantQuota(_ context.Context, tenant string, maxBytes, maxObjects uint64) (*masterv1.TenantQuota, error) {
	if tenant == "bad" {
		return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "bad tenant")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	q := &masterv1.TenantQuota{Tenant: tenant, MaxBytes: maxBytes, MaxObjects: maxObjects}
	f.quotas[tenant] = q
	return q, nil
}

func (f *fakeMeta) TenantQuota(_ context.Context, tenant string) (*masterv1.TenantQuota, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if q, ok := f.quotas[tenant]; ok {
		return q, nil
	}
	return &masterv1.TenantQuota{Tenant: tenant}, nil
}

func (f *fakeMeta) ListTenants(context.Context) []*masterv1.TenantQuota {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*masterv1.TenantQuota
	for _, q := range f.quotas {
		out = append(out, q)
	}
	return out
}

func (f *fakeMeta) Stats() (objects, bytes, revision uint64) { return 3, 300, 17 }

func (f *fakeMeta) SegmentReplicaCounts() map[string]uint64 {
	return map[string]uint64{"mem-a": 2, "disk-a": 1}
}

type fixture struct {
	client masterv1.AdminServiceClient
	reg    *registry.Registry
	meta   *fakeMeta
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	lg := testutil.Logger()
	reg, err := registry.New(registry.Config{}, registry.Deps{}, lg)
	if err != nil {
		t.Fatal(err)
	}
	// Agent a: one memory and one disk segment, healthy. Agent b: one
	// memory segment, lost and unmounted.
	register := func(agent string, infos ...*masterv1.SegmentInfo) uint64 {
		gen, _, err := reg.Register(registry.Registration{AgentID: agent, HostID: "host-" + agent, DataEndpoint: agent + ":50052", Version: "v1", Segments: infos})
		if err != nil {
			t.Fatal(err)
		}
		reg.Activate(agent, gen)
		return gen
	}
	register("a",
		&masterv1.SegmentInfo{SegmentId: "mem-a", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1000, Used: 100, LargestFreeExtent: 900, Alignment: 64, Name: "mem-0"},
		&masterv1.SegmentInfo{SegmentId: "disk-a", Medium: masterv1.Medium_MEDIUM_DISK, Capacity: 5000, Used: 500, Alignment: 4096, Name: "/data/seg"})
	genB := register("b", &masterv1.SegmentInfo{SegmentId: "mem-b", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 2000})
	reg.Unmount("b", genB, []string{"mem-b"})
	reg.MarkUnmounted([]string{"mem-b"})
	reg.Disconnect("b", genB)

	meta := &fakeMeta{reg: reg, quotas: map[string]*masterv1.TenantQuota{}}
	svc, err := New(Deps{Identity: cluster.Identity{MasterID: "m1", Epoch: 5}, Registry: reg, Meta: meta}, lg)
	if err != nil {
		t.Fatal(err)
	}
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	masterv1.RegisterAdminServiceServer(gs, svc)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		gs.Stop()
		<-done
	})
	return &fixture{client: masterv1.NewAdminServiceClient(conn), reg: reg, meta: meta}
}

func wantErr(t *testing.T, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("code: got %v, want %v (%v)", got, code, err)
	}
	if got := rpcerr.Reason(err); got != reason {
		t.Fatalf("reason: got %q, want %q", got, reason)
	}
}

func TestListSegments(t *testing.T) {
	f := newFixture(t)
	resp, err := f.client.ListSegments(t.Context(), &masterv1.ListSegmentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]*masterv1.Segment{}
	for _, s := range resp.GetSegments() {
		byID[s.GetInfo().GetSegmentId()] = s
	}
	if len(byID) != 3 {
		t.Fatalf("segments: got %d, want 3 (UNMOUNTED included)", len(byID))
	}
	m := byID["mem-a"]
	if m.GetAgentId() != "a" || m.GetHostId() != "host-a" || m.GetDataEndpoint() != "a:50052" || m.GetReplicas() != 2 ||
		!m.GetCanAllocate() || !m.GetCanServeRead() || m.GetInfo().GetAlignment() != 64 || m.GetInfo().GetLargestFreeExtent() != 900 ||
		m.GetInfo().GetName() != "mem-0" || m.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK ||
		m.GetHealth() != masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY || m.GetLastHeartbeatUnixMs() == 0 {
		t.Fatalf("mem-a: got %v", m)
	}
	b := byID["mem-b"]
	if b.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED || b.GetCanAllocate() || b.GetCanServeRead() {
		t.Fatalf("mem-b: got %v", b)
	}
}

func TestGetSegment(t *testing.T) {
	f := newFixture(t)
	tests := []struct {
		name   string
		id     string
		code   codes.Code
		reason string
	}{
		{"found", "disk-a", codes.OK, ""},
		{"empty id", "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"too long", strings.Repeat("x", 5000), codes.InvalidArgument, "INVALID_PARAMS"},
		{"unknown", "nope", codes.NotFound, "SEGMENT_NOT_FOUND"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := f.client.GetSegment(t.Context(), &masterv1.GetSegmentRequest{SegmentId: tt.id})
			wantErr(t, err, tt.code, tt.reason)
			if err == nil {
				s := resp.GetSegment()
				if s.GetInfo().GetMedium() != masterv1.Medium_MEDIUM_DISK || s.GetReplicas() != 1 || s.GetInfo().GetCapacity() != 5000 {
					t.Fatalf("disk-a: got %v", s)
				}
			}
		})
	}
}

func TestListAgents(t *testing.T) {
	f := newFixture(t)
	resp, err := f.client.ListAgents(t.Context(), &masterv1.ListAgentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ag := resp.GetAgents()
	if len(ag) != 2 {
		t.Fatalf("agents: got %d, want 2", len(ag))
	}
	a, b := ag[0], ag[1]
	if a.GetAgentId() != "a" || !a.GetConnected() || a.GetVersion() != "v1" || len(a.GetSegmentIds()) != 2 || a.GetLastHeartbeatUnixMs() == 0 {
		t.Fatalf("agent a: got %v", a)
	}
	if b.GetAgentId() != "b" || b.GetConnected() || len(b.GetSegmentIds()) != 0 {
		t.Fatalf("agent b: got %v", b)
	}
}

func TestDrainSegment(t *testing.T) {
	f := newFixture(t)
	resp, err := f.client.DrainSegment(t.Context(), &masterv1.DrainSegmentRequest{SegmentId: "mem-a"})
	if err != nil {
		t.Fatal(err)
	}
	s := resp.GetSegment()
	if s.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED || s.GetCanAllocate() || !s.GetCanServeRead() {
		t.Fatalf("drained segment: got %v", s)
	}
	// The counts come back, and the segment's entry shows the drain.
	want := &masterv1.DrainCounts{Total: 3, Moved: 2, Evicted: 1, Dropped: 1}
	if !proto.Equal(resp.GetCounts(), want) || !proto.Equal(s.GetDrain().GetCounts(), want) {
		t.Fatalf("drain counts: got %v and entry %v, want %v", resp.GetCounts(), s.GetDrain(), want)
	}
	list, err := f.client.ListSegments(t.Context(), &masterv1.ListSegmentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, sg := range list.GetSegments() {
		if d := sg.GetDrain(); (sg.GetInfo().GetSegmentId() == "mem-a") != (d != nil) || (d != nil && d.GetState() != masterv1.DrainState_DRAIN_STATE_DONE) {
			t.Fatalf("listing: segment %s has drain %v; want mem-a's alone, DONE", sg.GetInfo().GetSegmentId(), d)
		}
	}
	_, err = f.client.DrainSegment(t.Context(), &masterv1.DrainSegmentRequest{})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	_, err = f.client.DrainSegment(t.Context(), &masterv1.DrainSegmentRequest{SegmentId: "nope"})
	wantErr(t, err, codes.NotFound, "SEGMENT_NOT_FOUND")
	// An UNMOUNTED segment cannot be drained: the registry's table says so.
	_, err = f.client.DrainSegment(t.Context(), &masterv1.DrainSegmentRequest{SegmentId: "mem-b"})
	wantErr(t, err, codes.FailedPrecondition, "SEGMENT_UNAVAILABLE")

	f.meta.drainFn = func(ctx context.Context, _ string) error {
		<-ctx.Done()
		return ctx.Err()
	}
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err = f.client.DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: "disk-a"})
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("drain past the deadline: got %v, want DeadlineExceeded", err)
	}
}

func TestTenantQuotas(t *testing.T) {
	f := newFixture(t)
	set, err := f.client.SetTenantQuota(t.Context(), &masterv1.SetTenantQuotaRequest{Tenant: "t1", MaxBytes: 1 << 20, MaxObjects: 10})
	if err != nil {
		t.Fatal(err)
	}
	if q := set.GetQuota(); q.GetTenant() != "t1" || q.GetMaxBytes() != 1<<20 || q.GetMaxObjects() != 10 {
		t.Fatalf("set quota: got %v", q)
	}
	got, err := f.client.GetTenantQuota(t.Context(), &masterv1.GetTenantQuotaRequest{Tenant: "t1"})
	if err != nil || got.GetQuota().GetMaxObjects() != 10 {
		t.Fatalf("get quota: got %v, %v", got, err)
	}
	list, err := f.client.ListTenants(t.Context(), &masterv1.ListTenantsRequest{})
	if err != nil || len(list.GetTenants()) != 1 {
		t.Fatalf("list tenants: got %v, %v", list, err)
	}
	_, err = f.client.SetTenantQuota(t.Context(), &masterv1.SetTenantQuotaRequest{Tenant: "bad"})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	_, err = f.client.GetTenantQuota(t.Context(), &masterv1.GetTenantQuotaRequest{Tenant: strings.Repeat("t", 5000)})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
}

func TestGetClusterStatus(t *testing.T) {
	f := newFixture(t)
	st, err := f.client.GetClusterStatus(t.Context(), &masterv1.GetClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.GetMasterId() != "m1" || st.GetEpoch() != 5 || !st.GetLeader() || st.GetObjects() != 3 || st.GetBytes() != 300 || st.GetRevision() != 17 {
		t.Fatalf("identity and totals: got %v", st)
	}
	if st.GetAgentsConnected() != 1 || st.GetSegments() != 2 || st.GetCapacityBytes() != 6000 || st.GetUsedBytes() != 600 {
		t.Fatalf("counts: got agents %d segments %d capacity %d used %d, want 1 2 6000 600",
			st.GetAgentsConnected(), st.GetSegments(), st.GetCapacityBytes(), st.GetUsedBytes())
	}
	media := st.GetMedia()
	if len(media) != 2 || media[0].GetMedium() != masterv1.Medium_MEDIUM_MEMORY || media[0].GetCapacityBytes() != 1000 ||
		media[1].GetMedium() != masterv1.Medium_MEDIUM_DISK || media[1].GetUsedBytes() != 500 {
		t.Fatalf("media: got %v", media)
	}
}

func TestNewRequiresDeps(t *testing.T) {
	if _, err := New(Deps{}, testutil.Logger()); err == nil {
		t.Fatal("New without deps: got nil error")
	}
}
