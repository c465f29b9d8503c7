package devcerts_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
)

func TestInitDefaults(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	if err := devcerts.Init(dir, devcerts.Options{}); err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("ca.pem holds no certificate")
	}
	want := []struct {
		role   auth.Role
		name   string
		server bool
	}{
		{auth.RoleMaster, "master-1", true},
		{auth.RoleAgent, "agent-1", true},
		{auth.RoleAgent, "agent-2", true},
		{auth.RoleGateway, "gateway-1", true},
		{auth.RoleTenant, "default", false},
		{auth.RoleAdmin, "admin", false},
	}
	for _, w := range want {
		f := devcerts.FilesFor(dir, w.role, w.name)
		kp, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			t.Fatalf("%s/%s: %v", w.role, w.name, err)
		}
		leaf := kp.Leaf
		p, ok := auth.CertPrincipal(&tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{leaf}, VerifiedChains: [][]*x509.Certificate{{leaf}}}, devcerts.DefaultTrustDomain)
		if wantP := (auth.Principal{TrustDomain: devcerts.DefaultTrustDomain, Role: w.role, Name: w.name}); !ok || p != wantP {
			t.Errorf("principal %v, want %v", p, wantP)
		}
		eku := []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
		if w.server {
			eku = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		}
		for _, u := range eku {
			opts := x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{u}}
			if u == x509.ExtKeyUsageServerAuth {
				opts.DNSName = "127.0.0.1"
			}
			if _, err := leaf.Verify(opts); err != nil {
				t.Errorf("%s/%s for %v: %v", w.role, w.name, u, err)
			}
		}
		if !w.server && slices.Contains(leaf.ExtKeyUsage, x509.ExtKeyUsageServerAuth) {
			t.Errorf("%s/%s is a server certificate", w.role, w.name)
		}
		if d := time.Until(leaf.NotAfter); d < 364*24*time.Hour || d > 366*24*time.Hour {
			t.Errorf("%s/%s valid for %v, want a year", w.role, w.name, d)
		}
		if k, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || k.Curve != elliptic.P256() {
			t.Errorf("%s/%s key is %T, want ECDSA P-256", w.role, w.name, leaf.PublicKey)
		}
		for path, mode := range map[string]fs.FileMode{f.Key: 0o600, f.Cert: 0o644} {
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != mode {
				t.Errorf("%s mode %v, want %v", path, fi.Mode().Perm(), mode)
			}
		}
	}
	fi, err := os.Stat(filepath.Join(dir, "ca-key.pem"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("ca-key.pem: %v, %v", fi, err)
	}

	// An existing CA is not overwritten unless forced.
	if err := devcerts.Init(dir, devcerts.Options{}); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second Init: %v, want ErrExist", err)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); string(after) != string(caPEM) {
		t.Fatal("refused Init changed ca.pem")
	}
	if err := devcerts.Init(dir, devcerts.Options{Force: true}); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); string(after) == string(caPEM) {
		t.Fatal("forced Init kept the old CA")
	}
}

func TestInitOptions(t *testing.T) {
	dir := t.TempDir()
	o := devcerts.Options{TrustDomain: "prod.example", Hosts: []string{"master.svc", "10.1.2.3"}, Agents: []string{"h1"}, Gateways: []string{}, Tenants: []string{"a", "b"}, Admins: []string{}, Masters: []string{"10.1.2.3:7000"}}
	if err := devcerts.Init(dir, o); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	want := []string{"agent-h1-key.pem", "agent-h1.pem", "ca-key.pem", "ca.pem", "master-10.1.2.3:7000-key.pem", "master-10.1.2.3:7000.pem", "tenant-a-key.pem", "tenant-a.pem", "tenant-b-key.pem", "tenant-b.pem"}
	if !slices.Equal(names, want) {
		t.Fatalf("files %v, want %v", names, want)
	}
	if _, err := auth.NewSource(devcerts.FilesFor(dir, auth.RoleAgent, "h1"), nil); err != nil {
		t.Fatal(err)
	}
	kp, err := tls.LoadX509KeyPair(filepath.Join(dir, "agent-h1.pem"), filepath.Join(dir, "agent-h1-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if err := kp.Leaf.VerifyHostname("master.svc"); err != nil {
		t.Error(err)
	}
	if err := kp.Leaf.VerifyHostname("10.1.2.3"); err != nil {
		t.Error(err)
	}

	for _, bad := range []devcerts.Options{
		{TrustDomain: "Bad"},
		{Agents: []string{"a/b"}},
		{Tenants: []string{"x", "x"}},
	} {
		if err := devcerts.Init(t.TempDir(), bad); err == nil {
			t.Errorf("Init(%+v) succeeded", bad)
		}
	}
}
