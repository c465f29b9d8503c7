package testcluster_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestCertificateRotation replaces every certificate of a running cluster,
// CA included, the way an operator rotates without a restart: trust the
// new CA next to the old one, swap every process's certificate and key for
// ones from the new CA, then drop the old CA. Puts and gets run throughout,
// on long-lived connections and on fresh clients that handshake with
// whatever is on disk at that moment; none may fail. Afterwards the
// servers present certificates of the new CA.
func TestCertificateRotation(t *testing.T) {
	if testing.Short() {
		t.Skip("rotation waits for file reloads (about 15 s)")
	}
	c := testcluster.Start(t, testcluster.Options{TLS: true})
	dir := c.CertDir()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()

	var ops, failed atomic.Int64
	var firstErr atomic.Value
	fail := func(err error) {
		failed.Add(1)
		firstErr.CompareAndSwap(nil, err)
	}
	payload := bytes.Repeat([]byte("rotate"), 1000)
	work := func(cl *client.Client, prefix string, n int) {
		for i := range n {
			if ctx.Err() != nil {
				return
			}
			key := fmt.Sprintf("%s-%d", prefix, i)
			if err := cl.Put(ctx, key, payload); err != nil {
				if ctx.Err() == nil {
					fail(fmt.Errorf("put %s: %w", key, err))
				}
				continue
			}
			if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, payload) {
				if ctx.Err() == nil {
					fail(fmt.Errorf("get %s: %d bytes, %w", key, len(got), err))
				}
			}
			// Removed again (force: the get leased it): the test is about
			// handshakes, and tens of thousands of objects kept would fill
			// the segment until puts evict; a put that needs a contiguous
			// hole evicts neighbours however recent, and another worker's
			// get just after its put would find the object gone.
			if err := cl.Remove(ctx, key, true); err != nil && ctx.Err() == nil {
				fail(fmt.Errorf("remove %s: %w", key, err))
			}
			ops.Add(3)
		}
	}
	var wg sync.WaitGroup
	// A long-lived client: its connections were made before the rotation.
	long := c.Client(t)
	wg.Go(func() { work(long, "long", 1<<30) })
	// Fresh clients, one after another: each dials and handshakes anew
	// (master, DataService and transfer), reading the files then.
	wg.Go(func() {
		for gen := 0; ctx.Err() == nil; gen++ {
			cfg := client.Config{Master: c.MasterAddr(), TLS: c.ClientTLS(auth.RoleTenant, "default")}
			cl, err := client.New(ctx, cfg)
			if err != nil {
				if ctx.Err() == nil {
					fail(fmt.Errorf("client %d: %w", gen, err))
				}
				return
			}
			work(cl, fmt.Sprintf("fresh%d", gen), 5)
			_ = cl.Close()
		}
	})

	// settle waits past the processes' reload check (at most once a
	// second, files re-hashed while modified in the last 2 s) with
	// operations running.
	settle := func(what string) {
		t.Helper()
		start := ops.Load()
		time.Sleep(3 * time.Second)
		t.Logf("%s: %d operations meanwhile, %d failed", what, ops.Load()-start, failed.Load())
	}
	settle("before")

	next := t.TempDir()
	if err := devcerts.Init(next, devcerts.Options{
		Agents:   []string{testcluster.IntruderHost, "host-0", "host-1"},
		Tenants:  []string{"default", testcluster.TenantA, testcluster.TenantB},
		Admins:   []string{testcluster.Admin},
		Gateways: []string{"gateway-1"}, Masters: []string{"master-1"},
	}); err != nil {
		t.Fatal(err)
	}
	oldCA := read(t, filepath.Join(dir, "ca.pem"))
	newCA := read(t, filepath.Join(next, "ca.pem"))

	// 1. Trust both CAs everywhere.
	write(t, filepath.Join(dir, "ca.pem"), append(append([]byte{}, oldCA...), newCA...))
	settle("both CAs trusted")
	// 2. Every certificate and key from the new CA (each written whole,
	// by rename; a process that reads a certificate without its key yet
	// keeps its old pair and tries again).
	entries, err := os.ReadDir(next)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if name := e.Name(); name != "ca.pem" && name != "ca-key.pem" {
			write(t, filepath.Join(dir, name), read(t, filepath.Join(next, name)))
		}
	}
	settle("certificates replaced")
	// 3. Drop the old CA.
	write(t, filepath.Join(dir, "ca.pem"), newCA)
	settle("old CA dropped")

	cancel()
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d operations failed during the rotation; first: %v", n, ops.Load()+n, firstErr.Load())
	}
	if ops.Load() < 100 {
		t.Fatalf("only %d operations ran: the rotation was not under load", ops.Load())
	}

	// The servers now present certificates of the new CA.
	ca := parseCert(t, newCA)
	for name, addr := range map[string]string{
		"master": c.MasterAddr(), "agent 0": c.Agent(0).DataEndpoint(), "agent 1 transfer": c.Agent(1).TransferEndpoint(),
	} {
		conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13}) // only to read the chain
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		leaf := conn.ConnectionState().PeerCertificates[0]
		_ = conn.Close()
		if err := leaf.CheckSignatureFrom(ca); err != nil {
			t.Fatalf("%s still presents a certificate of the old CA: %v", name, err)
		}
	}
	t.Logf("%d operations, none failed", ops.Load())
}

func read(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func write(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := devcerts.WriteFileAtomic(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func parseCert(t *testing.T, pemBytes []byte) *x509.Certificate {
	t.Helper()
	blk, _ := pem.Decode(pemBytes)
	if blk == nil {
		t.Fatal("no PEM block")
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}
