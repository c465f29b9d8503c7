package client_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/callstream"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// The SDK's tests run against a real cluster started in-process by
// internal/testcluster: the master, agents with real memory segments, gRPC
// DataService and the bulk transfer listener, on loopback ports.
//
// The cluster's hooks fail master calls and the agents' gRPC DataService
// calls. What they cannot reach is the client's own view of the data plane,
// which this file shapes on the client side, through a unary interceptor on
// the client's master connection that rewrites the replica descriptors the
// master hands out:
//
//   - a refusing agent's replicas carry a token it cannot verify, so that
//     the real agent refuses them item by item;
//   - a failing agent's bulk transfer endpoint points at a closed port, so
//     that with the agent hook the agent fails on both data paths;
//   - an unreachable agent, one the master still lists (a partition
//     between the client and the agent, or the moment between a crash and
//     the master noticing it), has both endpoints at a closed port;
//   - transfer endpoints may go through a counting proxy, which forwards
//     every byte to the real agent and counts the requests.

// harness is one test's cluster and the client-side routing of its clients.
type harness struct {
	*testcluster.Cluster
	r *routes
}

// start starts a cluster for one test. No SDK test exercises the master's
// liveness checks (a stopped agent deregisters, and the master drops its
// segments at once), so they are relaxed from the harness's 1 s suspect and
// 3 s unmount: on a loaded CI machine a starved agent's heartbeats can be
// seconds late, and the master would declare it lost in the middle of a
// test.
func start(t *testing.T, opts testcluster.Options) *harness {
	t.Helper()
	adjust := opts.Master
	opts.Master = func(c *masterapp.Config) {
		c.SuspectAfter, c.UnmountAfter = 10*time.Second, 30*time.Second
		if adjust != nil {
			adjust(c)
		}
	}
	return &harness{Cluster: testcluster.Start(t, opts), r: &routes{down: map[string]bool{}, xferDown: map[string]bool{}, badToken: map[string]bool{}}}
}

// client returns an SDK client of the cluster (retrying fast), closed at
// the end of the test.
func (h *harness) client(t *testing.T, cfg client.Config) *client.Client {
	t.Helper()
	cfg.Master = h.MasterAddr()
	if cfg.Backoff == 0 {
		cfg.Backoff = time.Millisecond
	}
	cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(h.r.intercept), grpc.WithChainStreamInterceptor(h.r.interceptStream()))
	c, err := client.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// pathClient is a client of its own tenant (named after the data path) that
// moves bytes on the bulk transfer path or on gRPC DataService only, with
// small chunks so that modest objects are streamed in several. It runs on
// host-0, so reads try agent 0's replica first (the master and the SDK
// order local replicas first): a fault injected into agent 0 is met, and
// the read falls back to agent 1's.
func (h *harness) pathClient(t *testing.T, transfer bool) *client.Client {
	t.Helper()
	return h.client(t, client.Config{
		Tenant: pathName(transfer), HostID: "host-0", DisableTransfer: !transfer, ChunkSize: 64 << 10, SmallObject: 8 << 10,
	})
}

// paths runs f once with the bulk transfer path and once with gRPC
// DataService only.
func paths(t *testing.T, f func(t *testing.T, transfer bool)) {
	for _, transfer := range []bool{true, false} {
		t.Run(pathName(transfer), func(t *testing.T) { f(t, transfer) })
	}
}

func pathName(transfer bool) string {
	if transfer {
		return "transfer"
	}
	return "grpc"
}

// agentID is agent i's id (testcluster names them so).
func agentID(i int) string { return fmt.Sprintf("agent-%d", i) }

// failAgents makes the agents fail every data call until heal is called
// or the test ends: DataService through the cluster's agent hook
// (AGENT_UNAVAILABLE), the bulk transfer path by a closed port.
func (h *harness) failAgents(t *testing.T, agents ...int) (heal func()) {
	t.Helper()
	failing := map[int]bool{}
	for _, i := range agents {
		failing[i] = true
	}
	h.SetAgentHook(func(agent int, _ string) error {
		if failing[agent] {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent %d is failing", agent)
		}
		return nil
	})
	h.r.set(func() {
		clear(h.r.xferDown)
		for _, i := range agents {
			h.r.xferDown[agentID(i)] = true
		}
	})
	heal = func() {
		h.SetAgentHook(nil)
		h.r.set(func() { clear(h.r.xferDown) })
	}
	t.Cleanup(heal)
	return heal
}

// refuseAgents makes the agents refuse every item of theirs, as an agent
// refuses a token it cannot verify, until heal is called or the test ends:
// the client gets their replicas' tokens with a byte flipped, and the real
// agents answer each item (BatchWrite, BatchRead, transfers) or stream with
// an error.
func (h *harness) refuseAgents(t *testing.T, agents ...int) (heal func()) {
	t.Helper()
	h.r.set(func() {
		for _, i := range agents {
			h.r.badToken[agentID(i)] = true
		}
	})
	heal = func() { h.r.set(func() { clear(h.r.badToken) }) }
	t.Cleanup(heal)
	return heal
}

// refuseAgentsFor is refuseAgents for the lookups answered within d of the
// first one it spoils.
func (h *harness) refuseAgentsFor(t *testing.T, d time.Duration, agents ...int) {
	t.Helper()
	h.refuseAgents(t, agents...)
	h.r.set(func() { h.r.badFor, h.r.badUntil = d, time.Time{} })
	t.Cleanup(func() { h.r.set(func() { h.r.badFor, h.r.badUntil = 0, time.Time{} }) })
}

// cutAgent makes agent i unreachable from the client while the master
// still lists its replicas: every endpoint of it refuses connections, until
// heal is called or the test ends.
func (h *harness) cutAgent(t *testing.T, i int) (heal func()) {
	t.Helper()
	h.r.set(func() { h.r.down[agentID(i)] = true })
	heal = func() { h.r.set(func() { clear(h.r.down) }) }
	t.Cleanup(heal)
	return heal
}

// replicaOn is the index, in the master's replica order (Corrupt's), of
// the object's replica on host.
func (h *harness) replicaOn(t *testing.T, tenant, key, host string) int {
	t.Helper()
	resp, err := masterv1.NewObjectServiceClient(h.Conn()).GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Tenant: tenant, Key: key})
	if err != nil {
		t.Fatalf("GetReplicaList %q: %v", key, err)
	}
	for i, r := range resp.GetReplicas() {
		if r.GetHostId() == host {
			return i
		}
	}
	t.Fatalf("%q has no replica on %s", key, host)
	return -1
}

// waitSegmentsOK waits until exactly n segments are OK at the master (a
// stopped agent's are gone).
func (h *harness) waitSegmentsOK(t *testing.T, n int) {
	t.Helper()
	admin := masterv1.NewAdminServiceClient(h.Conn())
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		resp, err := admin.ListSegments(t.Context(), &masterv1.ListSegmentsRequest{})
		if err != nil {
			return err
		}
		ok := 0
		for _, s := range resp.GetSegments() {
			if s.GetLifecycle() == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK {
				ok++
			}
		}
		if ok != n {
			return fmt.Errorf("%d segments OK, want %d", ok, n)
		}
		return nil
	})
}

// countTransfers routes every agent's bulk transfer endpoint through a
// counting proxy, until the test ends.
func (h *harness) countTransfers(t *testing.T) *xferCounts {
	t.Helper()
	n := &xferCounts{}
	proxies := map[string]string{}
	for i := range h.Agents() {
		p := startProxy(t, h.Agent(i).TransferEndpoint(), n)
		proxies[agentID(i)] = p.ln.Addr().String()
	}
	h.r.set(func() { h.r.proxy = proxies })
	t.Cleanup(func() { h.r.set(func() { h.r.proxy = nil }) })
	return n
}

// closedAddr refuses connections (nothing listens on port 1 of loopback).
const closedAddr = "127.0.0.1:1"

// routes rewrites the replica descriptors of PutStart and GetReplicaList
// answers (single and batch) on their way to the client.
type routes struct {
	mu       sync.Mutex
	down     map[string]bool // agent ids: both endpoints closed
	xferDown map[string]bool // agent ids: transfer endpoint closed
	badToken map[string]bool // agent ids: tokens the agent refuses
	// badFor, when set, limits badToken to the lookups answered within
	// badFor of the first one it spoiled (badUntil): an agent that, for a
	// moment, does not know the master's key.
	badFor   time.Duration
	badUntil time.Time
	proxy    map[string]string // agent id -> counting proxy of its transfer endpoint
}

func (r *routes) set(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f()
}

func (r *routes) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
		return err
	}
	r.rewrite(reply)
	return nil
}

// onCallStream is a stream interceptor that wraps the master's CallStream
// (the client's only stream of it), and no other stream, with wrap.
func onCallStream(wrap func(grpc.ClientStream) grpc.ClientStream) grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil || method != masterv1.ObjectService_CallStream_FullMethodName {
			return cs, err
		}
		return wrap(cs), nil
	}
}

// interceptStream rewrites the answers of the master's CallStream as
// intercept rewrites the unary calls'.
func (r *routes) interceptStream() grpc.StreamClientInterceptor {
	return onCallStream(func(cs grpc.ClientStream) grpc.ClientStream { return &routedStream{ClientStream: cs, r: r} })
}

type routedStream struct {
	grpc.ClientStream
	r *routes
}

func (s *routedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	// The SDK's type embeds a CallStreamResponse.
	if pm, ok := m.(proto.Message); ok && err == nil {
		if a := callstream.Answer(pm); a != nil {
			s.r.rewrite(a)
		}
	}
	return err
}

// rewrite applies the routes to the replicas of a master's answer.
func (r *routes) rewrite(reply any) {
	var reps []*masterv1.ReplicaDescriptor
	switch m := reply.(type) {
	case *masterv1.PutStartResponse:
		reps = m.GetReplicas()
	case *masterv1.BatchPutStartResponse:
		for _, res := range m.GetResults() {
			reps = append(reps, res.GetReplicas()...)
		}
	case *masterv1.GetReplicaListResponse:
		reps = m.GetReplicas()
	case interface {
		// A BatchGetReplicaListResponse, or the SDK's type that embeds
		// one to decode it (lookupReply).
		GetResults() []*masterv1.GetReplicaListResult
	}:
		for _, res := range m.GetResults() {
			reps = append(reps, res.GetReplicaList().GetReplicas()...)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, d := range reps {
		id := d.GetAgentId()
		if p, ok := r.proxy[id]; ok && d.GetTransferEndpoint() != "" {
			d.TransferEndpoint = p
		}
		if r.xferDown[id] && d.GetTransferEndpoint() != "" {
			d.TransferEndpoint = closedAddr
		}
		spoil := r.badToken[id]
		if spoil && r.badFor > 0 {
			if r.badUntil.IsZero() {
				r.badUntil = time.Now().Add(r.badFor)
			}
			spoil = time.Now().Before(r.badUntil)
		}
		if spoil && len(d.GetToken()) > 0 {
			tok := slices.Clone(d.GetToken())
			tok[len(tok)/2] ^= 0xff
			d.Token = tok
		}
		if r.down[id] {
			d.DataEndpoint = closedAddr
			if d.GetTransferEndpoint() != "" {
				d.TransferEndpoint = closedAddr
			}
		}
	}
}

// xferCounts counts bulk transfer requests by operation.
type xferCounts struct{ writes, reads atomic.Int64 }

// proxy forwards bulk transfer connections to an agent's listener, reading
// each request's header (to count it and to know how much payload follows)
// and passing the answers back untouched.
type proxy struct {
	ln       net.Listener
	upstream string
	n        *xferCounts
	wg       sync.WaitGroup

	mu    sync.Mutex
	conns []net.Conn
}

func startProxy(t *testing.T, upstream string, n *xferCounts) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, upstream: upstream, n: n}
	p.wg.Go(p.serve)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *proxy) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns = append(p.conns, c)
}

func (p *proxy) serve() {
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.track(down)
		p.wg.Go(func() { p.relay(down) })
	}
}

func (p *proxy) relay(down net.Conn) {
	defer down.Close()
	up, err := net.Dial("tcp", p.upstream)
	if err != nil {
		return
	}
	p.track(up)
	defer up.Close()
	p.wg.Go(func() {
		_, _ = io.Copy(down, up)
		_ = down.Close()
	})
	if _, err := io.CopyN(up, down, int64(len(xfer.Preamble))); err != nil {
		return
	}
	var buf []byte
	for {
		hdr, _, scratch, err := xfer.ReadHeader(down, buf, 0)
		buf = scratch
		if err != nil {
			return
		}
		var req agentv1.TransferRequest
		if err := xfer.DecodeHeader(hdr, &req); err != nil {
			return
		}
		var payload int64
		switch req.GetOp() {
		case agentv1.TransferOp_TRANSFER_OP_WRITE:
			p.n.writes.Add(1)
			for _, it := range req.GetItems() {
				payload += int64(it.GetLength())
			}
		case agentv1.TransferOp_TRANSFER_OP_READ:
			p.n.reads.Add(1)
		}
		frame := binary.LittleEndian.AppendUint32(nil, uint32(len(hdr)))
		if _, err := up.Write(append(frame, hdr...)); err != nil {
			return
		}
		if _, err := io.CopyN(up, down, payload); err != nil {
			return
		}
	}
}
