// Package link is the agent's end of SegmentService.Connect: it dials the
// master, registers (agent id, host id, data endpoint, segments, the full
// allocation table, the highest epoch it has accepted), waits for Settings,
// heartbeats, answers batched Reserve/Release/Seal/Copy commands (several in
// flight), and reconnects with jittered exponential backoff when the stream
// ends. Commands from an epoch older than the highest one seen are refused
// item by item with STALE_EPOCH.
//
// Per session exactly one goroutine (the sender) calls Send and CloseSend;
// the receive loop and the command workers enqueue on a bounded channel.
//
// Run's context is the shutdown signal: when it ends the link announces a
// graceful unmount (Deregister{grace}), keeps the session (heartbeats,
// commands) and the data plane's reads going for ShutdownGrace, then closes
// the stream and returns.
package link

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/services/agent/internal/segment"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Config tunes the link. Zero fields take the defaults of DefaultConfig.
type Config struct {
	// MasterAddr is the master's gRPC address (host:port or a gRPC target).
	MasterAddr string
	AgentID    string
	HostID     string
	// DataEndpoint is host:port of this agent's DataService as clients dial it.
	DataEndpoint string
	// TransferEndpoint is host:port of this agent's bulk transfer listener
	// (internal/xfer) as clients dial it; empty when it is off.
	TransferEndpoint string
	Version          string

	// BackoffBase and BackoffMax bound the reconnect delay; each failed
	// attempt doubles it, with jitter; a session that registered resets it.
	BackoffBase time.Duration
	BackoffMax  time.Duration
	// SettingsTimeout bounds the wait for Settings after Register.
	SettingsTimeout time.Duration
	// ShutdownGrace is announced in Deregister and is how long the agent
	// keeps serving after the shutdown signal.
	ShutdownGrace time.Duration
	// CloseTimeout bounds the wait for the master to end the stream after
	// the agent closed its send side.
	CloseTimeout time.Duration
	// MaxInFlight bounds the commands handled concurrently.
	MaxInFlight int
	// SendQueue is the capacity of the outgoing queue.
	SendQueue int
	// ReservedGrace is used until Settings carry one.
	ReservedGrace time.Duration
	// KeepaliveTime and KeepaliveTimeout detect a dead master connection
	// (a blackholed network never errors a Recv on its own).
	KeepaliveTime    time.Duration
	KeepaliveTimeout time.Duration
	// CopyChunk is the message size of a Copy to another agent.
	CopyChunk int
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		BackoffBase:      250 * time.Millisecond,
		BackoffMax:       5 * time.Second,
		SettingsTimeout:  10 * time.Second,
		ShutdownGrace:    5 * time.Second,
		CloseTimeout:     2 * time.Second,
		MaxInFlight:      16,
		SendQueue:        256,
		ReservedGrace:    60 * time.Second,
		KeepaliveTime:    10 * time.Second,
		KeepaliveTimeout: 5 * time.Second,
		CopyChunk:        1 << 20,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	dur := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	dur(&c.BackoffBase, d.BackoffBase)
	dur(&c.BackoffMax, d.BackoffMax)
	dur(&c.SettingsTimeout, d.SettingsTimeout)
	dur(&c.CloseTimeout, d.CloseTimeout)
	dur(&c.ReservedGrace, d.ReservedGrace)
	dur(&c.KeepaliveTime, d.KeepaliveTime)
	dur(&c.KeepaliveTimeout, d.KeepaliveTimeout)
	if c.ShutdownGrace < 0 {
		c.ShutdownGrace = 0
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	if c.SendQueue <= 0 {
		c.SendQueue = d.SendQueue
	}
	if c.CopyChunk <= 0 {
		c.CopyChunk = d.CopyChunk
	}
	return c
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if c.MasterAddr == "" {
		errs = append(errs, errors.New("master address is required"))
	}
	if c.AgentID == "" {
		errs = append(errs, errors.New("agent id is required"))
	}
	if c.DataEndpoint == "" {
		errs = append(errs, errors.New("data endpoint is required"))
	}
	if c.BackoffMax < c.BackoffBase {
		errs = append(errs, fmt.Errorf("backoff max %v is below backoff base %v", c.BackoffMax, c.BackoffBase))
	}
	return errors.Join(errs...)
}

// Deps are the link's collaborators.
type Deps struct {
	Segments *segment.Set
	// OnSettings is called with every Settings the master sends (the data
	// plane takes its token key from it). It must not block.
	OnSettings func(*masterv1.Settings)
	// MasterDialOptions are added to the master connection's options
	// (tests dial bufconn). Insecure credentials unless overridden.
	MasterDialOptions []grpc.DialOption
	// CopyDialOptions are added to connections to other agents for Copy.
	CopyDialOptions []grpc.DialOption
	// Registerer receives the link metrics; nil skips them.
	Registerer prometheus.Registerer
	// Now is the clock for allocation times; nil means time.Now.
	Now func() time.Time
}

// State is the link's connection state.
type State int32

const (
	StateDisconnected State = iota
	StateConnecting
	StateConnected
	StateDeregistering
)

func (s State) String() string {
	switch s {
	case StateConnecting:
		return "connecting"
	case StateConnected:
		return "connected"
	case StateDeregistering:
		return "deregistering"
	}
	return "disconnected"
}

// Link is the agent's connection to the master.
type Link struct {
	cfg  Config
	deps Deps
	lg   *slog.Logger
	now  func() time.Time
	met  *metrics

	state   atomic.Int32
	epoch   atomic.Uint64 // highest master epoch accepted
	resGrce atomic.Int64  // reserved grace, ns
	graceCh chan struct{} // wakes the sweeper when the reserved grace changes

	// mu guards conns and closed.
	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn // Copy targets by endpoint
	closed bool
}

// New builds the link. It does no I/O and starts nothing.
func New(cfg Config, deps Deps, lg *slog.Logger) (*Link, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("link config: %w", err)
	}
	if deps.Segments == nil {
		return nil, errors.New("link: Segments is required")
	}
	l := &Link{cfg: cfg, deps: deps, lg: lg, now: deps.Now, conns: map[string]*grpc.ClientConn{}, graceCh: make(chan struct{}, 1)}
	if l.now == nil {
		l.now = time.Now
	}
	l.resGrce.Store(int64(cfg.ReservedGrace))
	l.met = newMetrics(deps.Registerer, l)
	return l, nil
}

// State is the current connection state.
func (l *Link) State() State { return State(l.state.Load()) }

// Epoch is the highest master epoch the agent has accepted.
func (l *Link) Epoch() uint64 { return l.epoch.Load() }

func (l *Link) setState(s State) { l.state.Store(int32(s)) }

// Run keeps a session with the master until ctx ends, then deregisters,
// keeps serving for ShutdownGrace and returns. It returns nil on a clean
// shutdown.
func (l *Link) Run(ctx context.Context) error {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		rpccodec.DialOption(),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: l.cfg.KeepaliveTime, Timeout: l.cfg.KeepaliveTimeout, PermitWithoutStream: true}),
		// Register carries the whole allocation table and Settings may carry
		// every allocation the master wants released: either can pass
		// gRPC's 4 MiB default, which would end the session and, on every
		// reconnect, end it again. Match the master's server limit.
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(server.MaxMessageBytes), grpc.MaxCallSendMsgSize(server.MaxMessageBytes)),
		// The channel's own redial backoff (default up to 120 s) would
		// otherwise outlast ours while the master is down: Connect fails
		// fast until the channel dials again.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           grpcbackoff.Config{BaseDelay: l.cfg.BackoffBase, Multiplier: 1.6, Jitter: 0.2, MaxDelay: l.cfg.BackoffMax},
			MinConnectTimeout: 5 * time.Second,
		}),
	}, l.deps.MasterDialOptions...)
	cc, err := grpc.NewClient(l.cfg.MasterAddr, opts...)
	if err != nil {
		return fmt.Errorf("link: master address %q: %w", l.cfg.MasterAddr, err)
	}
	defer cc.Close()
	client := masterv1.NewSegmentServiceClient(cc)

	// work outlives ctx by the shutdown grace (plus the close timeout as a
	// hard bound); sessions and the sweeper run under it.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	sh := &shutdown{stop: make(chan struct{})}
	var wg sync.WaitGroup
	defer func() {
		cancelWork()
		wg.Wait()
	}()
	wg.Go(func() { l.sweep(work) })
	wg.Go(func() {
		select {
		case <-ctx.Done():
		case <-work.Done():
			return
		}
		sh.begin(time.Now().Add(l.cfg.ShutdownGrace))
		t := time.NewTimer(l.cfg.ShutdownGrace + l.cfg.CloseTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			cancelWork()
		case <-work.Done():
		}
	})

	attempt := 0
	stopC := sh.stop // nil once a shutdown has cut a backoff short
	for {
		if sh.over(time.Now()) || work.Err() != nil {
			l.setState(StateDisconnected)
			return nil
		}
		l.setState(StateConnecting)
		established, err := l.session(work, client, sh)
		l.setState(StateDisconnected)
		if sh.over(time.Now()) || work.Err() != nil {
			return nil
		}
		if established {
			attempt = 0
		}
		l.met.sessions.WithLabelValues(sessionResult(established, err)).Inc()
		delay := retry.Delay(l.cfg.BackoffBase, l.cfg.BackoffMax, attempt)
		attempt++
		l.lg.Warn("master session ended; reconnecting", "master", l.cfg.MasterAddr, "err", err, "established", established, "retry_in", delay)
		if sh.stopping() {
			delay = min(delay, max(time.Until(sh.deadlineAt()), 0))
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-work.Done():
			t.Stop()
		case <-stopC:
			// The shutdown began while disconnected: try once more at
			// once so the master hears of the graceful unmount.
			stopC = nil
			t.Stop()
		}
	}
}

func sessionResult(established bool, err error) string {
	switch {
	case established:
		return "established"
	case err == nil:
		return "closed"
	}
	return "failed"
}

// shutdown is the link's view of the shutdown signal: stop is closed once
// the grace deadline is set.
type shutdown struct {
	stop chan struct{}
	once sync.Once
	// mu guards deadline.
	mu       sync.Mutex
	deadline time.Time
}

func (s *shutdown) begin(deadline time.Time) {
	s.once.Do(func() {
		s.mu.Lock()
		s.deadline = deadline
		s.mu.Unlock()
		close(s.stop)
	})
}

func (s *shutdown) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}

// deadlineAt returns the end of the grace period (zero before the signal).
func (s *shutdown) deadlineAt() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline
}

func (s *shutdown) over(now time.Time) bool {
	return s.stopping() && !now.Before(s.deadlineAt())
}

// sweep releases RESERVED allocations nobody sealed within the reserved
// grace.
func (l *Link) sweep(ctx context.Context) {
	for {
		grace := time.Duration(l.resGrce.Load())
		t := time.NewTimer(min(max(grace/4, 10*time.Millisecond), 5*time.Second))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-l.graceCh:
			t.Stop()
			continue
		case <-t.C:
		}
		if n := l.deps.Segments.ExpireReserved(l.now(), grace); n > 0 {
			l.met.expired.Add(float64(n))
			l.lg.Info("released unclaimed reservations", "count", n, "reserved_grace", grace)
		}
	}
}

// Close releases the connections to other agents. It is idempotent.
func (l *Link) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	var errs []error
	for _, c := range l.conns {
		errs = append(errs, c.Close())
	}
	l.conns = nil
	return errors.Join(errs...)
}

// raiseEpoch records e if it is the highest seen and reports whether e is
// acceptable (not older than the highest).
func (l *Link) raiseEpoch(e uint64) bool {
	for {
		cur := l.epoch.Load()
		if e < cur {
			return false
		}
		if e == cur || l.epoch.CompareAndSwap(cur, e) {
			return true
		}
	}
}

// errEpoch is a command's answer when its epoch is stale.
func errEpoch(got, highest uint64) error {
	return rpcerr.New(codes.FailedPrecondition, masterv1.ErrorReason_ERROR_REASON_STALE_EPOCH,
		"command from master epoch %d; this agent has accepted epoch %d", got, highest)
}

var errSettingsTimeout = errors.New("no Settings from the master in time")

// session runs one Connect stream. established reports whether Settings
// arrived (the session was healthy, so the backoff resets).
func (l *Link) session(parent context.Context, client masterv1.SegmentServiceClient, sh *shutdown) (established bool, err error) {
	ctx, cancel := context.WithCancelCause(parent)
	defer cancel(nil)
	stream, err := client.Connect(ctx, grpc.ForceCodecV2(newConnectCodec()))
	if err != nil {
		return false, err
	}
	s := &session{
		l: l, ctx: ctx, cancel: cancel, stream: stream,
		out:       make(chan *masterv1.ConnectRequest, l.cfg.SendQueue),
		interval:  make(chan time.Duration, 1),
		closeSend: make(chan struct{}),
		sem:       make(chan struct{}, l.cfg.MaxInFlight),
	}
	graceful := sh.stopping()
	s.out <- &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{
		AgentId: l.cfg.AgentID, HostId: l.cfg.HostID, DataEndpoint: l.cfg.DataEndpoint, TransferEndpoint: l.cfg.TransferEndpoint,
		Segments: l.deps.Segments.Infos(), Allocations: l.deps.Segments.Table(),
		KnownEpoch: l.epoch.Load(), GracefulUnmount: graceful, Version: l.cfg.Version,
	}}}
	recvc := make(chan received)
	recvErr := make(chan error, 1)
	s.wg.Go(s.sendLoop)
	s.wg.Go(func() { s.recvLoop(recvc, recvErr) })
	defer func() {
		cancel(nil)
		s.wg.Wait()
	}()

	// The first message must be Settings.
	t := time.NewTimer(l.cfg.SettingsTimeout)
	select {
	case rcv := <-recvc:
		t.Stop()
		msg := rcv.msg
		st := msg.GetSettings()
		if st == nil {
			return false, fmt.Errorf("master sent %T before Settings", msg.GetMsg())
		}
		if err := s.applySettings(st); err != nil {
			return false, err
		}
	case err := <-recvErr:
		t.Stop()
		return false, err
	case <-t.C:
		return false, errSettingsTimeout
	case <-ctx.Done():
		t.Stop()
		return false, context.Cause(ctx)
	}
	if graceful {
		l.setState(StateDeregistering)
	} else {
		l.setState(StateConnected)
	}
	l.lg.Info("registered with master", "master", l.cfg.MasterAddr, "epoch", l.epoch.Load(), "segments", len(l.deps.Segments.All()), "graceful", graceful)

	deregistered := false
	var graceC <-chan time.Time
	var closeC <-chan time.Time
	stopC := sh.stop
	for {
		select {
		case rcv := <-recvc:
			if err := s.handle(rcv); err != nil {
				return true, err
			}
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				err = nil
			}
			if deregistered && closeC != nil && err == nil {
				l.lg.Info("master closed the stream after deregistration")
			}
			return true, err
		case <-stopC:
			stopC = nil
			if !deregistered {
				deregistered = true
				l.setState(StateDeregistering)
				grace := max(time.Until(sh.deadlineAt()), 0)
				s.enqueue(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Deregister{Deregister: &masterv1.Deregister{
					Grace: durationpb.New(grace), Reason: "agent shutting down",
				}}})
				l.lg.Info("deregistering from master", "grace", grace)
			}
			gt := time.NewTimer(max(time.Until(sh.deadlineAt()), 0))
			defer gt.Stop()
			graceC = gt.C
		case <-graceC:
			graceC = nil
			close(s.closeSend)
			ct := time.NewTimer(l.cfg.CloseTimeout)
			defer ct.Stop()
			closeC = ct.C
		case <-closeC:
			return true, nil
		case <-ctx.Done():
			return true, context.Cause(ctx)
		}
	}
}

// session is one Connect stream's state.
type session struct {
	l      *Link
	ctx    context.Context
	cancel context.CancelCauseFunc
	stream masterv1.SegmentService_ConnectClient

	// out is the only way to the stream: sendLoop is its sole reader and
	// the only caller of Send and CloseSend.
	out       chan *masterv1.ConnectRequest
	interval  chan time.Duration // heartbeat interval updates for sendLoop
	closeSend chan struct{}      // closed to make sendLoop flush and CloseSend
	sem       chan struct{}      // command workers in flight
	wg        sync.WaitGroup     // sendLoop, recvLoop, workers
}

// enqueue hands msg to the sender; it gives up when the session ends.
func (s *session) enqueue(msg *masterv1.ConnectRequest) {
	select {
	case s.out <- msg:
	case <-s.ctx.Done():
	}
}

func (s *session) send(msg *masterv1.ConnectRequest) bool {
	if err := s.stream.Send(msg); err != nil {
		s.cancel(fmt.Errorf("send to master: %w", err))
		return false
	}
	return true
}

// sendLoop is the only goroutine that calls Send or CloseSend.
func (s *session) sendLoop() {
	var tick <-chan time.Time
	var ticker *time.Ticker
	defer func() {
		if ticker != nil {
			ticker.Stop()
		}
	}()
	var seq uint64
	for {
		select {
		case <-s.ctx.Done():
			return
		case msg := <-s.out:
			if !s.send(msg) {
				return
			}
		case d := <-s.interval:
			if ticker == nil {
				ticker = time.NewTicker(d)
				tick = ticker.C
			} else {
				ticker.Reset(d)
			}
		case <-tick:
			seq++
			if !s.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{
				Seq: seq, Segments: s.l.deps.Segments.Infos(),
			}}}) {
				return
			}
			s.l.met.heartbeats.Inc()
		case <-s.closeSend:
			for {
				select {
				case msg := <-s.out:
					if !s.send(msg) {
						return
					}
					continue
				default:
				}
				break
			}
			if err := s.stream.CloseSend(); err != nil {
				s.cancel(fmt.Errorf("close send: %w", err))
			}
			return
		}
	}
}

// received is a master message and, when its items are in the decoder's
// pooled arrays, their releaser (decode.go).
type received struct {
	msg  *masterv1.ConnectResponse
	held releaser
}

func (s *session) recvLoop(out chan<- received, errc chan<- error) {
	in := &connectResponse{ids: s.l.deps.Segments.SegmentID}
	for {
		in.ConnectResponse, in.held = new(masterv1.ConnectResponse), nil
		if err := s.stream.RecvMsg(in); err != nil {
			errc <- err
			return
		}
		select {
		case out <- received{msg: in.ConnectResponse, held: in.held}:
		case <-s.ctx.Done():
			return
		}
	}
}

func (s *session) applySettings(st *masterv1.Settings) error {
	l := s.l
	if !l.raiseEpoch(st.GetEpoch()) {
		return fmt.Errorf("master epoch %d is older than the accepted epoch %d", st.GetEpoch(), l.epoch.Load())
	}
	iv := st.GetHeartbeatInterval().AsDuration()
	if st.GetHeartbeatInterval() == nil || iv <= 0 {
		iv = time.Second
	}
	select {
	case <-s.interval:
	default:
	}
	s.interval <- iv
	if g := st.GetReservedGrace(); g != nil && g.AsDuration() > 0 && int64(g.AsDuration()) != l.resGrce.Load() {
		l.resGrce.Store(int64(g.AsDuration()))
		select {
		case l.graceCh <- struct{}{}:
		default:
		}
	}
	if rel := st.GetReleaseAllocations(); len(rel) > 0 {
		l.deps.Segments.ReleaseRefs(rel)
		l.lg.Info("released allocations the master did not claim", "count", len(rel))
	}
	if l.deps.OnSettings != nil {
		l.deps.OnSettings(st)
	}
	l.met.epoch.Set(float64(l.epoch.Load()))
	return nil
}

// handle applies one master message.
func (s *session) handle(rcv received) error {
	l := s.l
	msg := rcv.msg
	switch m := msg.GetMsg().(type) {
	case *masterv1.ConnectResponse_Settings:
		return s.applySettings(m.Settings)
	case *masterv1.ConnectResponse_Reserve:
		r := m.Reserve
		s.command("reserve", r.GetEpoch(), func() *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Reserve(r.GetItems(), l.now()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			items := make([]*masterv1.ReserveItemResult, len(r.GetItems()))
			for i := range items {
				items[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(err)}
			}
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{RequestId: r.GetRequestId(), Items: items}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Release:
		r := m.Release
		s.command("release", r.GetEpoch(), func() *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Release(r.GetItems()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{RequestId: r.GetRequestId(), Items: repeatItem(err, len(r.GetItems()))}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Seal:
		r := m.Seal
		s.command("seal", r.GetEpoch(), func() *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Seal(r.GetItems(), l.now()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{RequestId: r.GetRequestId(), Items: repeatItem(err, len(r.GetItems()))}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Copy:
		r := m.Copy
		s.command("copy", r.GetEpoch(), func() *masterv1.ConnectRequest {
			err := l.copy(s.ctx, r)
			if err != nil {
				l.lg.Warn("copy failed", "source_segment", r.GetSource().GetSegmentId(), "source_allocation", r.GetSource().GetAllocationId(),
					"target", r.GetTargetEndpoint(), "err", err)
			}
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: r.GetRequestId(), Status: rpcerr.Item(err)}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: r.GetRequestId(), Status: rpcerr.Item(err)}}}
		}, nil)
	default:
		// A newer master may send messages this agent does not know.
		l.lg.Debug("master message ignored", "msg", fmt.Sprintf("%T", msg.GetMsg()))
	}
	return nil
}

func repeatItem(err error, n int) []*masterv1.ItemStatus {
	out := make([]*masterv1.ItemStatus, n)
	for i := range out {
		out[i] = rpcerr.Item(err)
	}
	return out
}

// command runs one master command on a worker (at most MaxInFlight at once)
// after the epoch check, and enqueues its result. A stale command is
// answered at once with every item refused. held, when not nil, holds the
// command's items: it is released once run or refuse has returned.
func (s *session) command(kind string, epoch uint64, run func() *masterv1.ConnectRequest, refuse func(error) *masterv1.ConnectRequest, held releaser) {
	l := s.l
	if !l.raiseEpoch(epoch) {
		l.met.commands.WithLabelValues(kind, "stale_epoch").Inc()
		l.lg.Warn("command from a stale master epoch refused", "kind", kind, "epoch", epoch, "accepted_epoch", l.epoch.Load())
		msg := refuse(errEpoch(epoch, l.epoch.Load()))
		if held != nil {
			held.release()
		}
		s.enqueue(msg)
		return
	}
	select {
	case s.sem <- struct{}{}:
	case <-s.ctx.Done():
		return
	}
	l.met.commands.WithLabelValues(kind, "accepted").Inc()
	s.wg.Go(func() {
		defer func() { <-s.sem }()
		msg := run()
		if held != nil {
			held.release()
		}
		s.enqueue(msg)
	})
}

// copy streams a local sealed allocation into a reserved allocation at
// another agent.
func (l *Link) copy(ctx context.Context, r *masterv1.CopyRequest) error {
	src, dst := r.GetSource(), r.GetTarget()
	if src == nil || dst == nil || r.GetTargetEndpoint() == "" {
		return rpcerr.New(codes.InvalidArgument, masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "copy needs a source, a target and a target endpoint")
	}
	seg, ok := l.deps.Segments.Get(src.GetSegmentId())
	if !ok {
		return rpcerr.New(codes.NotFound, masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", src.GetSegmentId())
	}
	h, err := seg.OpenRead(src.GetAllocationId())
	if err != nil {
		return err
	}
	defer h.Close()
	cc, err := l.conn(r.GetTargetEndpoint())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := agentv1.NewDataServiceClient(cc).Write(ctx)
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	size, chunk := h.Size(), uint64(l.cfg.CopyChunk)
	var buf []byte
	for off, first := uint64(0), true; first || off < size; first = false {
		n := min(chunk, size-off)
		data, err := h.Bytes(off, n)
		if err != nil {
			return err
		}
		if data == nil && n > 0 {
			if uint64(cap(buf)) < n {
				buf = make([]byte, n)
			}
			data = buf[:n]
			if err := h.ReadAt(data, off); err != nil {
				return rpcerr.New(codes.Internal, masterv1.ErrorReason_ERROR_REASON_INTERNAL, "read allocation %d: %v", src.GetAllocationId(), err)
			}
		}
		req := &agentv1.WriteRequest{Data: data}
		if first {
			req.Header = &agentv1.WriteHeader{SegmentId: dst.GetSegmentId(), AllocationId: dst.GetAllocationId(), Token: r.GetTargetToken()}
		}
		if err := stream.Send(req); err != nil {
			break // the status comes from CloseAndRecv
		}
		off += n
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	if resp.GetBytesWritten() != size {
		return rpcerr.New(codes.Internal, masterv1.ErrorReason_ERROR_REASON_INTERNAL, "target wrote %d of %d bytes", resp.GetBytesWritten(), size)
	}
	l.met.copiedBytes.Add(float64(size))
	return nil
}

// conn returns a cached connection to another agent's DataService.
func (l *Link) conn(endpoint string) (*grpc.ClientConn, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, rpcerr.New(codes.Unavailable, masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent is shutting down")
	}
	if c, ok := l.conns[endpoint]; ok {
		return c, nil
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		rpccodec.DialOption(),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(256<<20), grpc.MaxCallRecvMsgSize(256<<20)),
	}, l.deps.CopyDialOptions...)
	c, err := grpc.NewClient(endpoint, opts...)
	if err != nil {
		return nil, rpcerr.New(codes.InvalidArgument, masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "target endpoint %q: %v", endpoint, err)
	}
	l.conns[endpoint] = c
	return c, nil
}
