// Package etcdtest runs a real single-member etcd server in the test's
// process (go.etcd.io/etcd/server/v3/embed) on loopback ports.
package etcdtest

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
)

// Server is a running embedded etcd.
type Server struct {
	e        *embed.Etcd
	Endpoint string // host:port of the client URL
}

// Start runs an etcd member with its data in a temporary directory and
// stops it when the test ends (or earlier with Stop).
func Start(t testing.TB) *Server { return start(t, nil) }

// StartTLS is Start with TLS on the client port: etcd's certificate and
// key, and the CA its clients' certificates must chain to (etcd's
// --client-cert-auth).
func StartTLS(t testing.TB, certFile, keyFile, caFile string) *Server {
	return start(t, &transport.TLSInfo{CertFile: certFile, KeyFile: keyFile, TrustedCAFile: caFile, ClientCertAuth: true})
}

func start(t testing.TB, tlsInfo *transport.TLSInfo) *Server {
	t.Helper()
	// freeURL's ports are free when it looks, not when etcd binds them: a
	// test in another process may take one in between (TestHAEtcdTLS once
	// failed "bind: address already in use" under CI's parallel packages).
	// Such a start is tried again on fresh ports.
	var (
		e      *embed.Etcd
		client url.URL
		err    error
	)
	for try := 1; ; try++ {
		cfg := embed.NewConfig()
		cfg.Name = "test"
		cfg.Dir = t.TempDir()
		cfg.LogLevel = "error"
		cfg.Logger = "zap"
		var peer url.URL
		client, peer = freeURL(t), freeURL(t)
		if tlsInfo != nil {
			client.Scheme = "https"
			cfg.ClientTLSInfo = *tlsInfo
		}
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
		if e, err = embed.StartEtcd(cfg); err == nil {
			break
		}
		if try == 5 || !(errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use")) {
			t.Fatalf("etcd: %v", err)
		}
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(30 * time.Second):
		e.Close()
		t.Fatal("etcd did not become ready in 30s")
	}
	s := &Server{e: e, Endpoint: client.Host}
	t.Cleanup(s.Stop)
	return s
}

// Stop stops the server (idempotent).
func (s *Server) Stop() {
	if s.e != nil {
		s.e.Close()
		s.e = nil
	}
}

func freeURL(t testing.TB) url.URL {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	u, err := url.Parse(fmt.Sprintf("http://%s", l.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	return *u
}

// Proxy forwards TCP connections to an address until Blackhole: from then
// on it moves no byte in either direction (connections stay open, as over
// a partitioned network) until Restore.
type Proxy struct {
	l      net.Listener
	target string
	Addr   string // host:port to dial instead of the target

	mu    sync.Mutex
	cond  *sync.Cond
	holed bool
	conns []net.Conn
}

// NewProxy starts a proxy to target, closed when the test ends.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{l: l, target: target, Addr: l.Addr().String()}
	p.cond = sync.NewCond(&p.mu)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			wg.Go(func() { p.pipe(u, c) })
			wg.Go(func() { p.pipe(c, u) })
		}
	})
	t.Cleanup(func() {
		l.Close()
		p.mu.Lock()
		p.holed = false
		for _, c := range p.conns {
			c.Close()
		}
		p.cond.Broadcast()
		p.mu.Unlock()
		wg.Wait()
	})
	return p
}

func (p *Proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		for p.holed {
			p.cond.Wait()
		}
		p.mu.Unlock()
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				src.Close()
				return
			}
		}
		if err != nil {
			dst.Close()
			return
		}
	}
}

// Blackhole stops moving bytes.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	p.holed = true
	p.mu.Unlock()
}

// Restore moves bytes again.
func (p *Proxy) Restore() {
	p.mu.Lock()
	p.holed = false
	p.cond.Broadcast()
	p.mu.Unlock()
}
