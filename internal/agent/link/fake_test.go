package link

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/durationpb"
)

// fakeMaster is a hand-written SegmentService: every Connect becomes a
// fakeSession the test drives message by message, and so does every Follow
// unless followErr answers it.
type fakeMaster struct {
	masterv1.UnimplementedSegmentServiceServer
	sessions chan *fakeSession
	follows  chan *fakeSession
	// followErr, when set, answers every Follow at once (the leader's
	// MASTER_IS_LEADER); set before the link starts.
	followErr func() error
	// followCalls counts Follow calls.
	followCalls atomic.Int64
	// onApplied, when set (before the link starts), is called with each
	// SettingsApplied as it arrives.
	onApplied func(*masterv1.SettingsApplied)
}

func newFakeMaster() *fakeMaster {
	return &fakeMaster{sessions: make(chan *fakeSession, 16), follows: make(chan *fakeSession, 16)}
}

func errMasterLeader() error {
	return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_IS_LEADER, "this master is the leader"))
}

type fakeSession struct {
	reg *masterv1.Register
	// allocs is the registration's allocation table, from its chunks.
	allocs []*masterv1.Allocation
	recv   chan *masterv1.ConnectRequest  // agent → master after Register
	send   chan *masterv1.ConnectResponse // master → agent
	// applied holds the agent's SettingsApplied answers (recv never
	// does).
	applied chan *masterv1.SettingsApplied
	drop    chan error // end the stream with this status
	// ended is closed when the handler returns; eof is set when the agent
	// closed its send side.
	ended chan struct{}
	eof   atomic.Bool
}

func (f *fakeMaster) Connect(stream masterv1.SegmentService_ConnectServer) error {
	return f.serve(stream, f.sessions)
}

func (f *fakeMaster) Follow(stream masterv1.SegmentService_FollowServer) error {
	f.followCalls.Add(1)
	if f.followErr != nil {
		return f.followErr()
	}
	return f.serve(stream, f.follows)
}

// recvTable receives a chunked Register's table, up to the last chunk.
func recvTable(recv func() (*masterv1.ConnectRequest, error)) ([]*masterv1.Allocation, error) {
	var table []*masterv1.Allocation
	for {
		m, err := recv()
		if err != nil {
			return nil, err
		}
		ch := m.GetRegisterChunk()
		if ch == nil {
			return nil, fmt.Errorf("fake master: got %T inside the registration", m.GetMsg())
		}
		for _, a := range ch.GetAllocations() {
			a.SegmentId = ch.GetSegmentId()
		}
		table = append(table, ch.GetAllocations()...)
		if ch.GetLast() {
			return table, nil
		}
	}
}

// serve hands the stream to the test as a fakeSession on out once its
// registration is in (a resume Register has no table after it).
func (f *fakeMaster) serve(stream masterv1.SegmentService_ConnectServer, out chan<- *fakeSession) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	var table []*masterv1.Allocation
	if r := first.GetRegister(); r.GetChunked() && !r.GetResume() {
		if table, err = recvTable(stream.Recv); err != nil {
			return err
		}
	}
	s := &fakeSession{
		reg:     first.GetRegister(),
		allocs:  table,
		recv:    make(chan *masterv1.ConnectRequest, 1024),
		send:    make(chan *masterv1.ConnectResponse, 64),
		applied: make(chan *masterv1.SettingsApplied, 64),
		drop:    make(chan error, 1),
		ended:   make(chan struct{}),
	}
	defer close(s.ended)
	ctx := stream.Context()
	select {
	case out <- s:
	case <-ctx.Done():
		return ctx.Err()
	}
	recvDone := make(chan error, 1)
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					s.eof.Store(true)
				}
				recvDone <- err
				return
			}
			if a := m.GetSettingsApplied(); a != nil {
				if f.onApplied != nil {
					f.onApplied(a)
				}
				select {
				case s.applied <- a:
				default:
				}
				continue
			}
			select {
			case s.recv <- m:
			default: // a test that does not read heartbeats must not block the stream
			}
		}
	}()
	// This handler goroutine is the stream's only sender.
	for {
		select {
		case m := <-s.send:
			if err := stream.Send(m); err != nil {
				return err
			}
		case err := <-s.drop:
			return err
		case err := <-recvDone:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// harness is an agent link wired to a fake master over bufconn or loopback.
type harness struct {
	t      *testing.T
	master *fakeMaster
	// standbys are further fake masters (harnessOpts.standbys), at
	// passthrough:///standby-<i> after the master in the link's list.
	standbys []*fakeMaster
	segs     *segment.Set
	mem      *segment.Segment
	feed     *segment.Feed // nil without harnessOpts.feed
	reg      *prometheus.Registry
	link     *Link
	cancel   context.CancelFunc
	done     chan error

	mu       sync.Mutex
	settings []*masterv1.Settings
	gs       *grpc.Server // the current fake master server
	addr     string       // its TCP address (tcp mode)
	// serverOpts are the fake master server's options (TLS credentials).
	serverOpts []grpc.ServerOption
}

type harnessOpts struct {
	cfg Config
	// addr, when set, is dialed over TCP instead of bufconn (a proxy).
	addr func(masterAddr string) string
	tcp  bool
	// server adds options to the fake master's server (TLS credentials,
	// an interceptor).
	server []grpc.ServerOption
	// feed attaches a table change feed of feedSize changes (0: the
	// default) to the segments and the link.
	feed     bool
	feedSize int
	// standbys adds fake masters to the list (bufconn only); the first
	// master then answers Follow with MASTER_IS_LEADER, and the standbys
	// with standbyFollowErr when set.
	standbys         int
	standbyFollowErr func() error
	// masters, when set, rewrites the link's master list.
	masters func(list string) string
	// now, when set, is the link's clock.
	now func() time.Time
	// applyDelay is how long OnSettings takes (a data plane slow to take
	// its keys).
	applyDelay time.Duration
}

func newHarness(t *testing.T, o harnessOpts) *harness {
	t.Helper()
	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, master: newFakeMaster(), mem: mem, segs: segment.NewSet(mem), done: make(chan error, 1), serverOpts: o.server, reg: prometheus.NewRegistry()}
	if o.feed {
		h.feed = segment.NewFeed(o.feedSize)
		h.segs.SetFeed(h.feed)
	}
	if o.standbys > 0 {
		h.master.followErr = errMasterLeader
	}

	gs := h.newServer()
	var dial []grpc.DialOption
	addr := "passthrough:///master"
	if o.standbys > 0 {
		if o.tcp {
			t.Fatal("harness: standbys need bufconn")
		}
		ml := bufconn.Listen(1 << 20)
		lis := map[string]*bufconn.Listener{"master": ml}
		go func() { _ = gs.Serve(ml) }()
		for i := range o.standbys {
			fm := newFakeMaster()
			fm.followErr = o.standbyFollowErr
			h.standbys = append(h.standbys, fm)
			sgs := h.grpcServer(fm)
			name := fmt.Sprintf("standby-%d", i)
			sl := bufconn.Listen(1 << 20)
			lis[name] = sl
			go func() { _ = sgs.Serve(sl) }()
			t.Cleanup(sgs.Stop)
			addr += ",passthrough:///" + name
		}
		dial = append(dial, grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
			l, ok := lis[a]
			if !ok {
				return nil, fmt.Errorf("no fake master at %q", a)
			}
			return l.DialContext(ctx)
		}))
	} else if o.tcp {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = gs.Serve(lis) }()
		addr = lis.Addr().String()
		h.addr = addr
		if o.addr != nil {
			addr = o.addr(addr)
		}
	} else {
		lis := bufconn.Listen(1 << 20)
		go func() { _ = gs.Serve(lis) }()
		dial = append(dial, grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	}

	if o.masters != nil {
		addr = o.masters(addr)
	}
	cfg := o.cfg
	cfg.MasterAddr, cfg.AgentID, cfg.HostID, cfg.DataEndpoint, cfg.TransferEndpoint = addr, "agent-1", "host-1", "agent-1:50052", "agent-1:50054"
	if cfg.BackoffBase == 0 {
		cfg.BackoffBase, cfg.BackoffMax = 5*time.Millisecond, 50*time.Millisecond
	}
	if cfg.SettingsTimeout == 0 {
		cfg.SettingsTimeout = 2 * time.Second
	}
	if cfg.ShutdownGrace == 0 {
		cfg.ShutdownGrace = 50 * time.Millisecond
	}
	l, err := New(cfg, Deps{
		Now:      o.now,
		Segments: h.segs,
		Feed:     h.feed,
		OnSettings: func(s *masterv1.Settings) {
			time.Sleep(o.applyDelay)
			h.mu.Lock()
			h.settings = append(h.settings, s)
			h.mu.Unlock()
		},
		MasterDialOptions: dial,
		Registerer:        h.reg,
	}, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	h.link = l
	t.Cleanup(func() {
		h.stop()
		_ = l.Close()
		h.mu.Lock()
		h.gs.Stop()
		h.mu.Unlock()
		_ = h.segs.Close()
	})
	return h
}

// grpcServer is a fake master's server with the harness's options.
func (h *harness) grpcServer(m *fakeMaster) *grpc.Server {
	gs := grpc.NewServer(append([]grpc.ServerOption{grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true})}, h.serverOpts...)...)
	masterv1.RegisterSegmentServiceServer(gs, m)
	return gs
}

func (h *harness) newServer() *grpc.Server {
	gs := h.grpcServer(h.master)
	h.mu.Lock()
	h.gs = gs
	h.mu.Unlock()
	return gs
}

// restartMaster stops the fake master (tcp mode), waits down, and serves
// again on the same address.
func (h *harness) restartMaster(down time.Duration) {
	h.t.Helper()
	h.mu.Lock()
	h.gs.Stop()
	h.mu.Unlock()
	time.Sleep(down)
	lis, err := net.Listen("tcp", h.addr)
	if err != nil {
		h.t.Fatal(err)
	}
	gs := h.newServer()
	go func() { _ = gs.Serve(lis) }()
}

func (h *harness) start() {
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- h.link.Run(ctx) }()
}

// stop signals shutdown and waits for Run to return.
func (h *harness) stop() {
	if h.cancel == nil {
		return
	}
	h.cancel()
	h.cancel = nil
	select {
	case err := <-h.done:
		if err != nil {
			h.t.Errorf("Run = %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		h.t.Error("Run did not return after shutdown")
	}
}

func (h *harness) session() *fakeSession {
	h.t.Helper()
	return h.sessionWithin(5 * time.Second)
}

func (h *harness) sessionWithin(d time.Duration) *fakeSession {
	h.t.Helper()
	select {
	case s := <-h.master.sessions:
		return s
	case <-time.After(d):
		h.t.Fatal("agent did not connect")
		return nil
	}
}

// standbySettings is a standby's answer to a Follow registration.
func standbySettings() *masterv1.ConnectResponse {
	m := settings(0)
	m.GetSettings().Standby = true
	return m
}

// follow returns the next Follow stream the fake master m accepted.
func (h *harness) follow(m *fakeMaster) *fakeSession {
	h.t.Helper()
	select {
	case s := <-m.follows:
		return s
	case <-time.After(5 * time.Second):
		h.t.Fatal("agent did not follow")
		return nil
	}
}

// requestTable answers a resume Register with TableRequest and returns the
// full registration that follows on the same stream.
func (s *fakeSession) requestTable(t *testing.T, reason string) (*masterv1.Register, []*masterv1.Allocation) {
	t.Helper()
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_TableRequest{TableRequest: &masterv1.TableRequest{Reason: reason}}}
	r := s.next(t).GetRegister()
	if r == nil {
		t.Fatal("no Register after TableRequest")
	}
	table, err := recvTable(func() (*masterv1.ConnectRequest, error) { return s.next(t), nil })
	if err != nil {
		t.Fatal(err)
	}
	return r, table
}

func settings(epoch uint64) *masterv1.ConnectResponse {
	return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: &masterv1.Settings{
		Epoch: epoch, HeartbeatInterval: durationpb.New(20 * time.Millisecond), SuspectAfter: durationpb.New(time.Second),
		UnmountAfter: durationpb.New(10 * time.Second), ReservedGrace: durationpb.New(time.Minute),
		TokenKeys: []*masterv1.TokenKey{{Id: 1, Key: []byte("0123456789abcdef0123456789abcdef")}}, MasterId: "fake",
	}}}
}

// next returns the next agent message that is not a heartbeat.
func (s *fakeSession) next(t *testing.T) *masterv1.ConnectRequest {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case m := <-s.recv:
			if m.GetHeartbeat() != nil {
				continue
			}
			return m
		case <-deadline:
			t.Fatal("no message from the agent")
			return nil
		}
	}
}

func (s *fakeSession) heartbeat(t *testing.T) *masterv1.Heartbeat {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case m := <-s.recv:
			if hb := m.GetHeartbeat(); hb != nil {
				return hb
			}
		case <-deadline:
			t.Fatal("no heartbeat from the agent")
			return nil
		}
	}
}

// proxy forwards TCP connections to target. cut blackholes the connections
// open at that moment: they stay open and silently drop every byte, as a cut
// network does; connections made later are forwarded normally.
type proxy struct {
	lis    net.Listener
	target string
	mu     sync.Mutex
	conns  []*piped
	wg     sync.WaitGroup
}

type piped struct {
	a, b  net.Conn
	black atomic.Bool
}

func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{lis: lis, target: target}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) addr() string { return p.lis.Addr().String() }

func (p *proxy) accept() {
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		pc := &piped{a: c, b: u}
		p.mu.Lock()
		p.conns = append(p.conns, pc)
		p.mu.Unlock()
		p.wg.Go(func() { pc.pipe(u, c) })
		p.wg.Go(func() { pc.pipe(c, u) })
	}
}

func (pc *piped) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !pc.black.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			_ = dst.Close()
			return
		}
	}
}

// cut blackholes every open connection.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		pc.black.Store(true)
	}
}

func (p *proxy) close() {
	_ = p.lis.Close()
	p.mu.Lock()
	for _, pc := range p.conns {
		_ = pc.a.Close()
		_ = pc.b.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func codesErr(c codes.Code) error { return status.Error(c, "dropped by the fake master") }
