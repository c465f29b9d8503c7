package app

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/config"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestAuthTableCoversEveryMethod fails when an RPC is added to DataService
// without a rule in authTable (with TLS on it would be refused to everyone).
func TestAuthTableCoversEveryMethod(t *testing.T) {
	if err := server.CheckTable(authTable(), authServices...); err != nil {
		t.Fatal(err)
	}
}

func secureConfig(dir string, role auth.Role, name string) server.Security {
	f := devcerts.FilesFor(dir, role, name)
	s := server.DefaultSecurity()
	s.CA, s.Cert, s.Key = f.CA, f.Cert, f.Key
	return s
}

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

// TestSecureAgent runs a real master and an agent with mTLS on loopback:
// the agent registers over mTLS, its admin port is HTTPS, DataService and
// the bulk transfer listener want a certificate.
func TestSecureAgent(t *testing.T) {
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Tenants: []string{"a"}}); err != nil {
		t.Fatal(err)
	}
	mcfg := masterapp.DefaultConfig()
	mcfg.GRPCAddr, mcfg.AdminAddr = "127.0.0.1:0", ""
	mcfg.Security = secureConfig(dir, auth.RoleMaster, "master-1")
	m, err := masterapp.New(mcfg, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Server.Listen(); err != nil {
		t.Fatal(err)
	}
	mctx, mcancel := context.WithCancel(context.Background())
	mdone := make(chan error, 1)
	go func() { mdone <- m.Run(mctx) }()
	defer func() {
		mcancel()
		if err := <-mdone; err != nil {
			t.Errorf("master Run: %v", err)
		}
	}()

	r := startAgentWith(t, m.Server.GRPCAddr(), t.TempDir(), func(c *Config) {
		c.HostID = "agent-1" // the certificate's name
		c.Security = secureConfig(dir, auth.RoleAgent, "agent-1")
	})
	defer r.stop(t)

	// Registered over mTLS: ready, and its segments are on the master.
	adminHTTP := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: clientSource(t, dir, auth.RoleAdmin, "admin").ClientTLS("127.0.0.1")}}
	defer adminHTTP.CloseIdleConnections()
	testutil.Eventually(t, 10*time.Second, func() bool {
		resp, err := adminHTTP.Get("https://" + r.agent.AdminAddr() + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, "the agent's HTTPS /readyz to answer 200 (link connected over mTLS)")
	admin, err := grpc.NewClient(m.Server.GRPCAddr(), grpc.WithTransportCredentials(
		clientSource(t, dir, auth.RoleAdmin, "admin").ClientCredentials("", auth.ServerIdentity{TrustDomain: "crescent.local", Roles: []auth.Role{auth.RoleMaster}})))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	segs, err := masterv1.NewAdminServiceClient(admin).ListSegments(ctx, &masterv1.ListSegmentsRequest{})
	if err != nil || len(segs.GetSegments()) != 3 {
		t.Fatalf("ListSegments as admin: got %d segments, %v; want the agent's 3", len(segs.GetSegments()), err)
	}

	// DataService: any certificate passes the Authorizer (the capability
	// token decides); none cannot connect.
	dataCall := func(tc grpc.DialOption) codes.Code {
		cc, err := grpc.NewClient(r.agent.DataEndpoint(), tc)
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		_, err = agentv1.NewDataServiceClient(cc).BatchRead(ctx, &agentv1.BatchReadRequest{})
		return status.Code(err)
	}
	tenant := clientSource(t, dir, auth.RoleTenant, "a")
	want := auth.ServerIdentity{TrustDomain: "crescent.local", Roles: []auth.Role{auth.RoleAgent}}
	switch got := dataCall(grpc.WithTransportCredentials(tenant.ClientCredentials("", want))); got {
	case codes.Unauthenticated, codes.PermissionDenied, codes.Unavailable:
		t.Errorf("DataService with a tenant certificate: got %v, want past authorization", got)
	}
	if got := dataCall(grpc.WithTransportCredentials(insecure.NewCredentials())); got != codes.Unavailable {
		t.Errorf("DataService in plaintext: got %v, want Unavailable", got)
	}
	if got := dataCall(grpc.WithTransportCredentials(clientSource(t, dir, auth.RoleTenant, "").ClientCredentials("", want))); got != codes.Unauthenticated {
		t.Errorf("DataService without a client certificate: got %v, want Unauthenticated", got)
	}

	// The bulk transfer listener speaks TLS and wants a client certificate.
	xfer := r.agent.TransferEndpoint()
	c, err := tls.Dial("tcp", xfer, tenant.ClientTLS("127.0.0.1"))
	if err != nil {
		t.Fatalf("transfer listener with a tenant certificate: %v", err)
	}
	c.Close()
	// Without a certificate the handshake completes and the listener
	// answers UNAUTHENTICATED, then closes the connection.
	c, err = tls.Dial("tcp", xfer, clientSource(t, dir, auth.RoleTenant, "").ClientTLS("127.0.0.1"))
	if err != nil {
		t.Fatalf("transfer listener without a client certificate: handshake: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	refusal, err := io.ReadAll(c)
	c.Close()
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("transfer listener without a client certificate: no answer within 5s (read %q)", refusal)
	}
	if !bytes.Contains(refusal, []byte("certificate")) {
		t.Fatalf("transfer listener without a client certificate: got %q (%v), want the UNAUTHENTICATED refusal", refusal, err)
	}
	raw, err := net.Dial("tcp", xfer)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = raw.Write([]byte("CRESCENT plaintext request\r\n\r\n"))
	_ = raw.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, _ := raw.Read(make([]byte, 64))
	raw.Close()
	if n > 0 && n < 5 {
		t.Fatalf("plaintext to the TLS transfer listener got a %d-byte answer", n)
	}
}

// TestAgentProtectedMode: without TLS the agent serves loopback only,
// the bulk transfer listener included, unless --insecure.
func TestAgentProtectedMode(t *testing.T) {
	for _, tt := range []struct {
		name     string
		edit     func(*Config)
		insecure bool
	}{
		{"grpc on every interface", func(c *Config) { c.GRPCAddr = "0.0.0.0:0" }, false},
		{"transfer on every interface", func(c *Config) { c.TransferAddr = "0.0.0.0:0" }, false},
		{"admin on every interface", func(c *Config) { c.AdminAddr = "0.0.0.0:0" }, false},
		{"insecure", func(c *Config) { c.GRPCAddr, c.TransferAddr = "0.0.0.0:0", "0.0.0.0:0" }, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Master, cfg.GRPCAddr, cfg.AdminAddr, cfg.HostID = "127.0.0.1:1", "127.0.0.1:0", "127.0.0.1:0", "host-t"
			cfg.Memory, cfg.Prefault = config.ByteSize(2<<20), false
			cfg.ShutdownGrace, cfg.ShutdownTimeout = 0, time.Second
			tt.edit(&cfg)
			cfg.Security.Insecure = tt.insecure
			a := New(cfg, testutil.Logger(), obs.NewRegistry())
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- a.Run(ctx) }()
			if !tt.insecure {
				select {
				case err := <-done:
					if !errors.Is(err, server.ErrProtectedMode) {
						t.Fatalf("Run: got %v, want protected mode", err)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("Run did not refuse")
				}
				return
			}
			select {
			case <-a.Ready():
			case err := <-done:
				t.Fatalf("Run with --insecure: %v", err)
			case <-time.After(10 * time.Second):
				t.Fatal("agent not ready")
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run: %v", err)
			}
		})
	}
}
