package auth_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// The test service: hand-written descriptors over real generated messages.
// Every method answers with the caller's principal in Key.
const (
	svc       = "/crescent.test.v1.Echo/"
	mTenant   = svc + "Tenant"   // Tenant rule, tenant+admin
	mBatch    = svc + "Batch"    // Tenant rule on BatchExistRequest items
	mAdmin    = svc + "Admin"    // admin only, audited
	mAny      = svc + "Any"      // any principal
	mUnlisted = svc + "Unlisted" // not in the table
	mStream   = svc + "Stream"   // bidi, Tenant rule
)

func principalOf(ctx context.Context) string {
	p, _ := auth.FromContext(ctx)
	return p.String()
}

func unary[Req any, PReq interface {
	*Req
	any
}](method string) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: strings.TrimPrefix(method, svc),
		Handler: func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
			in := PReq(new(Req))
			if err := dec(in); err != nil {
				return nil, err
			}
			h := func(ctx context.Context, _ any) (any, error) {
				return &masterv1.GetSizeRequest{Key: principalOf(ctx)}, nil
			}
			return ic(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: method}, h)
		},
	}
}

var echoDesc = grpc.ServiceDesc{
	ServiceName: "crescent.test.v1.Echo",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{
		unary[masterv1.GetSizeRequest](mTenant),
		unary[masterv1.BatchExistRequest](mBatch),
		unary[masterv1.GetSizeRequest](mAdmin),
		unary[masterv1.GetSizeRequest](mAny),
		unary[masterv1.GetSizeRequest](mUnlisted),
	},
	Streams: []grpc.StreamDesc{{
		StreamName: "Stream", ClientStreams: true, ServerStreams: true,
		Handler: func(_ any, ss grpc.ServerStream) error {
			for {
				var in masterv1.GetSizeRequest
				if err := ss.RecvMsg(&in); err != nil {
					if errors.Is(err, io.EOF) {
						return nil
					}
					return err
				}
				if err := ss.SendMsg(&masterv1.GetSizeRequest{Key: principalOf(ss.Context()), Tenant: in.GetTenant()}); err != nil {
					return err
				}
			}
		},
	}},
}

var table = auth.Table{
	mTenant: {Roles: []auth.Role{auth.RoleTenant, auth.RoleAdmin}, Tenant: true},
	mBatch:  {Roles: []auth.Role{auth.RoleTenant, auth.RoleAdmin}, Tenant: true},
	mAdmin:  {Roles: []auth.Role{auth.RoleAdmin}, Audit: true},
	mAny:    {Any: true},
	mStream: {Roles: []auth.Role{auth.RoleTenant}, Tenant: true},
}

type cluster struct {
	k    *pki
	addr string
	logs *logBuf
}

// startGRPC serves the echo service and health behind an Authorizer.
func startGRPC(t *testing.T, opts auth.Options, creds credentials.TransportCredentials) *cluster {
	t.Helper()
	c := &cluster{logs: &logBuf{}}
	opts.Logger = newLogger(c.logs)
	a, err := auth.NewAuthorizer(opts)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(creds), grpc.ChainUnaryInterceptor(a.Unary()), grpc.ChainStreamInterceptor(a.Stream()))
	gs.RegisterService(&echoDesc, struct{}{})
	healthpb.RegisterHealthServer(gs, health.NewServer())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c.addr = ln.Addr().String()
	var wg sync.WaitGroup
	wg.Go(func() { _ = gs.Serve(ln) })
	t.Cleanup(func() { gs.Stop(); wg.Wait() })
	return c
}

// startSecure is startGRPC with mTLS (client certificate optional, so
// bearer tokens work too) and the standard table.
func startSecure(t *testing.T, tokens *auth.Tokens) *cluster {
	t.Helper()
	k := newPKI(t)
	srv := source(t, k.principal(auth.RoleMaster, "m1"), nil)
	c := startGRPC(t, auth.Options{TrustDomain: td, Table: table, Tokens: tokens, Public: []string{"/grpc.health.v1.Health/*"}},
		srv.ServerCredentials(tls.VerifyClientCertIfGiven))
	c.k = k
	return c
}

func dialGRPC(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// as connects with a certificate for role/name.
func (c *cluster) as(t *testing.T, role auth.Role, name string) *grpc.ClientConn {
	s := source(t, c.k.principal(role, name), nil)
	return dialGRPC(t, c.addr, grpc.WithTransportCredentials(s.ClientCredentials("", auth.ServerIdentity{})))
}

// withCert connects with an arbitrary certificate (one Source would refuse).
func (c *cluster) withCert(t *testing.T, cert tls.Certificate) *grpc.ClientConn {
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: c.k.pool(), ServerName: "localhost", MinVersion: tls.VersionTLS13}
	return dialGRPC(t, c.addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
}

func call(t *testing.T, cc *grpc.ClientConn, method string, req any) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var out masterv1.GetSizeRequest
	err := cc.Invoke(ctx, method, req, &out)
	return out.GetKey(), err
}

func wantCode(t *testing.T, err error, code codes.Code, substr string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("code = %v (%v), want %v", got, err, code)
	}
	if substr != "" && !strings.Contains(status.Convert(err).Message(), substr) {
		t.Fatalf("message %q does not contain %q", status.Convert(err).Message(), substr)
	}
}

func TestAuthorizeUnary(t *testing.T) {
	c := startSecure(t, nil)
	tenantA, admin, agent := c.as(t, auth.RoleTenant, "a"), c.as(t, auth.RoleAdmin, "ops"), c.as(t, auth.RoleAgent, "h1")
	tenantDefault := c.as(t, auth.RoleTenant, "default")
	get := func(tenant string) *masterv1.GetSizeRequest {
		return &masterv1.GetSizeRequest{Tenant: tenant, Key: "k"}
	}
	tests := []struct {
		name   string
		cc     *grpc.ClientConn
		method string
		req    any
		code   codes.Code
		msg    string
	}{
		{"tenant own", tenantA, mTenant, get("a"), codes.OK, ""},
		{"tenant other", tenantA, mTenant, get("b"), codes.PermissionDenied, `request tenant "b" is not the caller's tenant "a"`},
		{"tenant empty is default", tenantA, mTenant, get(""), codes.PermissionDenied, `request tenant ""`},
		{"default tenant, empty", tenantDefault, mTenant, get(""), codes.OK, ""},
		{"admin any tenant", admin, mTenant, get("b"), codes.OK, ""},
		{"agent not listed", agent, mTenant, get("a"), codes.PermissionDenied, "role agent is not allowed"},
		{"batch own", tenantA, mBatch, &masterv1.BatchExistRequest{Items: []*masterv1.ExistRequest{{Tenant: "a"}, {Tenant: "a"}}}, codes.OK, ""},
		{"batch one other", tenantA, mBatch, &masterv1.BatchExistRequest{Items: []*masterv1.ExistRequest{{Tenant: "a"}, {Tenant: "b"}}}, codes.PermissionDenied, `"b"`},
		{"batch empty", tenantA, mBatch, &masterv1.BatchExistRequest{}, codes.OK, ""},
		{"admin only: tenant", tenantA, mAdmin, get("a"), codes.PermissionDenied, "spiffe://crescent.test/tenant/a may not call " + mAdmin},
		{"admin only: admin", admin, mAdmin, get(""), codes.OK, ""},
		{"any: agent", agent, mAny, get(""), codes.OK, ""},
		{"default deny", admin, mUnlisted, get(""), codes.PermissionDenied, "not in the authorization table"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			who, err := call(t, tt.cc, tt.method, tt.req)
			wantCode(t, err, tt.code, tt.msg)
			if err == nil && !strings.HasPrefix(who, "spiffe://"+td+"/") {
				t.Errorf("handler saw principal %q", who)
			}
		})
	}
}

func TestAuthenticateCertificates(t *testing.T) {
	c := startSecure(t, nil)
	uri := func(tdom, role, name string) string { return "spiffe://" + tdom + "/" + role + "/" + name }
	issue := func(name string, l devcerts.Leaf) tls.Certificate {
		l.ClientAuth = true
		return keyPair(t, c.k.leaf(name, l))
	}
	otherCA := newPKI(t)
	tests := []struct {
		name string
		cert tls.Certificate
		code codes.Code
		msg  string
	}{
		{"good", issue("good", devcerts.Leaf{URIs: []string{uri(td, "admin", "x")}}), codes.OK, ""},
		{"wrong trust domain", issue("wtd", devcerts.Leaf{URIs: []string{uri("evil.test", "admin", "x")}}), codes.Unauthenticated, "trust domain"},
		{"no SAN", issue("nosan", devcerts.Leaf{CommonName: "admin"}), codes.Unauthenticated, "0 URI SANs"},
		{"two SANs", issue("two", devcerts.Leaf{URIs: []string{uri(td, "admin", "x"), uri(td, "tenant", "a")}}), codes.Unauthenticated, "2 URI SANs"},
		{"not spiffe", issue("http", devcerts.Leaf{URIs: []string{"https://" + td + "/admin/x"}}), codes.Unauthenticated, "URI SAN"},
		{"unknown role", issue("role", devcerts.Leaf{URIs: []string{uri(td, "root", "x")}}), codes.Unauthenticated, "unknown role"},
		{"expired", issue("expired", devcerts.Leaf{URIs: []string{uri(td, "admin", "x")}, NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour)}), codes.Unavailable, ""},
		{"other CA", func() tls.Certificate {
			return keyPair(t, otherCA.leaf("x", devcerts.Leaf{URIs: []string{uri(td, "admin", "x")}, ClientAuth: true}))
		}(), codes.Unavailable, ""},
		{"server-only EKU", keyPair(t, c.k.leaf("srvonly", devcerts.Leaf{URIs: []string{uri(td, "admin", "x")}, ServerAuth: true})), codes.Unavailable, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			who, err := call(t, c.withCert(t, tt.cert), mAdmin, &masterv1.GetSizeRequest{})
			wantCode(t, err, tt.code, tt.msg)
			if err == nil && who != uri(td, "admin", "x") {
				t.Errorf("principal %q", who)
			}
		})
	}
	// No certificate and no token.
	caOnly := source(t, auth.Files{CA: c.k.dir + "/ca.pem"}, nil)
	cc := dialGRPC(t, c.addr, grpc.WithTransportCredentials(caOnly.ClientCredentials("", auth.ServerIdentity{})))
	_, err := call(t, cc, mAny, &masterv1.GetSizeRequest{})
	wantCode(t, err, codes.Unauthenticated, "no client certificate")
	// Public methods need nothing.
	if _, err := healthpb.NewHealthClient(cc).Check(t.Context(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("health check: %v", err)
	}
}

func TestBearerTokens(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/tokens"
	if err := devcerts.WriteFileAtomic(path, []byte(tokA+" spiffe://"+td+"/tenant/a\n"+tokB+" spiffe://elsewhere/admin/x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	toks, err := auth.LoadTokens(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := startSecure(t, toks)
	caOnly := source(t, auth.Files{CA: c.k.dir + "/ca.pem"}, nil)
	withToken := func(tok string) *grpc.ClientConn {
		return dialGRPC(t, c.addr, grpc.WithTransportCredentials(caOnly.ClientCredentials("", auth.ServerIdentity{})), grpc.WithPerRPCCredentials(auth.BearerCredentials(tok)))
	}
	who, err := call(t, withToken(tokA), mTenant, &masterv1.GetSizeRequest{Tenant: "a"})
	wantCode(t, err, codes.OK, "")
	if who != "spiffe://"+td+"/tenant/a" {
		t.Errorf("principal %q", who)
	}
	_, err = call(t, withToken(tokA), mTenant, &masterv1.GetSizeRequest{Tenant: "b"})
	wantCode(t, err, codes.PermissionDenied, "")
	_, err = call(t, withToken("not-a-known-token-at-all"), mTenant, &masterv1.GetSizeRequest{Tenant: "a"})
	wantCode(t, err, codes.Unauthenticated, "unknown bearer token")
	_, err = call(t, withToken(tokB), mAdmin, &masterv1.GetSizeRequest{})
	wantCode(t, err, codes.Unauthenticated, "trust domain")

	// A server without a token file refuses them.
	c2 := startSecure(t, nil)
	ca2 := source(t, auth.Files{CA: c2.k.dir + "/ca.pem"}, nil)
	cc := dialGRPC(t, c2.addr, grpc.WithTransportCredentials(ca2.ClientCredentials("", auth.ServerIdentity{})), grpc.WithPerRPCCredentials(auth.BearerCredentials(tokA)))
	_, err = call(t, cc, mTenant, &masterv1.GetSizeRequest{Tenant: "a"})
	wantCode(t, err, codes.Unauthenticated, "not accepted")

	// The credentials refuse to travel in plaintext.
	if !auth.BearerCredentials(tokA).RequireTransportSecurity() {
		t.Error("BearerCredentials does not require transport security")
	}
}

func TestStreamTenantCheckedOnEveryMessage(t *testing.T) {
	c := startSecure(t, nil)
	cc := c.as(t, auth.RoleTenant, "a")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	st, err := cc.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, mStream)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.SendMsg(&masterv1.GetSizeRequest{Tenant: "a"}); err != nil {
		t.Fatal(err)
	}
	var out masterv1.GetSizeRequest
	if err := st.RecvMsg(&out); err != nil {
		t.Fatalf("first message: %v", err)
	}
	if out.GetKey() != "spiffe://"+td+"/tenant/a" {
		t.Errorf("stream handler saw principal %q", out.GetKey())
	}
	if err := st.SendMsg(&masterv1.GetSizeRequest{Tenant: "b"}); err != nil {
		t.Fatal(err)
	}
	err = st.RecvMsg(&out)
	wantCode(t, err, codes.PermissionDenied, `request tenant "b"`)

	// The role is checked when the stream opens.
	st2, err := c.as(t, auth.RoleAdmin, "ops").NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, mStream)
	if err != nil {
		t.Fatal(err)
	}
	_ = st2.SendMsg(&masterv1.GetSizeRequest{Tenant: "a"})
	wantCode(t, st2.RecvMsg(&out), codes.PermissionDenied, "role admin is not allowed")
}

func TestAuditLine(t *testing.T) {
	c := startSecure(t, nil)
	if _, err := call(t, c.as(t, auth.RoleAdmin, "ops"), mAdmin, &masterv1.GetSizeRequest{}); err != nil {
		t.Fatal(err)
	}
	_, err := call(t, c.as(t, auth.RoleTenant, "a"), mAdmin, &masterv1.GetSizeRequest{})
	wantCode(t, err, codes.PermissionDenied, "")
	lines := c.logs.lines(`"msg":"audit"`)
	if len(lines) != 2 {
		t.Fatalf("%d audit lines, want 2:\n%s", len(lines), c.logs.String())
	}
	type line struct{ Principal, Method, Outcome, Code, Reason string }
	want := []line{
		{"spiffe://" + td + "/admin/ops", mAdmin, "ok", "OK", ""},
		{"spiffe://" + td + "/tenant/a", mAdmin, "denied", "PermissionDenied", "role tenant is not allowed"},
	}
	for i, l := range lines {
		var got line
		if err := json.Unmarshal([]byte(l), &got); err != nil {
			t.Fatal(err)
		}
		if got != want[i] {
			t.Errorf("audit line %d = %+v, want %+v", i, got, want[i])
		}
	}
	// Calls outside audited methods write no audit line.
	if _, err := call(t, c.as(t, auth.RoleAgent, "h"), mAny, &masterv1.GetSizeRequest{}); err != nil {
		t.Fatal(err)
	}
	if n := len(c.logs.lines(`"msg":"audit"`)); n != 2 {
		t.Errorf("%d audit lines after an unaudited call, want 2", n)
	}
}

func TestDisabled(t *testing.T) {
	c := startGRPC(t, auth.Options{Disabled: true, Table: table}, insecure.NewCredentials())
	cc := dialGRPC(t, c.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	for _, m := range []string{mAdmin, mUnlisted, mTenant} {
		who, err := call(t, cc, m, &masterv1.GetSizeRequest{Tenant: "zzz"})
		if err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		if who != "admin/insecure" {
			t.Errorf("%s: principal %q, want admin/insecure", m, who)
		}
	}
}

func TestPlaintextWithoutDisabledIsUnauthenticated(t *testing.T) {
	c := startGRPC(t, auth.Options{TrustDomain: td, Table: table}, insecure.NewCredentials())
	cc := dialGRPC(t, c.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	_, err := call(t, cc, mAny, &masterv1.GetSizeRequest{})
	wantCode(t, err, codes.Unauthenticated, "no TLS")
}

func TestNewAuthorizerValidates(t *testing.T) {
	bad := []auth.Options{
		{TrustDomain: "", Table: auth.Table{}},
		{TrustDomain: "UPPER", Table: auth.Table{}},
		{TrustDomain: td, Table: auth.Table{"noslash": {Any: true}}},
		{TrustDomain: td, Table: auth.Table{"/svc/": {Any: true}}},
		{TrustDomain: td, Table: auth.Table{"/svc/a/b": {Any: true}}},
		{TrustDomain: td, Table: auth.Table{"/svc/a*": {Any: true}}},
		{TrustDomain: td, Table: auth.Table{"/svc/a": {}}},
		{TrustDomain: td, Table: auth.Table{"/svc/a": {Any: true, Roles: []auth.Role{auth.RoleAdmin}}}},
		{TrustDomain: td, Table: auth.Table{"/svc/a": {Roles: []auth.Role{"root"}}}},
		{TrustDomain: td, Table: auth.Table{"/svc/a": {Any: true}}, Public: []string{"/svc/a"}},
		{TrustDomain: td, Public: []string{"health"}},
	}
	for i, o := range bad {
		if _, err := auth.NewAuthorizer(o); err == nil {
			t.Errorf("options %d (%+v) accepted", i, o)
		}
	}
	if _, err := auth.NewAuthorizer(auth.Options{TrustDomain: td, Table: table, Public: []string{"/grpc.health.v1.Health/*"}}); err != nil {
		t.Error(err)
	}
	if _, err := auth.NewAuthorizer(auth.Options{Disabled: true}); err != nil {
		t.Error(err)
	}
}

func TestHTTP(t *testing.T) {
	k := newPKI(t)
	dir := t.TempDir()
	if err := devcerts.WriteFileAtomic(dir+"/tokens", []byte(tokA+" spiffe://"+td+"/admin/ci\n"+tokB+" spiffe://"+td+"/tenant/a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	toks, err := auth.LoadTokens(dir+"/tokens", nil)
	if err != nil {
		t.Fatal(err)
	}
	var logs logBuf
	a, err := auth.NewAuthorizer(auth.Options{TrustDomain: td, Tokens: toks, Logger: newLogger(&logs)})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	hello := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, principalOf(r.Context())) })
	mux.Handle("/debug/", a.HTTPAudit(hello, auth.RoleAdmin))
	mux.Handle("/metrics", a.HTTP(hello))

	srv := source(t, k.principal(auth.RoleMaster, "m1"), nil)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srv.ServerTLS(tls.VerifyClientCertIfGiven))
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	var wg sync.WaitGroup
	wg.Go(func() { _ = hs.Serve(ln) })
	t.Cleanup(func() { _ = hs.Close(); wg.Wait() })
	base := "https://localhost:" + strings.Split(ln.Addr().String(), ":")[1]

	client := func(f auth.Files) *http.Client {
		tr := &http.Transport{TLSClientConfig: source(t, f, nil).ClientTLS("localhost")}
		t.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr, Timeout: 10 * time.Second}
	}
	admin, tenant, none := client(k.principal(auth.RoleAdmin, "ops")), client(k.principal(auth.RoleTenant, "a")), client(auth.Files{CA: k.dir + "/ca.pem"})
	tests := []struct {
		name, path, token string
		c                 *http.Client
		code              int
		body              string
	}{
		{"admin cert", "/debug/pprof/", "", admin, 200, "spiffe://" + td + "/admin/ops"},
		{"tenant cert", "/debug/pprof/", "", tenant, 403, "role tenant is not allowed"},
		{"nothing", "/debug/pprof/", "", none, 401, "no client certificate"},
		{"admin token", "/debug/pprof/", tokA, none, 200, "spiffe://" + td + "/admin/ci"},
		{"tenant token", "/debug/pprof/", tokB, none, 403, ""},
		{"bad token", "/debug/pprof/", "nope-nope-nope-nope", none, 401, "unknown bearer token"},
		{"any role", "/metrics", "", tenant, 200, "spiffe://" + td + "/tenant/a"},
		{"any role, nothing", "/metrics", "", none, 401, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, _ := http.NewRequestWithContext(t.Context(), "GET", base+tt.path, nil)
			if tt.token != "" {
				req.Header.Set("Authorization", "Bearer "+tt.token)
			}
			resp, err := tt.c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.code || !strings.Contains(string(body), tt.body) {
				t.Fatalf("%d %q, want %d %q", resp.StatusCode, body, tt.code, tt.body)
			}
			if tt.code == 401 && resp.Header.Get("WWW-Authenticate") == "" {
				t.Error("401 without WWW-Authenticate")
			}
		})
	}
	if n := len(logs.lines(`"msg":"audit"`, `"method":"HTTP GET /debug/pprof/"`)); n != 6 {
		t.Errorf("%d HTTP audit lines, want 6:\n%s", n, logs.String())
	}
}
