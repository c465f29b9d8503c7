package testcluster_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestAttacksRefusedWithMTLS replays issue 14's attacks, as an attacker on
// the cluster network would run them, against a real cluster with mTLS on
// every link: each fails with Unauthenticated or PermissionDenied, and the
// cluster's objects and segments are the same afterwards.
func TestAttacksRefusedWithMTLS(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{TLS: true})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	secret := bytes.Repeat([]byte("tenant-a secret "), 256)
	a := c.Client(t, c.As(auth.RoleTenant, testcluster.TenantA)).Tenant(testcluster.TenantA)
	for i := range 8 {
		if err := a.Put(ctx, fmt.Sprintf("secret-%d", i), secret); err != nil {
			t.Fatalf("tenant A put: %v", err)
		}
	}
	b := c.Client(t, c.As(auth.RoleTenant, testcluster.TenantB)).Tenant(testcluster.TenantB)
	if err := b.Put(ctx, "b-own", secret); err != nil {
		t.Fatalf("tenant B put: %v", err)
	}
	before := clusterState(t, c)

	wantCode := func(t *testing.T, err error, want codes.Code) {
		t.Helper()
		if got := status.Code(err); got != want {
			t.Fatalf("got %v (%v), want %v", got, err, want)
		}
	}

	t.Run("tenant B reads tenant A", func(t *testing.T) {
		// `crescentctl --tenant A get secret` from a host holding tenant
		// B's certificate: the request's tenant is not the caller's.
		_, err := b.Tenant(testcluster.TenantA).Get(ctx, "secret-0")
		wantCode(t, err, codes.PermissionDenied)
		_, err = masterv1.NewObjectServiceClient(c.DialAs(auth.RoleTenant, testcluster.TenantB)).
			GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: testcluster.TenantA, Key: "secret-0"})
		wantCode(t, err, codes.PermissionDenied)
		// Its own tenant still works.
		if _, err := b.Get(ctx, "b-own"); err != nil {
			t.Fatalf("tenant B's own get: %v", err)
		}
	})
	t.Run("no certificate", func(t *testing.T) {
		_, err := masterv1.NewObjectServiceClient(c.DialAs("", "")).
			GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: testcluster.TenantA, Key: "secret-0"})
		wantCode(t, err, codes.Unauthenticated)
	})
	t.Run("fake agent", func(t *testing.T) {
		// A hand-written SegmentService.Connect, as a tenant and with no
		// certificate: no Settings, so no token key.
		for _, who := range []struct {
			role auth.Role
			name string
			code codes.Code
		}{{auth.RoleTenant, testcluster.TenantA, codes.PermissionDenied}, {"", "", codes.Unauthenticated}} {
			settings, err := register(ctx, c.DialAs(who.role, who.name), &masterv1.Register{
				AgentId: "fake", HostId: "fake", DataEndpoint: "127.0.0.1:1",
				Segments: []*masterv1.SegmentInfo{{SegmentId: "fake-1tib", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 40, Alignment: 64}},
			})
			if settings != nil {
				t.Fatalf("%s/%s received Settings (token keys: %d)", who.role, who.name, len(settings.GetTokenKeys()))
			}
			wantCode(t, err, who.code)
		}
	})
	t.Run("agent certificate of another host", func(t *testing.T) {
		// A genuine agent certificate, for a host that is not agent 0's:
		// it may not take agent 0's id (which dropped its replicas), its
		// segment, or name agent 0's host.
		cc := c.DialAs(auth.RoleAgent, testcluster.IntruderHost)
		seg := memorySegment(t, c, 0)
		for _, reg := range []*masterv1.Register{
			{AgentId: "agent-0", HostId: testcluster.IntruderHost, DataEndpoint: "127.0.0.1:1"},
			{AgentId: "intruder", HostId: testcluster.IntruderHost, DataEndpoint: "127.0.0.1:1",
				Segments: []*masterv1.SegmentInfo{{SegmentId: seg, Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 40, Alignment: 64}}},
			{AgentId: "agent-0", HostId: "host-0", DataEndpoint: "127.0.0.1:1"},
		} {
			settings, err := register(ctx, cc, reg)
			if settings != nil {
				t.Fatalf("register %v received Settings", reg)
			}
			wantCode(t, err, codes.PermissionDenied)
		}
	})
	t.Run("forged and borrowed tokens", func(t *testing.T) {
		rl, err := masterv1.NewObjectServiceClient(c.Conn()).GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: testcluster.TenantA, Key: "secret-1"})
		if err != nil {
			t.Fatal(err)
		}
		r := rl.GetReplicas()[0]
		agent := agentOf(t, c, r.GetSegmentId())
		forged := token.Sign(token.SigningKey{ID: 1, Secret: token.NewKey()}, token.Claims{
			Mode: token.Read, Tenant: testcluster.TenantA, Key: "secret-1", SegmentID: r.GetSegmentId(),
			AllocationID: r.GetAllocationId(), Expiry: time.Now().Add(time.Minute),
		})
		for _, tc := range []struct {
			name  string
			role  auth.Role
			who   string
			token []byte
			code  codes.Code
		}{
			{"forged key", auth.RoleTenant, testcluster.TenantA, forged, codes.PermissionDenied},
			{"tenant A's token held by tenant B", auth.RoleTenant, testcluster.TenantB, r.GetToken(), codes.PermissionDenied},
			{"no certificate", "", "", r.GetToken(), codes.Unauthenticated},
		} {
			data := agentv1.NewDataServiceClient(dialAgent(t, c, agent, tc.role, tc.who))
			_, err := readAll(ctx, data, &agentv1.ReadRequest{SegmentId: r.GetSegmentId(), AllocationId: r.GetAllocationId(), Token: tc.token})
			if status.Code(err) != tc.code {
				t.Fatalf("%s: got %v (%v), want %v", tc.name, status.Code(err), err, tc.code)
			}
		}
		// The rightful tenant reads with the same token.
		data := agentv1.NewDataServiceClient(dialAgent(t, c, agent, auth.RoleTenant, testcluster.TenantA))
		if got, err := readAll(ctx, data, &agentv1.ReadRequest{SegmentId: r.GetSegmentId(), AllocationId: r.GetAllocationId(), Token: r.GetToken()}); err != nil || !bytes.Equal(got, secret) {
			t.Fatalf("tenant A's own read: %d bytes, %v", len(got), err)
		}
	})
	t.Run("admin actions as a tenant", func(t *testing.T) {
		tenant := c.DialAs(auth.RoleTenant, testcluster.TenantA)
		admin := masterv1.NewAdminServiceClient(tenant)
		objects := masterv1.NewObjectServiceClient(tenant)
		_, err := admin.DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: memorySegment(t, c, 0)})
		wantCode(t, err, codes.PermissionDenied)
		_, err = admin.SetTenantQuota(ctx, &masterv1.SetTenantQuotaRequest{Tenant: testcluster.TenantA, MaxBytes: 1 << 40})
		wantCode(t, err, codes.PermissionDenied)
		_, err = objects.RemoveAll(ctx, &masterv1.RemoveAllRequest{Tenant: testcluster.TenantB})
		wantCode(t, err, codes.PermissionDenied)
		_, err = objects.RemoveAll(ctx, &masterv1.RemoveAllRequest{Tenant: testcluster.TenantA, Force: true})
		wantCode(t, err, codes.PermissionDenied)
	})
	t.Run("pprof", func(t *testing.T) {
		// Off by default: not even the admin gets it.
		code := httpsGet(t, c, "https://"+c.MasterAdminAddr()+"/debug/pprof/", auth.RoleAdmin, testcluster.Admin)
		if code != http.StatusNotFound {
			t.Fatalf("pprof as admin without --pprof: HTTP %d, want 404", code)
		}
	})

	if after := clusterState(t, c); !slices.Equal(before, after) {
		t.Fatalf("the cluster changed:\nbefore %q\nafter  %q", before, after)
	}
	if got, err := a.Get(ctx, "secret-0"); err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("tenant A's object after the attacks: %d bytes, %v", len(got), err)
	}
}

// clusterState is every tenant's keys and every segment's owner, lifecycle,
// health and capacity, as the admin sees them.
func clusterState(t *testing.T, c *testcluster.Cluster) []string {
	t.Helper()
	var out []string
	for _, tenant := range []string{"default", testcluster.TenantA, testcluster.TenantB} {
		for _, k := range c.Keys(tenant) {
			out = append(out, tenant+"/"+k)
		}
	}
	resp, err := masterv1.NewAdminServiceClient(c.Conn()).ListSegments(t.Context(), &masterv1.ListSegmentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range resp.GetSegments() {
		out = append(out, fmt.Sprintf("segment %s agent=%s host=%s %v %v cap=%d replicas=%d", s.GetInfo().GetSegmentId(), s.GetAgentId(), s.GetHostId(), s.GetLifecycle(), s.GetHealth(), s.GetInfo().GetCapacity(), s.GetReplicas()))
	}
	slices.Sort(out)
	return out
}

// register opens SegmentService.Connect, sends reg and returns the Settings
// the master answers with, or the stream's error.
func register(ctx context.Context, cc *grpc.ClientConn, reg *masterv1.Register) (*masterv1.Settings, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	stream, err := masterv1.NewSegmentServiceClient(cc).Connect(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: reg}}); err != nil && err != io.EOF {
		return nil, err
	}
	resp, err := stream.Recv()
	if err != nil {
		return nil, err
	}
	return resp.GetSettings(), nil
}

// memorySegment is agent i's memory segment id.
func memorySegment(t *testing.T, c *testcluster.Cluster, i int) string {
	t.Helper()
	for _, s := range c.Agent(i).Segments().All() {
		if s.Medium() == masterv1.Medium_MEDIUM_MEMORY {
			return s.ID()
		}
	}
	t.Fatalf("agent %d has no memory segment", i)
	return ""
}

// agentOf is the index of the agent holding segment id.
func agentOf(t *testing.T, c *testcluster.Cluster, id string) int {
	t.Helper()
	for i := range c.Agents() {
		if _, ok := c.Agent(i).Segments().Get(id); ok {
			return i
		}
	}
	t.Fatalf("no agent holds segment %s", id)
	return -1
}

// dialAgent is a DataService connection to agent i as role/name (with the
// CA only when role is empty).
func dialAgent(t *testing.T, c *testcluster.Cluster, i int, role auth.Role, name string) *grpc.ClientConn {
	t.Helper()
	f := auth.Files{CA: c.Files(auth.RoleAdmin, testcluster.Admin).CA}
	if role != "" {
		f = c.Files(role, name)
	}
	src, err := auth.NewSource(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(c.Agent(i).DataEndpoint(), rpccodec.DialOption(),
		grpc.WithTransportCredentials(src.ClientCredentials("", auth.ServerIdentity{TrustDomain: testcluster.TrustDomain, Roles: []auth.Role{auth.RoleAgent}})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func readAll(ctx context.Context, data agentv1.DataServiceClient, req *agentv1.ReadRequest) ([]byte, error) {
	stream, err := data.Read(ctx, req)
	if err != nil {
		return nil, err
	}
	var out []byte
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, resp.GetData()...)
	}
}

// httpsGet fetches url from an admin port as role/name and returns the
// HTTP status.
func httpsGet(t *testing.T, c *testcluster.Cluster, url string, role auth.Role, name string) int {
	t.Helper()
	src, err := auth.NewSource(c.Files(role, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := src.ClientTLS("127.0.0.1")
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 10 * time.Second}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}
