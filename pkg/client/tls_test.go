package client_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The SDK's TLS wiring against hand-written TLS servers (a master that
// answers GetReplicaList, an agent with DataService and a transfer
// listener), each recording who called: the client's certificate (or
// bearer token) must reach every one of them.

const trustDomain = devcerts.DefaultTrustDomain

// caller is what a server learned about one call.
type caller struct {
	principal auth.Principal
	bearer    string // the authorization metadata, gRPC only
}

type callers struct {
	mu  sync.Mutex
	all map[string][]caller // by server: master, data, transfer
}

func (c *callers) add(server string, k caller) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.all == nil {
		c.all = map[string][]caller{}
	}
	c.all[server] = append(c.all[server], k)
}

func (c *callers) of(server string) []caller {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]caller(nil), c.all[server]...)
}

func grpcCaller(ctx context.Context) caller {
	p, _ := auth.PeerPrincipal(ctx, trustDomain)
	k := caller{principal: p}
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get("authorization")) > 0 {
		k.bearer = md.Get("authorization")[0]
	}
	return k
}

type tlsMaster struct {
	masterv1.UnimplementedObjectServiceServer
	calls *callers
	rl    *masterv1.GetReplicaListResponse
}

func (m *tlsMaster) GetReplicaList(ctx context.Context, _ *masterv1.GetReplicaListRequest) (*masterv1.GetReplicaListResponse, error) {
	m.calls.add("master", grpcCaller(ctx))
	return m.rl, nil
}

type tlsData struct {
	agentv1.UnimplementedDataServiceServer
	calls *callers
	data  []byte
}

func (d *tlsData) BatchRead(ctx context.Context, _ *agentv1.BatchReadRequest) (*agentv1.BatchReadResponse, error) {
	d.calls.add("data", grpcCaller(ctx))
	return &agentv1.BatchReadResponse{Results: []*agentv1.BatchReadResult{{Data: d.data}}}, nil
}

// tlsCluster is one master and one agent, with certificates from dir.
type tlsCluster struct {
	dir        string
	masterAddr string
	calls      callers
	data       []byte
}

func listen(t *testing.T, dir string, role auth.Role, name string) (net.Listener, *auth.Source) {
	t.Helper()
	src, err := auth.NewSource(devcerts.FilesFor(dir, role, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis, src
}

func serveGRPC(t *testing.T, lis net.Listener, src *auth.Source, register func(*grpc.Server)) {
	t.Helper()
	gs := grpc.NewServer(grpc.Creds(src.ServerCredentials(tls.VerifyClientCertIfGiven)))
	register(gs)
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-done })
}

// serveTransfer answers READ requests of one item with data, over TLS,
// recording the caller's certificate principal.
func serveTransfer(t *testing.T, lis net.Listener, src *auth.Source, calls *callers, data []byte) {
	t.Helper()
	tl := tls.NewListener(lis, src.ServerTLS(tls.RequireAndVerifyClientCert))
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			nc, err := tl.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer nc.Close()
				tc := nc.(*tls.Conn)
				if err := tc.Handshake(); err != nil {
					return
				}
				cs := tc.ConnectionState()
				p, _ := auth.CertPrincipal(&cs, trustDomain)
				calls.add("transfer", caller{principal: p})
				br := bufio.NewReader(tc)
				var pre [len(xfer.Preamble)]byte
				if _, err := io.ReadFull(br, pre[:]); err != nil {
					return
				}
				for {
					req := &agentv1.TransferRequest{}
					if _, err := xfer.ReadFrame(br, nil, req); err != nil {
						return
					}
					resp := &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: uint64(len(data)), ObjectSize: uint64(len(data))}}}
					b, err := xfer.AppendFrame(nil, resp)
					if err != nil || xfer.WriteFrame(tc, b, [][]byte{data}) != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() { _ = tl.Close(); wg.Wait() })
}

func startTLSCluster(t *testing.T) *tlsCluster {
	t.Helper()
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Tenants: []string{"A", "B"}}); err != nil {
		t.Fatal(err)
	}
	c := &tlsCluster{dir: dir, data: bytes.Repeat([]byte("tls!"), 1000)}
	dataLis, agentSrc := listen(t, dir, auth.RoleAgent, "agent-1")
	serveGRPC(t, dataLis, agentSrc, func(gs *grpc.Server) {
		agentv1.RegisterDataServiceServer(gs, &tlsData{calls: &c.calls, data: c.data})
	})
	xferLis, _ := listen(t, dir, auth.RoleAgent, "agent-1")
	serveTransfer(t, xferLis, agentSrc, &c.calls, c.data)
	masterLis, masterSrc := listen(t, dir, auth.RoleMaster, "master-1")
	rl := &masterv1.GetReplicaListResponse{Size: uint64(len(c.data)), Checksum: checksum.Sum(c.data), Replicas: []*masterv1.ReplicaDescriptor{{
		ReplicaId: 1, SegmentId: "s", AllocationId: 1, Token: []byte("t"),
		DataEndpoint: dataLis.Addr().String(), TransferEndpoint: xferLis.Addr().String(),
	}}}
	serveGRPC(t, masterLis, masterSrc, func(gs *grpc.Server) {
		masterv1.RegisterObjectServiceServer(gs, &tlsMaster{calls: &c.calls, rl: rl})
	})
	c.masterAddr = masterLis.Addr().String()
	return c
}

func (c *tlsCluster) newClient(t *testing.T, cfg client.Config) *client.Client {
	t.Helper()
	cfg.Master = c.masterAddr
	cl, err := client.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

func (c *tlsCluster) tlsFor(t *testing.T, role auth.Role, name string) *tls.Config {
	t.Helper()
	f := devcerts.FilesFor(c.dir, role, name)
	cfg, err := client.TLSFromFiles(f.CA, f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func tenant(name string) auth.Principal {
	return auth.Principal{TrustDomain: trustDomain, Role: auth.RoleTenant, Name: name}
}

func TestTLSCertificateReachesEveryServer(t *testing.T) {
	c := startTLSCluster(t)
	for _, tc := range []struct {
		name   string
		cfg    client.Config
		server string // where the bytes come from
	}{
		{"transfer", client.Config{}, "transfer"},
		{"DataService", client.Config{DisableTransfer: true}, "data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.TLS = c.tlsFor(t, auth.RoleTenant, "A")
			cl := c.newClient(t, cfg)
			before := len(c.calls.of(tc.server))
			got, err := cl.Get(t.Context(), "k")
			if err != nil || !bytes.Equal(got, c.data) {
				t.Fatalf("Get = %d bytes, %v; want %d bytes", len(got), err, len(c.data))
			}
			for _, server := range []string{"master", tc.server} {
				calls := c.calls.of(server)
				if len(calls) == 0 || calls[len(calls)-1].principal != tenant("A") {
					t.Fatalf("%s saw %v, want %v", server, calls, tenant("A"))
				}
			}
			if len(c.calls.of(tc.server)) == before {
				t.Fatalf("the bytes did not come from %s", tc.server)
			}
		})
	}
}

// A client without a certificate authenticates with its bearer token on
// every gRPC call, and moves bytes through DataService (the transfer
// protocol carries no token).
func TestTLSBearerToken(t *testing.T) {
	c := startTLSCluster(t)
	cfg, err := client.TLSFromFiles(filepath.Join(c.dir, "ca.pem"), "", "")
	if err != nil {
		t.Fatal(err)
	}
	const tok = "0123456789abcdef-token"
	cl := c.newClient(t, client.Config{TLS: cfg, BearerToken: tok})
	transfers := len(c.calls.of("transfer"))
	if got, err := cl.Get(t.Context(), "k"); err != nil || !bytes.Equal(got, c.data) {
		t.Fatalf("Get = %d bytes, %v", len(got), err)
	}
	for _, server := range []string{"master", "data"} {
		calls := c.calls.of(server)
		if len(calls) == 0 || calls[len(calls)-1] != (caller{bearer: "Bearer " + tok}) {
			t.Fatalf("%s saw %+v, want only the bearer token", server, calls)
		}
	}
	if len(c.calls.of("transfer")) != transfers {
		t.Fatal("a token client used the transfer listener")
	}
	if _, err := client.New(t.Context(), client.Config{Master: c.masterAddr, BearerToken: tok}); err == nil {
		t.Fatal("New with a bearer token and no TLS succeeded")
	}
}

// Certificates replaced on disk are used by the next connections.
func TestTLSFromFilesReloads(t *testing.T) {
	c := startTLSCluster(t)
	dir := t.TempDir()
	a, b := devcerts.FilesFor(c.dir, auth.RoleTenant, "A"), devcerts.FilesFor(c.dir, auth.RoleTenant, "B")
	mine := auth.Files{CA: a.CA, Cert: filepath.Join(dir, "me.pem"), Key: filepath.Join(dir, "me-key.pem")}
	install := func(f auth.Files) {
		for src, dst := range map[string]string{f.Cert: mine.Cert, f.Key: mine.Key} {
			data, err := os.ReadFile(src)
			if err != nil {
				t.Fatal(err)
			}
			if err := devcerts.WriteFileAtomic(dst, data, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	install(a)
	cfg, err := client.TLSFromFiles(mine.CA, mine.Cert, mine.Key)
	if err != nil {
		t.Fatal(err)
	}
	who := func() auth.Principal {
		cl, err := client.New(t.Context(), client.Config{Master: c.masterAddr, TLS: cfg, DisableTransfer: true})
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		if _, err := cl.Get(t.Context(), "k"); err != nil {
			t.Fatal(err)
		}
		calls := c.calls.of("master")
		return calls[len(calls)-1].principal
	}
	if got := who(); got != tenant("A") {
		t.Fatalf("before the files change the master saw %v", got)
	}
	install(b)
	testutil.Eventually(t, 10*time.Second, func() bool { return who() == tenant("B") }, "the replaced certificate in use")
}

func TestTLSFailures(t *testing.T) {
	c := startTLSCluster(t)
	other := t.TempDir()
	if err := devcerts.Init(other, devcerts.Options{}); err != nil {
		t.Fatal(err)
	}
	f := devcerts.FilesFor(other, auth.RoleTenant, auth.DefaultTenant)
	strange, err := client.TLSFromFiles(f.CA, f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
	}{
		{"plaintext client", nil},
		{"servers of another CA", strange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := c.newClient(t, client.Config{TLS: tc.cfg, Attempts: 1})
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			_, err := cl.Get(ctx, "k")
			if status.Code(errors.Unwrap(err)) != codes.Unavailable && status.Code(err) != codes.Unavailable {
				t.Fatalf("Get = %v, want UNAVAILABLE", err)
			}
		})
	}
	if _, err := client.TLSFromFiles(filepath.Join(c.dir, "missing.pem"), "", ""); err == nil {
		t.Fatal("TLSFromFiles of a missing CA succeeded")
	}
	a := devcerts.FilesFor(c.dir, auth.RoleTenant, "A")
	if _, err := client.TLSFromFiles(a.CA, a.Cert, ""); err == nil {
		t.Fatal("TLSFromFiles of a certificate without its key succeeded")
	}
}
