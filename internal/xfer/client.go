package xfer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Defaults for Config.
const (
	DefaultMaxIdlePerEndpoint = 16
	DefaultDialTimeout        = 5 * time.Second
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
	// DialTimeout bounds connecting to an agent (default 5s); the call's
	// context applies as well.
	DialTimeout time.Duration
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
	return exchange(ctx, p, endpoint, items, src, "source", (*conn).write)
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
	err := p.run(ctx, endpoint, func(c *conn) error {
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
	// ObjectSize and Checksum are the object's size and sealed xxhash64.
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
	return exchange(ctx, p, endpoint, items, dst, "destination", (*conn).read)
}

// run performs fn on a pooled connection to endpoint under ctx. When the
// first exchange on a reused connection fails before any byte of the
// answer arrived, the agent most likely closed that connection while it
// sat idle (or restarted): the call is retried once on a fresh connection.
// Both operations are idempotent until the caller seals, so a retry is
// safe even if the agent did act on the first attempt.
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
		if attempt == 0 && c.reused && c.dirty && !c.answered && stale(err) {
			p.dropIdle(endpoint)
			continue
		}
		return err
	}
}

// do runs fn on c with ctx's deadline on the socket and cancellation
// unblocking it, then returns c to the pool if it is still clean: a
// connection that saw an error after sending, or a cancellation, is closed.
func (p *Pool) do(ctx context.Context, c *conn, fn func(*conn) error) error {
	c.dirty, c.answered = false, false
	d, _ := ctx.Deadline() // zero: no deadline (clears a previous call's)
	_ = c.nc.SetDeadline(d)
	stop := context.AfterFunc(ctx, func() { _ = c.nc.SetDeadline(aLongTimeAgo) })
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

	nc, err := p.dial(ctx, "tcp", endpoint)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, unavailable(endpoint, err)
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

// conn is one client connection. Only the goroutine that took it from the
// pool touches it.
type conn struct {
	nc       net.Conn
	br       *bufio.Reader
	endpoint string
	greeted  bool      // the preamble went out
	reused   bool      // an earlier call completed on it
	lastUsed time.Time // when it went back to the pool
	wbuf     []byte    // request header scratch
	rbuf     []byte    // response header scratch

	// Per call.
	dirty    bool // bytes were sent: an error now leaves the stream unframed
	answered bool // the first byte of a response arrived
}

// send writes one request frame (with the preamble on a fresh connection)
// followed by payload.
func (c *conn) send(op agentv1.TransferOp, items []*agentv1.TransferItem, payload [][]byte) error {
	b := c.wbuf[:0]
	if !c.greeted {
		b = append(b, Preamble...)
	}
	b, err := AppendFrame(b, &agentv1.TransferRequest{Op: op, Items: items})
	if err != nil {
		return err // nothing sent: the connection stays usable
	}
	c.wbuf = b
	c.dirty, c.greeted = true, true
	if err := WriteFrame(c.nc, b, payload); err != nil {
		// The agent may have refused the request and closed the
		// connection; its answer says more than the broken pipe.
		if resp, rerr := c.response(); rerr == nil && resp.GetError() != nil {
			return c.refused(resp.GetError())
		}
		return unavailable(c.endpoint, err)
	}
	return nil
}

// response reads one response header and checks its envelope: no request
// error and one result per item.
func (c *conn) response() (*agentv1.TransferResponse, error) {
	if _, err := c.br.Peek(1); err != nil {
		return nil, unavailable(c.endpoint, err)
	}
	c.answered = true
	resp := &agentv1.TransferResponse{}
	buf, err := ReadFrame(c.br, c.rbuf, resp)
	c.rbuf = buf
	switch {
	case errors.Is(err, ErrProtocol):
		return nil, c.violation("bad response frame: %v", err)
	case err != nil:
		return nil, unavailable(c.endpoint, err)
	}
	return resp, nil
}

// exchange sends one request and returns its per-item results (a READ's
// payloads follow on the connection).
func (c *conn) exchange(op agentv1.TransferOp, items []*agentv1.TransferItem, payload [][]byte) ([]*agentv1.TransferResult, error) {
	if err := c.send(op, items, payload); err != nil {
		return nil, err
	}
	resp, err := c.response()
	if err != nil {
		return nil, err
	}
	if e := resp.GetError(); e != nil {
		return nil, c.refused(e)
	}
	if len(resp.GetResults()) != len(items) {
		return nil, c.violation("%d results for %d items", len(resp.GetResults()), len(items))
	}
	return resp.GetResults(), nil
}

// refused is the error for a request the agent refused whole.
func (c *conn) refused(st *agentv1.ItemResult) error {
	err := ItemError(st)
	if err == nil {
		return c.violation("request refused with code OK")
	}
	return fmt.Errorf("xfer %s: request refused: %w", c.endpoint, err)
}

func (c *conn) violation(format string, args ...any) error {
	return fmt.Errorf("xfer %s: %w: %w", c.endpoint,
		rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "agent broke the transfer protocol: "+format, args...), ErrProtocol)
}

// write runs one WRITE exchange of at most MaxItems items.
func (c *conn) write(items []*agentv1.TransferItem, src [][]byte, errs []error) error {
	rs, err := c.exchange(agentv1.TransferOp_TRANSFER_OP_WRITE, items, src)
	if err != nil {
		return err
	}
	for i, r := range rs {
		err := ItemError(r.GetStatus())
		if err == nil && r.GetLength() != items[i].GetLength() {
			return c.violation("item %d: %d bytes written of %d sent", i, r.GetLength(), items[i].GetLength())
		}
		errs[i] = err
	}
	return nil
}

// read runs one READ exchange of at most MaxItems items.
func (c *conn) read(items []*agentv1.TransferItem, dst [][]byte, res []ReadResult) error {
	rs, err := c.exchange(agentv1.TransferOp_TRANSFER_OP_READ, items, nil)
	if err != nil {
		return err
	}
	for i, r := range rs {
		if err := ItemError(r.GetStatus()); err != nil {
			res[i] = ReadResult{Err: err} // no payload follows a failed item
			continue
		}
		n, want, off, size := r.GetLength(), uint64(len(dst[i])), items[i].GetOffset(), r.GetObjectSize()
		if off > size || n > size-off {
			return c.violation("item %d: %d bytes from offset %d of a %d-byte object", i, n, off, size)
		}
		if n != want {
			if want != 0 {
				return c.violation("item %d: %d payload bytes for a %d-byte read", i, n, want)
			}
			// An empty dst asked for the rest of the object: drop it.
			if n > math.MaxInt64 {
				return c.violation("item %d: %d payload bytes", i, n)
			}
			if _, err := io.CopyN(io.Discard, c.br, int64(n)); err != nil {
				return unavailable(c.endpoint, err)
			}
			res[i] = ReadResult{ObjectSize: size, Checksum: r.GetChecksum(),
				Err: errInvalid("item %d: the destination buffer is empty but the object has %d bytes from offset %d", i, n, off)}
			continue
		}
		if _, err := io.ReadFull(c.br, dst[i]); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return unavailable(c.endpoint, err)
		}
		res[i] = ReadResult{N: len(dst[i]), ObjectSize: size, Checksum: r.GetChecksum()}
	}
	return nil
}

func errInvalid(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "xfer: "+format, args...)
}

// unavailable wraps a connection failure: UNAVAILABLE AGENT_UNAVAILABLE
// for status and reason, and the network error for errors.Is.
func unavailable(endpoint string, err error) error {
	return fmt.Errorf("xfer %s: %w: %w", endpoint,
		rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "transfer connection failed"), err)
}
