// Package link is the agent's end of SegmentService.Connect: it dials the
// master, registers (agent id, host id, data endpoint, segments, the full
// allocation table, the highest epoch it has accepted), waits for Settings,
// heartbeats, answers batched Reserve/Release/Seal/Copy commands (several in
// flight), and reconnects with jittered exponential backoff when the stream
// ends. Commands from an epoch older than the highest one seen are refused
// item by item with STALE_EPOCH.
//
// With a table change feed (Deps.Feed) a registration offers to resume
// instead: it carries the table's position and sends the table only when
// the master asks for it (TableRequest). With several masters it also keeps
// a SegmentService.Follow stream to each (follow.go), so the standbys hold
// the table when elected.
//
// Per session exactly one goroutine (the sender) calls Send and CloseSend;
// the receive loop and the command workers enqueue on a bounded channel.
// Per follow stream, likewise, one goroutine sends.
//
// Run's context is the shutdown signal: when it ends the link announces a
// graceful unmount (Deregister{grace}), keeps the session (heartbeats,
// commands) and the data plane's reads going for ShutdownGrace, then closes
// the stream and returns. Follow streams end with the context.
package link

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/xfer"
	"golang.org/x/sync/semaphore"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
)

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

	masters []string               // Config.MasterAddr split
	master  atomic.Pointer[string] // the address of the current or last attempt
	state   atomic.Int32
	epoch   atomic.Uint64 // highest master epoch accepted
	resGrce atomic.Int64  // reserved grace, ns
	graceCh chan struct{} // wakes the sweeper when the reserved grace changes
	// elected carries the address of a followed standby that ended its
	// follow stream because it was elected (follow.go): the session loop
	// leaves its session with another master for it at once.
	elected chan string
	// lost holds allocations dropped while serving, to report (lost.go).
	lost *lostQueue

	// pool holds the Copy connections to other agents' bulk transfer
	// listeners; copyBudget bounds the Copy bytes in flight.
	pool       *xfer.Pool
	copyBudget *semaphore.Weighted

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
	masters, err := masterlist.Split(cfg.MasterAddr)
	if err != nil {
		return nil, fmt.Errorf("link config: %w", err)
	}
	l := &Link{cfg: cfg, deps: deps, lg: lg, now: deps.Now, masters: masters, conns: map[string]*grpc.ClientConn{}, graceCh: make(chan struct{}, 1),
		elected:    make(chan string, 1),
		lost:       newLostQueue(),
		pool:       xfer.NewPool(xfer.Config{MaxIdlePerEndpoint: cfg.CopyConnsPerPeer, TLS: deps.CopyTLS}),
		copyBudget: semaphore.NewWeighted(int64(cfg.CopyMaxBytes))}
	l.master.Store(&masters[0])
	if l.now == nil {
		l.now = time.Now
	}
	l.resGrce.Store(int64(cfg.ReservedGrace))
	l.met = newMetrics(deps.Registerer, l)
	return l, nil
}

// State is the current connection state.
func (l *Link) State() State { return State(l.state.Load()) }

// Master is the address of the master the link is connected to, or trying
// (one of Config.MasterAddr's, or a leader it was redirected to).
func (l *Link) Master() string { return *l.master.Load() }

// Epoch is the highest master epoch the agent has accepted.
func (l *Link) Epoch() uint64 { return l.epoch.Load() }

func (l *Link) setState(s State) { l.state.Store(int32(s)) }

// creds are the transport credentials of the link's connections.
func (l *Link) creds() credentials.TransportCredentials {
	if l.cfg.Creds != nil {
		return l.cfg.Creds
	}
	return insecure.NewCredentials()
}

// Run keeps a session with the master until ctx ends, then deregisters,
// keeps serving for ShutdownGrace and returns. It returns nil on a clean
// shutdown.
func (l *Link) Run(ctx context.Context) error {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(l.creds()),
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
	ms := masterlist.NewPicker(l.masters)
	conns, err := masterlist.NewConns(l.masters, opts...)
	if err != nil {
		return fmt.Errorf("link: %w", err)
	}
	defer conns.Close()
	// Follow streams have connections of their own, made alike, so a
	// standby's whole table never queues behind the session's commands.
	var fconns *masterlist.Conns
	if l.following() {
		if fconns, err = masterlist.NewConns(l.masters, opts...); err != nil {
			return fmt.Errorf("link: %w", err)
		}
		defer fconns.Close()
	}

	// work outlives ctx by the shutdown grace (plus the close timeout as a
	// hard bound); sessions and the sweeper run under it.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	sh := &shutdown{stop: make(chan struct{})}
	// Followers end with ctx: a standby needs no graceful unmount.
	followCtx, cancelFollow := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancelWork()
		cancelFollow()
		wg.Wait()
	}()
	wg.Go(func() { l.sweep(work) })
	if fconns != nil {
		// One loop per master: two streams of one agent to one master
		// would replace each other there, over and over.
		seen := map[string]bool{}
		for _, addr := range l.masters {
			if !seen[addr] {
				seen[addr] = true
				wg.Go(func() { l.follow(followCtx, addr, fconns) })
			}
		}
	}
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

	stopC := sh.stop // nil once a shutdown has cut a backoff short
	// The failures to establish a session are warned of once and then
	// every 10 s while they last (an election without etcd, a master
	// recovering), not at every attempt.
	var streak retry.Streak
	for {
		if sh.over(time.Now()) || work.Err() != nil {
			l.setState(StateDisconnected)
			return nil
		}
		l.setState(StateConnecting)
		addr := ms.Current()
		l.master.Store(&addr)
		cc, err := conns.Get(addr)
		established := false
		began := l.now()
		if err == nil {
			established, err = l.sessionUntilElected(work, addr, masterv1.NewSegmentServiceClient(cc), sh)
		}
		l.setState(StateDisconnected)
		if sh.over(time.Now()) || work.Err() != nil {
			return nil
		}
		if established {
			ms.Healthy()
			streak.Succeed(l.now())
		}
		l.met.sessions.WithLabelValues(sessionResult(established, err)).Inc()
		delay, redirected := ms.Next(err, l.cfg.BackoffBase, l.cfg.BackoffMax)
		if established && l.now().Sub(began) >= quickRedialAfter {
			// A session that served for a while ended (a master restarted
			// or failed over): its replacement is most likely up already,
			// and every moment the agent waits is a moment its objects are
			// unreadable. Try again almost at once; a session that ends
			// sooner than quickRedialAfter backs off as usual, so a master
			// that keeps dropping agents is not hammered.
			delay = min(delay, retry.Jitter(quickRedial))
		}
		if redirected {
			l.met.redirects.Inc()
			l.lg.Info("master is not the leader; following its hint", "master", addr, "leader", ms.Current())
		} else {
			lvl, n, lasted := streak.FailLevel(l.now())
			l.lg.Log(work, lvl, "master session ended; reconnecting", "master", addr, "next", ms.Current(), "err", err,
				"established", established, "retry_in", delay, "failures", n, "failing_for", lasted)
		}
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

// sessionUntilElected runs a session with the master at addr until it
// ends, or until a followed standby reports that it was elected: then the
// session is left at once, and its error is a NOT_LEADER naming that
// standby, so the loop connects to it next. A leader that froze (stopped,
// hung, paused) keeps the session open until keepalive gives up on it
// (KeepaliveTime + KeepaliveTimeout, 15 s by default), and the new leader
// waits for this agent's registration before it serves: the follow
// stream's end is the earlier sign.
func (l *Link) sessionUntilElected(work context.Context, addr string, client masterv1.SegmentServiceClient, sh *shutdown) (bool, error) {
	ctx, cancel := context.WithCancelCause(work)
	defer cancel(nil)
	// An election reported between sessions is for this one.
	select {
	case e := <-l.elected:
		if e != addr {
			return false, rpcerr.NotLeader(e)
		}
	default:
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case e := <-l.elected:
				if e == addr {
					continue // the session is with it already
				}
				l.lg.Info("a followed standby was elected; leaving the session with the old leader", "master", addr, "leader", e)
				cancel(rpcerr.NotLeader(e))
				return
			case <-stop:
				return
			}
		}
	})
	established, err := l.session(ctx, client, sh)
	close(stop)
	wg.Wait()
	if _, moved := rpcerr.LeaderHint(context.Cause(ctx)); moved && work.Err() == nil {
		return established, context.Cause(ctx)
	}
	return established, err
}

// noteElected reports that the followed master at addr was elected; a
// report not yet taken is replaced.
func (l *Link) noteElected(addr string) {
	for {
		select {
		case l.elected <- addr:
			return
		default:
		}
		select {
		case <-l.elected:
		default:
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

// After a session that lasted at least quickRedialAfter, the agent dials
// again within quickRedial (jittered [quickRedial/2, quickRedial]) instead
// of waiting out BackoffBase (250 ms by default).
const (
	quickRedialAfter = 5 * time.Second
	quickRedial      = 20 * time.Millisecond
)

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
	errs := []error{l.pool.Close()}
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
