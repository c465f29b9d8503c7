package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	grpcmw "github.com/grpc-ecosystem/go-grpc-middleware/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeMeta is a hand-written cluster.Metadata that records its calls.
type fakeMeta struct {
	mu         sync.Mutex
	reconciles []reconcileCall
	drops      [][]string
	dropStates []masterv1.SegmentLifecycle
	losses     []reconcileCall
	reg        *registry.Registry // to observe segment states during drops

	// release, when set, is what Reconcile returns.
	release func(agentID string, allocs []*masterv1.Allocation) []*masterv1.AllocationRef
}

type reconcileCall struct {
	agentID  string
	segments []cluster.Segment
	allocs   []*masterv1.Allocation
}

func (f *fakeMeta) Reconcile(_ context.Context, agentID string, segs []cluster.Segment, allocs []*masterv1.Allocation) []*masterv1.AllocationRef {
	f.mu.Lock()
	f.reconciles = append(f.reconciles, reconcileCall{agentID, segs, allocs})
	rel := f.release
	f.mu.Unlock()
	if rel != nil {
		return rel(agentID, allocs)
	}
	return nil
}

func (f *fakeMeta) DropSegments(_ context.Context, ids []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.drops = append(f.drops, slices.Clone(ids))
	if f.reg != nil {
		for _, id := range ids {
			s, _ := f.reg.Segment(id)
			f.dropStates = append(f.dropStates, s.Lifecycle)
		}
	}
}

// droppedWhileUnmounting reports whether every DropSegments call saw its
// segments UNMOUNTING, as the contract says.
func (f *fakeMeta) droppedWhileUnmounting() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, lc := range f.dropStates {
		if lc != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING {
			return false
		}
	}
	return true
}

// Lost records the call, with copies of the allocations (the session's
// receiver reuses them once Lost returns), and reports each removed.
func (f *fakeMeta) Lost(_ context.Context, agentID string, segs []cluster.Segment, allocs []*masterv1.Allocation) int {
	own := make([]*masterv1.Allocation, len(allocs))
	for i, a := range allocs {
		own[i] = proto.CloneOf(a)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.losses = append(f.losses, reconcileCall{agentID, slices.Clone(segs), own})
	return len(allocs)
}

func (f *fakeMeta) lostCalls() []reconcileCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.losses)
}

func (f *fakeMeta) SegmentReplicaCounts() map[string]uint64 { return nil }

func (f *fakeMeta) reconcileCalls() []reconcileCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.reconciles)
}

func (f *fakeMeta) dropped() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, d := range f.drops {
		out = append(out, d...)
	}
	slices.Sort(out)
	return out
}

// harness is a master (registry + session manager + gRPC server) on a
// bufconn listener, or on a loopback port when tcp is set.
type harness struct {
	t     testing.TB
	clock *testutil.Clock // nil with a real clock
	m     *Manager
	reg   *registry.Registry
	meta  *fakeMeta
	prom  *prometheus.Registry
	dial  func(ctx context.Context) (*grpc.ClientConn, error)
	addr  string // loopback address when tcp
}

const testEpoch = 7

// fastConfig has real-time heartbeats and timeouts short enough for tests.
// Liveness (suspect 100 ms, unmount 500 ms) runs on the harness's fake
// clock unless the harness uses a real one, so a loaded machine cannot
// make a test agent look dead.
func fastConfig() Config {
	return Config{
		HeartbeatInterval: 20 * time.Millisecond,
		SuspectAfter:      100 * time.Millisecond,
		UnmountAfter:      500 * time.Millisecond,
		ReservedGrace:     time.Second,
		RegisterTimeout:   time.Second,
		RequestTimeout:    2 * time.Second,
		SweepInterval:     10 * time.Millisecond,
	}
}

type harnessOpts struct {
	tcp       bool // loopback TCP instead of bufconn
	realClock bool // liveness on the wall clock
}

func newHarness(t testing.TB, cfg Config, opts harnessOpts) *harness {
	t.Helper()
	lg := testutil.Logger()
	prom := prometheus.NewRegistry()
	var clock *testutil.Clock
	deps := registry.Deps{Metrics: prom}
	if !opts.realClock {
		clock = testutil.NewClock(time.Unix(1_700_000_000, 0))
		deps.Clock = clock.Now
	}
	reg, err := registry.New(registry.Config{DefaultGrace: time.Second}, deps, lg)
	if err != nil {
		t.Fatal(err)
	}
	meta := &fakeMeta{reg: reg}
	m, err := New(cfg, Deps{
		Identity: cluster.Identity{MasterID: "master-test", Epoch: testEpoch, Keys: token.NewRingWithKey(testTokenKey)},
		Registry: reg, Metadata: meta, Metrics: prom,
	}, lg)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.StreamInterceptor(testPrincipal))
	masterv1.RegisterSegmentServiceServer(gs, m)
	h := &harness{t: t, clock: clock, m: m, reg: reg, meta: meta, prom: prom}
	var lis net.Listener
	if opts.tcp {
		lis, err = net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		h.addr = lis.Addr().String()
		h.dial = func(context.Context) (*grpc.ClientConn, error) {
			return grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		}
	} else {
		bl := bufconn.Listen(1 << 20)
		lis = bl
		h.dial = func(context.Context) (*grpc.ClientConn, error) {
			return grpc.NewClient("passthrough:///bufnet",
				grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return bl.DialContext(ctx) }),
				grpc.WithTransportCredentials(insecure.NewCredentials()))
		}
	}
	var wg sync.WaitGroup
	runCtx, stopRun := context.WithCancel(context.Background())
	wg.Go(func() { _ = gs.Serve(lis) })
	wg.Go(func() { _ = m.Run(runCtx) })
	t.Cleanup(func() {
		stopRun()
		_ = m.Close()
		gs.Stop()
		wg.Wait()
		if !meta.droppedWhileUnmounting() {
			t.Error("DropSegments saw a segment that was not UNMOUNTING")
		}
	})
	return h
}

// advance moves the fake clock and runs a liveness pass.
func (h *harness) advance(d time.Duration) {
	h.t.Helper()
	if h.clock == nil {
		h.t.Fatal("advance needs the fake clock")
	}
	h.clock.Advance(d)
	h.m.sweep()
}

// beatAfter waits until the agent's heartbeat has been seen at the fake
// clock's current time.
func (h *harness) beatAfter(agentID string) {
	h.t.Helper()
	now := h.clock.Now()
	testutil.Eventually(h.t, 5*time.Second, func() bool {
		a, ok := h.reg.Agent(agentID)
		return ok && !a.LastHeartbeat.Before(now)
	}, "a heartbeat from %s", agentID)
}

// quiesce stops the agent's heartbeats and makes sure the master has
// processed every heartbeat already sent: a reserve answered after the stop
// travels behind them on the ordered stream.
func (h *harness) quiesce(a *fakeAgent) {
	h.t.Helper()
	a.setHeartbeat(false)
	if _, err := h.m.Reserve(h.t.Context(), a.id, []*masterv1.ReserveItem{{SegmentId: a.segment(), Size: 1, Key: "quiesce"}}); err != nil {
		h.t.Fatalf("quiesce %s: %v", a.id, err)
	}
}

// fakeAgent plays an agent over the generated SegmentService client. One
// goroutine sends (heartbeats and answers), one receives.
type fakeAgent struct {
	t        testing.TB
	id       string
	conn     *grpc.ClientConn
	stream   masterv1.SegmentService_ConnectClient
	cancel   context.CancelFunc
	settings *masterv1.Settings
	out      chan *masterv1.ConnectRequest
	ctl      chan func()
	wg       sync.WaitGroup

	heartbeat atomic.Bool // send heartbeats every interval
	answer    atomic.Bool // answer commands
	delay     atomic.Int64
	nextAlloc atomic.Uint64
	hbSeq     uint64
	firstSeg  string

	mu       sync.Mutex
	msgs     map[string]int // command messages received, by kind
	items    map[string]int // command items received, by kind
	epochs   []uint64
	released []*masterv1.AllocationRef
	copies   []*masterv1.CopyRequest
	traced   []tracedCmd // every command's trace context, in arrival order
	endErr   error       // the stream's final error
	ended    chan struct{}
}

// tracedCmd is the trace context a command message carried.
type tracedCmd struct {
	kind  string
	tc    *masterv1.TraceContext
	links []*masterv1.TraceContext
}

type agentOpt func(*masterv1.Register)

func withAllocations(a ...*masterv1.Allocation) agentOpt {
	return func(r *masterv1.Register) { r.Allocations = a }
}

func withSegments(ids ...string) agentOpt {
	return func(r *masterv1.Register) {
		r.Segments = nil
		for _, id := range ids {
			r.Segments = append(r.Segments, &masterv1.SegmentInfo{SegmentId: id, Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 30, Alignment: 64})
		}
	}
}

func registerMsg(agentID string, opts ...agentOpt) *masterv1.Register {
	r := &masterv1.Register{
		AgentId: agentID, HostId: "host-" + agentID, DataEndpoint: agentID + ":50052", TransferEndpoint: agentID + ":50054", KnownEpoch: testEpoch - 1, Version: "test",
	}
	withSegments(agentID + "-mem-0")(r)
	for _, o := range opts {
		o(r)
	}
	return r
}

// principalHeader carries a SPIFFE id for testPrincipal.
const principalHeader = "x-test-principal"

// testPrincipal stands in for the master's authorization interceptor
// (internal/auth, tested there and on real mTLS clusters in
// internal/testcluster): it puts the principal named in principalHeader
// into the stream's context, as the real one does from the verified
// certificate.
func testPrincipal(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	md, _ := metadata.FromIncomingContext(ss.Context())
	v := md.Get(principalHeader)
	if len(v) == 0 {
		return handler(srv, ss)
	}
	p, err := auth.ParseSPIFFE(v[0])
	if err != nil {
		return status.Error(codes.Unauthenticated, err.Error())
	}
	return handler(srv, &grpcmw.WrappedServerStream{ServerStream: ss, WrappedContext: auth.NewContext(ss.Context(), p)})
}

// connect opens a stream and sends first; it does not wait for Settings.
func (h *harness) open(first *masterv1.ConnectRequest) (*grpc.ClientConn, masterv1.SegmentService_ConnectClient, context.CancelFunc) {
	h.t.Helper()
	return h.openAs("", first)
}

// openAs is open with the stream's principal set to the SPIFFE id spiffe
// (none when empty).
func (h *harness) openAs(spiffe string, first *masterv1.ConnectRequest) (*grpc.ClientConn, masterv1.SegmentService_ConnectClient, context.CancelFunc) {
	h.t.Helper()
	conn, err := h.dial(h.t.Context())
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if spiffe != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, principalHeader, spiffe)
	}
	stream, err := masterv1.NewSegmentServiceClient(conn).Connect(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	if first != nil {
		// io.EOF means the master already ended the stream; Recv tells why.
		if err := stream.Send(first); err != nil && !errors.Is(err, io.EOF) {
			h.t.Fatal(err)
		}
	}
	return conn, stream, cancel
}

// connectAgent registers an agent, waits for Settings and starts its loops.
func (h *harness) connectAgent(agentID string, opts ...agentOpt) *fakeAgent {
	h.t.Helper()
	return h.connectWith(h.dial, agentID, opts...)
}

func (h *harness) connectWith(dial func(context.Context) (*grpc.ClientConn, error), agentID string, opts ...agentOpt) *fakeAgent {
	t := h.t
	t.Helper()
	conn, err := dial(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := masterv1.NewSegmentServiceClient(conn).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reg := registerMsg(agentID, opts...)
	if err := stream.Send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: reg}}); err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil {
		t.Fatalf("agent %s: first response: %v", agentID, err)
	}
	if first.GetSettings() == nil {
		t.Fatalf("agent %s: first response: got %T, want Settings", agentID, first.GetMsg())
	}
	// As an agent does once it holds the Settings' keys: the master makes
	// its segments readable on this answer.
	if err := stream.Send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SettingsApplied{SettingsApplied: &masterv1.SettingsApplied{}}}); err != nil {
		t.Fatal(err)
	}
	a := &fakeAgent{
		t: t, id: agentID, conn: conn, stream: stream, cancel: cancel, settings: first.GetSettings(),
		out: make(chan *masterv1.ConnectRequest, 1024), ctl: make(chan func()), msgs: map[string]int{}, items: map[string]int{},
		ended: make(chan struct{}),
	}
	a.firstSeg = reg.GetSegments()[0].GetSegmentId()
	a.heartbeat.Store(true)
	a.answer.Store(true)
	interval := a.settings.GetHeartbeatInterval().AsDuration()
	a.wg.Go(func() { a.sendLoop(ctx, interval) })
	a.wg.Go(a.recvLoop)
	t.Cleanup(a.stop)
	return a
}

// segment is the agent's first registered segment id.
func (a *fakeAgent) segment() string { return a.firstSeg }

func (a *fakeAgent) sendLoop(ctx context.Context, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.ended:
			return
		case <-tick.C:
			if !a.heartbeat.Load() {
				continue
			}
			a.hbSeq++
			if a.stream.Send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: a.hbSeq}}}) != nil {
				return
			}
		case msg := <-a.out:
			if a.stream.Send(msg) != nil {
				return
			}
		case f := <-a.ctl:
			f()
		}
	}
}

// setHeartbeat turns heartbeats on or off; once it returns, no heartbeat
// is sent until they are turned on again.
func (a *fakeAgent) setHeartbeat(on bool) {
	done := make(chan struct{})
	select {
	case a.ctl <- func() { a.heartbeat.Store(on); close(done) }:
		<-done
	case <-a.ended:
		a.heartbeat.Store(on)
	}
}

func (a *fakeAgent) recvLoop() {
	defer close(a.ended)
	for {
		msg, err := a.stream.Recv()
		if err != nil {
			a.mu.Lock()
			a.endErr = err
			a.mu.Unlock()
			return
		}
		if d := time.Duration(a.delay.Load()); d > 0 {
			// Answer later, without holding up the receiver.
			m := msg
			a.wg.Go(func() {
				t := time.NewTimer(d)
				defer t.Stop()
				select {
				case <-t.C:
					a.handle(m)
				case <-a.ended:
				}
			})
			continue
		}
		a.handle(msg)
	}
}

func (a *fakeAgent) handle(msg *masterv1.ConnectResponse) {
	a.mu.Lock()
	var reply *masterv1.ConnectRequest
	switch v := msg.GetMsg().(type) {
	case *masterv1.ConnectResponse_Reserve:
		a.msgs["reserve"]++
		a.items["reserve"] += len(v.Reserve.GetItems())
		a.epochs = append(a.epochs, v.Reserve.GetEpoch())
		a.traced = append(a.traced, tracedCmd{"reserve", v.Reserve.GetTraceContext(), v.Reserve.GetTraceLinks()})
		res := &masterv1.ReserveResult{RequestId: v.Reserve.GetRequestId()}
		for _, it := range v.Reserve.GetItems() {
			// The offset echoes the replica id so callers can check routing.
			res.Items = append(res.Items, &masterv1.ReserveItemResult{Status: &masterv1.ItemStatus{}, AllocationId: a.nextAlloc.Add(1), Offset: uint64(it.GetReplicaId()) * 10})
		}
		reply = &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: res}}
	case *masterv1.ConnectResponse_Seal:
		a.msgs["seal"]++
		a.items["seal"] += len(v.Seal.GetItems())
		a.epochs = append(a.epochs, v.Seal.GetEpoch())
		a.traced = append(a.traced, tracedCmd{"seal", v.Seal.GetTraceContext(), v.Seal.GetTraceLinks()})
		res := &masterv1.SealResult{RequestId: v.Seal.GetRequestId()}
		for _, it := range v.Seal.GetItems() {
			st := &masterv1.ItemStatus{}
			if it.GetChecksum() == 0 {
				st = &masterv1.ItemStatus{Code: 15, Reason: "CHECKSUM_MISMATCH", Message: "bad checksum"}
			}
			res.Items = append(res.Items, st)
		}
		reply = &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: res}}
	case *masterv1.ConnectResponse_Release:
		a.msgs["release"]++
		a.items["release"] += len(v.Release.GetItems())
		a.epochs = append(a.epochs, v.Release.GetEpoch())
		a.traced = append(a.traced, tracedCmd{"release", v.Release.GetTraceContext(), v.Release.GetTraceLinks()})
		a.released = append(a.released, v.Release.GetItems()...)
		res := &masterv1.ReleaseResult{RequestId: v.Release.GetRequestId()}
		for range v.Release.GetItems() {
			res.Items = append(res.Items, &masterv1.ItemStatus{})
		}
		reply = &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: res}}
	case *masterv1.ConnectResponse_Copy:
		a.msgs["copy"]++
		a.epochs = append(a.epochs, v.Copy.GetEpoch())
		a.copies = append(a.copies, v.Copy)
		a.traced = append(a.traced, tracedCmd{"copy", v.Copy.GetTraceContext(), nil})
		// Items whose token is "bad" fail; a request of no items is
		// refused as a whole, as an agent refuses one.
		res := &masterv1.CopyResult{RequestId: v.Copy.GetRequestId()}
		for _, it := range v.Copy.GetItems() {
			st := &masterv1.ItemStatus{}
			if string(it.GetTargetToken()) == "bad" {
				st = &masterv1.ItemStatus{Code: 7, Reason: "INVALID_TOKEN"}
			}
			res.Items = append(res.Items, st)
		}
		if len(res.Items) == 0 {
			res.Status = &masterv1.ItemStatus{Code: 3, Reason: "INVALID_PARAMS"}
		}
		reply = &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: res}}
	case *masterv1.ConnectResponse_Settings:
		a.settings = v.Settings
	}
	a.mu.Unlock()
	if reply != nil && a.answer.Load() {
		a.send(reply)
	}
}

func (a *fakeAgent) send(msg *masterv1.ConnectRequest) {
	select {
	case a.out <- msg:
	case <-a.ended:
	}
}

func (a *fakeAgent) counts(kind string) (msgs, items int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.msgs[kind], a.items[kind]
}

func (a *fakeAgent) releasedRefs() []*masterv1.AllocationRef {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.released)
}

// waitEnded waits for the master to end the stream and returns its error.
func (a *fakeAgent) waitEnded(d time.Duration) error {
	a.t.Helper()
	select {
	case <-a.ended:
	case <-time.After(d):
		a.t.Fatalf("agent %s: stream still open after %v", a.id, d)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.endErr
}

func (a *fakeAgent) stop() {
	a.cancel()
	a.wg.Wait()
	_ = a.conn.Close()
}

func segState(h *harness, id string) string {
	s, ok := h.reg.Segment(id)
	if !ok {
		return "absent"
	}
	return fmt.Sprintf("%s/%s", registry.LifecycleLabel(s.Lifecycle), registry.HealthLabel(s.Health))
}

func waitState(t testing.TB, h *harness, id, want string, d time.Duration) {
	t.Helper()
	testutil.Eventually(t, d, func() bool { return segState(h, id) == want }, "segment %s %s", id, want)
}
