package xfer

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
)

// Defaults for Config.
const (
	DefaultMaxIdlePerEndpoint = 16
	DefaultDialTimeout        = 5 * time.Second
	DefaultStallTimeout       = 5 * time.Second
)

const (
	// maxIdleAge retires a pooled connection unused this long instead of
	// reusing it: the agent drops connections idle for minutes (dataplane
	// TransferIdleTimeout, 5 min by default), and a reuse that races the
	// drop costs a retry.
	maxIdleAge = 2 * time.Minute
	// readBufferSize buffers response headers. Payload reads of at least
	// this size bypass the buffer (bufio.Reader.Read reads large requests
	// straight into the caller's slice), so only the first bytes of a
	// payload that arrive with the header are copied.
	readBufferSize = 64 << 10
	// maxKeptScratch is the largest header scratch buffer a pooled
	// connection keeps between calls.
	maxKeptScratch = 64 << 10
	// stallStep is how many payload bytes move under one stall deadline
	// (Config.StallTimeout), as the agent's listener moves them under one
	// of its IOTimeout: a step is the request's header and payload up to
	// this size, the answer's header, and every stallStep of payload.
	stallStep = 4 << 20
)

// ErrClosed is returned by calls on a closed Pool and by calls in flight
// when it closed (errors.Is works on it). It wraps context.Canceled, so its
// status is CANCELLED, like a call whose context ended.
var ErrClosed error = closedError{}

type closedError struct{}

func (closedError) Error() string { return "xfer: transfer pool is closed" }
func (closedError) Unwrap() error { return context.Canceled }

// aLongTimeAgo is a deadline in the past: setting it unblocks a connection's
// pending I/O at once.
var aLongTimeAgo = time.Unix(1, 0)

// Config tunes a Pool.
type Config struct {
	// MaxIdlePerEndpoint bounds the idle connections kept per agent
	// endpoint for reuse (default 16).
	MaxIdlePerEndpoint int
	// DialTimeout bounds connecting to an agent, the TLS handshake
	// included (default 5s); the call's context applies as well.
	DialTimeout time.Duration
	// StallTimeout bounds each step of an exchange with an agent: sending
	// the request with up to 4 MiB of its payload, every further 4 MiB,
	// waiting for the answer, reading every 4 MiB of its payload (default
	// 5 s). An agent that is stopped, hung or cut off, whose kernel still
	// holds the connection open, fails the call then with UNAVAILABLE
	// AGENT_UNAVAILABLE instead of holding it until the caller's deadline
	// (or for ever, without one); the caller's deadline applies as well. A
	// negative value turns the bound off.
	StallTimeout time.Duration
	// TLS, when set, makes every connection TLS with this configuration
	// (see ClientTLS: per endpoint, its host is the server name when the
	// configuration names none). Nil is plaintext.
	TLS *tls.Config
}

// Pool is a client of the bulk transfer protocol: it keeps connections per
// agent endpoint and runs Write and Read calls over them, one request at a
// time per connection. It is safe for concurrent use; concurrent calls to
// one endpoint use distinct connections.
type Pool struct {
	cfg Config
	// dial connects; tests replace it (net.Dialer.DialContext by default).
	dial func(ctx context.Context, network, addr string) (net.Conn, error)

	// mu guards idle, busy and closed.
	mu     sync.Mutex
	idle   map[string][]*conn // per endpoint, most recently used last
	busy   map[*conn]struct{}
	closed bool
}

// NewPool builds a pool; it dials nothing until the first call.
func NewPool(cfg Config) *Pool {
	if cfg.MaxIdlePerEndpoint <= 0 {
		cfg.MaxIdlePerEndpoint = DefaultMaxIdlePerEndpoint
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.StallTimeout == 0 {
		cfg.StallTimeout = DefaultStallTimeout
	}
	d := &net.Dialer{Timeout: cfg.DialTimeout}
	return &Pool{cfg: cfg, dial: d.DialContext, idle: map[string][]*conn{}, busy: map[*conn]struct{}{}}
}

// Close closes every connection: idle ones, and those of calls in flight,
// which then fail with ErrClosed. Later calls fail with ErrClosed. It is
// idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	var all []*conn
	for _, list := range p.idle {
		all = append(all, list...)
	}
	for c := range p.busy {
		all = append(all, c)
	}
	p.idle = nil
	p.mu.Unlock()
	for _, c := range all {
		_ = c.nc.Close()
	}
	return nil
}

// Write sends src[i] into items[i], which names the allocation, its write
// token and the offset; Write sets items[i].Length to len(src[i]). The
// payload goes to the socket straight from src (one vectored write per
// request). itemErrs[i] is nil or item i's error (an *rpcerr.Error, as
// DataService reports it). err is a transport, protocol or argument error,
// and then itemErrs is nil. More than MaxItems items travel as several
// requests on one connection; a failure after the first has succeeded still
// returns only err.
func (p *Pool) Write(ctx context.Context, endpoint string, items []*agentv1.TransferItem, src [][]byte) (itemErrs []error, err error) {
	ctx, span := startSpan(ctx, "transfer.write", endpoint, items, src)
	itemErrs, err = exchange(ctx, p, endpoint, items, src, "source", (*conn).write)
	endSpan(span, err, itemErrs, func(e error) error { return e })
	return itemErrs, err
}

// WriteResult is one item's outcome of WriteSealed.
type WriteResult struct {
	// Err is nil or the item's error (an *rpcerr.Error).
	Err error
	// Receipt is the agent's seal receipt for an item sent with
	// seal_checksum that the agent sealed on write; nil otherwise (the
	// master's Seal then seals it at PutEnd).
	Receipt []byte
}

// WriteSealed is Write that also returns each item's seal receipt: items
// that set SealChecksum (whole-object items only) ask the agent to verify
// and seal the allocation once its bytes are in (transfer.proto).
func (p *Pool) WriteSealed(ctx context.Context, endpoint string, items []*agentv1.TransferItem, src [][]byte) (res []WriteResult, err error) {
	ctx, span := startSpan(ctx, "transfer.write", endpoint, items, src)
	res, err = exchange(ctx, p, endpoint, items, src, "source", (*conn).writeSealed)
	endSpan(span, err, res, func(r WriteResult) error { return r.Err })
	return res, err
}

// tracer makes the client's transfer spans.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/xfer")

// startSpan starts the client span of one Write or Read call when the
// caller's span records; its requests then carry its context
// (TransferRequest.trace_context), so the agent's span is its child.
func startSpan(ctx context.Context, name, endpoint string, items []*agentv1.TransferItem, bufs [][]byte) (context.Context, trace.Span) {
	ctx, span := tracer.Child(ctx, name, tracectx.ClientKind...)
	if span.IsRecording() {
		n := 0
		for _, b := range bufs {
			n += len(b)
		}
		span.SetAttributes(tracectx.Endpoint.String(endpoint), tracectx.Items.Int(len(items)), tracectx.Bytes.Int(n))
	}
	return ctx, span
}

// endSpan ends a call's span with its error or its items' outcome.
func endSpan[R any](span trace.Span, err error, res []R, itemErr func(R) error) {
	if err == nil && span.IsRecording() {
		failed, first := 0, ""
		for _, r := range res {
			if e := itemErr(r); e != nil {
				if failed++; first == "" {
					first = tracectx.ReasonOf(e)
				}
			}
		}
		tracectx.Outcome(span, failed, first)
	}
	tracectx.End(span, err)
}

// exchange is Write and Read: it checks the arguments, sets each item's
// Length to its buffer's, and runs the items on one pooled connection in
// requests of at most MaxItems, one result per item.
func exchange[R any](ctx context.Context, p *Pool, endpoint string, items []*agentv1.TransferItem, bufs [][]byte, what string,
	do func(c *conn, items []*agentv1.TransferItem, bufs [][]byte, out []R) error) ([]R, error) {
	if len(items) != len(bufs) {
		return nil, errInvalid("%d transfer items but %d %s buffers", len(items), len(bufs), what)
	}
	for i, it := range items {
		if it == nil {
			return nil, errInvalid("transfer item %d is nil", i)
		}
		it.Length = uint64(len(bufs[i]))
	}
	out := make([]R, len(items))
	if len(items) == 0 {
		return out, nil
	}
	tc := tracectx.Transfer(ctx) // nil unless the call's span is sampled
	err := p.run(ctx, endpoint, func(c *conn) error {
		c.trace = tc
		for lo := 0; lo < len(items); lo += MaxItems {
			hi := min(lo+MaxItems, len(items))
			if err := do(c, items[lo:hi], bufs[lo:hi], out[lo:hi]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ReadResult is one item's outcome of Read.
type ReadResult struct {
	// Err is nil or the item's error (an *rpcerr.Error).
	Err error
	// N is the number of bytes read into dst[i]: len(dst[i]) on success.
	N int
	// ObjectSize and Checksum are the object's size and sealed checksum (XXH3-64, internal/checksum).
	ObjectSize, Checksum uint64
}

// Read reads items[i] into dst[i], which the caller sizes (the object size
// from GetReplicaList, or the length of a range); Read sets items[i].Length
// to len(dst[i]). The payload is read from the socket straight into dst. An
// empty dst[i] asks for the rest of the object from the item's offset
// (length 0 on the wire), so it succeeds only for an empty rest; otherwise
// the item fails with INVALID_PARAMS. res[i].Err is item i's error; err is
// a transport, protocol or argument error, and then res is nil.
func (p *Pool) Read(ctx context.Context, endpoint string, items []*agentv1.TransferItem, dst [][]byte) (res []ReadResult, err error) {
	ctx, span := startSpan(ctx, "transfer.read", endpoint, items, dst)
	res, err = exchange(ctx, p, endpoint, items, dst, "destination", (*conn).read)
	endSpan(span, err, res, func(r ReadResult) error { return r.Err })
	return res, err
}

// Verify asks the agent at endpoint to check items' SEALED allocations
// against their sealed checksums (TRANSFER_OP_VERIFY; items need a read
// token, their offset and length are ignored). errs[i] is nil when item
// i's bytes are intact, DATA_LOSS CHECKSUM_MISMATCH when they were not
// (the agent dropped the allocation and reported it lost), or why it could
// not be checked; err is a transport, protocol or argument error (an agent
// that predates VERIFY closes the connection), and then errs is nil.
func (p *Pool) Verify(ctx context.Context, endpoint string, items []*agentv1.TransferItem) (errs []error, err error) {
	if len(items) > MaxVerifyItems {
		return nil, errInvalid("%d items to verify, at most %d", len(items), MaxVerifyItems)
	}
	ctx, span := startSpan(ctx, "transfer.verify", endpoint, items, nil)
	errs, err = exchange(ctx, p, endpoint, items, make([][]byte, len(items)), "", (*conn).verify)
	endSpan(span, err, errs, func(e error) error { return e })
	return errs, err
}

// run performs fn on a pooled connection to endpoint under ctx. When the
// first exchange on a reused connection fails before any byte of the
// answer arrived, the agent most likely closed that connection while it
// sat idle (or restarted): the call is retried once on a fresh connection.
// Both operations are idempotent until the caller seals, so a retry is
// safe even if the agent did act on the first attempt. A WRITE with
// seal_checksum seals as it ends: its retry after an agent that did act
// (and then lost the connection before answering) is refused with
// ALLOCATION_STATE, so the put fails and is revoked, never sealed twice
// or with other bytes.
func (p *Pool) run(ctx context.Context, endpoint string, fn func(*conn) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	for attempt := 0; ; attempt++ {
		c, err := p.get(ctx, endpoint, attempt > 0)
		if err != nil {
			return err
		}
		err = p.do(ctx, c, fn)
		if err == nil {
			return nil
		}
		if cerr := contextError(ctx, err); cerr != nil {
			return cerr
		}
		if p.isClosed() {
			return ErrClosed
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return stalled(endpoint, p.cfg.StallTimeout)
		}
		if attempt == 0 && c.reused && c.dirty && !c.answered && stale(err) {
			p.dropIdle(endpoint)
			continue
		}
		return err
	}
}

// do runs fn on c with a deadline per step on the socket (conn.step: the
// stall bound, or ctx's deadline when sooner) and cancellation unblocking
// it, then returns c to the pool if it is still clean: a connection that
// saw an error after sending, or a cancellation, is closed.
func (p *Pool) do(ctx context.Context, c *conn, fn func(*conn) error) error {
	c.dirty, c.answered = false, false
	stop := c.dl.Begin(ctx, c.nc, p.cfg.StallTimeout)
	c.step()
	err := fn(c)
	interrupted := !stop()
	p.put(c, (err == nil || !c.dirty) && !interrupted)
	return err
}

// contextError returns the context's error when it explains err: ctx ended,
// or the socket deadline that mirrors ctx's deadline fired (ctx may not
// have noticed yet).
func contextError(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	if d, ok := ctx.Deadline(); ok && errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

// stale reports whether err looks like a connection the peer had closed.
func stale(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

func (p *Pool) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// get returns an idle connection to endpoint (unless fresh) or dials one.
func (p *Pool) get(ctx context.Context, endpoint string, fresh bool) (*conn, error) {
	var old []*conn
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	list := p.idle[endpoint]
	for !fresh && len(list) > 0 {
		c := list[len(list)-1]
		list = list[:len(list)-1]
		if time.Since(c.lastUsed) > maxIdleAge {
			old = append(old, c)
			continue
		}
		p.idle[endpoint] = list
		p.busy[c] = struct{}{}
		p.mu.Unlock()
		closeAll(old)
		return c, nil
	}
	p.idle[endpoint] = list
	p.mu.Unlock()
	closeAll(old)

	nc, err := p.connect(ctx, endpoint)
	if err != nil {
		return nil, err
	}
	c := &conn{nc: nc, br: bufio.NewReaderSize(nc, readBufferSize), endpoint: endpoint}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = nc.Close()
		return nil, ErrClosed
	}
	p.busy[c] = struct{}{}
	return c, nil
}

// connect dials endpoint and, with Config.TLS, completes the TLS handshake,
// both within DialTimeout and ctx.
func (p *Pool) connect(ctx context.Context, endpoint string) (net.Conn, error) {
	dctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	defer cancel()
	nc, err := p.dial(dctx, "tcp", endpoint)
	if err == nil && p.cfg.TLS != nil {
		tc := TLSClient(nc, ClientTLS(p.cfg.TLS, endpoint))
		if err = tc.HandshakeContext(dctx); err != nil {
			_ = nc.Close()
		}
		nc = tc
	}
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, unavailable(endpoint, err)
	}
	return nc, nil
}

// ClientTLS is base for one connection to endpoint (host:port): a clone
// whose ServerName, when base names none, is the endpoint's host, and whose
// VerifyConnection, if any, sees that host as the ConnectionState's
// ServerName when no SNI was sent (crypto/tls sends none for an IP
// address). So one configuration serves every agent and master, and
// internal/auth's Source.ClientTLS(""), which verifies in VerifyConnection
// against the name it is given or else the SNI, verifies IP endpoints too.
func ClientTLS(base *tls.Config, endpoint string) *tls.Config {
	c := base.Clone()
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		host = endpoint
	}
	if c.ServerName == "" {
		c.ServerName = host
	}
	if verify := c.VerifyConnection; verify != nil {
		name := c.ServerName
		c.VerifyConnection = func(cs tls.ConnectionState) error {
			if cs.ServerName == "" {
				cs.ServerName = name
			}
			return verify(cs)
		}
	}
	return c
}

// put returns c to the idle list if healthy and there is room, else
// closes it.
func (p *Pool) put(c *conn, healthy bool) {
	if cap(c.rbuf) > maxKeptScratch {
		c.rbuf = nil
	}
	if cap(c.wbuf) > maxKeptScratch {
		c.wbuf = nil
	}
	// Bytes left over from the last answer would be read as the next
	// one: such a connection is out of step, not reusable.
	healthy = healthy && c.br.Buffered() == 0
	p.mu.Lock()
	delete(p.busy, c)
	if healthy && !p.closed && len(p.idle[c.endpoint]) < p.cfg.MaxIdlePerEndpoint {
		c.reused, c.lastUsed = true, time.Now()
		p.idle[c.endpoint] = append(p.idle[c.endpoint], c)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	_ = c.nc.Close()
}

// dropIdle closes the idle connections to endpoint (after one of them
// turned out dead, the others are likely dead too).
func (p *Pool) dropIdle(endpoint string) {
	p.mu.Lock()
	list := p.idle[endpoint]
	delete(p.idle, endpoint)
	p.mu.Unlock()
	closeAll(list)
}

func closeAll(cs []*conn) {
	for _, c := range cs {
		_ = c.nc.Close()
	}
}

func errInvalid(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "xfer: "+format, args...)
}

// stalled is the error of an exchange whose agent let a step's deadline
// pass (Config.StallTimeout): UNAVAILABLE AGENT_UNAVAILABLE, as for a
// connection that failed, and os.ErrDeadlineExceeded for errors.Is.
func stalled(endpoint string, stall time.Duration) error {
	return fmt.Errorf("xfer %s: %w: %w", endpoint,
		rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "transfer stalled: the agent moved no data for %s", stall), os.ErrDeadlineExceeded)
}

// unavailable wraps a connection failure: UNAVAILABLE AGENT_UNAVAILABLE
// for status and reason, and the network error for errors.Is.
func unavailable(endpoint string, err error) error {
	return fmt.Errorf("xfer %s: %w: %w", endpoint,
		rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "transfer connection failed"), err)
}
