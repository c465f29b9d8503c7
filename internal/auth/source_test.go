package auth_test

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"math/big"
	"strings"
	"sync"
	"testing"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
)

// tlsServer accepts TLS connections on loopback, completes the handshake and
// records the client's principal; it stops with the test.
type tlsServer struct {
	addr string
	mu   sync.Mutex
	seen []auth.Principal // guarded by mu
}

func serveTLS(t *testing.T, cfg *tls.Config) *tlsServer {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := &tlsServer{addr: ln.Addr().String()}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				tc := c.(*tls.Conn)
				if tc.HandshakeContext(t.Context()) != nil {
					return
				}
				cs := tc.ConnectionState()
				p, _ := auth.CertPrincipal(&cs, td)
				s.mu.Lock()
				s.seen = append(s.seen, p)
				s.mu.Unlock()
				_, _ = tc.Write([]byte{1}) // the client waits for it: the handshake is done on both sides
				_, _ = io.Copy(io.Discard, tc)
			})
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return s
}

func (s *tlsServer) principals() []auth.Principal {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]auth.Principal(nil), s.seen...)
}

// dial handshakes with cfg and returns the server leaf's serial.
func dial(t *testing.T, addr string, cfg *tls.Config) (*big.Int, error) {
	t.Helper()
	c, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return nil, err // the server refused our certificate after the handshake (TLS 1.3)
	}
	return c.ConnectionState().PeerCertificates[0].SerialNumber, nil
}

func serial(t *testing.T, f auth.Files) *big.Int {
	t.Helper()
	return keyPair(t, f).Leaf.SerialNumber
}

func TestSourceReloadServerCert(t *testing.T) {
	k := newPKI(t)
	srvFiles := k.principal(auth.RoleMaster, "m1")
	var logs logBuf
	srv := source(t, srvFiles, newLogger(&logs))
	srv.SetReloadCheck(0)
	s := serveTLS(t, srv.ServerTLS(tls.RequireAndVerifyClientCert))
	cli := source(t, k.principal(auth.RoleAgent, "a1"), nil)

	first := serial(t, srvFiles)
	got, err := dial(t, s.addr, cli.ClientTLS("localhost"))
	if err != nil {
		t.Fatal(err)
	}
	if got.Cmp(first) != 0 {
		t.Fatalf("serial %v, want %v", got, first)
	}

	// Replace the files (as a rotation does): the next handshake sees the new certificate.
	next := k.principal(auth.RoleMaster, "m1")
	second := serial(t, next)
	if got, err = dial(t, s.addr, cli.ClientTLS("localhost")); err != nil {
		t.Fatal(err)
	}
	if got.Cmp(second) != 0 {
		t.Fatalf("after rotation serial %v, want %v", got, second)
	}
	if srv.Reloads() != 1 {
		t.Errorf("Reloads = %d, want 1", srv.Reloads())
	}

	// A bad key: logged, the old material kept.
	k.write("master-m1-key.pem", []byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"))
	for range 2 {
		if got, err = dial(t, s.addr, cli.ClientTLS("localhost")); err != nil {
			t.Fatal(err)
		}
		if got.Cmp(second) != 0 {
			t.Fatalf("after a bad file serial %v, want %v (kept)", got, second)
		}
	}
	if srv.Reloads() != 1 {
		t.Errorf("Reloads = %d after a bad file, want 1", srv.Reloads())
	}
	if n := len(logs.lines("tls material reload failed")); n != 1 {
		t.Errorf("%d reload-failed lines, want 1\n%s", n, logs.String())
	}
	want := auth.Principal{TrustDomain: td, Role: auth.RoleAgent, Name: "a1"}
	for _, p := range s.principals() {
		if p != want {
			t.Errorf("server saw client %v, want %v", p, want)
		}
	}
}

func TestSourceReloadCA(t *testing.T) {
	k := newPKI(t)
	srv := source(t, k.principal(auth.RoleMaster, "m1"), nil)
	srv.SetReloadCheck(0)
	s := serveTLS(t, srv.ServerTLS(tls.RequireAndVerifyClientCert))
	cliFiles := k.principal(auth.RoleAgent, "a1")
	cli := source(t, cliFiles, nil)
	cli.SetReloadCheck(0)
	if _, err := dial(t, s.addr, cli.ClientTLS("localhost")); err != nil {
		t.Fatal(err)
	}

	// A new CA on both sides; the client's old certificate is refused, the new one works.
	other := newPKI(t)
	k.write("ca.pem", other.ca.CertPEM)
	if _, err := dial(t, s.addr, cli.ClientTLS("localhost")); err == nil {
		t.Fatal("the client verified a server whose CA it no longer trusts")
	}
	k.ca = other.ca
	k.principal(auth.RoleMaster, "m1")
	old := &tls.Config{Certificates: []tls.Certificate{keyPair(t, cliFiles)}, RootCAs: k.pool(), ServerName: "localhost", MinVersion: tls.VersionTLS13}
	if _, err := dial(t, s.addr, old); err == nil {
		t.Fatal("the server accepted a client certificate of the CA it no longer trusts")
	}
	k.principal(auth.RoleAgent, "a1")
	if _, err := dial(t, s.addr, cli.ClientTLS("localhost")); err != nil {
		t.Fatalf("after both sides rotated: %v", err)
	}
}

func TestClientVerifiesServer(t *testing.T) {
	k := newPKI(t)
	srv := source(t, k.principal(auth.RoleMaster, "m1"), nil)
	s := serveTLS(t, srv.ServerTLS(tls.VerifyClientCertIfGiven))
	caOnly := source(t, auth.Files{CA: k.dir + "/ca.pem"}, nil)
	agent := source(t, k.principal(auth.RoleAgent, "a1"), nil)
	tests := []struct {
		name    string
		cfg     *tls.Config
		wantErr string
	}{
		{"ca only, by name", caOnly.ClientTLS("localhost"), ""},
		{"by ip", caOnly.ClientTLS("127.0.0.1"), ""},
		{"wrong name", caOnly.ClientTLS("example.com"), "certificate is valid for"},
		{"expect master", agent.ClientTLSExpect("localhost", auth.ServerIdentity{TrustDomain: td, Roles: []auth.Role{auth.RoleMaster}}), ""},
		{"expect gateway", agent.ClientTLSExpect("localhost", auth.ServerIdentity{TrustDomain: td, Roles: []auth.Role{auth.RoleGateway}}), "want role"},
		{"expect other domain", agent.ClientTLSExpect("localhost", auth.ServerIdentity{TrustDomain: "other"}), "trust domain"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := dial(t, s.addr, tt.cfg)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want %q", err, tt.wantErr)
			}
		})
	}
	// No name and an IP address: nothing to verify against, so no connection.
	c, err := tls.Dial("tcp", s.addr, caOnly.ClientTLS(""))
	if err == nil {
		c.Close()
		t.Fatal("connected without a server name to verify")
	}
}

func TestNewSourceErrors(t *testing.T) {
	k := newPKI(t)
	good := k.principal(auth.RoleAgent, "a")
	expired := k.leaf("expired", devcerts.Leaf{URIs: []string{"spiffe://" + td + "/agent/x"}, ClientAuth: true, Validity: 1})
	tests := []struct {
		name string
		f    auth.Files
	}{
		{"none", auth.Files{}},
		{"no ca", auth.Files{Cert: good.Cert, Key: good.Key}},
		{"cert without key", auth.Files{CA: good.CA, Cert: good.Cert}},
		{"missing file", auth.Files{CA: good.CA + ".missing"}},
		{"ca is a key", auth.Files{CA: good.Key}},
		{"key mismatch", auth.Files{CA: good.CA, Cert: good.Cert, Key: expired.Key}},
		{"expired", expired},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := auth.NewSource(tt.f, nil); err == nil {
				t.Fatal("NewSource succeeded")
			}
		})
	}
	if (auth.Files{}).Enabled() || !good.Enabled() {
		t.Error("Enabled wrong")
	}
}

func TestCertPrincipalNeedsVerifiedChain(t *testing.T) {
	if _, ok := auth.CertPrincipal(nil, td); ok {
		t.Error("nil state has a principal")
	}
	k := newPKI(t)
	kp := keyPair(t, k.principal(auth.RoleAdmin, "x"))
	cs := &tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{kp.Leaf}}
	if _, ok := auth.CertPrincipal(cs, td); ok {
		t.Error("an unverified certificate gave a principal")
	}
	cs.VerifiedChains = [][]*x509.Certificate{{kp.Leaf}}
	if p, ok := auth.CertPrincipal(cs, td); !ok || p.Name != "x" {
		t.Errorf("verified chain: %v, %v", p, ok)
	}
	if _, ok := auth.CertPrincipal(cs, "other"); ok {
		t.Error("principal outside the trust domain")
	}
}
