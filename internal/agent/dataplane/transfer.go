package dataplane

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/conntrack"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/xfer"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Defaults for TransferConfig.
const (
	DefaultTransferIdleTimeout  = 5 * time.Minute
	DefaultTransferIOTimeout    = 30 * time.Second
	DefaultTransferDrainTimeout = 10 * time.Second
	// DefaultTransferMaxConns and DefaultTransferMaxConnsPerIP leave room
	// for many client processes per host (pkg/client opens up to its
	// MaxConcurrency connections per agent and call) while bounding what
	// connections can pin: about 70 KiB each at rest, up to
	// MaxHeaderBytes plus the decoded items while a request is read.
	DefaultTransferMaxConns      = 1024
	DefaultTransferMaxConnsPerIP = 256
	// DefaultTransferMaxItemsInFlight is 32 requests of xfer.MaxItems.
	DefaultTransferMaxItemsInFlight = 32 * xfer.MaxItems
)

const (
	// transferReadBuffer buffers request headers and the payload bytes that
	// arrive with them; the rest of a payload bound for memory segments is
	// read with readv straight into the mappings (readInto).
	transferReadBuffer = 64 << 10
	// maxReadv bounds the buffers of one readv (IOV_MAX is 1024).
	maxReadv = 1024
	// ioStep is how many payload bytes move under one I/O deadline: a peer
	// must make this much progress every IOTimeout.
	ioStep = 4 << 20
	// diskChunk is the pooled buffer between the socket and a disk segment.
	diskChunk = 1 << 20
	// lingerBytes and lingerTime bound what a refusing agent still reads
	// and drops after its error answer, so a client in the middle of
	// sending its payload can finish and read the answer instead of
	// meeting a reset.
	lingerBytes = 4 << 20
	lingerTime  = time.Second
	// maxKeptHeader is the largest header scratch buffer a connection
	// keeps between requests.
	maxKeptHeader = 64 << 10
	// maxRejecting bounds the refused connections answered at once (each
	// answer lingers up to lingerTime); beyond it a refused connection is
	// closed without an answer.
	maxRejecting = 32
	// idleTrim is how long a connection waits for its next request before
	// it gives back what it keeps from request to request (trim).
	idleTrim = time.Second
)

// TransferConfig tunes the bulk transfer listener.
type TransferConfig struct {
	// IdleTimeout closes a connection that starts no request for this
	// long (default 5 min).
	IdleTimeout time.Duration
	// IOTimeout bounds each step of a request once it started: the rest of
	// its header, every 4 MiB of payload, the answer. A stalled peer cannot
	// pin allocations longer (default 30 s).
	IOTimeout time.Duration
	// DrainTimeout is how long requests in progress may finish after
	// ServeTransfer's context ends before their connections are cut
	// (default 10 s).
	DrainTimeout time.Duration
	// MaxConns bounds the open connections (default 1024), MaxConnsPerIP
	// those from one remote IP address (default 256). A connection past
	// either is answered RESOURCE_EXHAUSTED LIMIT_EXCEEDED and closed.
	MaxConns, MaxConnsPerIP int
	// MaxHeaderBytes bounds a request header (default and at most
	// xfer.MaxHeaderBytes, 1 MiB); a larger one is refused with
	// RESOURCE_EXHAUSTED LIMIT_EXCEEDED before it is read.
	MaxHeaderBytes int
	// TrustDomain is the SPIFFE trust domain of the callers' certificates
	// when the listener ServeTransfer gets is a TLS listener (issue 14):
	// a connection whose verified certificate holds no principal of it is
	// refused UNAUTHENTICATED, and a tenant principal's tokens must name
	// its tenant. Unused on a plaintext listener.
	TrustDomain string
	// MaxItemsInFlight bounds the items of the requests being served at
	// once, over all connections (default 131072, 32 requests of
	// xfer.MaxItems; at least xfer.MaxItems). What a request holds grows
	// with its items (about 250 bytes each besides its header) while its
	// header can be tiny, so this, not the header size, bounds that
	// memory. A request that would pass it waits up to IOTimeout for
	// others to finish, then is refused with RESOURCE_EXHAUSTED
	// LIMIT_EXCEEDED.
	MaxItemsInFlight int
}

func (c TransferConfig) withDefaults() TransferConfig {
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = DefaultTransferIdleTimeout
	}
	if c.IOTimeout <= 0 {
		c.IOTimeout = DefaultTransferIOTimeout
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = DefaultTransferDrainTimeout
	}
	if c.MaxConns <= 0 {
		c.MaxConns = DefaultTransferMaxConns
	}
	if c.MaxConnsPerIP <= 0 {
		c.MaxConnsPerIP = DefaultTransferMaxConnsPerIP
	}
	if c.MaxHeaderBytes <= 0 || c.MaxHeaderBytes > xfer.MaxHeaderBytes {
		c.MaxHeaderBytes = xfer.MaxHeaderBytes
	}
	if c.MaxItemsInFlight <= 0 {
		c.MaxItemsInFlight = DefaultTransferMaxItemsInFlight
	}
	c.MaxItemsInFlight = max(c.MaxItemsInFlight, xfer.MaxItems)
	return c
}

var diskBufs = sync.Pool{New: func() any { b := make([]byte, diskChunk); return &b }}

// ServeTransfer serves the bulk transfer protocol (internal/xfer) on lis until
// ctx ends, one goroutine per connection, requests answered in order, at
// most TransferConfig.MaxConns connections (MaxConnsPerIP per remote
// address): one more is answered LIMIT_EXCEEDED and closed. Then
// it closes lis and the idle connections, lets requests in progress finish
// for up to TransferConfig.DrainTimeout, cuts what remains and returns once
// every connection goroutine has. It returns nil after ctx ended, or the
// listener's error.
//
// lis may be a TLS listener (crypto/tls.NewListener; internal/auth's
// Source.ServerTLS): each connection then completes its handshake within
// IOTimeout before anything else, and its caller is the principal of its
// verified certificate in TransferConfig.TrustDomain. A connection without
// one is answered UNAUTHENTICATED and closed; a tenant principal's tokens
// must name its own tenant.
func (s *Server) ServeTransfer(ctx context.Context, lis net.Listener) error {
	t := newTransferServer(s)
	stop := context.AfterFunc(ctx, func() { _ = lis.Close() })
	defer stop()
	var err error
	for {
		nc, aerr := retry.Accept(ctx, lis, s.lg, "transfer")
		if aerr != nil {
			if ctx.Err() == nil {
				err = aerr
			}
			break
		}
		c, rerr := t.add(nc)
		if rerr != nil {
			t.reject(nc, rerr)
			continue
		}
		if c == nil {
			_ = nc.Close()
			continue
		}
		t.wg.Go(func() { t.serve(c) })
	}
	_ = lis.Close()
	t.shutdown()
	return err
}

// transferServer is one ServeTransfer: its connections and their states.
type transferServer struct {
	s   *Server
	cfg TransferConfig
	wg  sync.WaitGroup

	// conns admits connections under MaxConns and MaxConnsPerIP, knows
	// which are idle between requests and is closing once shutdown began
	// (the closing state acquire and reject read too). It has its own
	// lock, never held with mu.
	conns *conntrack.Tracker[netip.Addr]

	// mu guards rejecting, items and freed.
	mu sync.Mutex
	// rejecting counts refused connections still being answered.
	rejecting int
	// items counts the items of the requests being served (acquire);
	// freed, when set, is closed as soon as some are given back.
	items int
	freed chan struct{}
}

func newTransferServer(s *Server) *transferServer {
	return &transferServer{s: s, cfg: s.cfg.Transfer, conns: conntrack.New[netip.Addr](s.cfg.Transfer.MaxConns, s.cfg.Transfer.MaxConnsPerIP)}
}

// transferConn is one client connection, served by one goroutine.
type transferConn struct {
	nc net.Conn
	tc *conntrack.Conn[netip.Addr] // its entry in transferServer.conns
	// tenant is the caller's tenant when it is a tenant principal (TLS),
	// "" otherwise; tokens must name it (callerTenant).
	tenant string
	// br buffers the connection once its preamble is in, so a connection
	// that never gets that far costs no buffer.
	br   *bufio.Reader
	hbuf []byte
	wbuf []byte
	iov  net.Buffers
	// req decodes request headers (decode.go).
	req transferRequest
	// A WRITE's per-item arrays, reused by the next request (reuse).
	handles []segment.Handle
	hs      handles
	errs    []error
	results []agentv1.TransferResult
	rptrs   []*agentv1.TransferResult
	seals   []sealWrite
	sums    []hashed
	// digest and one serve readHashed.
	digest *checksum.Digest
	one    [1][]byte

	// rdLeft is how many more bytes may be read before the read deadline
	// is renewed (every ioStep bytes of a request).
	rdLeft int
	// rc reads the socket directly (readInto); nil when nc is not a
	// socket (a net.Pipe in tests), and then payloads go through br.
	rc syscall.RawConn
	// run holds the destinations of consecutive memory items of a WRITE,
	// vec the share of them one readv fills; both are reused.
	run, vec [][]byte
	// readv's state for rvFn, a method value made once (a closure per
	// call would allocate).
	rvFn  func(fd uintptr) bool
	rvN   int
	rvErr error

	// The request's span (a child of the client's when its header names a
	// sampled span; else one that records nothing) and what it reports.
	span   trace.Span
	traced transferOutcome
}

// transferOutcome is what a request's span reports: the payload bytes
// moved, the items that failed and the first one's reason.
type transferOutcome struct {
	bytes  uint64
	failed int
	first  string
}

// itemFailed counts a failed item for the request's span.
func (c *transferConn) itemFailed(err error) {
	if c.span != nil && c.span.IsRecording() {
		if c.traced.failed++; c.traced.first == "" {
			c.traced.first = tracectx.ReasonOf(err)
		}
	}
}

// tracer makes the agent's transfer spans.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/agent/dataplane")

// startSpan starts the span of one request when its header names a sampled
// client span: "transfer.write" or "transfer.read", its child.
func startSpan(c *transferConn, req *agentv1.TransferRequest) {
	c.traced = transferOutcome{}
	c.span = noSpan
	tc := req.GetTraceContext()
	if tc == nil {
		return
	}
	name := "transfer.read"
	switch req.GetOp() {
	case agentv1.TransferOp_TRANSFER_OP_WRITE:
		name = "transfer.write"
	case agentv1.TransferOp_TRANSFER_OP_VERIFY:
		name = "transfer.verify"
	}
	_, c.span = tracer.Remote(context.Background(), name, tracectx.ParseTransfer(tc), nil, tracectx.ServerKind...)
	if c.span.IsRecording() {
		items := req.GetItems()
		c.span.SetAttributes(tracectx.Items.Int(len(items)))
		if seg := items[0].GetSegmentId(); !slices.ContainsFunc(items, func(it *agentv1.TransferItem) bool { return it.GetSegmentId() != seg }) {
			c.span.SetAttributes(tracectx.Segment.String(strings.Clone(seg))) // the id points into the header buffer
		}
	}
}

// logContext is a context holding the request's span, for log lines
// written while serving it (they then carry its trace_id and span_id).
func (c *transferConn) logContext() context.Context {
	if c.span == nil {
		return context.Background()
	}
	return trace.ContextWithSpan(context.Background(), c.span)
}

// endSpan ends the request's span with err or its items' outcome.
func endSpan(c *transferConn, err error) {
	if c.span.IsRecording() {
		c.span.SetAttributes(tracectx.Bytes.Int64(int64(c.traced.bytes)))
		if err == nil {
			tracectx.Outcome(c.span, c.traced.failed, c.traced.first)
		}
	}
	tracectx.End(c.span, err)
	c.span = nil
}

var noSpan = trace.SpanFromContext(context.Background())

func (t *transferServer) deadline(d time.Duration) time.Time { return time.Now().Add(d) }

// serve runs one connection: preamble, then requests in order until the
// peer leaves, breaks the protocol, idles out, or the server closes.
func (t *transferServer) serve(c *transferConn) {
	defer t.remove(c)
	s := t.s
	if tc, ok := c.nc.(*tls.Conn); ok && !t.authenticate(c, tc) {
		return
	}
	_ = c.nc.SetReadDeadline(t.deadline(t.cfg.IOTimeout))
	var pre [len(xfer.Preamble)]byte
	if _, err := io.ReadFull(c.nc, pre[:]); err != nil {
		return
	}
	c.br = bufio.NewReaderSize(c.nc, transferReadBuffer)
	if string(pre[:]) != xfer.Preamble {
		t.refuse(c, "transfer", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"not a transfer connection: preamble %q, want %q", pre[:], xfer.Preamble))
		return
	}
	for {
		if !t.setBusy(c, false) {
			return
		}
		// Idle until the next request starts, then IOTimeout for the rest.
		if !t.await(c) {
			return
		}
		t.setBusy(c, true)
		_ = c.nc.SetReadDeadline(t.deadline(t.cfg.IOTimeout))
		c.rdLeft = ioStep
		hdr, n, hbuf, err := xfer.ReadHeader(c.br, c.hbuf, t.cfg.MaxHeaderBytes)
		c.hbuf = hbuf
		if err != nil {
			if errors.Is(err, xfer.ErrProtocol) {
				t.refuse(c, "transfer", err)
			}
			return
		}
		// Items are budgeted before they are decoded.
		if !t.acquire(n) {
			t.refuse(c, "transfer", t.errBusy())
			return
		}
		err = t.request(c, hdr)
		t.release(n)
		if cap(c.hbuf) > maxKeptHeader {
			c.hbuf = nil
		}
		if err != nil {
			s.lg.Debug("transfer connection ended", "remote", c.nc.RemoteAddr().String(), "err", err)
			return
		}
	}
}

// authenticate completes a TLS connection's handshake within IOTimeout and
// learns its caller from the verified certificate; false when the
// connection is to end (a failed handshake, or no principal, which is
// answered UNAUTHENTICATED).
func (t *transferServer) authenticate(c *transferConn, tc *tls.Conn) bool {
	_ = tc.SetDeadline(t.deadline(t.cfg.IOTimeout))
	if err := tc.Handshake(); err != nil {
		t.s.lg.Debug("transfer TLS handshake failed", "remote", tc.RemoteAddr().String(), "err", err)
		return false
	}
	_ = tc.SetDeadline(time.Time{})
	cs := tc.ConnectionState()
	p, ok := auth.CertPrincipal(&cs, t.cfg.TrustDomain)
	if !ok {
		t.refuse(c, "transfer", status.Errorf(codes.Unauthenticated,
			"the transfer listener knows callers by their certificate: none with a principal of trust domain %q", t.cfg.TrustDomain))
		return false
	}
	if p.Role == auth.RoleTenant {
		c.tenant = auth.NormalizeTenant(p.Name)
	}
	return true
}

// request decodes and serves one request whose header is hdr; an error
// ends the connection (a refused request was answered).
func (t *transferServer) request(c *transferConn, hdr []byte) error {
	req := &agentv1.TransferRequest{}
	c.req.TransferRequest = req
	err := xfer.DecodeHeader(hdr, &c.req)
	c.req.TransferRequest = nil
	if err == nil {
		err = xfer.CheckRequest(req)
	}
	if err != nil {
		t.refuse(c, "transfer", err)
		return err
	}
	startSpan(c, req)
	switch req.GetOp() {
	case agentv1.TransferOp_TRANSFER_OP_WRITE:
		err = t.write(c, req.GetItems())
	case agentv1.TransferOp_TRANSFER_OP_VERIFY:
		err = t.verify(c, req.GetItems())
	default:
		err = t.read(c, req.GetItems())
	}
	endSpan(c, err)
	return err
}

// await waits for the next request to start, up to IdleTimeout; false
// when it did not. A connection idle for more than idleTrim first gives
// back the per-request arrays and scratch buffers it keeps, so idle
// connections hold little more than their read buffer.
func (t *transferServer) await(c *transferConn) bool {
	if c.br.Buffered() > 0 {
		return true
	}
	start := time.Now()
	_ = c.nc.SetReadDeadline(start.Add(min(idleTrim, t.cfg.IdleTimeout)))
	_, err := c.br.Peek(1)
	if err == nil {
		return true
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) || t.cfg.IdleTimeout <= idleTrim {
		return false
	}
	c.trim()
	_ = c.nc.SetReadDeadline(start.Add(t.cfg.IdleTimeout))
	_, err = c.br.Peek(1)
	return err == nil
}

// trim drops what c keeps from request to request.
func (c *transferConn) trim() {
	c.hbuf, c.wbuf, c.iov, c.run, c.vec = nil, nil, nil, nil, nil
	c.req.items = nil
	c.handles, c.hs, c.errs, c.results, c.rptrs = nil, nil, nil, nil, nil
}
