package testcluster

import (
	"crypto/tls"
	"fmt"
	"path/filepath"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// TrustDomain is the trust domain of a cluster started with Options.TLS.
const TrustDomain = devcerts.DefaultTrustDomain

// Principals a cluster with Options.TLS holds certificates for, besides
// its own components (master-1, gateway-1, agents host-0 … host-N-1): an
// admin, the tenants default, tenant-a and tenant-b (plus Options.Tenants),
// and an agent certificate for a host that runs no agent, for tests of what
// a genuine but foreign agent certificate may not do.
const (
	Admin        = "admin"
	TenantA      = "tenant-a"
	TenantB      = "tenant-b"
	IntruderHost = "host-intruder"
)

// initCerts makes the development CA and every certificate (Options.TLS).
func (c *Cluster) initCerts() {
	c.t.Helper()
	c.certDir = filepath.Join(c.t.TempDir(), "certs")
	agents := []string{IntruderHost}
	for i := range c.opts.Agents {
		agents = append(agents, hostID(i))
	}
	tenants := append([]string{"default", TenantA, TenantB}, c.opts.Tenants...)
	err := devcerts.Init(c.certDir, devcerts.Options{
		Agents: agents, Tenants: tenants, Admins: []string{Admin},
		Gateways: []string{"gateway-1"}, Masters: []string{"master-1"},
	})
	if err != nil {
		c.t.Fatalf("certificates: %v", err)
	}
}

// hostID is agent i's host id (its certificate's name with Options.TLS).
func hostID(i int) string { return fmt.Sprintf("host-%d", i) }

// Secure reports whether the cluster runs with mTLS (Options.TLS).
func (c *Cluster) Secure() bool { return c.certDir != "" }

// CertDir is the directory of the cluster's CA and certificates ("" without
// Options.TLS); the layout is devcerts'.
func (c *Cluster) CertDir() string { return c.certDir }

// Files names the certificate and key of one principal (Options.TLS).
func (c *Cluster) Files(role auth.Role, name string) auth.Files {
	return devcerts.FilesFor(c.certDir, role, name)
}

// security is a component's Security: its principal's files, or plaintext.
func (c *Cluster) security(role auth.Role, name string) server.Security {
	s := server.DefaultSecurity()
	if c.Secure() {
		f := c.Files(role, name)
		s.CA, s.Cert, s.Key, s.TrustDomain = f.CA, f.Cert, f.Key, TrustDomain
	}
	return s
}

// DialAs is a gRPC connection to the master as principal role/name
// (plaintext without Options.TLS), closed with the test. A zero role dials
// with the CA only: no client certificate.
func (c *Cluster) DialAs(role auth.Role, name string) *grpc.ClientConn {
	c.t.Helper()
	creds := grpc.WithTransportCredentials(insecure.NewCredentials())
	if c.Secure() {
		f := auth.Files{CA: filepath.Join(c.certDir, "ca.pem")}
		if role != "" {
			f = c.Files(role, name)
		}
		src, err := auth.NewSource(f, c.lg)
		if err != nil {
			c.t.Fatalf("credentials of %s/%s: %v", role, name, err)
		}
		creds = grpc.WithTransportCredentials(src.ClientCredentials("", auth.ServerIdentity{TrustDomain: TrustDomain, Roles: []auth.Role{auth.RoleMaster}}))
	}
	cc, err := grpc.NewClient(c.masterAddr, creds, rpccodec.DialOption(), tracing.DialOption())
	if err != nil {
		c.t.Fatalf("dial master: %v", err)
	}
	c.t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// ClientTLS is the SDK's TLS configuration for principal role/name (nil
// without Options.TLS).
func (c *Cluster) ClientTLS(role auth.Role, name string) *tls.Config {
	c.t.Helper()
	if !c.Secure() {
		return nil
	}
	f := c.Files(role, name)
	cfg, err := client.TLSFromFiles(f.CA, f.Cert, f.Key)
	if err != nil {
		c.t.Fatalf("client TLS of %s/%s: %v", role, name, err)
	}
	return cfg
}

// As is a Client option: connect as principal role/name (Options.TLS).
func (c *Cluster) As(role auth.Role, name string) func(*client.Config) {
	t := c.ClientTLS(role, name)
	return func(cfg *client.Config) { cfg.TLS = t }
}
