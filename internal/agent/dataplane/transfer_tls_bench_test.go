package dataplane

import (
	"context"
	"crypto/tls"
	"net"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// BenchmarkTransferTLS is the cost of mTLS on the bulk transfer path
// (issue 14): one agent data plane serves the same memory segment on a
// plaintext and on a TLS transfer listener (devcerts certificates, TLS 1.3,
// the client offering a tenant certificate), and every iteration runs the
// workload once on each, plaintext first, so that the ratio tls/plain
// compares the two in the same instant of a shared VM. Workloads are those
// of the cluster table: a batch of 128 objects of 4 KiB in one request,
// and one object of 1 MiB, written and read.
//
//	go test ./internal/agent/dataplane -run '^$' -bench TransferTLS -benchtime 2s -count 5
func BenchmarkTransferTLS(b *testing.B) {
	for _, w := range []struct {
		name  string
		n     int // objects per request
		size  int
		write bool
	}{
		{"put-4KiB-batch128", 128, 4 << 10, true},
		{"get-4KiB-batch128", 128, 4 << 10, false},
		{"put-1MiB", 1, 1 << 20, true},
		{"get-1MiB", 1, 1 << 20, false},
	} {
		b.Run(w.name, func(b *testing.B) { benchTransferTLS(b, w.n, w.size, w.write) })
	}
}

func benchTransferTLS(b *testing.B, n, size int, write bool) {
	dir := b.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Agents: []string{"bench"}, Tenants: []string{"bench"}, Admins: []string{}}); err != nil {
		b.Fatal(err)
	}
	agent, err := auth.NewSource(devcerts.FilesFor(dir, auth.RoleAgent, "bench"), nil)
	if err != nil {
		b.Fatal(err)
	}
	tenant, err := auth.NewSource(devcerts.FilesFor(dir, auth.RoleTenant, "bench"), nil)
	if err != nil {
		b.Fatal(err)
	}
	mem, err := segment.NewMemory("bench", uint64(n*size)+uint64(n)*4096)
	if err != nil {
		b.Fatal(err)
	}
	defer mem.Close()
	key := token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys := &Keyring{}
	keys.Set([]*masterv1.TokenKey{{Id: key.ID, Key: key.Secret}})
	srv := New(Config{Transfer: TransferConfig{TrustDomain: devcerts.DefaultTrustDomain}}, Deps{Segments: segment.NewSet(mem), Keys: keys, Registerer: obs.NewRegistry()}, testutil.Logger())

	ctx, cancel := context.WithCancel(context.Background())
	var served []chan error
	serve := func(wrap func(net.Listener) net.Listener) string {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		if wrap != nil {
			lis = wrap(lis)
		}
		done := make(chan error, 1)
		served = append(served, done)
		go func() { done <- srv.ServeTransfer(ctx, lis) }()
		return lis.Addr().String()
	}
	plainAddr := serve(nil)
	tlsAddr := serve(func(l net.Listener) net.Listener {
		return xfer.TLSListener(l, agent.ServerTLS(tls.RequireAndVerifyClientCert))
	})
	plain := xfer.NewPool(xfer.Config{})
	secure := xfer.NewPool(xfer.Config{TLS: tenant.ClientTLS("")})
	defer func() {
		_ = plain.Close()
		_ = secure.Close()
		cancel()
		for _, d := range served {
			if err := <-d; err != nil {
				b.Error(err)
			}
		}
	}()

	// n allocations written once, sealed for the reads.
	exp := time.Now().Add(time.Hour)
	witems, ritems := make([]*agentv1.TransferItem, n), make([]*agentv1.TransferItem, n)
	src, dst := make([][]byte, n), make([][]byte, n)
	for i := range n {
		a, err := mem.Reserve(&masterv1.ReserveItem{SegmentId: mem.ID(), Size: uint64(size), Tenant: "bench", Key: "bench"}, time.Now())
		if err != nil {
			b.Fatal(err)
		}
		id := a.GetAllocationId()
		claims := token.Claims{Tenant: "bench", Key: "bench", SegmentID: mem.ID(), AllocationID: id, Expiry: exp}
		claims.Mode = token.Write
		witems[i] = &agentv1.TransferItem{SegmentId: mem.ID(), AllocationId: id, Token: token.Sign(key, claims)}
		claims.Mode = token.Read
		ritems[i] = &agentv1.TransferItem{SegmentId: mem.ID(), AllocationId: id, Token: token.Sign(key, claims)}
		src[i], dst[i] = make([]byte, size), make([]byte, size)
		for j := range src[i] {
			src[i][j] = byte(i + j*31)
		}
	}
	op := func(p *xfer.Pool, addr string, write bool) {
		if write {
			errs, err := p.Write(ctx, addr, witems, src)
			if err == nil {
				err = firstErr(errs)
			}
			if err != nil {
				b.Fatal(err)
			}
			return
		}
		res, err := p.Read(ctx, addr, ritems, dst)
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
		}
	}
	op(plain, plainAddr, true)
	if !write {
		args := make([]segment.SealArg, n)
		for i, it := range witems {
			args[i] = segment.SealArg{ID: it.GetAllocationId(), Checksum: checksum.Sum(src[i])}
		}
		for i, err := range mem.Seal(args, time.Now()) {
			if err != nil {
				b.Fatalf("seal %d: %v", i, err)
			}
		}
	}
	// Warm up both connections (the TLS handshake is not measured: pooled
	// connections live for minutes).
	op(plain, plainAddr, write)
	op(secure, tlsAddr, write)

	var plainD, tlsD time.Duration
	b.ResetTimer()
	for b.Loop() {
		t0 := time.Now()
		op(plain, plainAddr, write)
		t1 := time.Now()
		op(secure, tlsAddr, write)
		plainD += t1.Sub(t0)
		tlsD += time.Since(t1)
	}
	b.StopTimer()
	bytes := float64(n*size) * float64(b.N)
	b.ReportMetric(bytes/float64(plainD.Nanoseconds()), "plain-GB/s")
	b.ReportMetric(bytes/float64(tlsD.Nanoseconds()), "tls-GB/s")
	b.ReportMetric(float64(plainD)/float64(tlsD), "tls/plain")
	if n > 1 {
		objs := float64(n) * float64(b.N)
		b.ReportMetric(objs/plainD.Seconds(), "plain-obj/s")
		b.ReportMetric(objs/tlsD.Seconds(), "tls-obj/s")
	}
}

func firstErr(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
