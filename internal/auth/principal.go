// Package auth is Crescent's identity and access layer (issue 14): who a peer
// is (a Principal, from the SPIFFE URI SAN of its verified certificate or from
// a static bearer token), the TLS material every server and client uses
// (Source, reloaded from files on change), and the one authorization table
// each server enforces in one interceptor pair (Authorizer), default deny.
//
// Principals are spiffe://<trust-domain>/<role>/<name>, with the roles agent,
// gateway, tenant, admin and master. A tenant principal's name is the tenant
// it may act for.
//
// Only the standard library's crypto/tls and crypto/x509 and grpc's
// credentials do cryptography here; this package only chooses configurations
// and reads identities out of verified chains.
//
// Concurrency: nothing here starts a goroutine. Source and Tokens reload their
// files on use, at most once per ReloadCheck interval, by whichever caller
// first notices the interval has passed (the others keep using the current
// material meanwhile); the material itself is swapped atomically.
//
// Errors at the gRPC edge are plain statuses: Unauthenticated when the caller
// has no valid identity, PermissionDenied when it has one that may not do
// what it asked. masterv1.ErrorReason has no reason for either (ILLEGAL_CLIENT
// and INVALID_TOKEN mean other things), so none is attached; the code is the
// contract.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package auth

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Role is the second path segment of a principal's SPIFFE id.
type Role string

// The roles of issue 14, plus master (masters serve agents, gateways and
// clients; those may check that they talk to one).
const (
	RoleAgent   Role = "agent"
	RoleGateway Role = "gateway"
	RoleTenant  Role = "tenant"
	RoleAdmin   Role = "admin"
	RoleMaster  Role = "master"
)

// Valid reports whether r is one of the known roles.
func (r Role) Valid() bool {
	switch r {
	case RoleAgent, RoleGateway, RoleTenant, RoleAdmin, RoleMaster:
		return true
	}
	return false
}

// Limits on SPIFFE ids (ParseSPIFFE enforces them; so does devcerts).
const (
	MaxURILen         = 2048
	MaxNameLen        = 128
	MaxTrustDomainLen = 255
)

// DefaultTenant is the tenant a request with an empty tenant acts for. It is
// the same rule as internal/master/meta's NormalizeTenant (a test checks that
// the constants agree), duplicated rather than imported: auth is imported by
// the SDK, the CLI, agents and gateways, which must not pull in the master's
// object state machine, and meta's own dependencies (token, cluster) may come
// to import auth, which would make a cycle.
const DefaultTenant = "default"

// NormalizeTenant maps "" to DefaultTenant, as the master does.
func NormalizeTenant(t string) string {
	if t == "" {
		return DefaultTenant
	}
	return t
}

// Principal is who a peer is: spiffe://<TrustDomain>/<Role>/<Name>.
type Principal struct {
	TrustDomain string
	Role        Role
	Name        string
}

// String is the principal's SPIFFE id, "" for the zero Principal, and
// "<role>/<name>" for one without a trust domain (the insecure principal).
func (p Principal) String() string {
	switch {
	case p.IsZero():
		return ""
	case p.TrustDomain == "":
		return string(p.Role) + "/" + p.Name
	}
	return "spiffe://" + p.TrustDomain + "/" + string(p.Role) + "/" + p.Name
}

// IsZero reports whether p is the zero Principal (no identity).
func (p Principal) IsZero() bool { return p == Principal{} }

// Validate checks p's parts against the same rules as ParseSPIFFE.
func (p Principal) Validate() error {
	if err := validTrustDomain(p.TrustDomain); err != nil {
		return err
	}
	if !p.Role.Valid() {
		return fmt.Errorf("auth: unknown role %q", trunc(string(p.Role)))
	}
	return validName(p.Name)
}

// InsecurePrincipal is the principal every call runs as when authorization
// is disabled (plaintext mode).
func InsecurePrincipal() Principal { return Principal{Role: RoleAdmin, Name: "insecure"} }

// ErrInvalidSPIFFE is wrapped by every ParseSPIFFE error.
var ErrInvalidSPIFFE = errors.New("auth: invalid SPIFFE id")

// ParseSPIFFE parses spiffe://<trust-domain>/<role>/<name> strictly: scheme
// spiffe (lower case), a trust domain of lower-case letters, digits, '-', '_'
// and '.' in non-empty labels of at most 63 bytes (at most 255 in all), a
// known role and exactly one name segment of 1..128 bytes of
// [A-Za-z0-9._:-] (not "." or ".."); no port, user, query, fragment or
// percent-encoding; at most 2048 bytes in all. The error never quotes more
// than a short prefix of uri.
func ParseSPIFFE(uri string) (Principal, error) {
	if len(uri) > MaxURILen {
		return Principal{}, fmt.Errorf("%w: longer than %d bytes", ErrInvalidSPIFFE, MaxURILen)
	}
	rest, ok := strings.CutPrefix(uri, "spiffe://")
	if !ok {
		return Principal{}, fmt.Errorf("%w: %q does not start with spiffe://", ErrInvalidSPIFFE, trunc(uri))
	}
	td, path, ok := strings.Cut(rest, "/")
	if !ok {
		return Principal{}, fmt.Errorf("%w: %q has no path", ErrInvalidSPIFFE, trunc(uri))
	}
	if err := validTrustDomain(td); err != nil {
		return Principal{}, fmt.Errorf("%w: %w", ErrInvalidSPIFFE, err)
	}
	role, name, ok := strings.Cut(path, "/")
	if !ok {
		return Principal{}, fmt.Errorf("%w: %q: path is not /<role>/<name>", ErrInvalidSPIFFE, trunc(uri))
	}
	if !Role(role).Valid() {
		return Principal{}, fmt.Errorf("%w: unknown role %q", ErrInvalidSPIFFE, trunc(role))
	}
	if err := validName(name); err != nil {
		return Principal{}, fmt.Errorf("%w: %w", ErrInvalidSPIFFE, err)
	}
	return Principal{TrustDomain: td, Role: Role(role), Name: name}, nil
}

func validTrustDomain(td string) error {
	if td == "" {
		return errors.New("empty trust domain")
	}
	if len(td) > MaxTrustDomainLen {
		return fmt.Errorf("trust domain longer than %d bytes", MaxTrustDomainLen)
	}
	label := 0
	for i := 0; i < len(td); i++ {
		c := td[i]
		switch {
		case c == '.':
			if label == 0 {
				return fmt.Errorf("trust domain %q has an empty label", trunc(td))
			}
			label = 0
			continue
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_':
		default:
			return fmt.Errorf("trust domain %q: byte %#x not allowed (lower-case letters, digits, '-', '_', '.')", trunc(td), c)
		}
		label++
		if label > 63 {
			return fmt.Errorf("trust domain %q has a label longer than 63 bytes", trunc(td))
		}
	}
	if label == 0 {
		return fmt.Errorf("trust domain %q ends with '.'", trunc(td))
	}
	return nil
}

func validName(n string) error {
	if n == "" || len(n) > MaxNameLen {
		return fmt.Errorf("name must be 1..%d bytes, got %d", MaxNameLen, len(n))
	}
	if n == "." || n == ".." {
		return fmt.Errorf("name %q is a dot segment", n)
	}
	for i := 0; i < len(n); i++ {
		c := n[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == ':', c == '-':
		default:
			return fmt.Errorf("name %q: byte %#x not allowed ([A-Za-z0-9._:-])", trunc(n), c)
		}
	}
	return nil
}

// truncLen bounds how much caller-supplied text an error or log line quotes.
const truncLen = 64

// trunc shortens s for messages: untrusted input is never echoed unbounded.
func trunc(s string) string {
	if len(s) <= truncLen {
		return s
	}
	return s[:truncLen] + "..."
}

type ctxKey struct{}

// NewContext returns ctx carrying p (the interceptors do this for handlers).
func NewContext(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, ctxKey{}, p)
}

// FromContext returns the principal NewContext put in ctx.
func FromContext(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(ctxKey{}).(Principal)
	return p, ok && !p.IsZero()
}
