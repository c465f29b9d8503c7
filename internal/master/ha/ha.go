// Package ha elects the master that leads, on a real etcd cluster (issue
// 15): masters campaign with etcd's election recipe
// (go.etcd.io/etcd/client/v3/concurrency) under a lease; the one elected
// leads until it resigns or can no longer prove its lease alive. No
// consensus is written here: etcd decides.
//
// Three guarantees the master builds on:
//
//   - One epoch per term, strictly above every earlier term's: written to
//     etcd in a transaction that succeeds only while this master holds the
//     election key. Agents refuse commands of an older epoch.
//   - A leader never believes its lease alive longer than etcd can: each
//     renewal is timed from before the request was sent, so the lease
//     cannot expire in etcd before Valid turns false here; a margin covers
//     the two clocks' rates. The master refuses every RPC, and withholds
//     the answer of one that was running, once Valid is false, and stops.
//   - A new leader is elected only once the old leader's key is gone (it
//     resigned, or its lease expired in etcd), and it waits the same margin
//     before it serves: by then the old leader has stopped acknowledging.
package ha

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// Config configures an Elector.
type Config struct {
	// Endpoints are etcd's client addresses (host:port or URLs).
	Endpoints []string
	// Prefix is the etcd key prefix of this cluster's masters
	// ("/crescent/master/"): election keys under Prefix+"election/", the
	// last epoch at Prefix+"epoch".
	Prefix string
	// LeaseTTL is the leader's lease: how long a dead leader keeps the
	// others from taking over (whole seconds, at least 2).
	LeaseTTL time.Duration
	// Advertise is the address clients are redirected to while this master
	// leads (its gRPC host:port as others reach it).
	Advertise string
	// DialTimeout bounds connecting to etcd.
	DialTimeout time.Duration
	// TLS secures the etcd connection (nil: plaintext).
	TLS *tls.Config
	// MaxAgents bounds the agent list a new leader reads (0:
	// DefaultMaxAgents); a longer list is not read at all (Agents fails,
	// and the leader recovers on its grace as a single master does).
	MaxAgents int
}

// DefaultMaxAgents is Config.MaxAgents's default: far past any cluster's
// agents, and a list of that many 256-byte ids is 16 MiB at most.
const DefaultMaxAgents = 1 << 16

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if len(c.Endpoints) == 0 {
		errs = append(errs, errors.New("etcd-endpoints: at least one is required"))
	}
	if c.Prefix == "" || c.Prefix[len(c.Prefix)-1] != '/' {
		errs = append(errs, fmt.Errorf("etcd-prefix must end in '/', got %q", c.Prefix))
	}
	if c.LeaseTTL < 2*time.Second || c.LeaseTTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("etcd-lease-ttl must be whole seconds, at least 2s, got %v", c.LeaseTTL))
	}
	if c.Advertise == "" {
		errs = append(errs, errors.New("advertise-addr is required with etcd-endpoints"))
	}
	if c.DialTimeout <= 0 {
		errs = append(errs, fmt.Errorf("etcd dial timeout must be > 0, got %v", c.DialTimeout))
	}
	return errors.Join(errs...)
}

// margin is what a leader takes off each renewal's lease, and what a new
// leader waits before it serves: a tenth of the TTL, at least 200 ms.
func (c Config) margin() time.Duration { return max(c.LeaseTTL/10, 200*time.Millisecond) }

// Elector campaigns for leadership and follows who leads.
type Elector struct {
	cfg    Config
	lg     *slog.Logger
	cli    *clientv3.Client
	now    func() time.Time
	leader atomic.Pointer[string] // the leader's Advertise as last seen ("" none)
}

// New connects to etcd (lazily: the first request dials).
func New(cfg Config, lg *slog.Logger) (*Elector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Endpoints,
		DialTimeout: cfg.DialTimeout,
		TLS:         cfg.TLS,
		Logger:      nil,
	})
	if err != nil {
		return nil, fmt.Errorf("ha: etcd client: %w", err)
	}
	e := &Elector{cfg: cfg, lg: lg, cli: cli, now: time.Now}
	none := ""
	e.leader.Store(&none)
	return e, nil
}

// Close closes the etcd client.
func (e *Elector) Close() error { return e.cli.Close() }

func (e *Elector) electionPrefix() string { return e.cfg.Prefix + "election/" }
func (e *Elector) epochKey() string       { return e.cfg.Prefix + "epoch" }

// Leader is the leader's advertised address as last seen by Follow ("":
// none known).
func (e *Elector) Leader() string { return *e.leader.Load() }

// Follow keeps Leader current until ctx ends: it reads the election's
// first key and watches the prefix for the next change. etcd being
// unreachable only delays it (retried every second).
func (e *Elector) Follow(ctx context.Context) {
	for ctx.Err() == nil {
		if err := e.followOnce(ctx); err != nil && ctx.Err() == nil {
			e.lg.Debug("following the master leader", "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

func (e *Elector) followOnce(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, e.cfg.DialTimeout)
	resp, err := e.cli.Get(rctx, e.electionPrefix(), clientv3.WithFirstCreate()...)
	cancel()
	if err != nil {
		return err
	}
	addr := ""
	if len(resp.Kvs) > 0 {
		addr = string(resp.Kvs[0].Value)
	}
	e.leader.Store(&addr)
	wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer wcancel()
	wch := e.cli.Watch(wctx, e.electionPrefix(), clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	select {
	case <-ctx.Done():
		return nil
	case w, ok := <-wch:
		if !ok {
			return errors.New("watch closed")
		}
		return w.Err()
	}
}

// ErrLost is the cause of a term's end when its lease can no longer be
// proven alive.
var ErrLost = errors.New("ha: leadership lost: the etcd lease could not be renewed in time")

// Term is one leadership: from Campaign's return until Lost closes.
type Term struct {
	// Epoch is the term's epoch: above every earlier term's.
	Epoch uint64

	e          *Elector
	lease      clientv3.LeaseID
	session    *concurrency.Session
	election   *concurrency.Election
	validUntil atomic.Int64 // unix nanos
	elected    atomic.Bool  // Campaign returned the term: a lapse loses leadership
	abandoned  atomic.Bool  // etcd did not answer the campaign's end: no revoke
	lost       chan struct{}
	lostOnce   sync.Once
	stop       context.CancelFunc
	done       chan struct{}
}

// Valid reports whether the lease is provably alive now: the master may
// acknowledge.
func (t *Term) Valid() bool {
	select {
	case <-t.lost:
		return false
	default:
	}
	return t.e.now().UnixNano() < t.validUntil.Load()
}

// Lost is closed once the term is over (lease not renewed in time, or
// Resign).
func (t *Term) Lost() <-chan struct{} { return t.lost }

func (t *Term) markLost() { t.lostOnce.Do(func() { close(t.lost) }) }

// Campaign blocks until this master leads (or ctx ends), then returns its
// term. The lease is renewed from the start, so a campaign that waits
// long keeps its place.
func (e *Elector) Campaign(ctx context.Context) (*Term, error) {
	ttl := int64(e.cfg.LeaseTTL / time.Second)
	sent := e.now()
	g, err := e.cli.Grant(ctx, ttl)
	if err != nil {
		return nil, fmt.Errorf("ha: lease: %w", err)
	}
	kctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	t := &Term{e: e, lease: g.ID, lost: make(chan struct{}), stop: stop, done: make(chan struct{})}
	t.validUntil.Store(sent.Add(time.Duration(g.TTL)*time.Second - e.cfg.margin()).UnixNano())
	go t.keepAlive(kctx)
	fail := func(err error) (*Term, error) {
		t.close(context.WithoutCancel(ctx))
		return nil, err
	}
	if t.session, err = concurrency.NewSession(e.cli, concurrency.WithLease(g.ID), concurrency.WithContext(kctx)); err != nil {
		return fail(fmt.Errorf("ha: session: %w", err))
	}
	t.election = concurrency.NewElection(t.session, e.electionPrefix())
	if err := t.campaign(ctx, e.cfg.Advertise); err != nil {
		return fail(fmt.Errorf("ha: campaign: %w", err))
	}
	if t.Epoch, err = t.nextEpoch(ctx); err != nil {
		return fail(err)
	}
	// The old leader stopped acknowledging before its lease expired by
	// its clock; wait out the rate difference of the two clocks.
	select {
	case <-ctx.Done():
		return fail(ctx.Err())
	case <-time.After(e.cfg.margin()):
	}
	if !t.Valid() {
		return fail(ErrLost)
	}
	t.elected.Store(true)
	addr := e.cfg.Advertise
	e.leader.Store(&addr)
	e.lg.Info("elected master leader", "epoch", t.Epoch, "lease_ttl", e.cfg.LeaseTTL)
	return t, nil
}

// campaign is the election's Campaign, bounded: once ctx ends, or the
// campaign's lease lapses (a campaign on a lapsed lease cannot win: its
// key goes with the lease), it returns within DialTimeout. etcd's
// Campaign, when its context ends while it waits, resigns under the etcd
// client's own context, which has no end while etcd cannot be reached: a
// standby stopped together with its etcd (`make run-ha` or compose
// stopping everything at once) hung there until it was killed. The
// resignation left behind finishes, or fails, when the Elector closes its
// client; close's revoke (or the lease's expiry) takes the election key
// with the lease in any case.
func (t *Term) campaign(ctx context.Context, val string) error {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- t.election.Campaign(cctx, val) }()
	var why error
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		why = ctx.Err()
	case <-t.lost:
		why = ErrLost
	}
	cancel()
	timer := time.NewTimer(t.e.cfg.DialTimeout)
	defer timer.Stop()
	select {
	case <-errc:
	case <-timer.C:
		// etcd did not answer for DialTimeout: close leaves the lease to
		// expire rather than wait as long again to revoke it.
		t.abandoned.Store(true)
		t.e.lg.Warn("etcd did not take back a campaign that was stopped; leaving it to the lease", "err", why)
	}
	return why
}

// nextEpoch writes and returns max(now, last epoch + 1), only while this
// term holds the election key.
func (t *Term) nextEpoch(ctx context.Context) (uint64, error) {
	e := t.e
	resp, err := e.cli.Get(ctx, e.epochKey())
	if err != nil {
		return 0, fmt.Errorf("ha: read the last epoch: %w", err)
	}
	var last uint64
	var modRev int64
	if len(resp.Kvs) == 1 {
		if last, err = strconv.ParseUint(string(resp.Kvs[0].Value), 10, 64); err != nil {
			return 0, fmt.Errorf("ha: the last epoch at %s is %q: %w", e.epochKey(), resp.Kvs[0].Value, err)
		}
		modRev = resp.Kvs[0].ModRevision
	}
	next := max(uint64(e.now().UnixNano()), last+1)
	tr, err := e.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.CreateRevision(t.election.Key()), "=", t.election.Rev()),
		clientv3.Compare(clientv3.ModRevision(e.epochKey()), "=", modRev),
	).Then(clientv3.OpPut(e.epochKey(), strconv.FormatUint(next, 10))).Commit()
	if err != nil {
		return 0, fmt.Errorf("ha: write the epoch: %w", err)
	}
	if !tr.Succeeded {
		return 0, errors.New("ha: write the epoch: no longer the leader, or another term wrote one")
	}
	return next, nil
}

// keepAlive renews the lease every third of its TTL and moves validUntil
// to (time the renewal was sent) + TTL - margin; when a renewal fails it
// keeps trying. Whatever a renewal in flight does, the term is lost the
// moment validUntil passes.
func (t *Term) keepAlive(ctx context.Context) {
	defer close(t.done)
	e := t.e
	interval := e.cfg.LeaseTTL / 3
	type result struct {
		resp *clientv3.LeaseKeepAliveResponse
		err  error
	}
	for {
		sent := e.now()
		rctx, cancel := context.WithTimeout(ctx, interval)
		resc := make(chan result, 1)
		go func() {
			resp, err := e.cli.KeepAliveOnce(rctx, t.lease)
			resc <- result{resp, err}
		}()
		var r result
		select {
		case r = <-resc:
			cancel()
		case <-time.After(time.Until(time.Unix(0, t.validUntil.Load()))):
			cancel()
			<-resc
			t.lapsed()
			return
		}
		switch {
		case ctx.Err() != nil:
			return
		case r.err == nil && r.resp.TTL > 0:
			t.validUntil.Store(sent.Add(time.Duration(r.resp.TTL)*time.Second - e.cfg.margin()).UnixNano())
		case errors.Is(r.err, rpctypes.ErrLeaseNotFound) || (r.err == nil && r.resp.TTL <= 0):
			e.lg.Error("master lease gone in etcd: leadership lost", "lease", int64(t.lease), "err", r.err)
			t.markLost()
			return
		default:
			e.lg.Warn("master lease renewal failed; retrying", "err", r.err, "valid_for", time.Until(time.Unix(0, t.validUntil.Load())))
		}
		left := time.Until(time.Unix(0, t.validUntil.Load()))
		if left <= 0 {
			t.lapsed()
			return
		}
		wait := interval - e.now().Sub(sent)
		if r.err != nil {
			wait = min(wait, 200*time.Millisecond)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(min(max(wait, 0), left)):
		}
	}
}

// lapsed ends a term whose lease was not renewed in time. Only a leader
// loses leadership so; a standby's campaign lease lapsing (etcd slow or
// gone while it waits) is logged as what it is.
func (t *Term) lapsed() {
	if t.elected.Load() {
		t.e.lg.Error("master lease not renewed in time: leadership lost", "lease_ttl", t.e.cfg.LeaseTTL)
	} else {
		t.e.lg.Warn("campaign lease not renewed in time; campaigning again", "lease_ttl", t.e.cfg.LeaseTTL)
	}
	t.markLost()
}

// Resign gives leadership up at once (the next master need not wait for
// the lease to expire) and ends the term.
func (t *Term) Resign(ctx context.Context) {
	t.markLost()
	t.close(ctx)
}

// close stops renewing and revokes the lease (its keys go with it).
func (t *Term) close(ctx context.Context) {
	t.markLost()
	t.stop()
	<-t.done
	rctx, cancel := context.WithTimeout(ctx, t.e.cfg.DialTimeout)
	defer cancel()
	if t.session != nil {
		t.session.Orphan() // its own keep-alive stops; the lease is revoked below
	}
	if t.abandoned.Load() {
		return // etcd just failed to answer for DialTimeout; the lease expires by itself
	}
	// The election key goes with the lease.
	if _, err := t.e.cli.Revoke(rctx, t.lease); err != nil {
		t.e.lg.Warn("master lease not revoked; it expires by itself", "err", err)
	}
}

func (e *Elector) agentsPrefix() string { return e.cfg.Prefix + "agents/" }

// Agents lists the agents the leaders recorded as registered and not
// departed (SetAgent): the ones a new leader waits for before it answers
// for their objects.
func (t *Term) Agents(ctx context.Context) ([]string, error) {
	e := t.e
	limit := e.cfg.MaxAgents
	if limit <= 0 {
		limit = DefaultMaxAgents
	}
	resp, err := e.cli.Get(ctx, e.agentsPrefix(), clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(int64(limit)))
	if err != nil {
		return nil, fmt.Errorf("ha: list agents: %w", err)
	}
	if resp.More {
		return nil, fmt.Errorf("ha: list agents: more than %d recorded under %s", limit, e.agentsPrefix())
	}
	ids := make([]string, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		ids = append(ids, string(kv.Key[len(e.agentsPrefix()):]))
	}
	return ids, nil
}

// SetAgent records that agent id registered (up) or departed, only while
// this term holds the election key.
func (t *Term) SetAgent(ctx context.Context, id string, up bool) error {
	e := t.e
	key := e.agentsPrefix() + id
	op := clientv3.OpDelete(key)
	if up {
		op = clientv3.OpPut(key, "")
	}
	tr, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(t.election.Key()), "=", t.election.Rev())).Then(op).Commit()
	if err != nil {
		return fmt.Errorf("ha: record agent %s: %w", id, err)
	}
	if !tr.Succeeded {
		return errors.New("ha: record agent: no longer the leader")
	}
	return nil
}
