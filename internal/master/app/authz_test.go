package app

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestAuthTableCoversEveryMethod fails when an RPC is added to a master
// service without a rule in authTable (with TLS on it would be refused to
// everyone).
func TestAuthTableCoversEveryMethod(t *testing.T) {
	if err := server.CheckTable(authTable(), authServices...); err != nil {
		t.Fatal(err)
	}
}

// logSink collects JSON log lines, safe for concurrent writers.
type logSink struct{ testutil.LogBuffer }

// audits returns the audit lines' principal, method and outcome.
func (l *logSink) audits() []string {
	var out []string
	for line := range strings.SplitSeq(l.String(), "\n") {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil || rec["msg"] != "audit" {
			continue
		}
		method := rec["method"].(string)
		out = append(out, rec["principal"].(string)+" "+method[strings.LastIndexByte(method, '/')+1:]+" "+rec["outcome"].(string))
	}
	return out
}

// secureMaster runs a master with mTLS on loopback (and a bearer token file
// with one tenant token, so clients without a certificate can connect) and
// returns its gRPC address and its log.
func secureMaster(t *testing.T, dir string) (string, *logSink) {
	t.Helper()
	m, logs := secureMasterApp(t, dir)
	return m.Server.GRPCAddr(), logs
}

// secureMasterApp is secureMaster's master itself.
func secureMasterApp(t *testing.T, dir string) (*Master, *logSink) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.RecoveryGrace = 0
	f := devcerts.FilesFor(dir, auth.RoleMaster, "master-1")
	cfg.Security.CA, cfg.Security.Cert, cfg.Security.Key = f.CA, f.Cert, f.Key
	cfg.Security.AuthTokens = filepath.Join(dir, "tokens")
	if err := os.WriteFile(cfg.Security.AuthTokens, []byte(tenantAToken+" spiffe://crescent.local/tenant/a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &logSink{}
	m, err := New(cfg, slog.New(slog.NewJSONHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Server.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return m, logs
}

const tenantAToken = "tenant-a-token-0123456789"

// clientSource is role/name's development certificate (a CA-only client
// with no name).
func clientSource(t *testing.T, dir string, role auth.Role, name string) *auth.Source {
	t.Helper()
	f := devcerts.FilesFor(dir, role, name)
	if name == "" {
		f = auth.Files{CA: f.CA}
	}
	src, err := auth.NewSource(f, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// masterIdentity is what a client of these tests expects the server to be.
var masterIdentity = auth.ServerIdentity{TrustDomain: "crescent.local", Roles: []auth.Role{auth.RoleMaster}}

// conn dials addr as role/name (a CA-only client with no name).
func conn(t *testing.T, dir, addr string, role auth.Role, name string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	tc := clientSource(t, dir, role, name).ClientCredentials("", masterIdentity)
	cc, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(tc)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// TestAuthorization runs each attack of issue 14 (and the calls that must
// keep working) against a master with mTLS on.
func TestAuthorization(t *testing.T) {
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Tenants: []string{"a", "b"}}); err != nil {
		t.Fatal(err)
	}
	addr, logs := secureMaster(t, dir)
	tenantA := conn(t, dir, addr, auth.RoleTenant, "a")
	admin := conn(t, dir, addr, auth.RoleAdmin, "admin")
	agent := conn(t, dir, addr, auth.RoleAgent, "agent-1")
	gateway := conn(t, dir, addr, auth.RoleGateway, "gateway-1")
	anon := conn(t, dir, addr, auth.RoleTenant, "")
	tokenA := conn(t, dir, addr, auth.RoleTenant, "", grpc.WithPerRPCCredentials(auth.BearerCredentials(tenantAToken)))

	unary := func(cc *grpc.ClientConn, call func(context.Context, *grpc.ClientConn) error) codes.Code {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		return status.Code(call(ctx, cc))
	}
	get := func(tenant string) func(context.Context, *grpc.ClientConn) error {
		return func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := masterv1.NewObjectServiceClient(cc).GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: tenant, Key: "secret"})
			return err
		}
	}
	batchExist := func(tenants ...string) func(context.Context, *grpc.ClientConn) error {
		return func(ctx context.Context, cc *grpc.ClientConn) error {
			req := &masterv1.BatchExistRequest{}
			for _, tn := range tenants {
				req.Items = append(req.Items, &masterv1.ExistRequest{Tenant: tn, Key: "k"})
			}
			_, err := masterv1.NewObjectServiceClient(cc).BatchExist(ctx, req)
			return err
		}
	}
	removeAll := func(tenant string, force bool) func(context.Context, *grpc.ClientConn) error {
		return func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := masterv1.NewObjectServiceClient(cc).RemoveAll(ctx, &masterv1.RemoveAllRequest{Tenant: tenant, Force: force})
			return err
		}
	}
	toMemory := &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_Medium{Medium: masterv1.Medium_MEDIUM_MEMORY}}
	copyKeys := func(tenant string, move bool) func(context.Context, *grpc.ClientConn) error {
		return func(ctx context.Context, cc *grpc.ClientConn) error {
			oc := masterv1.NewObjectServiceClient(cc)
			var err error
			if move {
				_, err = oc.Move(ctx, &masterv1.ObjectServiceMoveRequest{Tenant: tenant, Keys: []string{"k"}, Target: toMemory})
			} else {
				_, err = oc.Copy(ctx, &masterv1.ObjectServiceCopyRequest{Tenant: tenant, Keys: []string{"k"}, Target: toMemory})
			}
			return err
		}
	}
	adminCopy := func(tenant string, move bool) func(context.Context, *grpc.ClientConn) error {
		return func(ctx context.Context, cc *grpc.ClientConn) error {
			ac := masterv1.NewAdminServiceClient(cc)
			var err error
			if move {
				_, err = ac.MoveObjects(ctx, &masterv1.MoveObjectsRequest{Tenant: tenant, Keys: []string{"k"}, Target: toMemory})
			} else {
				_, err = ac.CopyObjects(ctx, &masterv1.CopyObjectsRequest{Tenant: tenant, Keys: []string{"k"}, Target: toMemory})
			}
			return err
		}
	}
	prefetch := func(tenant string) func(context.Context, *grpc.ClientConn) error {
		return func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := masterv1.NewObjectServiceClient(cc).Prefetch(ctx, &masterv1.PrefetchRequest{Tenant: tenant, Keys: []string{"k"}, Wait: true})
			return err
		}
	}
	setQuota := func(ctx context.Context, cc *grpc.ClientConn) error {
		_, err := masterv1.NewAdminServiceClient(cc).SetTenantQuota(ctx, &masterv1.SetTenantQuotaRequest{Tenant: "a", MaxObjects: 10})
		return err
	}
	drain := func(ctx context.Context, cc *grpc.ClientConn) error {
		_, err := masterv1.NewAdminServiceClient(cc).DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: "nope"})
		return err
	}
	listSegments := func(ctx context.Context, cc *grpc.ClientConn) error {
		_, err := masterv1.NewAdminServiceClient(cc).ListSegments(ctx, &masterv1.ListSegmentsRequest{})
		return err
	}
	connect := func(ctx context.Context, cc *grpc.ClientConn) error {
		st, err := masterv1.NewSegmentServiceClient(cc).Connect(ctx)
		if err == nil {
			_, err = st.Recv()
		}
		return err
	}
	// Watch is refused at once or blocks until a change; Snapshot answers.
	watch := func(ctx context.Context, cc *grpc.ClientConn) error {
		st, err := masterv1.NewChangeServiceClient(cc).Watch(ctx, &masterv1.WatchRequest{})
		if err == nil {
			_, err = st.Recv()
		}
		return err
	}
	snapshot := func(ctx context.Context, cc *grpc.ClientConn) error {
		st, err := masterv1.NewChangeServiceClient(cc).Snapshot(ctx, &masterv1.SnapshotRequest{})
		if err == nil {
			_, err = st.Recv()
		}
		return err
	}

	tests := []struct {
		name string
		cc   *grpc.ClientConn
		call func(context.Context, *grpc.ClientConn) error
		want codes.Code
	}{
		// Who may not call at all.
		{"no certificate, no token", anon, get("a"), codes.Unauthenticated},
		{"agent reads objects", agent, get("a"), codes.PermissionDenied},
		{"gateway reads objects", gateway, get("a"), codes.PermissionDenied},
		{"tenant calls AdminService", tenantA, listSegments, codes.PermissionDenied},
		{"tenant drains a segment", tenantA, drain, codes.PermissionDenied},
		{"tenant sets a quota", tenantA, setQuota, codes.PermissionDenied},
		{"tenant registers as an agent", tenantA, connect, codes.PermissionDenied},
		{"admin registers as an agent", admin, connect, codes.PermissionDenied},
		{"tenant watches changes", tenantA, watch, codes.PermissionDenied},
		{"agent watches changes", agent, watch, codes.PermissionDenied},
		// Tenants stay in their tenant.
		{"tenant a reads tenant b", tenantA, get("b"), codes.PermissionDenied},
		{"tenant a reads the default tenant", tenantA, get(""), codes.PermissionDenied},
		{"tenant a batch with one item of b", tenantA, batchExist("a", "b"), codes.PermissionDenied},
		{"token of tenant a reads tenant b", tokenA, get("b"), codes.PermissionDenied},
		{"tenant a removes all of b", tenantA, removeAll("b", false), codes.PermissionDenied},
		{"tenant a forces RemoveAll on itself", tenantA, removeAll("a", true), codes.PermissionDenied},
		// Copy and Move: a tenant's own keys only; the admin forms are
		// admins' (issue 17).
		{"tenant a copies keys of b", tenantA, copyKeys("b", false), codes.PermissionDenied},
		{"tenant a moves keys of b", tenantA, copyKeys("b", true), codes.PermissionDenied},
		{"token of tenant a copies keys of default", tokenA, copyKeys("", false), codes.PermissionDenied},
		{"tenant a calls CopyObjects on its own", tenantA, adminCopy("a", false), codes.PermissionDenied},
		{"tenant a calls MoveObjects on its own", tenantA, adminCopy("a", true), codes.PermissionDenied},
		{"agent copies keys", agent, copyKeys("a", false), codes.PermissionDenied},
		{"gateway calls MoveObjects", gateway, adminCopy("a", true), codes.PermissionDenied},
		// Prefetch: like Copy, a tenant's own keys only.
		{"tenant a prefetches keys of b", tenantA, prefetch("b"), codes.PermissionDenied},
		{"token of tenant a prefetches keys of default", tokenA, prefetch(""), codes.PermissionDenied},
		{"agent prefetches keys", agent, prefetch("a"), codes.PermissionDenied},
		{"gateway prefetches keys", gateway, prefetch("a"), codes.PermissionDenied},
		{"tenant a prefetches its own", tenantA, prefetch("a"), codes.OK},
		{"token of tenant a prefetches its own", tokenA, prefetch("a"), codes.OK},
		{"admin prefetches keys of b", admin, prefetch("b"), codes.OK},
		// What keeps working.
		{"tenant a copies its own", tenantA, copyKeys("a", false), codes.OK},
		{"tenant a moves its own", tenantA, copyKeys("a", true), codes.OK},
		{"admin copies keys of b", admin, copyKeys("b", false), codes.OK},
		{"admin calls CopyObjects on b", admin, adminCopy("b", false), codes.OK},
		{"admin calls MoveObjects on b", admin, adminCopy("b", true), codes.OK},
		{"tenant a reads its own", tenantA, get("a"), codes.NotFound},
		{"token of tenant a reads its own", tokenA, get("a"), codes.NotFound},
		{"tenant a batch of its own", tenantA, batchExist("a", "a"), codes.OK},
		{"tenant a removes all of its own", tenantA, removeAll("a", false), codes.OK},
		{"admin reads any tenant", admin, get("b"), codes.NotFound},
		{"admin lists segments", admin, listSegments, codes.OK},
		{"admin sets a quota", admin, setQuota, codes.OK},
		{"admin forces RemoveAll on b", admin, removeAll("b", true), codes.OK},
		{"tenant takes a snapshot", tenantA, snapshot, codes.PermissionDenied},
		{"gateway takes a snapshot", gateway, snapshot, codes.OK},
		{"admin takes a snapshot", admin, snapshot, codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := unary(tt.cc, tt.call); got != tt.want {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
		})
	}

	// Admin actions (and RemoveAll) leave audit lines naming the principal,
	// refused ones too.
	got := strings.Join(logs.audits(), "\n")
	for _, want := range []string{
		"spiffe://crescent.local/admin/admin SetTenantQuota ok",
		"spiffe://crescent.local/tenant/a SetTenantQuota denied",
		"spiffe://crescent.local/tenant/a DrainSegment denied",
		"spiffe://crescent.local/tenant/a RemoveAll failed", // force: refused after the table let it in
		"spiffe://crescent.local/tenant/a RemoveAll ok",
		"spiffe://crescent.local/admin/admin RemoveAll ok",
		"spiffe://crescent.local/admin/admin CopyObjects ok",
		"spiffe://crescent.local/admin/admin MoveObjects ok",
		"spiffe://crescent.local/tenant/a MoveObjects denied",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("audit log lacks %q; it has:\n%s", want, got)
		}
	}
}

// TestPlaintextAllowsEverything: without TLS (loopback), every call runs
// as the insecure admin principal, as before issue 14.
func TestPlaintextAllowsEverything(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", ""
	cfg.RecoveryGrace = 0
	cc := runMaster(t, cfg).cc
	rctx, rcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer rcancel()
	if _, err := masterv1.NewObjectServiceClient(cc).RemoveAll(rctx, &masterv1.RemoveAllRequest{Tenant: "b", Force: true}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("RemoveAll with force in plaintext: %v", err)
	}
	if _, err := masterv1.NewAdminServiceClient(cc).SetTenantQuota(rctx, &masterv1.SetTenantQuotaRequest{Tenant: "b"}); err != nil {
		t.Fatalf("SetTenantQuota in plaintext: %v", err)
	}
}

// TestProtectedMode: a plaintext master refuses every interface unless
// --insecure.
func TestProtectedMode(t *testing.T) {
	for _, insecure := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.GRPCAddr, cfg.AdminAddr = "0.0.0.0:0", ""
		cfg.Security.Insecure = insecure
		m, err := New(cfg, testutil.Logger())
		if err != nil {
			t.Fatal(err)
		}
		err = m.Server.Listen()
		if refused := err != nil; refused == insecure {
			t.Fatalf("insecure=%v: Listen: %v", insecure, err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := m.Run(ctx); (err != nil) == insecure {
			t.Fatalf("insecure=%v: Run: %v", insecure, err)
		}
	}
}
