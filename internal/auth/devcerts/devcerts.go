// Package devcerts makes a development CA and certificates for every
// Crescent role (`crescentctl certs init DIR`, tests, `make run-secure`):
// ECDSA P-256 keys and certificates made with crypto/x509, each leaf carrying
// its principal as a SPIFFE URI SAN (spiffe://<trust-domain>/<role>/<name>).
// Not for production: the CA key lies next to the certificates.
//
// Layout written by Init: DIR/ca.pem, DIR/ca-key.pem and, per principal,
// DIR/<role>-<name>.pem and DIR/<role>-<name>-key.pem; keys are 0600.
package devcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
)

// DefaultTrustDomain is the trust domain when Options leaves it empty.
const DefaultTrustDomain = "crescent.local"

// DefaultValidity is how long certificates are valid when Options leaves it
// zero.
const DefaultValidity = 365 * 24 * time.Hour

// backdate covers clock skew between the machine that issues and the ones
// that verify.
const backdate = 5 * time.Minute

// Options says what Init issues. Nil name lists take their defaults; an
// empty, non-nil list issues none of that role.
type Options struct {
	// TrustDomain of every principal; DefaultTrustDomain when empty.
	TrustDomain string
	// Hosts are the DNS names and IP addresses of the server certificates
	// (agents, gateways, masters); localhost, 127.0.0.1 and ::1 when nil.
	Hosts []string
	// Agents are agent host ids; agent-1, agent-2 when nil.
	Agents []string
	// Gateways are gateway ids; gateway-1 when nil.
	Gateways []string
	// Tenants are tenant names; default when nil.
	Tenants []string
	// Admins are admin names; admin when nil.
	Admins []string
	// Masters are master ids; master-1 when nil.
	Masters []string
	// Validity of every certificate; DefaultValidity when zero.
	Validity time.Duration
	// Force overwrites an existing CA (and every certificate) in the directory.
	Force bool
}

func (o *Options) defaults() {
	if o.TrustDomain == "" {
		o.TrustDomain = DefaultTrustDomain
	}
	if o.Hosts == nil {
		o.Hosts = []string{"localhost", "127.0.0.1", "::1"}
	}
	if o.Agents == nil {
		o.Agents = []string{"agent-1", "agent-2"}
	}
	if o.Gateways == nil {
		o.Gateways = []string{"gateway-1"}
	}
	if o.Tenants == nil {
		o.Tenants = []string{auth.DefaultTenant}
	}
	if o.Admins == nil {
		o.Admins = []string{"admin"}
	}
	if o.Masters == nil {
		o.Masters = []string{"master-1"}
	}
	if o.Validity <= 0 {
		o.Validity = DefaultValidity
	}
}

// ServerRole reports whether certificates of role r are also server
// certificates (server and client auth, with the Hosts as SANs).
func ServerRole(r auth.Role) bool {
	return r == auth.RoleAgent || r == auth.RoleGateway || r == auth.RoleMaster
}

// FilesFor names the files Init writes for one principal.
func FilesFor(dir string, role auth.Role, name string) auth.Files {
	base := filepath.Join(dir, string(role)+"-"+name)
	return auth.Files{CA: filepath.Join(dir, "ca.pem"), Cert: base + ".pem", Key: base + "-key.pem"}
}

// ErrCAExists is returned by Init when dir already holds a CA and o.Force is
// not set; it wraps fs.ErrExist.
var ErrCAExists = fmt.Errorf("devcerts: a CA already exists (use Force to overwrite): %w", fs.ErrExist)

// Init writes a development CA and certificates for every role into dir
// (created if missing). It refuses to overwrite an existing CA unless
// o.Force. Every file is written to a temporary name and renamed, so a
// running process that reloads them never reads half a file.
func Init(dir string, o Options) error {
	o.defaults()
	caCert, caKey := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if !o.Force {
		for _, p := range []string{caCert, caKey} {
			if _, err := os.Stat(p); err == nil {
				return ErrCAExists
			} else if !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
	}
	type issue struct {
		role  auth.Role
		names []string
	}
	var all []auth.Principal
	seen := map[auth.Principal]bool{}
	for _, is := range []issue{
		{auth.RoleMaster, o.Masters}, {auth.RoleAgent, o.Agents}, {auth.RoleGateway, o.Gateways},
		{auth.RoleTenant, o.Tenants}, {auth.RoleAdmin, o.Admins},
	} {
		for _, n := range is.names {
			p := auth.Principal{TrustDomain: o.TrustDomain, Role: is.role, Name: n}
			if err := p.Validate(); err != nil {
				return fmt.Errorf("devcerts: %s %q: %w", is.role, n, err)
			}
			if seen[p] {
				return fmt.Errorf("devcerts: %s %q named twice", is.role, n)
			}
			seen[p] = true
			all = append(all, p)
		}
	}

	ca, err := NewCA(o.TrustDomain, o.Validity)
	if err != nil {
		return err
	}
	type file struct {
		path string
		data []byte
		mode os.FileMode
	}
	caKeyPEM, err := ca.KeyPEM()
	if err != nil {
		return err
	}
	files := []file{{caKey, caKeyPEM, 0o600}}
	for _, p := range all {
		leaf := Leaf{URIs: []string{p.String()}, CommonName: string(p.Role) + "-" + p.Name, ClientAuth: true, Validity: o.Validity}
		if ServerRole(p.Role) {
			leaf.ServerAuth, leaf.Hosts = true, o.Hosts
		}
		certPEM, keyPEM, err := ca.Issue(leaf)
		if err != nil {
			return fmt.Errorf("devcerts: %s: %w", p, err)
		}
		f := FilesFor(dir, p.Role, p.Name)
		files = append(files, file{f.Cert, certPEM, 0o644}, file{f.Key, keyPEM, 0o600})
	}
	files = append(files, file{caCert, ca.CertPEM, 0o644}) // last: its presence means a complete set
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, f := range files {
		if err := WriteFileAtomic(f.path, f.data, f.mode); err != nil {
			return err
		}
	}
	return nil
}

// WriteFileAtomic writes data to a temporary file in path's directory and
// renames it over path.
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// CA is a certificate authority held in memory.
type CA struct {
	Cert    *x509.Certificate
	Key     *ecdsa.PrivateKey
	CertPEM []byte
}

// NewCA makes a self-signed ECDSA P-256 CA for trustDomain.
func NewCA(trustDomain string, validity time.Duration) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := serialNumber()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"Crescent development"}, CommonName: "Crescent development CA " + trustDomain},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// KeyPEM is the CA key as a PKCS#8 PEM block.
func (ca *CA) KeyPEM() ([]byte, error) { return keyPEM(ca.Key) }

// Leaf describes a certificate to issue. Tests use it for the odd ones
// (no SAN, two SANs, expired).
type Leaf struct {
	CommonName string
	URIs       []string // SPIFFE ids, usually exactly one
	Hosts      []string // DNS names and IP addresses
	ServerAuth bool
	ClientAuth bool
	// Validity from now (backdated a little); NotBefore/NotAfter, when set,
	// win.
	Validity            time.Duration
	NotBefore, NotAfter time.Time
}

// Issue makes a key and a certificate signed by ca.
func (ca *CA) Issue(l Leaf) (certPEM, keyPEMOut []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := serialNumber()
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	if l.Validity <= 0 {
		l.Validity = DefaultValidity
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{Organization: []string{"Crescent development"}, CommonName: l.CommonName},
		NotBefore:    now.Add(-backdate),
		NotAfter:     now.Add(l.Validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	if !l.NotBefore.IsZero() {
		tmpl.NotBefore = l.NotBefore
	}
	if !l.NotAfter.IsZero() {
		tmpl.NotAfter = l.NotAfter
	}
	if l.ServerAuth {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if l.ClientAuth {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	for _, u := range l.URIs {
		pu, err := url.Parse(u)
		if err != nil {
			return nil, nil, fmt.Errorf("uri %q: %w", u, err)
		}
		tmpl.URIs = append(tmpl.URIs, pu)
	}
	for _, h := range l.Hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, nil, err
	}
	kp, err := keyPEM(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), kp, nil
}

func keyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

func serialNumber() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}
