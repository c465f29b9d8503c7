package auth

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// Files names PEM files: CA bundle (verifies peers), certificate chain and key.
// CA is required whenever any is set; Cert and Key go together (a client
// that authenticates with a bearer token has only CA).
type Files struct {
	CA, Cert, Key string
}

// Enabled reports whether any TLS file is configured.
func (f Files) Enabled() bool { return f.CA != "" || f.Cert != "" || f.Key != "" }

// Validate checks that the combination of files makes sense.
func (f Files) Validate() error {
	if !f.Enabled() {
		return errors.New("auth: no TLS files configured")
	}
	if f.CA == "" {
		return errors.New("auth: a CA bundle is required with TLS")
	}
	if (f.Cert == "") != (f.Key == "") {
		return errors.New("auth: certificate and key go together")
	}
	return nil
}

// material is one loaded, consistent file set; replaced whole on reload.
type material struct {
	roots *x509.CertPool
	cert  *tls.Certificate // nil without Cert/Key
}

// Source holds the loaded material and reloads it when the files change
// (checked on use at most once per ReloadCheck interval, DefaultReloadCheck
// unless SetReloadCheck says otherwise, by mtime+size and then a content
// hash; a bad new file set is logged and the old material kept). It starts
// no goroutine. Safe for concurrent use.
type Source struct {
	files   Files
	lg      *slog.Logger
	w       *watcher
	cur     atomic.Pointer[material]
	reloads atomic.Uint64
}

// NewSource loads f. A missing or bad file is an error here (at start);
// later, on reload, it is only logged.
func NewSource(f Files, lg *slog.Logger) (*Source, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	paths := []string{f.CA}
	if f.Cert != "" {
		paths = append(paths, f.Cert, f.Key)
	}
	s := &Source{files: f, lg: lg, w: newWatcher(maxFileBytes, paths...)}
	st, data, err := s.w.readAll()
	if err != nil {
		return nil, fmt.Errorf("auth: load TLS files: %w", err)
	}
	now := time.Now()
	m, err := parseMaterial(data, now)
	if err != nil {
		return nil, err
	}
	s.cur.Store(m)
	s.w.init(st, data, now)
	return s, nil
}

// SetReloadCheck sets how often, at most, the files are looked at; d <= 0
// means on every use (tests).
func (s *Source) SetReloadCheck(d time.Duration) {
	s.w.every.Store(int64(d))
	s.w.nextDue.Store(0)
}

// Reloads counts successful reloads (not the first load).
func (s *Source) Reloads() uint64 { return s.reloads.Load() }

// Files returns the file names s was built with.
func (s *Source) Files() Files { return s.files }

// material returns the current material, reloading first when due.
func (s *Source) material() *material {
	err := s.w.poll(time.Now(), func(data [][]byte) error {
		m, err := parseMaterial(data, time.Now())
		if err != nil {
			return err
		}
		s.cur.Store(m)
		n := s.reloads.Add(1)
		attrs := []any{"ca", s.files.CA, "reloads", n}
		if m.cert != nil {
			attrs = append(attrs, "cert", s.files.Cert, "not_after", m.cert.Leaf.NotAfter)
		}
		s.lg.Info("tls material reloaded", attrs...)
		return nil
	})
	if err != nil {
		s.lg.Warn("tls material reload failed; keeping the current material", "ca", s.files.CA, "cert", s.files.Cert, "err", err)
	}
	return s.cur.Load()
}

// parseMaterial parses [CA] or [CA, cert, key].
func parseMaterial(data [][]byte, now time.Time) (*material, error) {
	roots, err := parseRoots(data[0])
	if err != nil {
		return nil, err
	}
	m := &material{roots: roots}
	if len(data) == 3 {
		kp, err := tls.X509KeyPair(data[1], data[2])
		if err != nil {
			return nil, fmt.Errorf("auth: certificate and key: %w", err)
		}
		if kp.Leaf == nil {
			if kp.Leaf, err = x509.ParseCertificate(kp.Certificate[0]); err != nil {
				return nil, fmt.Errorf("auth: certificate: %w", err)
			}
		}
		if now.After(kp.Leaf.NotAfter) {
			return nil, fmt.Errorf("auth: certificate expired at %s", kp.Leaf.NotAfter.UTC().Format(time.RFC3339))
		}
		m.cert = &kp
	}
	return m, nil
}

// parseRoots accepts a bundle of CERTIFICATE blocks only.
func parseRoots(b []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	n := 0
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("auth: CA bundle holds a %q block", trunc(blk.Type))
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("auth: CA bundle: %w", err)
		}
		pool.AddCert(c)
		n++
	}
	if n == 0 {
		return nil, errors.New("auth: CA bundle holds no certificate")
	}
	return pool, nil
}

// ServerTLS is the server side: TLS 1.3 minimum; every handshake takes the
// current certificate and client CAs (GetConfigForClient, GetCertificate),
// so a reload applies to new connections while open ones keep theirs.
// clientAuth is tls.RequireAndVerifyClientCert for links that require a
// certificate, tls.VerifyClientCertIfGiven where bearer tokens are also
// accepted. Session tickets are off, so every connection is verified against
// the current CAs. ALPN: NextProtos set on the returned config before use is
// carried into each handshake (grpc's credentials.NewTLS adds h2 itself).
func (s *Source) ServerTLS(clientAuth tls.ClientAuthType) *tls.Config {
	base := &tls.Config{
		MinVersion:             tls.VersionTLS13,
		ClientAuth:             clientAuth,
		ClientCAs:              s.cur.Load().roots,
		SessionTicketsDisabled: true,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return s.serverCert(s.material())
		},
	}
	base.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		m := s.material()
		cert, err := s.serverCert(m)
		if err != nil {
			return nil, err
		}
		return &tls.Config{
			MinVersion:             tls.VersionTLS13,
			Certificates:           []tls.Certificate{*cert},
			ClientAuth:             clientAuth,
			ClientCAs:              m.roots,
			SessionTicketsDisabled: true,
			NextProtos:             base.NextProtos,
		}, nil
	}
	return base
}

// ServerCredentials is credentials.NewTLS(s.ServerTLS(clientAuth)).
func (s *Source) ServerCredentials(clientAuth tls.ClientAuthType) credentials.TransportCredentials {
	return credentials.NewTLS(s.ServerTLS(clientAuth))
}

func (s *Source) serverCert(m *material) (*tls.Certificate, error) {
	if m.cert == nil {
		return nil, errors.New("auth: no server certificate configured")
	}
	return m.cert, nil
}

// ServerIdentity, when not zero, is what a client additionally requires of
// the server's certificate: a single SPIFFE URI SAN in TrustDomain with one
// of Roles (any role when empty).
type ServerIdentity struct {
	TrustDomain string
	Roles       []Role
}

// IsZero reports whether no identity is required.
func (w ServerIdentity) IsZero() bool { return w.TrustDomain == "" && len(w.Roles) == 0 }

// ClientTLS is the client side: TLS 1.3 minimum; the current certificate is
// offered (GetClientCertificate) and the server's chain is verified against
// the current roots with x509's Verify, including the host name (serverName,
// or the SNI the connection sent when it is empty). crypto/tls's own
// verification is off (InsecureSkipVerify) only because its roots cannot
// change per handshake; VerifyConnection does the same verification. With no
// serverName and an IP address (no SNI is sent) the handshake fails: use
// ClientCredentials for grpc, which takes the name from the target.
func (s *Source) ClientTLS(serverName string) *tls.Config {
	return s.ClientTLSExpect(serverName, ServerIdentity{})
}

// ClientTLSExpect is ClientTLS that also requires the server's identity
// (an agent checking that it talks to a master).
func (s *Source) ClientTLSExpect(serverName string, want ServerIdentity) *tls.Config {
	return &tls.Config{
		MinVersion:         tls.VersionTLS13,
		ServerName:         serverName,
		InsecureSkipVerify: true, // verified in VerifyConnection against the current roots
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if m := s.material(); m.cert != nil {
				return m.cert, nil
			}
			return &tls.Certificate{}, nil // none: the server decides
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			name := serverName
			if name == "" {
				name = cs.ServerName
			}
			return s.verifyServer(cs, name, want)
		},
	}
}

// verifyServer is the verification crypto/tls would do with RootCAs set to
// the current roots, plus the optional identity check.
func (s *Source) verifyServer(cs tls.ConnectionState, name string, want ServerIdentity) error {
	if name == "" {
		return errors.New("auth: no server name to verify the server certificate against")
	}
	if len(cs.PeerCertificates) == 0 {
		return errors.New("auth: server sent no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	leaf := cs.PeerCertificates[0]
	_, err := leaf.Verify(x509.VerifyOptions{
		Roots:         s.material().roots,
		Intermediates: inter,
		DNSName:       name,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	if err != nil {
		return fmt.Errorf("auth: server certificate: %w", err)
	}
	if want.IsZero() {
		return nil
	}
	p, reason := leafPrincipal(leaf, want.TrustDomain)
	if reason != "" {
		return fmt.Errorf("auth: server certificate: %s", reason)
	}
	if len(want.Roles) > 0 && !slices.Contains(want.Roles, p.Role) {
		return fmt.Errorf("auth: server is %s, want role %v", p, want.Roles)
	}
	return nil
}

// ClientCredentials is grpc transport credentials over ClientTLSExpect that
// verify the server against serverName or, when it is empty, the host of the
// target being dialled (as grpc's own TLS credentials do).
func (s *Source) ClientCredentials(serverName string, want ServerIdentity) credentials.TransportCredentials {
	return &clientCreds{s: s, name: serverName, want: want, TransportCredentials: credentials.NewTLS(s.ClientTLSExpect(serverName, want))}
}

// clientCreds builds the per-handshake config once the authority is known.
type clientCreds struct {
	credentials.TransportCredentials // Info, ServerHandshake
	s                                *Source
	name                             string
	want                             ServerIdentity
}

func (c *clientCreds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	name := c.name
	if name == "" {
		name = authority
		if h, _, err := net.SplitHostPort(authority); err == nil {
			name = h
		}
	}
	return credentials.NewTLS(c.s.ClientTLSExpect(name, c.want)).ClientHandshake(ctx, authority, conn)
}

func (c *clientCreds) Clone() credentials.TransportCredentials {
	return c.s.ClientCredentials(c.name, c.want)
}

func (c *clientCreds) OverrideServerName(string) error { return nil } // deprecated in grpc; the name is fixed

// PeerPrincipal is the principal of a grpc peer: the verified leaf's single
// SPIFFE URI SAN, which must be in trustDomain.
func PeerPrincipal(ctx context.Context, trustDomain string) (Principal, bool) {
	pr, ok := peer.FromContext(ctx)
	if !ok {
		return Principal{}, false
	}
	info, ok := pr.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return Principal{}, false
	}
	return CertPrincipal(&info.State, trustDomain)
}

// CertPrincipal is PeerPrincipal for net/http's r.TLS and a raw tls.Conn's
// ConnectionState: only a chain crypto/tls verified counts (a certificate
// accepted without verification, RequireAnyClientCert, is no identity).
func CertPrincipal(cs *tls.ConnectionState, trustDomain string) (Principal, bool) {
	p, reason := certIdentity(cs, trustDomain)
	return p, reason == ""
}

// certIdentity returns the principal or, when there is none, why not ("" only
// with a principal). errNoCert's text is returned when no certificate was
// presented at all.
func certIdentity(cs *tls.ConnectionState, trustDomain string) (Principal, string) {
	if cs == nil || !cs.HandshakeComplete || len(cs.PeerCertificates) == 0 {
		return Principal{}, reasonNoCert
	}
	if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return Principal{}, "client certificate was not verified"
	}
	return leafPrincipal(cs.VerifiedChains[0][0], trustDomain)
}

const reasonNoCert = "no client certificate"

func leafPrincipal(leaf *x509.Certificate, trustDomain string) (Principal, string) {
	if trustDomain == "" {
		return Principal{}, "no trust domain configured"
	}
	if len(leaf.URIs) != 1 {
		return Principal{}, fmt.Sprintf("certificate has %d URI SANs, want exactly one spiffe:// id", len(leaf.URIs))
	}
	p, err := ParseSPIFFE(leaf.URIs[0].String())
	if err != nil {
		return Principal{}, "certificate URI SAN: " + err.Error()
	}
	if p.TrustDomain != trustDomain {
		return Principal{}, fmt.Sprintf("certificate trust domain %q is not %q", p.TrustDomain, trustDomain)
	}
	return p, ""
}
