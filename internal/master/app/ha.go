package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/ha"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/session"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
)

// HA is the high-availability part of the master's configuration (issue
// 15): with EtcdEndpoints set, masters elect a leader on etcd; the others
// stand by.
type HA struct {
	// EtcdEndpoints is a comma-separated list of etcd client addresses;
	// empty runs a single master without election.
	EtcdEndpoints string
	// EtcdPrefix is the key prefix of this cluster's masters in etcd.
	EtcdPrefix string
	// EtcdLeaseTTL is the leader's lease: how long a dead leader keeps
	// the standbys from taking over.
	EtcdLeaseTTL time.Duration
	// AdvertiseAddr is the gRPC address clients are redirected to while
	// this master leads (default: this host's name and the grpc-addr port).
	AdvertiseAddr string
	// EtcdTLSCA, EtcdTLSCert and EtcdTLSKey secure the etcd connection:
	// the CA that signed etcd's server certificate, and this master's
	// client certificate and key (for etcd's --client-cert-auth). Any of
	// them set turns TLS on; read once at start.
	EtcdTLSCA, EtcdTLSCert, EtcdTLSKey string
}

// etcdTLS returns the etcd connection's TLS configuration (nil: plaintext).
func (h *HA) etcdTLS() (*tls.Config, error) {
	if h.EtcdTLSCA == "" && h.EtcdTLSCert == "" && h.EtcdTLSKey == "" {
		return nil, nil
	}
	if (h.EtcdTLSCert == "") != (h.EtcdTLSKey == "") {
		return nil, errors.New("etcd-tls-cert and etcd-tls-key go together")
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if h.EtcdTLSCA != "" {
		pem, err := os.ReadFile(h.EtcdTLSCA)
		if err != nil {
			return nil, fmt.Errorf("etcd-tls-ca: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("etcd-tls-ca %s: no certificate in it", h.EtcdTLSCA)
		}
	}
	if h.EtcdTLSCert != "" {
		kp, err := tls.LoadX509KeyPair(h.EtcdTLSCert, h.EtcdTLSKey)
		if err != nil {
			return nil, fmt.Errorf("etcd-tls-cert/key: %w", err)
		}
		c.Certificates = []tls.Certificate{kp}
	}
	return c, nil
}

func (h *HA) enabled() bool { return h.EtcdEndpoints != "" }

// haConfig returns the elector's configuration for a master listening on
// grpcAddr.
func (h *HA) haConfig(grpcAddr string) (ha.Config, error) {
	adv := h.AdvertiseAddr
	if adv == "" {
		host, port, err := net.SplitHostPort(grpcAddr)
		if err != nil {
			return ha.Config{}, fmt.Errorf("grpc-addr %q: %w", grpcAddr, err)
		}
		if host == "" || host == "0.0.0.0" || host == "::" {
			if host, err = os.Hostname(); err != nil {
				return ha.Config{}, fmt.Errorf("advertise-addr: no host name to derive it from: %w", err)
			}
		}
		adv = net.JoinHostPort(host, port)
	}
	var eps []string
	for e := range strings.SplitSeq(h.EtcdEndpoints, ",") {
		if e = strings.TrimSpace(e); e != "" {
			eps = append(eps, e)
		}
	}
	tc, err := h.etcdTLS()
	if err != nil {
		return ha.Config{}, err
	}
	return ha.Config{Endpoints: eps, Prefix: h.EtcdPrefix, LeaseTTL: h.EtcdLeaseTTL, Advertise: adv, DialTimeout: 5 * time.Second, TLS: tc}, nil
}

// runHA campaigns for leadership until ctx ends. While it stands by, a
// standby server on the master's ports answers every RPC NOT_LEADER with
// the leader's address, and /readyz fails (so a Kubernetes Service of
// ready pods routes to the leader only); it also serves the agents' Follow
// streams into a master built for the next term (warm: its objects are
// kept from the agents' tables as they change). Once elected that master
// takes the term's epoch and serves while the term holds, its agents
// resuming their registrations without sending their tables; if the term
// is lost the master stops and the process stands by again with a fresh
// one.
func runHA(ctx context.Context, cfg Config, lg *slog.Logger) error {
	hc, err := cfg.HA.haConfig(cfg.GRPCAddr)
	if err != nil {
		return err
	}
	el, err := ha.New(hc, lg.With("part", "ha"))
	if err != nil {
		return err
	}
	defer el.Close()
	fctx, stopFollow := context.WithCancel(ctx)
	var follow sync.WaitGroup
	follow.Go(func() { el.Follow(fctx) })
	defer func() { stopFollow(); follow.Wait() }()

	// A campaign that fails (its lease expired while the machine or etcd
	// was slow, the epoch write lost a race, etcd unreachable) is tried
	// again: a standby that gave up would leave the cluster without one.
	backoff := retry.NewBackoff(100*time.Millisecond, 2*time.Second)
	var (
		m    *Master
		gate *leaderGate
	)
	defer func() {
		if m != nil {
			m.discard()
		}
	}()
	for ctx.Err() == nil {
		if m == nil {
			gate = &leaderGate{}
			if m, err = newStandbyMaster(cfg, lg, server.UnaryInterceptors(gate.unary), grpc.ChainStreamInterceptor(gate.stream)); err != nil {
				return err
			}
		}
		term, err := standBy(ctx, cfg, lg, el, m)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ce *campaignError
			if !errors.As(err, &ce) {
				return err
			}
			lg.Warn("campaign failed; campaigning again", "err", err)
			if backoff.Wait(ctx) != nil {
				return nil
			}
			continue
		}
		unsettled, err := readUnsettled(ctx, term)
		if err != nil {
			// Not knowing which segments to distrust, it must not serve
			// (a removal an earlier leader acknowledged could come back).
			term.Resign(context.WithoutCancel(ctx))
			lg.Warn("elected, but the unsettled segments are unreadable; campaigning again", "err", err)
			if backoff.Wait(ctx) != nil {
				return nil
			}
			continue
		}
		backoff.Reset()
		m.promote(term.Epoch, unsettled)
		m.Store.SetLedger(termLedger{term}, unsettled)
		valid := term.Valid
		gate.valid.Store(&valid)
		err = lead(ctx, cfg, lg, term, m)
		m = nil // run closed it; the next term gets a fresh one
		if ctx.Err() != nil {
			term.Resign(context.WithoutCancel(ctx))
			return err
		}
		term.Resign(context.WithoutCancel(ctx))
		lg.Error("master lost leadership; standing by", "epoch", term.Epoch, "err", err)
	}
	return nil
}

// readUnsettled reads the segments earlier leaders recorded as unsettled
// (ha/unsettled.go), as meta's.
func readUnsettled(ctx context.Context, term *ha.Term) ([]meta.UnsettledSegment, error) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	recs, err := term.Unsettled(rctx)
	if err != nil {
		return nil, err
	}
	out := make([]meta.UnsettledSegment, len(recs))
	for i, r := range recs {
		out[i] = meta.UnsettledSegment{ID: r.ID, Agent: r.Agent, Memory: r.Memory}
	}
	return out, nil
}

// termLedger records a leader's unsettled segments in etcd under its term
// (meta.Ledger).
type termLedger struct{ t *ha.Term }

func (l termLedger) Record(ctx context.Context, segs []meta.UnsettledSegment) error {
	recs := make([]ha.UnsettledSegment, len(segs))
	for i, s := range segs {
		recs[i] = ha.UnsettledSegment{ID: s.ID, Agent: s.Agent, Memory: s.Memory}
	}
	return l.t.SetUnsettled(ctx, recs, nil)
}

func (l termLedger) Forget(ctx context.Context, ids []string) error {
	return l.t.SetUnsettled(ctx, nil, ids)
}

// newStandbyMaster builds the master a standby keeps warm for the next
// term: no epoch yet, its store following the agents' tables (releases
// owed, not sent); standBy serves its Follow streams, promote makes it the
// leader's.
func newStandbyMaster(cfg Config, lg *slog.Logger, opts ...grpc.ServerOption) (*Master, error) {
	m, err := newMaster(cfg, lg, 0, opts...)
	if err != nil {
		return nil, err
	}
	m.Store.SetFollowing(true)
	return m, nil
}

// standBy serves NOT_LEADER on the master's ports while it campaigns, and
// the agents' Follow streams into m; it returns the term once elected (the
// standby server stopped, the follow streams ended).
func standBy(ctx context.Context, cfg Config, lg *slog.Logger, el *ha.Elector, m *Master) (*ha.Term, error) {
	creds, err := cfg.Security.Load(lg)
	if err != nil {
		return nil, err
	}
	notLeader := func() error { return rpcerr.Status(rpcerr.NotLeader(el.Leader())) }
	// The standby's own registry has its gRPC metrics and
	// crescent_master_leader; the warm master's adds the runtime
	// collectors and the follow metrics, and nothing else (a standby must
	// not export crescent_master_recovering and the serving master's
	// other families, which the alerts count).
	reg := prometheus.NewRegistry()
	reg.MustRegister(leaderGauge(func() bool { return false }))
	srv := server.New(server.Config{
		GRPCAddr: cfg.GRPCAddr, AdminAddr: cfg.AdminAddr, ShutdownTimeout: cfg.ShutdownTimeout,
		Credentials: creds, Table: authTable(), QuietCodes: []codes.Code{codes.Unavailable},
		ExtraMetrics: standbyMetrics(m.Server.Registry),
	}, lg.With("part", "standby"), reg, grpc.UnknownServiceHandler(func(any, grpc.ServerStream) error {
		return notLeader()
	}))
	masterv1.RegisterSegmentServiceServer(srv.GRPC, &standbySegments{m: m.Sessions, notLeader: notLeader})
	srv.SetReadiness(func() error { return fmt.Errorf("standby: not the leader (leader: %q)", el.Leader()) })
	m.Sessions.SetStandby()
	if err := listenRetry(ctx, srv); err != nil {
		return nil, err
	}
	sctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- srv.Run(sctx) }()
	// The liveness sweep runs for the followed agents: one that is lost
	// while this master stands by is unmounted here as on the leader.
	var sweep sync.WaitGroup
	sweep.Go(func() { _ = m.Sessions.Run(sctx) })
	lg.Info("master standing by", "grpc", srv.GRPCAddr(), "leader", el.Leader())
	term, cerr := el.Campaign(ctx)
	// Follow streams end first: the server's graceful stop waits for
	// streams, and the metadata must be still before it is promoted.
	m.Sessions.EndFollowing()
	stop()
	sweep.Wait()
	if err := <-done; err != nil && cerr == nil {
		term.Resign(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("standby server: %w", err)
	}
	if cerr != nil {
		return nil, &campaignError{cerr}
	}
	return term, nil
}

// standbySegments is a standby's SegmentService: agents follow it; their
// Connect is refused with the leader's address.
type standbySegments struct {
	masterv1.UnimplementedSegmentServiceServer
	m         *session.Manager
	notLeader func() error
}

func (s *standbySegments) Connect(masterv1.SegmentService_ConnectServer) error { return s.notLeader() }

func (s *standbySegments) Follow(stream masterv1.SegmentService_FollowServer) error {
	return s.m.Follow(stream)
}

// campaignError is standBy's error when the campaign, not the standby
// server, failed: runHA campaigns again.
type campaignError struct{ err error }

func (e *campaignError) Error() string { return e.err.Error() }
func (e *campaignError) Unwrap() error { return e.err }

// lead runs m, promoted to term, until ctx ends or the term is lost.
func lead(ctx context.Context, cfg Config, lg *slog.Logger, term *ha.Term, m *Master) error {
	var books sync.WaitGroup
	defer books.Wait() // after cancel below: the recorder stops on mctx
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	expectAgents(mctx, cfg, lg, term, m, &books)
	go func() {
		select {
		case <-term.Lost():
			cancel()
		case <-mctx.Done():
		}
	}()
	if err := m.Server.Registry.Register(leaderGauge(term.Valid)); err != nil {
		m.discard()
		return err
	}
	if err := listenRetry(mctx, m.Server); err != nil {
		m.discard()
		return err
	}
	err := m.run(mctx)
	select {
	case <-term.Lost():
		return errors.Join(ha.ErrLost, err)
	default:
		return err
	}
}

// expectAgents makes the new leader's recovery wait for every agent the
// earlier leaders recorded in etcd (as registered and not departed), up
// to unmount-after (by then a live master would have declared a missing
// one lost) and recovery-max; and records this leader's own agents.
//
// An agent is recorded before its registration is acknowledged (so before
// any put is placed on it), so the list read here holds every agent that
// may hold an acknowledged object: once they are all back the recovery
// ends, without waiting out the recovery grace (which exists for a master
// that cannot know its agents: a single master's restart, or an etcd read
// that failed here). Departures are recorded in the background; one that
// is missed only makes a later leader wait for that agent until
// unmount-after.
func expectAgents(ctx context.Context, cfg Config, lg *slog.Logger, term *ha.Term, m *Master, wg *sync.WaitGroup) {
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	known, err := term.Agents(lctx)
	cancel()
	if err != nil {
		lg.Warn("the agents of earlier leaders are unknown; recovery waits on its grace alone", "err", err)
	}
	start := time.Now()
	m.rec.expect = func() int {
		if time.Since(start) >= cfg.UnmountAfter {
			return 0
		}
		n := 0
		for _, id := range known {
			if !m.Sessions.Connected(id) {
				n++
			}
		}
		return n
	}
	m.rec.exact = err == nil
	if len(known) > 0 {
		lg.Info("waiting for the agents earlier leaders knew", "agents", len(known))
	}
	var (
		mu       sync.Mutex
		recorded = make(map[string]bool, len(known))
	)
	for _, id := range known {
		recorded[id] = true
	}
	departed := make(chan string, 1024)
	m.Sessions.SetEvents(session.Events{
		Arrive: func(ctx context.Context, id string) error {
			mu.Lock()
			done := recorded[id]
			mu.Unlock()
			if done {
				return nil
			}
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			if err := term.SetAgent(rctx, id, true); err != nil {
				return err
			}
			mu.Lock()
			recorded[id] = true
			mu.Unlock()
			return nil
		},
		Depart: func(id string) {
			select {
			case departed <- id:
			default:
				lg.Warn("agent departure not recorded (queue full)", "agent_id", id)
			}
		},
	})
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case id := <-departed:
				mu.Lock()
				delete(recorded, id)
				mu.Unlock()
				rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				if err := term.SetAgent(rctx, id, false); err != nil && ctx.Err() == nil {
					lg.Warn("agent departure not recorded in etcd", "agent_id", id, "err", err)
				}
				cancel()
			}
		}
	})
}

// listenRetry binds srv's ports, retrying briefly: the previous server on
// the same ports (the standby's, or the last term's master) may still be
// releasing them.
func listenRetry(ctx context.Context, srv *server.Server) error {
	var err error
	for range 50 {
		if err = srv.Listen(); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return err
}

// leaderGate refuses RPCs, and withholds a finished unary RPC's answer,
// once the leader's term is no longer provably valid: a leader cut off
// from etcd must not acknowledge anything after a new leader may have
// taken over.
type leaderGate struct {
	// valid is the term's check, set once elected; nil refuses everything.
	valid atomic.Pointer[func() bool]
}

func (g *leaderGate) ok() bool {
	v := g.valid.Load()
	return v != nil && (*v)()
}

func (g *leaderGate) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if !g.ok() {
		return nil, rpcerr.Status(rpcerr.NotLeader(""))
	}
	resp, err := h(ctx, req)
	if err == nil && !g.ok() {
		return nil, rpcerr.Status(rpcerr.NotLeader(""))
	}
	return resp, err
}

func (g *leaderGate) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if !g.ok() {
		return rpcerr.Status(rpcerr.NotLeader(""))
	}
	return h(srv, ss)
}

// leaderGauge is crescent_master_leader: 1 while this master leads (its
// term provably valid), 0 while it stands by. Exactly one master of a
// healthy cluster reports 1.
func leaderGauge(leads func() bool) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "crescent_master_leader",
		Help: "1 while this master leads (its etcd term valid), 0 while it stands by; masters without election do not export it.",
	}, func() float64 {
		if leads() {
			return 1
		}
		return 0
	})
}

// standbyMetrics is the part of a warm master's registry a standby
// exports: the runtime collectors and the agents' follow streams.
func standbyMetrics(g prometheus.Gatherer) prometheus.Gatherer {
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		mfs, err := g.Gather()
		kept := mfs[:0]
		for _, mf := range mfs {
			if n := mf.GetName(); strings.HasPrefix(n, "go_") || strings.HasPrefix(n, "process_") ||
				strings.HasPrefix(n, "crescent_master_agent_follow") {
				kept = append(kept, mf)
			}
		}
		return kept, err
	})
}
