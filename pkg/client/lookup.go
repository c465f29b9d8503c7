package client

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/fastcall"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/xfer"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The lookups on the master's lookup listener (internal/fastcall; issue
// 18, item 1). A master's CallStream names its lookup listener in a
// response header; while that stream lives, the lookups the stream would
// carry (GetReplicaList, BatchGetReplicaList, Exist, BatchExist) go there
// instead: the caller's goroutine writes the call on a pooled connection
// of its own and reads the answer, two wake-ups where the stream's
// message takes about eight. The master runs them exactly as the stream's
// (same interceptors, same authorization from the same client
// certificate), so only the transport differs.
//
//   - Only lookups: they may be made twice. A call whose connection fails
//     before its answer goes again on the stream (or as a unary call), and
//     the listener is not used again for a backoff (lookupRetry, doubling
//     to lookupMaxDown); a dial or probe that fails counts so too.
//   - A listener is dialed on a call's path only once it has answered
//     (since it was named, or since it last failed). Until then one probe
//     at a time dials it in the background and makes an empty call (which
//     any master answers UNIMPLEMENTED, before authorization), and calls
//     go on the stream. An advertised port the client cannot reach (SYNs
//     dropped by a firewall, a load balancer that accepts and never
//     answers) would otherwise hold every lookup in flight for up to
//     lookupDialTimeout each time its backoff ran out, or to its deadline.
//   - A broken stream forgets its listener (a new leader names its own).
//   - Not with Config.BearerToken (the listener knows callers by their
//     certificate), Config.DialOptions (no gRPC interceptor of the
//     client's sees a call there), Config.DisableCallStream, or
//     Config.DisableLookupListener.

const (
	lookupRetry   = 100 * time.Millisecond
	lookupMaxDown = 30 * time.Second
	// lookupDialTimeout bounds a dial and TLS handshake to the listener.
	lookupDialTimeout = 2 * time.Second
	// lookupIdle is how many idle connections a listener's pool keeps.
	lookupIdle = 8
	// lookupCallTimeout bounds a call whose context has no deadline: a
	// master answers in milliseconds, and one that does not (stopped, hung)
	// sends the call back to the stream, whose keepalive notices it.
	lookupCallTimeout = 10 * time.Second
)

// lookupMethod reports whether method may go on the lookup listener.
func lookupMethod(method string) bool {
	switch method {
	case masterv1.ObjectService_GetReplicaList_FullMethodName, masterv1.ObjectService_BatchGetReplicaList_FullMethodName,
		masterv1.ObjectService_Exist_FullMethodName, masterv1.ObjectService_BatchExist_FullMethodName:
		return true
	}
	return false
}

// lookupListener is one master's lookup listener and its idle connections.
type lookupListener struct {
	addr string      // host:port
	tls  *tls.Config // nil: plaintext

	mu     sync.Mutex
	idle   []*lookupConn
	fails  int
	until  time.Time // while down: not used before then
	closed bool
	// ready: the listener answered since it was named or last failed, so
	// a call may dial it; until then probe does, in the background.
	ready   bool
	probing bool

	ctx    context.Context // ends at close: the probe's
	stop   context.CancelFunc
	probes sync.WaitGroup
}

type lookupConn struct {
	nc    net.Conn
	br    *bufio.Reader
	buf   []byte // the last answer's bytes
	out   []byte // the last request's frame
	fresh bool   // the preamble is still to go
}

// resolveLookup is the address a master's advertised lookup listener is
// dialed at: adv as it is, or, when it names only a port (":port"), that
// port on the host of master (the address the client dialed).
func resolveLookup(adv, master string) (string, bool) {
	host, port, err := net.SplitHostPort(adv)
	if err != nil || port == "" {
		return "", false
	}
	if host == "" {
		if host, _, err = net.SplitHostPort(master); err != nil {
			return "", false
		}
	}
	return net.JoinHostPort(host, port), true
}

func newLookupListener(addr string, base *tls.Config) *lookupListener {
	l := &lookupListener{addr: addr}
	l.ctx, l.stop = context.WithCancel(context.Background())
	if base != nil {
		l.tls = xfer.ClientTLS(base, addr)
	}
	return l
}

// call makes q on the listener, answered into reply. errStreamDown: it was
// not answered there and goes another way.
func (l *lookupListener) call(ctx context.Context, q *masterv1.CallStreamRequest, reply any) error {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(lookupCallTimeout)
	}
	setTimeout(q, deadline)
	c, err := l.get(ctx)
	if err != nil {
		return err
	}
	r, keep, err := c.exchange(ctx, deadline, q)
	if errors.Is(err, errFrameTooLarge) {
		l.release(c, true) // too large for the listener: the stream takes it
		return errStreamDown
	}
	switch {
	case err != nil && ctx.Err() != nil:
		_ = c.nc.Close()
		return status.FromContextError(ctx.Err()).Err()
	case err != nil:
		_ = c.nc.Close()
		l.down()
		return errStreamDown
	}
	if cap(c.buf) > 1<<20 {
		c.buf = nil // a large answer's buffer is not kept
	}
	if cap(c.out) > 1<<20 {
		c.out = nil
	}
	l.release(c, keep)
	if r.Code != int32(codes.OK) {
		return status.ErrorProto(&spb.Status{Code: r.Code, Message: r.Message, Details: r.Details})
	}
	return r.answerInto(reply)
}

// get takes an idle connection or, once the listener has answered, dials
// one; errStreamDown while the listener is down or not known to answer
// (a probe is then under way), or when the dial fails.
func (l *lookupListener) get(ctx context.Context) (*lookupConn, error) {
	l.mu.Lock()
	if l.closed || time.Now().Before(l.until) {
		l.mu.Unlock()
		return nil, errStreamDown
	}
	if n := len(l.idle); n > 0 {
		c := l.idle[n-1]
		l.idle[n-1] = nil
		l.idle = l.idle[:n-1]
		l.mu.Unlock()
		return c, nil
	}
	if !l.ready {
		if !l.probing {
			l.probing = true
			l.probes.Go(l.probe)
		}
		l.mu.Unlock()
		return nil, errStreamDown
	}
	l.mu.Unlock()
	dctx, cancel := context.WithTimeout(ctx, lookupDialTimeout)
	defer cancel()
	c, err := l.dial(dctx)
	if err != nil {
		if ctx.Err() == nil {
			l.down()
		}
		return nil, errStreamDown
	}
	return c, nil
}

// dial connects to the listener, with its TLS handshake, under ctx.
func (l *lookupListener) dial(ctx context.Context) (*lookupConn, error) {
	nc, err := (&net.Dialer{}).DialContext(ctx, "tcp", l.addr)
	if err != nil {
		return nil, err
	}
	if l.tls != nil {
		tc := tls.Client(nc, l.tls)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = nc.Close()
			return nil, err
		}
		nc = tc
	}
	return &lookupConn{nc: nc, br: bufio.NewReaderSize(nc, 16<<10), fresh: true}, nil
}

// probe finds out, off any call's path, whether the listener answers: it
// dials it and makes an empty call, within lookupDialTimeout. On an
// answer the listener is ready and the connection kept; else the backoff
// starts.
func (l *lookupListener) probe() {
	ctx, cancel := context.WithTimeout(l.ctx, lookupDialTimeout)
	defer cancel()
	c, err := l.dial(ctx)
	if err == nil {
		if err = c.ping(ctx); err != nil {
			_ = c.nc.Close()
		}
	}
	l.mu.Lock()
	l.probing = false
	keep := err == nil && !l.closed && len(l.idle) < lookupIdle
	switch {
	case l.closed:
	case err != nil:
		l.downLocked()
	default:
		l.ready, l.fails = true, 0
		if keep {
			l.idle = append(l.idle, c)
		}
	}
	l.mu.Unlock()
	if err == nil && !keep {
		_ = c.nc.Close()
	}
}

// ping makes an empty call on a fresh connection: one that names no
// method, which a master answers UNIMPLEMENTED without running anything.
// Any answer will do.
func (c *lookupConn) ping(ctx context.Context) error {
	deadline, _ := ctx.Deadline()
	_, keep, err := c.exchange(ctx, deadline, &masterv1.CallStreamRequest{})
	switch {
	case err != nil:
		return err
	case !keep:
		return ctx.Err() // its deadline may yet land on the connection
	}
	return c.nc.SetDeadline(time.Time{})
}

// errFrameTooLarge: a call over fastcall.MaxRequest, not sent.
var errFrameTooLarge = errors.New("client: call too large for the lookup listener")

// exchange writes q on c (after the preamble on a fresh connection) and
// reads its answer, by deadline or until ctx ends. keep reports whether c
// may serve another call: it answered, and ctx's end did not (and will
// not) cut its deadline short. errFrameTooLarge leaves c as it was.
func (c *lookupConn) exchange(ctx context.Context, deadline time.Time, q *masterv1.CallStreamRequest) (r *callReply, keep bool, err error) {
	out := c.out[:0]
	if c.fresh {
		out = append(out, fastcall.Preamble...)
	}
	if out, err = fastcall.AppendFrame(out, q, fastcall.MaxRequest); err != nil {
		return nil, false, errFrameTooLarge
	}
	c.out, c.fresh = out, false
	_ = c.nc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.nc.SetDeadline(time.Unix(1, 0)) })
	_, err = c.nc.Write(out)
	if err == nil {
		c.buf, err = fastcall.ReadFrame(c.br, c.buf, fastcall.MaxResponse)
	}
	r = &callReply{}
	if err == nil {
		err = rpccodec.UnmarshalLimited(c.buf, r)
	}
	return r, stop() && err == nil, err
}

// release ends a call on c that the listener answered (or that never
// went): the backoff starts over, and c is kept for the next call when
// keep and there is room, else closed.
func (l *lookupListener) release(c *lookupConn, keep bool) {
	if keep {
		_ = c.nc.SetDeadline(time.Time{})
	}
	l.mu.Lock()
	l.fails = 0
	if keep && !l.closed && len(l.idle) < lookupIdle {
		l.idle = append(l.idle, c)
		c = nil
	}
	l.mu.Unlock()
	if c != nil {
		_ = c.nc.Close()
	}
}

// down starts a backoff after a failure; the listener must answer a
// probe again before a call dials it.
func (l *lookupListener) down() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.downLocked()
}

func (l *lookupListener) downLocked() {
	l.fails++
	l.until = time.Now().Add(min(lookupRetry<<min(l.fails-1, 16), lookupMaxDown))
	l.ready = false
}

// close closes the idle connections and ends a probe, waiting for it;
// calls in flight close theirs.
func (l *lookupListener) close() {
	l.mu.Lock()
	l.closed = true
	idle := l.idle
	l.idle = nil
	l.mu.Unlock()
	l.stop()
	l.probes.Wait()
	for _, c := range idle {
		_ = c.nc.Close()
	}
}
