package server

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"
)

// certs is a development CA and certificates for every role, made once
// per test binary (TestMain removes certsDir).
var (
	certsDir string
	certs    = sync.OnceValues(func() (string, error) {
		dir, err := os.MkdirTemp("", "crescent-server-certs-")
		if err != nil {
			return "", err
		}
		certsDir = dir
		return dir, devcerts.Init(dir, devcerts.Options{Tenants: []string{"a", "b"}})
	})
)

func certDir(t *testing.T) string {
	t.Helper()
	dir, err := certs()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

const adminToken = "admin-token-0123456789abcdef"

// security is the TLS configuration of a process holding role/name's
// certificate; tokens adds a bearer token file with an admin token.
func security(t *testing.T, role auth.Role, name string, tokens bool) Security {
	t.Helper()
	f := devcerts.FilesFor(certDir(t), role, name)
	sec := DefaultSecurity()
	sec.CA, sec.Cert, sec.Key = f.CA, f.Cert, f.Key
	if tokens {
		sec.AuthTokens = filepath.Join(t.TempDir(), "tokens")
		line := adminToken + " spiffe://" + DefaultTrustDomain + "/admin/ops\n"
		if err := os.WriteFile(sec.AuthTokens, []byte(line), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return sec
}

func load(t *testing.T, sec Security) *Credentials {
	t.Helper()
	if err := sec.Validate(); err != nil {
		t.Fatal(err)
	}
	c, err := sec.Load(testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// testService is grpc's interop TestService: EmptyCall is admin only,
// UnaryCall any role; neither is implemented, so a call the Authorizer
// lets through ends Unimplemented.
type testService struct {
	testgrpc.UnimplementedTestServiceServer
}

var testTable = auth.Table{
	"/grpc.testing.TestService/EmptyCall": {Roles: []auth.Role{auth.RoleAdmin}},
	"/grpc.testing.TestService/UnaryCall": {Any: true},
}

// running starts s and stops it when the test ends.
func running(t *testing.T, s *Server) {
	t.Helper()
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func secureServer(t *testing.T, creds *Credentials) *Server {
	t.Helper()
	s := New(Config{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", ShutdownTimeout: time.Second, Credentials: creds, Table: testTable},
		testutil.Logger(), obs.NewRegistry())
	testgrpc.RegisterTestServiceServer(s.GRPC, testService{})
	running(t, s)
	return s
}

// dial connects with tc; the connection is closed when the test ends.
func dial(t *testing.T, addr string, tc credentials.TransportCredentials, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(tc)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// clientCreds are the mTLS credentials of role/name (a CA-only client when
// name is empty).
func clientCreds(t *testing.T, role auth.Role, name string) credentials.TransportCredentials {
	t.Helper()
	f := devcerts.FilesFor(certDir(t), role, name)
	if name == "" {
		f = auth.Files{CA: f.CA}
	}
	src, err := auth.NewSource(f, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	return src.ClientCredentials("", auth.ServerIdentity{TrustDomain: DefaultTrustDomain, Roles: []auth.Role{auth.RoleMaster}})
}

func callCode(t *testing.T, cc *grpc.ClientConn, admin bool) codes.Code {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	c := testgrpc.NewTestServiceClient(cc)
	var err error
	if admin {
		_, err = c.EmptyCall(ctx, &testgrpc.Empty{})
	} else {
		_, err = c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
	}
	return status.Code(err)
}

func TestSecureGRPC(t *testing.T) {
	s := secureServer(t, load(t, security(t, auth.RoleMaster, "master-1", false)))
	addr := s.GRPCAddr()
	tests := []struct {
		name       string
		creds      credentials.TransportCredentials
		admin, any codes.Code
	}{
		// Passed the Authorizer: the handler answers Unimplemented.
		{"admin", clientCreds(t, auth.RoleAdmin, "admin"), codes.Unimplemented, codes.Unimplemented},
		{"tenant", clientCreds(t, auth.RoleTenant, "a"), codes.PermissionDenied, codes.Unimplemented},
		{"agent", clientCreds(t, auth.RoleAgent, "agent-1"), codes.PermissionDenied, codes.Unimplemented},
		// No certificate: the handshake passes (health stays reachable),
		// every other call is refused with a reason.
		{"no client certificate", clientCreds(t, auth.RoleAdmin, ""), codes.Unauthenticated, codes.Unauthenticated},
		{"plaintext", insecure.NewCredentials(), codes.Unavailable, codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cc := dial(t, addr, tt.creds)
			if got := callCode(t, cc, true); got != tt.admin {
				t.Errorf("admin-only call: got %v, want %v", got, tt.admin)
			}
			if got := callCode(t, cc, false); got != tt.any {
				t.Errorf("any-role call: got %v, want %v", got, tt.any)
			}
		})
	}
	t.Run("health is public", func(t *testing.T) {
		// A TLS client without a certificate cannot connect at all here,
		// so public means: any certificate, any role.
		cc := dial(t, addr, clientCreds(t, auth.RoleTenant, "b"))
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health: got %v, %v; want SERVING", resp.GetStatus(), err)
		}
	})
}

func TestSecureGRPCBearerTokens(t *testing.T) {
	s := secureServer(t, load(t, security(t, auth.RoleMaster, "master-1", true)))
	noCert := clientCreds(t, auth.RoleAdmin, "")
	tests := []struct {
		name       string
		opts       []grpc.DialOption
		admin, any codes.Code
	}{
		{"no certificate, no token", nil, codes.Unauthenticated, codes.Unauthenticated},
		{"unknown token", []grpc.DialOption{grpc.WithPerRPCCredentials(auth.BearerCredentials("not-a-known-token-at-all"))}, codes.Unauthenticated, codes.Unauthenticated},
		{"admin token", []grpc.DialOption{grpc.WithPerRPCCredentials(auth.BearerCredentials(adminToken))}, codes.Unimplemented, codes.Unimplemented},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cc := dial(t, s.GRPCAddr(), noCert, tt.opts...)
			if got := callCode(t, cc, true); got != tt.admin {
				t.Errorf("admin-only call: got %v, want %v", got, tt.admin)
			}
			if got := callCode(t, cc, false); got != tt.any {
				t.Errorf("any-role call: got %v, want %v", got, tt.any)
			}
		})
	}
	t.Run("certificate still works", func(t *testing.T) {
		cc := dial(t, s.GRPCAddr(), clientCreds(t, auth.RoleTenant, "a"))
		if got := callCode(t, cc, true); got != codes.PermissionDenied {
			t.Errorf("tenant on an admin-only call: got %v, want PermissionDenied", got)
		}
	})
}

// httpsClient is an HTTPS client verifying the server with the CA and
// presenting role/name's certificate (none when name is empty).
func httpsClient(t *testing.T, role auth.Role, name string) *http.Client {
	t.Helper()
	f := devcerts.FilesFor(certDir(t), role, name)
	if name == "" {
		f = auth.Files{CA: f.CA}
	}
	src, err := auth.NewSource(f, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: src.ClientTLS("127.0.0.1")}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 5 * time.Second}
}

func get(t *testing.T, c *http.Client, url string) int {
	t.Helper()
	r, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	_, _ = io.Copy(io.Discard, r.Body)
	r.Body.Close()
	return r.StatusCode
}

func TestSecureAdminHTTP(t *testing.T) {
	for _, pprof := range []bool{false, true} {
		t.Run(map[bool]string{false: "pprof off", true: "pprof on"}[pprof], func(t *testing.T) {
			sec := security(t, auth.RoleMaster, "master-1", false)
			sec.Pprof = pprof
			s := secureServer(t, load(t, sec))
			base := "https://" + s.AdminAddr()
			pprofAdmin, pprofOther := http.StatusNotFound, http.StatusNotFound
			if pprof {
				pprofAdmin, pprofOther = http.StatusOK, http.StatusForbidden
			}
			anon, tenant, admin := httpsClient(t, auth.RoleAdmin, ""), httpsClient(t, auth.RoleTenant, "a"), httpsClient(t, auth.RoleAdmin, "admin")
			tests := []struct {
				client *http.Client
				who    string
				path   string
				want   int
			}{
				{anon, "no certificate", "/healthz", 200},
				{anon, "no certificate", "/readyz", 200},
				{anon, "no certificate", "/metrics", http.StatusUnauthorized},
				{tenant, "tenant", "/healthz", 200},
				{tenant, "tenant", "/metrics", http.StatusForbidden},
				{admin, "admin", "/metrics", 200},
				{admin, "admin", "/debug/pprof/", pprofAdmin},
				{tenant, "tenant", "/debug/pprof/", pprofOther},
			}
			for _, tt := range tests {
				if got := get(t, tt.client, base+tt.path); got != tt.want {
					t.Errorf("%s GET %s: got %d, want %d", tt.who, tt.path, got, tt.want)
				}
			}
			if pprof {
				if got := get(t, anon, base+"/debug/pprof/"); got != http.StatusUnauthorized {
					t.Errorf("no certificate GET /debug/pprof/: got %d, want 401", got)
				}
			}
			// Plain HTTP to the HTTPS port is refused.
			if r, err := http.Get("http://" + s.AdminAddr() + "/healthz"); err == nil {
				r.Body.Close()
				if r.StatusCode == 200 {
					t.Error("plain HTTP to the HTTPS admin port: got 200")
				}
			}
		})
	}
}

func TestPlaintextPprof(t *testing.T) {
	for _, pprof := range []bool{false, true} {
		sec := DefaultSecurity()
		sec.Pprof = pprof
		s := New(Config{AdminAddr: "127.0.0.1:0", ShutdownTimeout: time.Second, Credentials: &Credentials{Security: sec}}, testutil.Logger(), obs.NewRegistry())
		running(t, s)
		want := map[bool]int{false: http.StatusNotFound, true: http.StatusOK}[pprof]
		if got := get(t, http.DefaultClient, "http://"+s.AdminAddr()+"/debug/pprof/"); got != want {
			t.Errorf("pprof %v: GET /debug/pprof/: got %d, want %d", pprof, got, want)
		}
		if got := get(t, http.DefaultClient, "http://"+s.AdminAddr()+"/metrics"); got != 200 {
			t.Errorf("plaintext /metrics: got %d, want 200", got)
		}
	}
	http.DefaultClient.CloseIdleConnections()
}

func TestProtectedMode(t *testing.T) {
	tests := []struct {
		name      string
		addr      string
		sec       func() Security
		wantErr   bool
		wantWarns bool
	}{
		{"plaintext on every interface is refused", "0.0.0.0:0", DefaultSecurity, true, false},
		{"plaintext on [::] is refused", "[::]:0", DefaultSecurity, true, false},
		{"plaintext on loopback", "127.0.0.1:0", DefaultSecurity, false, false},
		{"insecure on every interface", "0.0.0.0:0", func() Security { s := DefaultSecurity(); s.Insecure = true; return s }, false, true},
		{"TLS on every interface", "0.0.0.0:0", func() Security { return security(t, auth.RoleMaster, "master-1", false) }, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, which := range []string{"grpc", "admin"} {
				logs := &testutil.LogBuffer{}
				lg := slog.New(slog.NewTextHandler(logs, nil))
				cfg := Config{ShutdownTimeout: time.Second, Credentials: load(t, tt.sec())}
				if which == "grpc" {
					cfg.GRPCAddr, cfg.AdminAddr = tt.addr, "127.0.0.1:0"
				} else {
					cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", tt.addr
				}
				s := New(cfg, lg, obs.NewRegistry())
				s.warnEvery = 20 * time.Millisecond
				err := s.Listen()
				if gotErr := errors.Is(err, ErrProtectedMode); gotErr != tt.wantErr {
					t.Fatalf("%s: Listen: got %v, want protected-mode error %v", which, err, tt.wantErr)
				}
				if err != nil {
					if s.GRPCAddr() != "" || s.AdminAddr() != "" {
						t.Fatalf("%s: a refused Listen left listeners open: %q %q", which, s.GRPCAddr(), s.AdminAddr())
					}
					if !strings.Contains(err.Error(), "--insecure") {
						t.Errorf("the error does not say how to proceed: %v", err)
					}
					continue
				}
				ctx, cancel := context.WithCancel(t.Context())
				done := make(chan error, 1)
				go func() { done <- s.Run(ctx) }()
				if tt.wantWarns {
					// At start, then every warnEvery.
					testutil.Eventually(t, 5*time.Second, func() bool { return logs.Count("insecure: plaintext") >= 3 },
						"%s: three insecure warnings (at start, then every warnEvery)", which)
				}
				cancel()
				if err := <-done; err != nil {
					t.Fatalf("Run: %v", err)
				}
				if n := logs.Count("insecure: plaintext"); !tt.wantWarns && n > 0 {
					t.Fatalf("%s: got %d insecure warnings, want none", which, n)
				}
			}
		})
	}
}

func TestSecurityValidate(t *testing.T) {
	full := security(t, auth.RoleMaster, "master-1", false)
	tests := []struct {
		name string
		edit func(*Security)
		want string
	}{
		{"defaults", func(*Security) {}, ""},
		{"full TLS", func(s *Security) { *s = full }, ""},
		{"TLS without key", func(s *Security) { *s = full; s.Key = "" }, "go together"},
		{"CA only", func(s *Security) { s.CA = full.CA }, "go together"},
		{"tokens without TLS", func(s *Security) { s.AuthTokens = "/x" }, "needs TLS"},
		{"insecure with TLS", func(s *Security) { *s = full; s.Insecure = true }, "insecure"},
		{"bad trust domain", func(s *Security) { s.TrustDomain = "Not A Domain" }, "trust-domain"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := DefaultSecurity()
			tt.edit(&s)
			err := s.Validate()
			if (err == nil) != (tt.want == "") || (err != nil && !strings.Contains(err.Error(), tt.want)) {
				t.Fatalf("Validate: got %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// TestSecurityFlags checks the flag names (config.Load derives the
// CRESCENT_* and YAML names from them).
func TestSecurityFlags(t *testing.T) {
	sec := DefaultSecurity()
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	sec.RegisterFlags(fs)
	env := map[string]string{"CRESCENT_TLS_CA": "/ca.pem", "CRESCENT_INSECURE": "true"}
	if err := fs.Parse([]string{"--tls-cert", "/c.pem", "--tls-key", "/k.pem", "--auth-tokens", "/t", "--pprof", "--trust-domain", "example.org", "--max-connections-per-ip", "64"}); err != nil {
		t.Fatal(err)
	}
	for k, v := range env {
		name := strings.ToLower(strings.ReplaceAll(strings.TrimPrefix(k, "CRESCENT_"), "_", "-"))
		if err := fs.Set(name, v); err != nil {
			t.Fatal(err)
		}
	}
	want := Security{CA: "/ca.pem", Cert: "/c.pem", Key: "/k.pem", TrustDomain: "example.org", AuthTokens: "/t", Insecure: true, Pprof: true,
		MaxConns: DefaultMaxConns, MaxConnsPerIP: 64}
	if sec != want {
		t.Fatalf("got %+v, want %+v", sec, want)
	}
}

func TestHealthcheckHTTPS(t *testing.T) {
	s := secureServer(t, load(t, security(t, auth.RoleMaster, "master-1", false)))
	url := "https://" + s.AdminAddr() + "/readyz"
	ca := devcerts.FilesFor(certDir(t), auth.RoleAdmin, "").CA
	proc := func(sec *Security) Process {
		return Process{
			Name: "crescent-test", HealthURL: "http://" + s.AdminAddr() + "/readyz",
			Flags:    sec.RegisterFlags,
			Security: func() Security { return *sec },
		}
	}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want int
	}{
		{"CA flag", []string{"healthcheck", url, "--tls-ca", ca}, nil, 0},
		{"CA from the environment", []string{"healthcheck", url}, map[string]string{"CRESCENT_TLS_CA": ca}, 0},
		{"default URL becomes https with TLS", []string{"healthcheck"}, map[string]string{
			"CRESCENT_TLS_CA": ca, "CRESCENT_TLS_CERT": s.creds.Cert, "CRESCENT_TLS_KEY": s.creds.Key}, 0},
		{"no CA", []string{"healthcheck", url}, nil, 1},
		{"plain http to the HTTPS port", []string{"healthcheck", "http://" + s.AdminAddr() + "/readyz"}, nil, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sec := DefaultSecurity()
			var out bytes.Buffer
			lookup := func(k string) (string, bool) { v, ok := tt.env[k]; return v, ok }
			if got := Main(proc(&sec), tt.args, lookup, &out); got != tt.want {
				t.Fatalf("exit code: got %d, want %d (output %q)", got, tt.want, out.String())
			}
		})
	}
}

// TestCheckTable is the helper every server's table test uses.
func TestCheckTable(t *testing.T) {
	sd := &testgrpc.TestService_ServiceDesc
	full := auth.Table{}
	for _, m := range sd.Methods {
		full["/"+sd.ServiceName+"/"+m.MethodName] = auth.Rule{Any: true}
	}
	for _, st := range sd.Streams {
		full["/"+sd.ServiceName+"/"+st.StreamName] = auth.Rule{Any: true}
	}
	if err := CheckTable(full, sd); err != nil {
		t.Fatalf("a complete table: %v", err)
	}
	if err := CheckTable(testTable, sd); err == nil || !strings.Contains(err.Error(), "StreamingOutputCall has no rule") {
		t.Fatalf("an incomplete table: got %v, want StreamingOutputCall reported", err)
	}
	full["/grpc.testing.TestService/Gone"] = auth.Rule{Any: true}
	if err := CheckTable(full, sd); err == nil || !strings.Contains(err.Error(), "Gone") {
		t.Fatalf("a stray rule: got %v, want it reported", err)
	}
	wild := auth.Table{"/grpc.testing.TestService/*": {Any: true}}
	if err := CheckTable(wild, sd); err == nil {
		t.Fatal("a wildcard passed as a rule for every method")
	}
}

// TestSilentConnectionCut: a peer that connects to the TLS gRPC port and
// never says anything is dropped after HandshakeTimeout, not grpc-go's
// default two minutes.
func TestSilentConnectionCut(t *testing.T) {
	old := HandshakeTimeout
	HandshakeTimeout = 300 * time.Millisecond
	t.Cleanup(func() { HandshakeTimeout = old })
	s := secureServer(t, load(t, security(t, auth.RoleMaster, "master-1", false)))
	c, err := net.Dial("tcp", s.GRPCAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	start := time.Now()
	_, err = io.ReadAll(c) // the server closes; nothing was sent
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("a silent connection was still open after %v", time.Since(start))
	}
}
