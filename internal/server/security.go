package server

import (
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"

	"github.com/crescent-kv/crescent/internal/auth"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// DefaultTrustDomain is the trust domain of --trust-domain's default (and of
// the development certificates, devcerts.DefaultTrustDomain).
const DefaultTrustDomain = "crescent.local"

// ErrProtectedMode is wrapped by the error of a plaintext server asked to
// listen on an address other than loopback without --insecure.
var ErrProtectedMode = errors.New("protected mode")

// Security is a process's transport security and access configuration
// (issue 14). Every binary binds it with RegisterFlags, so each field is
// also CRESCENT_<FLAG> and a YAML key. With no TLS file the process is in
// plaintext mode: nothing is authenticated, and its servers listen only on
// loopback unless Insecure is set (protected mode).
type Security struct {
	// CA, Cert and Key are PEM files (auth.Files): the CA bundle that
	// verifies peers, this process's certificate chain and its key. They
	// are reloaded on change (auth.Source).
	CA, Cert, Key string
	// TrustDomain every peer's SPIFFE id must be in.
	TrustDomain string
	// AuthTokens is a bearer token file (auth.ParseTokens), for clients that
	// cannot hold a certificate; optional, TLS only.
	AuthTokens string
	// Insecure allows plaintext on addresses other than loopback.
	Insecure bool
	// Pprof serves /debug/pprof/ on the admin port: to admin principals with
	// TLS, to anyone who reaches the port without.
	Pprof bool
	// MaxConns bounds the open connections of the gRPC port, and again of
	// the admin port; MaxConnsPerIP those from one remote IP address. A
	// connection past either is closed as it is accepted (0: the default,
	// DefaultMaxConns and DefaultMaxConnsPerIP).
	MaxConns, MaxConnsPerIP int
}

// DefaultSecurity returns the defaults: plaintext, protected mode, no pprof,
// the default connection caps.
func DefaultSecurity() Security {
	return Security{TrustDomain: DefaultTrustDomain, MaxConns: DefaultMaxConns, MaxConnsPerIP: DefaultMaxConnsPerIP}
}

// RegisterFlags binds every field to fs with its current value as default.
func (s *Security) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&s.CA, "tls-ca", s.CA, "PEM CA bundle that verifies peers' certificates; setting the TLS files turns on mTLS and authorization (files are reloaded on change)")
	fs.StringVar(&s.Cert, "tls-cert", s.Cert, "PEM certificate chain of this process (its SPIFFE id spiffe://<trust-domain>/<role>/<name> as URI SAN)")
	fs.StringVar(&s.Key, "tls-key", s.Key, "PEM private key of --tls-cert")
	fs.StringVar(&s.TrustDomain, "trust-domain", s.TrustDomain, "SPIFFE trust domain every peer's identity must be in")
	fs.StringVar(&s.AuthTokens, "auth-tokens", s.AuthTokens, "optional file of bearer tokens, one \"<token> <spiffe-id>\" a line, for clients without a certificate (TLS only; reloaded on change)")
	fs.BoolVar(&s.Insecure, "insecure", s.Insecure, "without TLS, listen on addresses other than loopback anyway (plaintext, no authentication: anyone who reaches the ports may do anything)")
	fs.BoolVar(&s.Pprof, "pprof", s.Pprof, "serve /debug/pprof/ on the admin port (with TLS to admin principals only)")
	fs.IntVar(&s.MaxConns, "max-connections", s.MaxConns, "open connections the gRPC port admits, and again the admin port; one more is closed as it is accepted")
	fs.IntVar(&s.MaxConnsPerIP, "max-connections-per-ip", s.MaxConnsPerIP, "open connections the gRPC port admits from one remote IP address, and again the admin port")
}

// Files are the TLS files as auth.Files.
func (s Security) Files() auth.Files { return auth.Files{CA: s.CA, Cert: s.Cert, Key: s.Key} }

// TLS reports whether TLS files are configured.
func (s Security) TLS() bool { return s.Files().Enabled() }

// Validate checks the combination: a server needs CA, certificate and key
// together; tokens need TLS; --insecure means nothing with TLS.
func (s Security) Validate() error {
	var errs []error
	if _, err := auth.ParseSPIFFE("spiffe://" + s.TrustDomain + "/admin/x"); err != nil {
		errs = append(errs, fmt.Errorf("trust-domain %q is not a valid SPIFFE trust domain", s.TrustDomain))
	}
	if s.MaxConns < 0 || s.MaxConnsPerIP < 0 {
		errs = append(errs, fmt.Errorf("max-connections (%d) and max-connections-per-ip (%d) may not be negative (0 is the default)", s.MaxConns, s.MaxConnsPerIP))
	}
	if s.TLS() {
		if s.CA == "" || s.Cert == "" || s.Key == "" {
			errs = append(errs, errors.New("tls-ca, tls-cert and tls-key go together"))
		}
		if s.Insecure {
			errs = append(errs, errors.New("insecure is for plaintext: drop it or the tls-* files"))
		}
	} else if s.AuthTokens != "" {
		errs = append(errs, errors.New("auth-tokens needs TLS (tls-ca, tls-cert, tls-key): bearer tokens are never accepted in plaintext"))
	}
	return errors.Join(errs...)
}

// Load reads the files Security names: the TLS Source and the bearer
// tokens. Plaintext mode loads nothing.
func (s Security) Load(lg *slog.Logger) (*Credentials, error) {
	c := &Credentials{Security: s}
	if !s.TLS() {
		return c, nil
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	src, err := auth.NewSource(s.Files(), lg.With("part", "tls"))
	if err != nil {
		return nil, err
	}
	c.Source = src
	if s.AuthTokens != "" {
		if c.Tokens, err = auth.LoadTokens(s.AuthTokens, lg.With("part", "tokens")); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Credentials are a Security configuration loaded: what one process's
// servers (and its clients of other Crescent servers) use. A nil
// *Credentials is plaintext mode with the defaults.
type Credentials struct {
	Security
	// Source is the TLS material; nil in plaintext mode.
	Source *auth.Source
	// Tokens are the bearer tokens; nil without AuthTokens.
	Tokens *auth.Tokens
}

// Secure reports whether c serves TLS (and so authorizes every call).
func (c *Credentials) Secure() bool { return c != nil && c.Source != nil }

// clientAuth is what the servers ask of a client's TLS: a certificate is
// verified when given, but the handshake does not demand one. Identity is
// decided per call by the Authorizer (every method but health and
// reflection needs a principal), so a caller without a certificate gets
// UNAUTHENTICATED with a reason instead of an opaque handshake failure
// ("tls: certificate required" surfaces as UNAVAILABLE at the client, which
// retries it), bearer-token clients can connect, and Kubernetes' gRPC
// probes, which present no certificate, can reach grpc.health.v1. A
// certificate that is presented must still verify against the CA.
func (c *Credentials) clientAuth() tls.ClientAuthType { return tls.VerifyClientCertIfGiven }

// ServerTLS is the TLS configuration of a non-gRPC listener that serves
// the same clients as the gRPC port (the agent's bulk transfer listener);
// nil in plaintext mode.
func (c *Credentials) ServerTLS() *tls.Config {
	if !c.Secure() {
		return nil
	}
	return c.Source.ServerTLS(c.clientAuth())
}

// Client is the transport credentials for dialling another Crescent server
// whose certificate must name one of roles (e.g. the master): mTLS with
// this process's certificate, the server verified against the host name of
// the target; insecure credentials in plaintext mode.
func (c *Credentials) Client(roles ...auth.Role) credentials.TransportCredentials {
	if !c.Secure() {
		return insecure.NewCredentials()
	}
	return c.Source.ClientCredentials("", auth.ServerIdentity{TrustDomain: c.TrustDomain, Roles: roles})
}

// ClientTLS is Client as a TLS configuration, for connections that are
// not gRPC (an agent's Copy to another agent's bulk transfer listener,
// through xfer.ClientTLS, which names each endpoint's host); nil in
// plaintext mode.
func (c *Credentials) ClientTLS(roles ...auth.Role) *tls.Config {
	if !c.Secure() {
		return nil
	}
	return c.Source.ClientTLSExpect("", auth.ServerIdentity{TrustDomain: c.TrustDomain, Roles: roles})
}

// CheckListen enforces protected mode on a bound listener address: a
// plaintext server may listen on loopback only, unless Insecure. what names
// the listener in the error ("grpc-addr").
func (c *Credentials) CheckListen(what string, addr net.Addr) error {
	if c.Secure() || (c != nil && c.Insecure) || isLoopback(addr) {
		return nil
	}
	return fmt.Errorf("%w: %s %s is not a loopback address and no TLS is configured: "+
		"set --tls-ca, --tls-cert and --tls-key (`crescentctl certs init` makes development ones), listen on 127.0.0.1, "+
		"or pass --insecure to serve plaintext without authentication", ErrProtectedMode, what, addr)
}

// isLoopback reports whether a bound address is a loopback one (an
// unspecified address, 0.0.0.0 or ::, is not: it listens on every interface).
func isLoopback(a net.Addr) bool {
	switch a := a.(type) {
	case *net.TCPAddr:
		return a.IP.IsLoopback()
	case *net.UDPAddr:
		return a.IP.IsLoopback()
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// CheckTable reports every method of services that t has no exact rule for
// (a wildcard does not count: each RPC gets its own decision) and every
// entry of t that names no method of services. Each server's test calls it,
// so a new RPC without a rule fails CI rather than being refused to
// everyone in production.
func CheckTable(t auth.Table, services ...*grpc.ServiceDesc) error {
	var errs []error
	known := map[string]bool{}
	for _, sd := range services {
		names := make([]string, 0, len(sd.Methods)+len(sd.Streams))
		for _, m := range sd.Methods {
			names = append(names, m.MethodName)
		}
		for _, st := range sd.Streams {
			names = append(names, st.StreamName)
		}
		for _, n := range names {
			full := "/" + sd.ServiceName + "/" + n
			known[full] = true
			if _, ok := t[full]; !ok {
				errs = append(errs, fmt.Errorf("%s has no rule", full))
			}
		}
	}
	for _, m := range slices.Sorted(maps.Keys(t)) {
		if !known[m] {
			errs = append(errs, fmt.Errorf("rule %s names no method of the registered services", m))
		}
	}
	return errors.Join(errs...)
}
