package auth_test

import (
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/testutil"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const td = "crescent.test"

// pki is a CA in a temporary directory that issues certificates as files.
type pki struct {
	t   *testing.T
	dir string
	ca  *devcerts.CA
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	ca, err := devcerts.NewCA(td, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	k := &pki{t: t, dir: t.TempDir(), ca: ca}
	k.write("ca.pem", ca.CertPEM)
	return k
}

func (k *pki) write(name string, data []byte) string {
	k.t.Helper()
	p := filepath.Join(k.dir, name)
	if err := devcerts.WriteFileAtomic(p, data, 0o600); err != nil {
		k.t.Fatal(err)
	}
	return p
}

// leaf issues l and writes it as <name>.pem and <name>-key.pem.
func (k *pki) leaf(name string, l devcerts.Leaf) auth.Files {
	k.t.Helper()
	c, key, err := k.ca.Issue(l)
	if err != nil {
		k.t.Fatal(err)
	}
	return auth.Files{CA: filepath.Join(k.dir, "ca.pem"), Cert: k.write(name+".pem", c), Key: k.write(name+"-key.pem", key)}
}

// principal issues a normal certificate for role/name in td.
func (k *pki) principal(role auth.Role, name string) auth.Files {
	return k.leaf(string(role)+"-"+name, devcerts.Leaf{
		URIs:       []string{auth.Principal{TrustDomain: td, Role: role, Name: name}.String()},
		Hosts:      []string{"localhost", "127.0.0.1"},
		ServerAuth: devcerts.ServerRole(role), ClientAuth: true,
	})
}

// keyPair loads files as a tls.Certificate without Source's checks (an
// expired certificate, say).
func keyPair(t *testing.T, f auth.Files) tls.Certificate {
	t.Helper()
	kp, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	return kp
}

func (k *pki) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(k.ca.Cert)
	return p
}

func source(t *testing.T, f auth.Files, lg *slog.Logger) *auth.Source {
	t.Helper()
	s, err := auth.NewSource(f, lg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// logBuf is a goroutine-safe log sink.
type logBuf struct{ testutil.LogBuffer }

// lines returns the logged JSON lines containing every one of subs.
func (l *logBuf) lines(subs ...string) []string {
	var out []string
	for line := range strings.SplitSeq(l.String(), "\n") {
		ok := line != ""
		for _, s := range subs {
			ok = ok && strings.Contains(line, s)
		}
		if ok {
			out = append(out, line)
		}
	}
	return out
}

func newLogger(buf *logBuf) *slog.Logger {
	return slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
