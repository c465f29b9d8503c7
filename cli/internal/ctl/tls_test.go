package ctl

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The TLS flags against a real TLS master (a hand-written ObjectService
// that answers QueryRoute and records who asked): until testcluster runs
// with mTLS, this is where the flags meet a server that checks them.

// tlsMaster records the principal and the authorization header of every
// QueryRoute.
type tlsMaster struct {
	masterv1.UnimplementedObjectServiceServer
	mu     sync.Mutex
	who    []auth.Principal
	bearer []string
}

func (m *tlsMaster) QueryRoute(ctx context.Context, r *masterv1.QueryRouteRequest) (*masterv1.QueryRouteResponse, error) {
	p, _ := auth.PeerPrincipal(ctx, devcerts.DefaultTrustDomain)
	md, _ := metadata.FromIncomingContext(ctx)
	m.mu.Lock()
	m.who = append(m.who, p)
	m.bearer = append(m.bearer, strings.Join(md.Get("authorization"), ","))
	m.mu.Unlock()
	if p.Role == auth.RoleTenant && r.GetTenant() != p.Name {
		// As the master's Authorizer refuses it: a code, no reason.
		return nil, status.Errorf(codes.PermissionDenied, "auth: %s may not act for tenant %q", p, r.GetTenant())
	}
	return &masterv1.QueryRouteResponse{Size: 42}, nil
}

func (m *tlsMaster) last() (auth.Principal, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.who) == 0 {
		return auth.Principal{}, ""
	}
	return m.who[len(m.who)-1], m.bearer[len(m.bearer)-1]
}

// startTLSMaster makes certificates with crescentctl certs init and serves
// the fake master with the master's certificate.
func startTLSMaster(t *testing.T) (dir, addr string, m *tlsMaster) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "certs")
	if code, _, errOut := run(t, "unused:1", "certs", "init", dir, "--tenants", "default,A", "--agents", "host-a"); code != ExitOK {
		t.Fatalf("certs init: exit %d, %s", code, errOut)
	}
	src, err := auth.NewSource(devcerts.FilesFor(dir, auth.RoleMaster, "master-1"), nil)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m = &tlsMaster{}
	gs := grpc.NewServer(grpc.Creds(src.ServerCredentials(tls.VerifyClientCertIfGiven)))
	masterv1.RegisterObjectServiceServer(gs, m)
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-done })
	return dir, lis.Addr().String(), m
}

func tlsFlags(dir string, role auth.Role, name string) []string {
	f := devcerts.FilesFor(dir, role, name)
	return []string{"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
}

func TestTLSFlags(t *testing.T) {
	dir, addr, m := startTLSMaster(t)
	tenantA := auth.Principal{TrustDomain: devcerts.DefaultTrustDomain, Role: auth.RoleTenant, Name: "A"}

	t.Run("certificate", func(t *testing.T) {
		code, out, errOut := run(t, addr, append(tlsFlags(dir, auth.RoleTenant, "A"), "--tenant", "A", "stat", "k")...)
		if code != ExitOK || !strings.Contains(out, "size:     42") {
			t.Fatalf("stat: exit %d, stdout %q, stderr %q", code, out, errOut)
		}
		if p, _ := m.last(); p != tenantA {
			t.Fatalf("the master saw %v, want %v", p, tenantA)
		}
	})
	t.Run("another tenant", func(t *testing.T) {
		// A refusal without a reason names its code.
		code, out, errOut := run(t, addr, append(tlsFlags(dir, auth.RoleTenant, "A"), "--tenant", "B", "stat", "k")...)
		if code != ExitError || out != "" || !strings.Contains(errOut, "may not act for tenant") || !strings.HasSuffix(errOut, "(PermissionDenied)\n") {
			t.Fatalf("stat: exit %d, stdout %q, stderr %q; want exit %d and the refusal ending (PermissionDenied)", code, out, errOut, ExitError)
		}
	})
	t.Run("environment", func(t *testing.T) {
		f := devcerts.FilesFor(dir, auth.RoleAdmin, "admin")
		t.Setenv("CRESCENT_TLS_CA", f.CA)
		t.Setenv("CRESCENT_TLS_CERT", f.Cert)
		t.Setenv("CRESCENT_TLS_KEY", f.Key)
		if code, _, errOut := run(t, addr, "stat", "k"); code != ExitOK {
			t.Fatalf("stat: exit %d, stderr %q", code, errOut)
		}
		if p, _ := m.last(); p.Role != auth.RoleAdmin || p.Name != "admin" {
			t.Fatalf("the master saw %v, want the admin", p)
		}
	})
	t.Run("token file", func(t *testing.T) {
		const tok = "s3cret-token-0123456789"
		path := filepath.Join(t.TempDir(), "token")
		if err := os.WriteFile(path, []byte("  "+tok+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		code, _, errOut := run(t, addr, "--tls-ca", filepath.Join(dir, "ca.pem"), "--token-file", path, "stat", "k")
		if code != ExitOK {
			t.Fatalf("stat: exit %d, stderr %q", code, errOut)
		}
		if p, bearer := m.last(); !p.IsZero() || bearer != "Bearer "+tok {
			t.Fatalf("the master saw principal %v, authorization %q; want only the token", p, bearer)
		}
	})
	for _, tc := range []struct {
		name string
		args []string
		code int
	}{
		{"plaintext against TLS", []string{"--timeout", "3s"}, ExitError},
		{"a certificate without its key", []string{"--tls-ca", filepath.Join(dir, "ca.pem"), "--tls-cert", filepath.Join(dir, "tenant-A.pem")}, ExitUsage},
		{"a certificate without a CA", []string{"--tls-cert", filepath.Join(dir, "tenant-A.pem"), "--tls-key", filepath.Join(dir, "tenant-A-key.pem")}, ExitUsage},
		{"a token without TLS", []string{"--token-file", filepath.Join(dir, "ca.pem")}, ExitUsage},
		{"a token file that is no token", []string{"--tls-ca", filepath.Join(dir, "ca.pem"), "--token-file", filepath.Join(dir, "ca.pem")}, ExitError},
		{"a missing CA file", []string{"--tls-ca", filepath.Join(dir, "nope.pem")}, ExitError},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if code, out, errOut := run(t, addr, append(tc.args, "stat", "k")...); code != tc.code || out != "" || errOut == "" {
				t.Fatalf("exit %d, stdout %q, stderr %q; want exit %d and an error", code, out, errOut, tc.code)
			}
		})
	}
}

func TestCertsInit(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	code, out, errOut := run(t, "unused:1", "certs", "init", dir, "--trust-domain", "example.test",
		"--agents", "host-a,host-b", "--tenants", "A", "--admins", "ops", "--gateways", "", "--masters", "m1", "--hosts", "node1,10.0.0.1")
	if code != ExitOK {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	want := map[string]string{ // certificate → principal
		"master-m1.pem": "spiffe://example.test/master/m1", "agent-host-a.pem": "spiffe://example.test/agent/host-a",
		"agent-host-b.pem": "spiffe://example.test/agent/host-b", "tenant-A.pem": "spiffe://example.test/tenant/A",
		"admin-ops.pem": "spiffe://example.test/admin/ops",
	}
	for cert, principal := range want {
		f := filepath.Join(dir, cert)
		if !strings.Contains(out, principal+":\n  "+f+"\n  "+strings.TrimSuffix(f, ".pem")+"-key.pem\n") {
			t.Errorf("the listing does not name %s for %s:\n%s", f, principal, out)
		}
		key, err := os.Stat(strings.TrimSuffix(f, ".pem") + "-key.pem")
		if err != nil || key.Mode().Perm() != 0o600 {
			t.Errorf("key of %s: %v, mode %v; want 0600", cert, err, key.Mode())
		}
		if _, err := auth.NewSource(auth.Files{CA: filepath.Join(dir, "ca.pem"), Cert: f, Key: strings.TrimSuffix(f, ".pem") + "-key.pem"}, nil); err != nil {
			t.Errorf("%s does not load: %v", cert, err)
		}
	}
	if strings.Contains(out, "/gateway/") {
		t.Errorf("--gateways \"\" issued a gateway certificate:\n%s", out)
	}
	grpcurl := "grpcurl -cacert " + filepath.Join(dir, "ca.pem") + " -cert " + filepath.Join(dir, "admin-ops.pem") + " -key " + filepath.Join(dir, "admin-ops-key.pem") + " 127.0.0.1:50051 list"
	if !strings.Contains(out, grpcurl) {
		t.Errorf("no %q in:\n%s", grpcurl, out)
	}
	if !strings.Contains(out, "--tenant A ls") {
		t.Errorf("the crescentctl line does not name tenant A:\n%s", out)
	}

	// A second init keeps the CA unless --force.
	ca, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if code, _, errOut := run(t, "unused:1", "certs", "init", dir); code != ExitError || !strings.Contains(errOut, "--force") {
		t.Fatalf("second init: exit %d, stderr %q; want an error that names --force", code, errOut)
	}
	if again, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); string(again) != string(ca) {
		t.Fatal("a refused init replaced the CA")
	}
	code, out, _ = run(t, "unused:1", "-o", "json", "certs", "init", "--force", dir)
	if again, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); code != ExitOK || string(again) == string(ca) {
		t.Fatalf("init --force: exit %d; the CA was replaced: %v", code, string(again) != string(ca))
	}
	var rows []certFile
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r certFile
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		rows = append(rows, r)
	}
	// CA, master-1, agent-1, agent-2, gateway-1, default, admin.
	if len(rows) != 7 || rows[0].Principal != "" || rows[0].Cert != filepath.Join(dir, "ca.pem") {
		t.Fatalf("json listing = %+v", rows)
	}
	if code, _, errOut := run(t, "unused:1", "certs", "init", filepath.Join(t.TempDir(), "x"), "--tenants", "bad/name"); code != ExitError || errOut == "" {
		t.Fatalf("a bad name: exit %d, stderr %q", code, errOut)
	}
}

// The TLS flags against a real cluster with mTLS (testcluster): a tenant's
// certificate puts and gets its own keys on both data paths, and is refused
// another tenant's.
func TestTLSCluster(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{TLS: true})
	flags := tlsFlags(c.CertDir(), auth.RoleTenant, testcluster.TenantA)
	src := filepath.Join(t.TempDir(), "in")
	data := strings.Repeat("0123456789abcdef", 40<<10)
	if err := os.WriteFile(src, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	for i, path := range [][]string{nil, {"--grpc-data"}} {
		args := append(append(append([]string{}, flags...), path...), "--tenant", testcluster.TenantA)
		key := fmt.Sprintf("k%d", i)
		if code, _, errOut := run(t, c.MasterAddr(), append(args, "put", key, src)...); code != ExitOK {
			t.Fatalf("put %v: exit %d, %s", path, code, errOut)
		}
		if code, out, errOut := run(t, c.MasterAddr(), append(args, "get", key)...); code != ExitOK || out != data {
			t.Fatalf("get %v: exit %d, %d bytes, %s", path, code, len(out), errOut)
		}
	}
	code, _, errOut := run(t, c.MasterAddr(), append(flags, "--tenant", testcluster.TenantB, "stat", "k0")...)
	if code != ExitError || !strings.Contains(errOut, "PermissionDenied") && !strings.Contains(strings.ToLower(errOut), "permission") {
		t.Fatalf("stat of another tenant's key: exit %d, stderr %q", code, errOut)
	}
	// A refused listing prints its error and nothing else (no table header).
	code, out, errOut := run(t, c.MasterAddr(), append(flags, "--tenant", testcluster.TenantB, "ls")...)
	if code != ExitError || out != "" || !strings.Contains(errOut, "PermissionDenied") {
		t.Fatalf("ls of another tenant: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	// Its own listing has the header and its keys.
	if code, out, errOut := run(t, c.MasterAddr(), append(flags, "--tenant", testcluster.TenantA, "ls")...); code != ExitOK || !strings.HasPrefix(out, "KEY") || !strings.Contains(out, "k1") {
		t.Fatalf("ls: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}
