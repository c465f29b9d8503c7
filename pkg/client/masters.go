package client

import (
	"context"
	"crypto/tls"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/callstream"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// masters is the client's side of master high availability (issue 15): the
// configured master addresses, one gRPC connection to each (dialled on first
// use), and the address the client believes leads. It is a
// grpc.ClientConnInterface, so every master RPC, the SDK's own calls and the
// raw Objects, Admin and Changes clients alike, goes through its one retry
// loop (do), which follows NOT_LEADER redirects and fails over to the next
// master. Data-plane calls to the agents do not come here.
//
// A master that is not the leader answers every RPC with UNAVAILABLE /
// NOT_LEADER and the leader's address in the ErrorInfo metadata key
// "leader" (empty while no leader is known). The client follows that
// address even when it is not configured (a leader advertises the address
// it is reachable at, which may not be the one a client was given, as
// behind a Kubernetes Service), but it dials at most maxHints such
// addresses over its lifetime; past that a hint is treated as NOT_LEADER
// without a leader. With TLS the hinted master must still present a
// certificate the client's CA verifies.
type masters struct {
	addrs    []string // configured, in order; never empty
	attempts int      // Config.Attempts
	backoff  time.Duration
	failover time.Duration // Config.FailoverTimeout
	dial     func(addr string) (*grpc.ClientConn, error)

	noStream bool // Config.DisableCallStream (callstream.go)
	// lookups: lookups may go on a master's lookup listener (lookup.go);
	// tls is the client's TLS configuration for it.
	lookups bool
	tls     *tls.Config

	mu      sync.Mutex // guards conns, streams, hints, leader, closed
	conns   map[string]*grpc.ClientConn
	streams map[string]*callStream // by address (callstream.go)
	hints   []string               // addresses followed from NOT_LEADER that are not configured
	leader  string                 // the address the next call goes to
	closed  bool
}

// maxHints bounds the unconfigured leader addresses a client dials.
const maxHints = 8

// maxBackoff caps the wait between two tries of one call: a failover
// should be noticed within a fraction of a second of a new leader.
const maxBackoff = 500 * time.Millisecond

// errClosed is returned by calls on a closed client.
var errClosed = errors.New("client: closed")

// splitMasters parses Config.Master: one address or several separated by
// commas (blanks around them and empty entries ignored, duplicates
// dropped).
func splitMasters(s string) []string {
	var out []string
	for a := range strings.SplitSeq(s, ",") {
		if a = strings.TrimSpace(a); a != "" && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

func newMasters(cfg *Config, addrs []string, dial func(string) (*grpc.ClientConn, error)) *masters {
	return &masters{
		addrs: addrs, attempts: cfg.Attempts, backoff: cfg.Backoff, failover: cfg.FailoverTimeout, dial: dial,
		noStream: cfg.DisableCallStream,
		lookups:  !cfg.DisableLookupListener && cfg.BearerToken == "" && len(cfg.DialOptions) == 0, tls: cfg.TLS,
		conns: map[string]*grpc.ClientConn{}, streams: map[string]*callStream{}, leader: addrs[0],
	}
}

// current is the address the next try goes to.
func (m *masters) current() (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return "", errClosed
	}
	return m.leader, nil
}

// conn returns the connection to addr, dialling it on first use. Dialling
// does no I/O (grpc.NewClient connects on the first RPC).
func (m *masters) conn(addr string) (*grpc.ClientConn, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, errClosed
	}
	if cc, ok := m.conns[addr]; ok {
		return cc, nil
	}
	cc, err := m.dial(addr)
	if err != nil {
		return nil, err
	}
	m.conns[addr] = cc
	return cc, nil
}

// follow makes leader, named by the master at from in a NOT_LEADER answer,
// the current address. It reports false when it cannot: no or the same
// address, or one more unconfigured address than maxHints allows.
func (m *masters) follow(from, leader string) bool {
	if leader == "" || leader == from {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if !slices.Contains(m.addrs, leader) && !slices.Contains(m.hints, leader) {
		if len(m.hints) >= maxHints {
			return false
		}
		m.hints = append(m.hints, leader)
	}
	m.leader = leader
	return true
}

// next moves on from addr, which failed, to the configured address after it
// (the first one when addr is a followed hint). It does nothing when
// another call has already moved on, so that concurrent failures skip no
// master.
func (m *masters) next(addr string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.leader != addr {
		return
	}
	m.leader = m.addrs[(slices.Index(m.addrs, addr)+1)%len(m.addrs)]
}

// Close closes every call stream, then every connection. Idempotent.
func (m *masters) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true // no stream or connection is added after this
	m.mu.Unlock()
	// Without m.mu: a stream's close may wait for its master (closeWait).
	for _, cs := range m.streams {
		cs.close()
	}
	var errs []error
	for _, cc := range m.conns {
		errs = append(errs, cc.Close())
	}
	return errors.Join(errs...)
}

// verdict is what a failed try tells the retry loop.
type verdict int

const (
	// final: return the error.
	final verdict = iota
	// again: a transient failure at this master (AGENT_UNAVAILABLE, or the
	// only configured master unreachable); retried here, Attempts tries in
	// all.
	again
	// recovering: MASTER_RECOVERING, a leader that took over moments ago;
	// retried here within FailoverTimeout.
	recovering
	// redirect: NOT_LEADER naming the leader; tried there at once.
	redirect
	// failover: NOT_LEADER without a leader (an election),
	// MASTER_SHUTTING_DOWN, or one of several masters unreachable; the next
	// master is tried, within FailoverTimeout.
	failover
)

// classify judges a failed master call. An error that carries a reason is
// judged by its reason alone (each reason has one code); only a failure
// without one (the connection, not the master, failed) by its code. several
// tells whether there is another master to turn to. For a redirect it also
// returns the leader's address.
func classify(err error, several bool) (verdict, string) {
	e := new(rpcerr.Error)
	if !errors.As(rpcerr.FromStatus(err), &e) {
		return final, ""
	}
	switch e.Reason {
	case masterv1.ErrorReason_ERROR_REASON_NOT_LEADER:
		if l := e.Metadata[rpcerr.LeaderKey]; l != "" {
			return redirect, l
		}
		return failover, ""
	case masterv1.ErrorReason_ERROR_REASON_MASTER_SHUTTING_DOWN:
		return failover, ""
	case masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING:
		return recovering, ""
	case masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE:
		return again, ""
	case masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED:
		if e.Code() != codes.Unavailable {
			return final, ""
		}
		if several {
			return failover, ""
		}
		return again, ""
	}
	return final, ""
}

// do runs op against the master the client believes leads and tries again
// after a retryable failure, until op succeeds, fails for good or ctx ends:
//
//   - NOT_LEADER naming the leader: op runs at once against that leader (a
//     second redirect within one call waits a backoff first, so masters
//     that name each other cannot make it spin);
//   - NOT_LEADER without a leader, MASTER_SHUTTING_DOWN, or one of several
//     masters unreachable: the next configured master, after a backoff;
//   - MASTER_RECOVERING: the same master, after a backoff;
//   - AGENT_UNAVAILABLE, or the only master unreachable: the same master,
//     after a backoff, Attempts tries in all.
//
// The leader-change cases are retried until FailoverTimeout has passed
// since the first of them. Backoffs are jittered and double from
// Config.Backoff up to maxBackoff; no wait outlasts ctx. Any other error
// returns at once. The error returned is op's own, or an endedError when
// ctx ended during a wait.
func (m *masters) do(ctx context.Context, op func(addr string) error) error {
	var (
		b         *retry.Backoff
		tries     int
		redirects int
		until     time.Time // end of the failover budget
	)
	for {
		addr, err := m.current()
		if err != nil {
			return err
		}
		if err = op(addr); err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		v, leader := classify(err, len(m.addrs) > 1)
		if v == redirect && !m.follow(addr, leader) {
			v = failover
		}
		switch v {
		case final:
			return err
		case again:
			if tries++; tries >= m.attempts {
				return err
			}
		case redirect:
			if redirects++; redirects == 1 {
				continue
			}
		case failover:
			m.next(addr)
		}
		if v != again {
			if until.IsZero() {
				until = time.Now().Add(m.failover)
			}
			if !time.Now().Before(until) {
				return err
			}
		}
		if b == nil {
			b = retry.NewBackoff(m.backoff, max(m.backoff, maxBackoff))
		}
		if werr := b.Wait(ctx); werr != nil {
			return &endedError{ctx: werr, last: err}
		}
	}
}

// endedError is what a call returns when its context ends while it waits
// to try again: the context's error (errors.Is sees it, status.Code gives
// its code, CANCELLED or DEADLINE_EXCEEDED) and, in the message, the last
// master's answer.
type endedError struct{ ctx, last error }

func (e *endedError) Error() string {
	return e.ctx.Error() + " while retrying the master (last error: " + e.last.Error() + ")"
}

func (e *endedError) Unwrap() error { return e.ctx }

func (e *endedError) GRPCStatus() *status.Status {
	return status.New(status.FromContextError(e.ctx).Code(), e.Error())
}

// Invoke implements grpc.ClientConnInterface: a unary call to the leader,
// carried on its call stream when it can be (callstream.go).
func (m *masters) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	carried := m.carries(ctx, method)
	return m.do(ctx, func(addr string) error {
		cc, err := m.conn(addr)
		if err != nil {
			return err
		}
		if carried {
			if cs := m.callStream(addr, cc); cs != nil {
				// A fresh envelope each try: the last one may still be
				// queued on a stream that broke.
				if q, ok := callstream.Wrap(method, args); ok {
					if lookupMethod(method) {
						if err := cs.lookupCall(ctx, q, reply); !errors.Is(err, errStreamDown) {
							return err
						}
					}
					if err := cs.call(ctx, q, reply); !errors.Is(err, errStreamDown) {
						return err
					}
				}
			}
		}
		return cc.Invoke(ctx, method, args, reply, opts...)
	})
}

// NewStream implements grpc.ClientConnInterface. A server-streaming call
// (every stream a client opens on the master: Watch, Snapshot) is opened
// lazily, on its first RecvMsg, through do: a master's refusal arrives
// with the first response, so that is where the stream follows the leader
// and fails over. Once a message has arrived the stream is the caller's; a
// stream that breaks later is reopened by calling the method again, which
// finds the leader the same way. Other streams are opened through do and
// returned as they are.
func (m *masters) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if !desc.ServerStreams || desc.ClientStreams {
		var cs grpc.ClientStream
		err := m.do(ctx, func(addr string) error {
			cc, err := m.conn(addr)
			if err != nil {
				return err
			}
			cs, err = cc.NewStream(ctx, desc, method, opts...)
			return err
		})
		return cs, err
	}
	return &serverStream{m: m, ctx: ctx, desc: desc, method: method, opts: opts}, nil
}

// serverStream is a server-streaming call opened on its first RecvMsg (or
// Header). It is used as the generated clients use one: SendMsg with the
// request, CloseSend, then RecvMsg from one goroutine.
type serverStream struct {
	m      *masters
	ctx    context.Context
	desc   *grpc.StreamDesc
	method string
	opts   []grpc.CallOption

	req       any
	closeSend bool
	cs        grpc.ClientStream // nil until opened
	openErr   error
}

// open opens the stream on the leader and runs first (RecvMsg or Header)
// on it, trying again as do decides while first fails.
func (s *serverStream) open(first func(grpc.ClientStream) error) error {
	return s.m.do(s.ctx, func(addr string) error {
		cc, err := s.m.conn(addr)
		if err != nil {
			return err
		}
		cs, err := cc.NewStream(s.ctx, s.desc, s.method, s.opts...)
		if err != nil {
			return err
		}
		if s.req != nil {
			if err := cs.SendMsg(s.req); err != nil {
				return firstErr(cs, err)
			}
		}
		if s.closeSend {
			if err := cs.CloseSend(); err != nil {
				return err
			}
		}
		if err := first(cs); err != nil {
			return err
		}
		s.cs = cs
		return nil
	})
}

// firstErr is the status behind a failed SendMsg: gRPC returns io.EOF
// there and the real error from RecvMsg.
func firstErr(cs grpc.ClientStream, err error) error {
	if rerr := cs.RecvMsg(new(struct{})); rerr != nil {
		return rerr
	}
	return err
}

func (s *serverStream) SendMsg(msg any) error {
	if s.cs != nil {
		return s.cs.SendMsg(msg)
	}
	s.req = msg
	return nil
}

func (s *serverStream) CloseSend() error {
	if s.cs != nil {
		return s.cs.CloseSend()
	}
	s.closeSend = true
	return nil
}

func (s *serverStream) RecvMsg(msg any) error {
	if s.cs != nil {
		return s.cs.RecvMsg(msg)
	}
	if s.openErr != nil {
		return s.openErr
	}
	s.openErr = s.open(func(cs grpc.ClientStream) error { return cs.RecvMsg(msg) })
	return s.openErr
}

func (s *serverStream) Header() (metadata.MD, error) {
	if s.cs == nil {
		if s.openErr == nil {
			s.openErr = s.open(func(cs grpc.ClientStream) error { _, err := cs.Header(); return err })
		}
		if s.openErr != nil {
			return nil, s.openErr
		}
	}
	return s.cs.Header()
}

func (s *serverStream) Trailer() metadata.MD {
	if s.cs == nil {
		return nil
	}
	return s.cs.Trailer()
}

func (s *serverStream) Context() context.Context {
	if s.cs == nil {
		return s.ctx
	}
	return s.cs.Context()
}
