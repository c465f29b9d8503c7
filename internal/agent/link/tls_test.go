package link

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const trustDomain = devcerts.DefaultTrustDomain

// certs writes a development CA and certificates for master-1, agents
// agent-1 and agent-2 and gateway-1 into a temporary directory.
func certs(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Agents: []string{"agent-1", "agent-2"}, Tenants: []string{}, Admins: []string{}}); err != nil {
		t.Fatal(err)
	}
	return dir
}

func source(t *testing.T, dir string, role auth.Role, name string) *auth.Source {
	t.Helper()
	s, err := auth.NewSource(devcerts.FilesFor(dir, role, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// peers records the principal of every caller of a server.
type peers struct {
	mu   sync.Mutex
	seen []auth.Principal
}

func (p *peers) add(ctx context.Context) {
	pr, _ := auth.PeerPrincipal(ctx, trustDomain)
	p.mu.Lock()
	p.seen = append(p.seen, pr)
	p.mu.Unlock()
}

func (p *peers) stream() grpc.ServerOption {
	return grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		p.add(ss.Context())
		return h(srv, ss)
	})
}

func (p *peers) all() []auth.Principal {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]auth.Principal(nil), p.seen...)
}

// The link dials the master with Config.Creds: the master knows the agent
// by its certificate, and the agent talks to a master only.
func TestTLSMaster(t *testing.T) {
	dir := certs(t)
	agent := source(t, dir, auth.RoleAgent, "agent-1")
	creds := agent.ClientCredentials("", auth.ServerIdentity{TrustDomain: trustDomain, Roles: []auth.Role{auth.RoleMaster}})
	for _, tc := range []struct {
		name   string
		server *auth.Source
		ok     bool
	}{
		{"master", source(t, dir, auth.RoleMaster, "master-1"), true},
		{"a gateway posing as the master", source(t, dir, auth.RoleGateway, "gateway-1"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p peers
			h := newHarness(t, harnessOpts{tcp: true, cfg: Config{Creds: creds}, server: []grpc.ServerOption{
				grpc.Creds(tc.server.ServerCredentials(tls.RequireAndVerifyClientCert)), p.stream(),
			}})
			h.start()
			if !tc.ok {
				select {
				case <-h.master.sessions:
					t.Fatal("the agent registered with a server that is not a master")
				case <-time.After(500 * time.Millisecond):
				}
				return
			}
			s := h.session()
			if s.reg.GetAgentId() != "agent-1" {
				t.Fatalf("Register = %v", s.reg)
			}
			want := auth.Principal{TrustDomain: trustDomain, Role: auth.RoleAgent, Name: "agent-1"}
			if got := p.all(); len(got) == 0 || got[0] != want {
				t.Fatalf("the master saw %v, want %v", got, want)
			}
		})
	}
}

// countingData is a DataService that takes a Write whole and records it.
type countingData struct {
	agentv1.UnimplementedDataServiceServer
	mu  sync.Mutex
	got []byte
}

func (c *countingData) Write(stream agentv1.DataService_WriteServer) error {
	var buf []byte
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			c.mu.Lock()
			c.got = buf
			c.mu.Unlock()
			return stream.SendAndClose(&agentv1.WriteResponse{BytesWritten: uint64(len(buf))})
		}
		if err != nil {
			return err
		}
		buf = append(buf, m.GetData()...)
	}
}

// A Copy to another agent goes over TLS with the agent's certificate.
func TestTLSCopy(t *testing.T) {
	dir := certs(t)
	var p peers
	target := &countingData{}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(source(t, dir, auth.RoleAgent, "agent-2").ServerCredentials(tls.RequireAndVerifyClientCert)), p.stream())
	agentv1.RegisterDataServiceServer(gs, target)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)

	agent := source(t, dir, auth.RoleAgent, "agent-1")
	h := newHarness(t, harnessOpts{cfg: Config{Creds: agent.ClientCredentials("", auth.ServerIdentity{TrustDomain: trustDomain})}})
	// The fake master listens on bufconn without TLS: its dial options
	// replace the link's credentials for the master connection only.
	h.link.deps.MasterDialOptions = append(h.link.deps.MasterDialOptions, grpc.WithTransportCredentials(insecure.NewCredentials()))
	data := bytes.Repeat([]byte("0123456789"), 300<<10/10)
	src := sealedAlloc(t, h.mem, "src", data)
	s := connected(t, h, 1)
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Copy{Copy: &masterv1.CopyRequest{
		RequestId: 1, Epoch: 1, Source: &masterv1.AllocationRef{SegmentId: h.mem.ID(), AllocationId: src.GetAllocationId()},
		TargetEndpoint: lis.Addr().String(), Target: &masterv1.AllocationRef{SegmentId: "t", AllocationId: 1}, TargetToken: []byte("tok"),
	}}}
	if cr := s.next(t).GetCopyResult(); cr.GetRequestId() != 1 || cr.GetStatus().GetCode() != 0 {
		t.Fatalf("CopyResult = %v", cr)
	}
	target.mu.Lock()
	got := target.got
	target.mu.Unlock()
	if !bytes.Equal(got, data) {
		t.Fatalf("the target received %d bytes, want %d", len(got), len(data))
	}
	want := auth.Principal{TrustDomain: trustDomain, Role: auth.RoleAgent, Name: "agent-1"}
	if seen := p.all(); len(seen) != 1 || seen[0] != want {
		t.Fatalf("the target saw %v, want %v", seen, want)
	}
}
