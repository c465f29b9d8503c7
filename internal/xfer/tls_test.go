package xfer

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// certs writes a development CA and certificates (devcerts) into a
// temporary directory: agent "a" (a server certificate for localhost and
// 127.0.0.1) and tenant "t".
func certs(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Agents: []string{"a"}, Tenants: []string{"t"}, Admins: []string{}, Gateways: []string{}, Masters: []string{}}); err != nil {
		t.Fatal(err)
	}
	return dir
}

func source(t *testing.T, f auth.Files) *auth.Source {
	t.Helper()
	s, err := auth.NewSource(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// listeners are the two ways an agent may wrap its transfer listener.
var listeners = []struct {
	name string
	wrap func(net.Listener, *tls.Config) net.Listener
}{
	{"TLSListener", TLSListener},
	{"tls.NewListener", tls.NewListener},
}

// tlsListener listens on 127.0.0.1 with the agent's certificate, requiring
// a client certificate.
func tlsListener(t *testing.T, dir string, wrap func(net.Listener, *tls.Config) net.Listener) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := source(t, devcerts.FilesFor(dir, auth.RoleAgent, "a"))
	return wrap(lis, srv.ServerTLS(tls.RequireAndVerifyClientCert))
}

func TestTLSWriteRead(t *testing.T) {
	for _, l := range listeners {
		t.Run(l.name, func(t *testing.T) { testTLSWriteRead(t, l.wrap) })
	}
}

func testTLSWriteRead(t *testing.T, wrap func(net.Listener, *tls.Config) net.Listener) {
	dir := certs(t)
	s := newStore()
	var peer atomic.Value // auth.Principal
	a := startFakeOn(t, tlsListener(t, dir, wrap), func(c net.Conn, br *bufio.Reader) error {
		if tc, ok := c.(*tls.Conn); ok {
			cs := tc.ConnectionState()
			p, _ := auth.CertPrincipal(&cs, devcerts.DefaultTrustDomain)
			peer.Store(p)
		}
		return s.handle(c, br)
	})
	cli := source(t, devcerts.FilesFor(dir, auth.RoleTenant, "t"))
	for _, ep := range []string{a.addr(), "localhost:" + portOf(t, a.addr())} {
		t.Run(ep, func(t *testing.T) {
			p := NewPool(Config{TLS: cli.ClientTLS("")})
			defer p.Close()
			src := [][]byte{[]byte("hello"), bytes.Repeat([]byte{7}, 3<<20)}
			if errs, err := p.Write(t.Context(), ep, items(1, 2), src); err != nil || errs[0] != nil || errs[1] != nil {
				t.Fatalf("Write = %v, %v", errs, err)
			}
			dst := [][]byte{make([]byte, 5), make([]byte, 3<<20)}
			res, err := p.Read(t.Context(), ep, items(1, 2), dst)
			if err != nil || res[0].Err != nil || res[1].Err != nil || !bytes.Equal(dst[0], src[0]) || !bytes.Equal(dst[1], src[1]) {
				t.Fatalf("Read = %+v, %v", res, err)
			}
			if want := (auth.Principal{TrustDomain: devcerts.DefaultTrustDomain, Role: auth.RoleTenant, Name: "t"}); peer.Load() != want {
				t.Fatalf("the agent saw %v, want %v", peer, want)
			}
		})
	}
}

func portOf(t *testing.T, addr string) string {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// A server the client cannot verify (another CA; a name its certificate
// does not hold), a client the server refuses (no certificate), and a
// plaintext client: each call fails UNAVAILABLE AGENT_UNAVAILABLE, and
// nothing is left running (goleak in TestMain).
func TestTLSFailures(t *testing.T) {
	dir, other := certs(t), certs(t)
	good := source(t, devcerts.FilesFor(dir, auth.RoleTenant, "t"))
	strange := source(t, devcerts.FilesFor(other, auth.RoleTenant, "t"))
	noCert := source(t, auth.Files{CA: filepath.Join(dir, "ca.pem")})
	for _, l := range listeners {
		a := startFakeOn(t, tlsListener(t, dir, l.wrap), newStore().handle)
		for _, tc := range []struct {
			name string
			cfg  *tls.Config
		}{
			{"server of another CA", strange.ClientTLS("")},
			{"server name not in its certificate", good.ClientTLS("agent.example")},
			{"no client certificate", noCert.ClientTLS("")},
			{"plaintext client", nil},
		} {
			t.Run(l.name+"/"+tc.name, func(t *testing.T) {
				p := NewPool(Config{TLS: tc.cfg, DialTimeout: 2 * time.Second})
				defer p.Close()
				// Without an alert that gets through, the client would wait
				// for the context's end.
				ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
				defer cancel()
				_, err := p.Write(ctx, a.addr(), items(1), [][]byte{[]byte("x")})
				if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" || status.Code(err) != codes.Unavailable {
					t.Fatalf("Write = %v, want UNAVAILABLE AGENT_UNAVAILABLE", err)
				}
			})
		}
	}
}

// A listener that accepts and never answers the handshake: the call fails
// within DialTimeout.
func TestTLSHandshakeTimeout(t *testing.T) {
	dir := certs(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := lis.Accept()
		if err == nil {
			accepted <- c // held open, never read
		}
		close(accepted)
	}()
	t.Cleanup(func() {
		_ = lis.Close()
		for c := range accepted {
			_ = c.Close()
		}
	})
	p := NewPool(Config{TLS: source(t, devcerts.FilesFor(dir, auth.RoleTenant, "t")).ClientTLS(""), DialTimeout: 300 * time.Millisecond})
	defer p.Close()
	start := time.Now()
	_, err = p.Read(t.Context(), lis.Addr().String(), items(1), [][]byte{nil})
	d := time.Since(start)
	if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("Read = %v, want AGENT_UNAVAILABLE", err)
	}
	if d < 300*time.Millisecond || d > 5*time.Second {
		t.Fatalf("the handshake failed after %v, DialTimeout is 300ms", d)
	}
}

func TestClientTLS(t *testing.T) {
	var seen string
	base := &tls.Config{VerifyConnection: func(cs tls.ConnectionState) error { seen = cs.ServerName; return nil }}
	for _, tc := range []struct{ endpoint, want string }{
		{"10.0.0.1:7", "10.0.0.1"}, {"[::1]:7", "::1"}, {"agent-1:7", "agent-1"}, {"agent-1", "agent-1"},
	} {
		c := ClientTLS(base, tc.endpoint)
		seen = ""
		if err := c.VerifyConnection(tls.ConnectionState{}); err != nil || c.ServerName != tc.want || seen != tc.want {
			t.Errorf("ClientTLS(%q): ServerName %q, verified as %q, want %q", tc.endpoint, c.ServerName, seen, tc.want)
		}
	}
	named := ClientTLS(&tls.Config{ServerName: "fixed"}, "10.0.0.1:7")
	if named.ServerName != "fixed" || named.VerifyConnection != nil {
		t.Errorf("a configured ServerName is kept: got %q", named.ServerName)
	}
}

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int32
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// Between Gather and Flush, a TLS connection's records leave in writes of
// up to batchSize; outside, one write per record, as crypto/tls makes them.
func TestGatherBatchesRecords(t *testing.T) {
	dir := certs(t)
	lis := tlsListener(t, dir, TLSListener)
	defer lis.Close()
	const size = 1 << 20
	got := make(chan int, 2)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			close(got)
			return
		}
		defer c.Close()
		buf := make([]byte, size)
		for range 2 {
			_, err := io.ReadFull(c, buf)
			if err != nil {
				break
			}
			got <- size
		}
		close(got)
	}()
	raw, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cc := &countingConn{Conn: raw}
	tc := tls.Client(newBatchConn(cc), ClientTLS(source(t, devcerts.FilesFor(dir, auth.RoleTenant, "t")).ClientTLS(""), lis.Addr().String()))
	defer tc.Close()
	if err := tc.HandshakeContext(t.Context()); err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, size)
	for _, gather := range []bool{true, false} {
		before := cc.writes.Load()
		if gather {
			Gather(tc)
		}
		if _, err := tc.Write(payload); err != nil {
			t.Fatal(err)
		}
		if err := Flush(tc); err != nil {
			t.Fatal(err)
		}
		if n := <-got; n != size {
			t.Fatal("the server did not read the payload")
		}
		writes := cc.writes.Load() - before
		if gather && writes > size/batchSize+1 || !gather && writes < size/(16<<10) {
			t.Errorf("gather %v: %d writes for %d bytes", gather, writes, size)
		}
	}
}
