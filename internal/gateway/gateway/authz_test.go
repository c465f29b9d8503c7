package gateway

import (
	"context"
	"net/http"
	"testing"
	"time"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestAuthTableCoversEveryMethod fails when an RPC is added to the
// gateway's services without a rule in authTable (it would be refused to
// everyone with TLS on).
func TestAuthTableCoversEveryMethod(t *testing.T) {
	if err := server.CheckTable(authTable(), authServices...); err != nil {
		t.Fatal(err)
	}
}

// TestSecureStatus: with TLS, the gateway's status (gRPC and HTTP) is for
// admin, gateway and tenant principals only.
func TestSecureStatus(t *testing.T) {
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{}); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig("127.0.0.1:1") // no master: the status is served anyway
	f := devcerts.FilesFor(dir, auth.RoleGateway, "gateway-1")
	cfg.Security.CA, cfg.Security.Cert, cfg.Security.Key = f.CA, f.Cert, f.Key
	r := startGateway(t, cfg)
	defer r.stop()

	source := func(role auth.Role, name string) *auth.Source {
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
	for _, tt := range []struct {
		role       auth.Role
		name       string
		http       int
		grpcStatus codes.Code
	}{
		{auth.RoleAdmin, "admin", http.StatusOK, codes.OK},
		{auth.RoleTenant, auth.DefaultTenant, http.StatusOK, codes.OK},
		{auth.RoleAgent, "agent-1", http.StatusForbidden, codes.PermissionDenied},
		{auth.RoleTenant, "", http.StatusUnauthorized, codes.Unauthenticated}, // no certificate
	} {
		t.Run(string(tt.role)+"/"+tt.name, func(t *testing.T) {
			src := source(tt.role, tt.name)
			tr := &http.Transport{TLSClientConfig: src.ClientTLS("127.0.0.1")}
			defer tr.CloseIdleConnections()
			resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("https://" + r.g.AdminAddr() + "/kv_events/status")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tt.http {
				t.Errorf("GET /kv_events/status: got %d, want %d", resp.StatusCode, tt.http)
			}
			cc, err := grpc.NewClient(r.g.GRPCAddr(), grpc.WithTransportCredentials(src.ClientCredentials("", auth.ServerIdentity{})))
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			_, err = gatewayv1.NewGatewayServiceClient(cc).GetStatus(ctx, &gatewayv1.GetStatusRequest{})
			if got := status.Code(err); got != tt.grpcStatus {
				t.Errorf("GetStatus: got %v, want %v", got, tt.grpcStatus)
			}
		})
	}
}
