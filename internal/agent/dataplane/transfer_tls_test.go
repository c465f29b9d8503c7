package dataplane

import (
	"bytes"
	"crypto/tls"
	"net"
	"path/filepath"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The transfer listener behind TLS (issue 14): the agent app wraps it in
// crypto/tls with internal/auth's ServerTLS; ServeTransfer completes each
// handshake and knows the caller by its certificate. The test tokens
// (xenv.item) are for tenant "t".

// wrappers are the two ways the agent app may put its transfer listener
// behind TLS: xfer.TLSListener (records gathered into fewer writes and
// reads) and crypto/tls's own.
var wrappers = []struct {
	name string
	wrap func(net.Listener, *tls.Config) net.Listener
}{
	{"xfer.TLSListener", xfer.TLSListener},
	{"tls.NewListener", tls.NewListener},
}

// tlsEnv is a transfer listener behind TLS (wrap) with devcerts
// certificates in dir, and clientAuth as the agent app would choose it.
func tlsEnv(t *testing.T, wrap func(net.Listener, *tls.Config) net.Listener, clientAuth tls.ClientAuthType) (e *xenv, dir string) {
	t.Helper()
	dir = t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Agents: []string{"host-a"}, Tenants: []string{"t", "u"}, Admins: []string{}}); err != nil {
		t.Fatal(err)
	}
	src, err := auth.NewSource(devcerts.FilesFor(dir, auth.RoleAgent, "host-a"), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := TransferConfig{TrustDomain: devcerts.DefaultTrustDomain, IOTimeout: 2 * time.Second}
	e = startTransferOn(t, cfg, func(l net.Listener) net.Listener { return wrap(l, src.ServerTLS(clientAuth)) })
	return e, dir
}

// pool is a transfer client with role/name's certificate.
func tlsPool(t *testing.T, dir string, role auth.Role, name string) *xfer.Pool {
	t.Helper()
	f := devcerts.FilesFor(dir, role, name)
	if name == "" {
		f = auth.Files{CA: filepath.Join(dir, "ca.pem")}
	}
	src, err := auth.NewSource(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := xfer.NewPool(xfer.Config{TLS: src.ClientTLS(""), DialTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func TestTransferTLS(t *testing.T) {
	for _, w := range wrappers {
		t.Run(w.name, func(t *testing.T) { testTransferTLS(t, w.wrap) })
	}
}

func testTransferTLS(t *testing.T, wrap func(net.Listener, *tls.Config) net.Listener) {
	e, dir := tlsEnv(t, wrap, tls.RequireAndVerifyClientCert)
	data := bytes.Repeat([]byte("mTLS"), 300<<10) // 1.2 MiB: several records, more than one ioStep read
	id := e.reserve(t, e.mem, uint64(len(data)))
	write := func(p *xfer.Pool) error {
		errs, err := p.Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write)}, [][]byte{data})
		if err == nil {
			err = errs[0]
		}
		return err
	}
	read := func(p *xfer.Pool) ([]byte, error) {
		got := make([]byte, len(data))
		res, err := p.Read(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Read)}, [][]byte{got})
		if err == nil {
			err = res[0].Err
		}
		return got, err
	}
	owner, other := tlsPool(t, dir, auth.RoleTenant, "t"), tlsPool(t, dir, auth.RoleTenant, "u")

	// A tenant certificate of another tenant than the token's is refused,
	// item by item, on both operations.
	wantErr(t, write(other), codes.PermissionDenied, "INVALID_TOKEN")
	if err := write(owner); err != nil {
		t.Fatalf("the owner's write: %v", err)
	}
	seal(t, e.mem, id, data)
	_, err := read(other)
	wantErr(t, err, codes.PermissionDenied, "INVALID_TOKEN")
	for _, p := range []*xfer.Pool{owner, tlsPool(t, dir, auth.RoleAgent, "host-a")} {
		got, err := read(p)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read over TLS: %v (equal %v)", err, bytes.Equal(got, data))
		}
	}
}

// A caller the listener cannot know is turned away whole, and ServeTransfer
// leaves no goroutine behind (goleak in TestMain).
func TestTransferTLSRefusals(t *testing.T) {
	other := t.TempDir()
	if err := devcerts.Init(other, devcerts.Options{}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		clientAuth tls.ClientAuthType
		pool       func(t *testing.T, dir string) *xfer.Pool
		code       codes.Code
	}{
		{"plaintext client", tls.RequireAndVerifyClientCert, func(*testing.T, string) *xfer.Pool {
			p := xfer.NewPool(xfer.Config{DialTimeout: 2 * time.Second})
			t.Cleanup(func() { _ = p.Close() })
			return p
		}, codes.Unavailable},
		{"certificate of another CA", tls.RequireAndVerifyClientCert, func(t *testing.T, _ string) *xfer.Pool {
			return tlsPool(t, other, auth.RoleTenant, auth.DefaultTenant)
		}, codes.Unavailable},
		// The agent app may let certificate-less clients finish the
		// handshake (bearer tokens on its gRPC port): the transfer
		// listener still wants a principal.
		{"no client certificate", tls.VerifyClientCertIfGiven, func(t *testing.T, dir string) *xfer.Pool {
			return tlsPool(t, dir, auth.RoleTenant, "")
		}, codes.Unauthenticated},
	} {
		for _, w := range wrappers {
			t.Run(w.name+"/"+tc.name, func(t *testing.T) {
				e, dir := tlsEnv(t, w.wrap, tc.clientAuth)
				id := e.reserve(t, e.mem, 10)
				_, err := tc.pool(t, dir).Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write)}, [][]byte{make([]byte, 10)})
				if status.Code(err) != tc.code {
					t.Fatalf("Write = %v (code %v), want %v", err, status.Code(err), tc.code)
				}
				if tc.code == codes.Unavailable && rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
					t.Fatalf("Write = %v, want AGENT_UNAVAILABLE", err)
				}
			})
		}
	}
}

// A client that connects and never completes the handshake is cut after
// IOTimeout.
func TestTransferTLSHandshakeTimeout(t *testing.T) {
	e, _ := tlsEnv(t, xfer.TLSListener, tls.RequireAndVerifyClientCert)
	c, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	var b [1]byte
	if _, err := c.Read(b[:]); err == nil {
		t.Fatal("the agent answered a connection that sent nothing")
	}
	if d := time.Since(start); d > 8*time.Second {
		t.Fatalf("a silent connection was kept %v (IOTimeout 2s)", d)
	}
}
