package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/testutil"
)

// TestTLSAccess (TLS mode only, issue 14): on a cluster with mTLS,
// crescentctl holding tenant-b's certificate cannot read tenant-a's object
// by naming tenant-a (PERMISSION_DENIED), while tenant-a's certificate can;
// and a process started without TLS files on 0.0.0.0 refuses to start
// (protected mode) saying what to do, and with --insecure starts and warns.
func TestTLSAccess(t *testing.T) {
	if !tlsMode(t) {
		t.Skipf("runs only with %s=1 (make test-e2e's second run): it checks what mTLS refuses", tlsEnv)
	}
	c := StartCluster(t, Options{Agents: 1})
	ctx := ctxT(t, time.Minute)
	if err := c.Client("tenant-a").Put(ctx, "secret", []byte("tenant a's")); err != nil {
		t.Fatal(err)
	}

	t.Run("another tenant's certificate", func(t *testing.T) {
		out, errOut, code := c.CtlAs(auth.RoleTenant, "tenant-b", nil, "--tenant", "tenant-a", "get", "secret")
		if code == 0 || out != "" || !strings.Contains(errOut, "PermissionDenied") {
			t.Fatalf("crescentctl --tenant tenant-a get with tenant-b's certificate: exit %d, stdout %q, stderr %q; want a failure naming PermissionDenied and no bytes", code, out, errOut)
		}
		t.Logf("refused: %s", strings.TrimSpace(errOut))
		if out, errOut, code := c.CtlAs(auth.RoleTenant, "tenant-a", nil, "--tenant", "tenant-a", "get", "secret"); code != 0 || out != "tenant a's" {
			t.Fatalf("the same get with tenant-a's certificate: exit %d, stdout %q, stderr %q", code, out, errOut)
		}
	})

	// A master of its own, plaintext, asked to listen on every interface.
	anyAddr := func() string {
		_, port, _ := net.SplitHostPort(freeAddr(t))
		return net.JoinHostPort("0.0.0.0", port)
	}
	grpcAddr, adminAddr := anyAddr(), anyAddr()
	bin := filepath.Join(c.bin, "crescent-master")
	args := []string{"--grpc-addr", grpcAddr, "--admin-addr", adminAddr, "--log-level", "info"}

	t.Run("protected mode", func(t *testing.T) {
		cmd := exec.CommandContext(ctx, bin, args...)
		out, err := cmd.CombinedOutput() // it must exit by itself
		if err == nil {
			t.Fatalf("plaintext master on %s started (exit 0); want a refusal:\n%s", grpcAddr, out)
		}
		for _, want := range []string{"protected mode", "not a loopback address", "--tls-ca", "--insecure"} {
			if !strings.Contains(string(out), want) {
				t.Fatalf("refusal does not say %q: %v\n%s", want, err, out)
			}
		}
		t.Logf("refused: %v\n%s", err, tail(string(out), 5))
	})

	t.Run("insecure", func(t *testing.T) {
		p := &Proc{t: t, Name: "insecure-master", bin: bin, args: append(args, "--insecure"),
			log: filepath.Join(t.TempDir(), "insecure-master.log"), admin: loopback(adminAddr), http: plainHTTP, scheme: "http"}
		p.start()
		t.Cleanup(p.Stop)
		waitReady(t, p)
		testutil.EventuallyNoError(t, 5*time.Second, func() error {
			if lg := p.Logs(); !strings.Contains(lg, "insecure: plaintext, no authentication") {
				return fmt.Errorf("no insecure warning in the log:\n%s", tail(lg, 20))
			}
			return nil
		})
	})
}

// plainHTTP reads the admin port of a process started without TLS.
var plainHTTP = &http.Client{Timeout: 10 * time.Second}

// loopback is addr (0.0.0.0:port) as the 127.0.0.1 address that reaches it.
func loopback(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	return net.JoinHostPort("127.0.0.1", port)
}
