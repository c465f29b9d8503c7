package dataplane

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/services/agent/internal/segment"
	"golang.org/x/sys/unix"
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
func (s *Server) ServeTransfer(ctx context.Context, lis net.Listener) error {
	t := newTransferServer(s)
	stop := context.AfterFunc(ctx, func() { _ = lis.Close() })
	defer stop()
	var err error
	var delay time.Duration
	for {
		nc, aerr := lis.Accept()
		if aerr != nil {
			if ctx.Err() != nil {
				break
			}
			if temporary(aerr) {
				// Out of descriptors or memory: back off instead of
				// spinning, as net/http does.
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				s.lg.Warn("transfer accept failed; retrying", "err", aerr, "delay", delay)
				select {
				case <-ctx.Done():
				case <-time.After(delay):
				}
				continue
			}
			err = fmt.Errorf("transfer listener: %w", aerr)
			break
		}
		delay = 0
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

func temporary(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ENOBUFS) ||
		errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.ECONNABORTED)
}

// transferServer is one ServeTransfer: its connections and their states.
type transferServer struct {
	s   *Server
	cfg TransferConfig
	wg  sync.WaitGroup

	// mu guards conns, perIP, every conn's busy flag, rejecting, items,
	// freed and closing.
	mu    sync.Mutex
	conns map[*transferConn]struct{}
	// perIP counts the open connections by remote address (the zero
	// Addr for connections that are not TCP).
	perIP map[netip.Addr]int
	// rejecting counts refused connections still being answered.
	rejecting int
	// items counts the items of the requests being served (acquire);
	// freed, when set, is closed as soon as some are given back.
	items   int
	freed   chan struct{}
	closing bool
}

func newTransferServer(s *Server) *transferServer {
	return &transferServer{s: s, cfg: s.cfg.Transfer, conns: map[*transferConn]struct{}{}, perIP: map[netip.Addr]int{}}
}

// transferConn is one client connection, served by one goroutine.
type transferConn struct {
	nc net.Conn
	ip netip.Addr // the key of transferServer.perIP
	// br buffers the connection once its preamble is in, so a connection
	// that never gets that far costs no buffer.
	br   *bufio.Reader
	busy bool // a request is in progress; guarded by transferServer.mu
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
}

// remoteIP is the address connections are counted under for
// MaxConnsPerIP: the remote IP of a TCP connection (an IPv4-mapped IPv6
// address as IPv4), the zero Addr for anything else.
func remoteIP(nc net.Conn) netip.Addr {
	if a, ok := nc.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// add registers a new connection. It returns nil and no error when the
// server is closing, and a LIMIT_EXCEEDED error when the connection is
// one too many (counted in crescent_agent_transfer_connections_refused_total).
func (t *transferServer) add(nc net.Conn) (*transferConn, error) {
	ip := remoteIP(nc)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closing {
		return nil, nil
	}
	if len(t.conns) >= t.cfg.MaxConns {
		t.s.xferRefused.WithLabelValues("max_connections").Inc()
		return nil, errConnLimit("the agent holds its maximum of %d transfer connections", t.cfg.MaxConns)
	}
	if t.perIP[ip] >= t.cfg.MaxConnsPerIP {
		t.s.xferRefused.WithLabelValues("max_connections_per_ip").Inc()
		return nil, errConnLimit("%s holds the maximum of %d transfer connections per remote address", ip, t.cfg.MaxConnsPerIP)
	}
	t.perIP[ip]++
	c := &transferConn{nc: nc, ip: ip, req: transferRequest{ids: t.s.segs.SegmentID}}
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
			c.rvFn = c.readvOnce
		}
	}
	t.conns[c] = struct{}{}
	t.s.xferConns.Inc()
	return c, nil
}

func errConnLimit(format string, args ...any) error {
	err := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED, format+"; retry later", args...)
	err.Metadata = map[string]string{"limit": "transfer_connections"}
	return err
}

// reject answers a connection add refused with err, when fewer than
// maxRejecting answers are under way (else it just closes it), the way
// refuse answers a refused request: the client reads the error in place
// of its first answer. It does not wait for the answer.
func (t *transferServer) reject(nc net.Conn, err error) {
	t.mu.Lock()
	ok := !t.closing && t.rejecting < maxRejecting
	if ok {
		t.rejecting++
	}
	t.mu.Unlock()
	if !ok {
		_ = nc.Close()
		return
	}
	t.wg.Go(func() {
		defer func() {
			_ = nc.Close()
			t.mu.Lock()
			t.rejecting--
			t.mu.Unlock()
		}()
		b, merr := xfer.AppendFrame(nil, &agentv1.TransferResponse{Error: xfer.ItemResult(err)})
		if merr != nil {
			return
		}
		t.answer(nc, nil, b)
	})
}

func (t *transferServer) remove(c *transferConn) {
	t.mu.Lock()
	delete(t.conns, c)
	if t.perIP[c.ip]--; t.perIP[c.ip] <= 0 {
		delete(t.perIP, c.ip)
	}
	if c.busy {
		c.busy = false
		t.s.xferBusy.Dec()
	}
	t.mu.Unlock()
	t.s.xferConns.Dec()
	_ = c.nc.Close()
}

// setBusy marks c busy or idle; it reports false when c should stop
// (the server is closing and c finished its request).
func (t *transferServer) setBusy(c *transferConn, busy bool) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case busy && !c.busy:
		t.s.xferBusy.Inc()
	case !busy && c.busy:
		t.s.xferBusy.Dec()
	}
	c.busy = busy
	return busy || !t.closing
}

// shutdown closes the idle connections at once, gives busy ones
// DrainTimeout to finish their request, then cuts them, and waits for
// every connection goroutine.
func (t *transferServer) shutdown() {
	t.mu.Lock()
	t.closing = true
	if t.freed != nil {
		close(t.freed)
		t.freed = nil
	}
	for c := range t.conns {
		if !c.busy {
			_ = c.nc.Close()
		}
	}
	t.mu.Unlock()
	done := make(chan struct{})
	go func() {
		t.wg.Wait()
		close(done)
	}()
	timer := time.NewTimer(t.cfg.DrainTimeout)
	defer timer.Stop()
	select {
	case <-done:
		return
	case <-timer.C:
	}
	t.mu.Lock()
	n := len(t.conns)
	for c := range t.conns {
		_ = c.nc.Close()
	}
	t.mu.Unlock()
	t.s.lg.Warn("transfer requests still running at shutdown were cut", "connections", n, "drain_timeout", t.cfg.DrainTimeout)
	<-done
}

func (t *transferServer) deadline(d time.Duration) time.Time { return time.Now().Add(d) }

// serve runs one connection: preamble, then requests in order until the
// peer leaves, breaks the protocol, idles out, or the server closes.
func (t *transferServer) serve(c *transferConn) {
	defer t.remove(c)
	s := t.s
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
	if req.GetOp() == agentv1.TransferOp_TRANSFER_OP_WRITE {
		return t.write(c, req.GetItems())
	}
	return t.read(c, req.GetItems())
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
	c.req.arr, c.req.ptrs, c.req.tokens = nil, nil, nil
	c.handles, c.hs, c.errs, c.results, c.rptrs = nil, nil, nil, nil, nil
}

// acquire takes n items of MaxItemsInFlight for a request, waiting up to
// IOTimeout for other requests to give theirs back; false when they did
// not, or the server is closing.
func (t *transferServer) acquire(n int) bool {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		t.mu.Lock()
		if t.items+n <= t.cfg.MaxItemsInFlight {
			t.items += n
			t.mu.Unlock()
			t.s.xferItems.Add(float64(n))
			return true
		}
		if t.closing {
			t.mu.Unlock()
			return false
		}
		if t.freed == nil {
			t.freed = make(chan struct{})
		}
		freed := t.freed
		t.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(t.cfg.IOTimeout)
		}
		select {
		case <-freed:
		case <-timer.C:
			return false
		}
	}
}

// release gives back n items acquire took and wakes the requests waiting
// for them.
func (t *transferServer) release(n int) {
	t.mu.Lock()
	t.items -= n
	if t.freed != nil {
		close(t.freed)
		t.freed = nil
	}
	t.mu.Unlock()
	t.s.xferItems.Sub(float64(n))
}

func (t *transferServer) errBusy() error {
	err := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
		"the agent serves its maximum of %d transfer items at once and none were freed for %v; retry later", t.cfg.MaxItemsInFlight, t.cfg.IOTimeout)
	err.Metadata = map[string]string{"limit": "transfer_items_in_flight"}
	return err
}

// refuse answers a request refused whole with its error, then lingers
// briefly so a client still sending can read the answer; the caller closes
// the connection.
func (t *transferServer) refuse(c *transferConn, method string, err error) {
	t.s.errs.WithLabelValues(method, rpcerr.Reason(err)).Inc()
	b, merr := xfer.AppendFrame(c.wbuf[:0], &agentv1.TransferResponse{Error: xfer.ItemResult(err)})
	if merr != nil {
		return
	}
	t.answer(c.nc, c.br, b)
}

// answer writes a refusal frame b to nc, closes nc's writing side and
// reads and drops what the client still sends (from r if set, else nc),
// up to lingerBytes for at most lingerTime; the caller closes nc.
func (t *transferServer) answer(nc net.Conn, r io.Reader, b []byte) {
	_ = nc.SetWriteDeadline(t.deadline(min(lingerTime, t.cfg.IOTimeout)))
	if _, werr := nc.Write(b); werr != nil {
		return
	}
	if cw, ok := nc.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		_ = nc.SetReadDeadline(t.deadline(min(lingerTime, t.cfg.IOTimeout)))
		if r == nil {
			r = nc
		}
		_, _ = io.CopyN(io.Discard, r, lingerBytes)
	}
}

// handles are the open allocations of one request, by item (nil where the
// item failed or is done).
type handles []*segment.Handle

// close closes every open handle; closing twice is harmless.
func (hs handles) close() {
	for i, h := range hs {
		if h != nil {
			h.Close()
			hs[i] = nil
		}
	}
}

// write serves a WRITE request: every item is opened and checked first, then
// the payload is received in order, straight into a memory segment's
// mapping (runs of such items with vectored reads) or through a pooled
// buffer into a disk segment, a failed item's bytes read and dropped. Every
// handle is closed before the answer, so a Seal that follows the client's
// return never finds the write open.
func (t *transferServer) write(c *transferConn, items []*agentv1.TransferItem) error {
	s := t.s
	hs := reuse(&c.hs, len(items))
	slab := reuse(&c.handles, len(items)) // hs[i] is &slab[i] or nil
	errs := reuse(&c.errs, len(items))
	defer func() {
		hs.close()
		// Kept for the next request: drop what they point to (closed
		// handles, errors) now, in this order.
		clear(slab)
		clear(errs)
	}()
	now := s.now()
	for i, it := range items {
		h := &slab[i]
		err := s.openWriteTo(h, it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), now)
		if err == nil {
			if err = h.CheckBounds(it.GetOffset(), it.GetLength()); err != nil {
				h.Close()
			}
		}
		if err != nil {
			if it.GetLength() > xfer.MaxDrainBytes {
				err = fmt.Errorf("item %d failed and its %d payload bytes exceed the %d-byte drain limit: %w", i, it.GetLength(), xfer.MaxDrainBytes, err)
				t.refuse(c, "transfer_write", err)
				return err
			}
			errs[i] = err
			continue
		}
		hs[i] = h
	}
	run := c.run[:0]
	for i, it := range items {
		n := it.GetLength()
		if hs[i] != nil {
			// Checked by CheckBounds: only a disk segment has no dst.
			if dst, err := hs[i].WritableBytes(it.GetOffset(), n); err == nil && dst != nil {
				if n > 0 {
					run = append(run, dst)
				}
				continue
			}
		}
		if err := t.readInto(c, run); err != nil {
			return err
		}
		run = run[:0]
		if hs[i] == nil {
			if err := t.discard(c, n); err != nil {
				return err
			}
			continue
		}
		ierr, err := t.receive(c, hs[i], it.GetOffset(), n)
		if err != nil {
			return err
		}
		errs[i] = ierr
	}
	err := t.readInto(c, run)
	clear(run[:cap(run)]) // drop the references to the mappings
	c.run = run[:0]
	if err != nil {
		return err
	}
	hs.close()
	resp := &agentv1.TransferResponse{Results: reuse(&c.rptrs, len(items))}
	rs := reuse(&c.results, len(items))
	var in uint64
	for i, err := range errs {
		r := &rs[i]
		if err != nil {
			s.errs.WithLabelValues("transfer_write", rpcerr.Reason(err)).Inc()
			r.Status = xfer.ItemResult(err)
		} else {
			r.Length = items[i].GetLength()
			in += r.Length
		}
		resp.Results[i] = r
	}
	s.bytesIn.Add(float64(in))
	hdr, err := t.header(c, resp)
	if err != nil {
		return err
	}
	_ = c.nc.SetWriteDeadline(t.deadline(t.cfg.IOTimeout))
	_, err = c.nc.Write(hdr)
	return err
}

// receive reads the n payload bytes of h's item at off. A disk write
// failure is the item's error (the rest of its bytes are still read, to
// keep the stream framed); a read failure is the connection's.
func (t *transferServer) receive(c *transferConn, h *segment.Handle, off, n uint64) (itemErr, connErr error) {
	dst, err := h.WritableBytes(off, n)
	if err != nil {
		return err, t.discard(c, n)
	}
	if dst != nil {
		return nil, t.readFull(c, dst)
	}
	bp := diskBufs.Get().(*[]byte)
	defer diskBufs.Put(bp)
	buf := *bp
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := t.readFull(c, buf[:k]); err != nil {
			return nil, err
		}
		if itemErr == nil {
			if err := h.WriteAt(buf[:k], off); err != nil {
				itemErr = rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "write allocation %d", h.ID())
			}
		}
		off += k
		n -= k
	}
	return itemErr, nil
}

// readFull fills p from the connection, renewing the read deadline every
// ioStep bytes of the request.
func (t *transferServer) readFull(c *transferConn, p []byte) error {
	for len(p) > 0 {
		t.renewRead(c)
		k := min(len(p), c.rdLeft)
		if _, err := io.ReadFull(c.br, p[:k]); err != nil {
			return err
		}
		p = p[k:]
		c.rdLeft -= k
	}
	return nil
}

// renewRead renews the read deadline once the request has read ioStep
// bytes under the current one. Renewing it for every item instead cost 3 %
// of the agent's CPU on batches of 4 KiB objects (a timer update each).
func (t *transferServer) renewRead(c *transferConn) {
	if c.rdLeft <= 0 {
		_ = c.nc.SetReadDeadline(t.deadline(t.cfg.IOTimeout))
		c.rdLeft = ioStep
	}
}

// readInto fills bufs (non-empty slices) in order from the connection: from
// what the reader holds, then with vectored reads from the socket straight
// into bufs, as many of them per readv as the socket has bytes for. A
// batch of 4 KiB objects used to be read 64 KiB at a time into the reader
// and copied out (the copy alone was 5 % of the agent's CPU). bufs' slices
// are consumed.
func (t *transferServer) readInto(c *transferConn, bufs [][]byte) error {
	for len(bufs) > 0 && c.br.Buffered() > 0 {
		t.renewRead(c)
		b := bufs[0][:min(len(bufs[0]), c.rdLeft)]
		n, _ := c.br.Read(b) // buffered: no read from the socket
		c.rdLeft -= n
		if bufs[0] = bufs[0][n:]; len(bufs[0]) == 0 {
			bufs = bufs[1:]
		}
	}
	if c.rc == nil {
		for _, b := range bufs {
			if err := t.readFull(c, b); err != nil {
				return err
			}
		}
		return nil
	}
	for len(bufs) > 0 {
		t.renewRead(c)
		vec, want := c.vec[:0], 0
		for _, b := range bufs {
			if len(vec) == maxReadv || want == c.rdLeft {
				break
			}
			b = b[:min(len(b), c.rdLeft-want)]
			vec = append(vec, b)
			want += len(b)
		}
		n, err := c.readv(vec)
		clear(vec)
		c.vec = vec[:0]
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		c.rdLeft -= n
		for n > 0 {
			k := min(n, len(bufs[0]))
			n -= k
			if bufs[0] = bufs[0][k:]; len(bufs[0]) == 0 {
				bufs = bufs[1:]
			}
		}
	}
	return nil
}

// readv reads into vec from the socket, waiting for it to be readable
// (the read deadline applies).
func (c *transferConn) readv(vec [][]byte) (int, error) {
	c.vec = vec
	c.rvN, c.rvErr = 0, nil
	if err := c.rc.Read(c.rvFn); err != nil {
		return 0, err
	}
	return c.rvN, c.rvErr
}

// readvOnce is rc.Read's callback: one readv of c.vec; false (wait) when
// the socket has nothing yet.
func (c *transferConn) readvOnce(fd uintptr) bool {
	for {
		n, err := unix.Readv(int(fd), c.vec)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EAGAIN):
			return false
		}
		c.rvN, c.rvErr = max(n, 0), err
		return true
	}
}

// discard reads and drops n payload bytes (n <= MaxDrainBytes).
func (t *transferServer) discard(c *transferConn, n uint64) error {
	if n == 0 {
		return nil
	}
	bp := diskBufs.Get().(*[]byte)
	defer diskBufs.Put(bp)
	buf := *bp
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := t.readFull(c, buf[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// read serves a READ request: every item is opened (pinning its extent)
// and checked, the answer's header lists the results, and the payloads
// follow, sent straight from a memory segment's mapping or through a pooled
// buffer from a disk segment. Handles close once the bytes are on the
// socket. A disk error in the middle of a payload cannot be reported any
// more (its length was promised): it ends the connection.
func (t *transferServer) read(c *transferConn, items []*agentv1.TransferItem) error {
	s := t.s
	hs := make(handles, len(items))
	defer hs.close()
	resp := &agentv1.TransferResponse{Results: make([]*agentv1.TransferResult, len(items))}
	rs := make([]agentv1.TransferResult, len(items))
	for i, it := range items {
		r := &rs[i]
		resp.Results[i] = r
		h, length, err := s.openRange(it)
		if err != nil {
			s.errs.WithLabelValues("transfer_read", rpcerr.Reason(err)).Inc()
			r.Status = xfer.ItemResult(err)
			continue
		}
		hs[i] = h
		r.Length, r.ObjectSize, r.Checksum = length, h.Size(), h.Checksum()
	}
	hdr, err := t.header(c, resp)
	if err != nil {
		return err
	}
	iov := append(c.iov[:0], hdr)
	var out uint64
	for i, h := range hs {
		if h == nil || rs[i].Length == 0 {
			continue
		}
		off, n := items[i].GetOffset(), rs[i].Length
		data, err := h.Bytes(off, n)
		if err != nil {
			return err // checked by openRange: cannot happen
		}
		if data != nil {
			iov = append(iov, data)
			out += n
			continue
		}
		if err := t.writev(c, iov); err != nil {
			return err
		}
		iov = iov[:0]
		if err := t.sendDisk(c, h, off, n); err != nil {
			return err
		}
		out += n
	}
	err = t.writev(c, iov)
	c.iov = iov[:0]
	clear(iov[:cap(iov)]) // drop the references to the mappings
	if err != nil {
		return err
	}
	s.bytesOut.Add(float64(out))
	return nil
}

// openRange opens a READ item and resolves its range: length 0 reads to
// the end of the object.
func (s *Server) openRange(it *agentv1.TransferItem) (*segment.Handle, uint64, error) {
	h, err := s.open(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), token.Read)
	if err != nil {
		return nil, 0, err
	}
	size, off, length := h.Size(), it.GetOffset(), it.GetLength()
	switch {
	case off > size:
		err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "offset %d is past the end of the %d-byte object", off, size)
	case length == 0:
		length = size - off
	case length > size-off:
		err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "%d bytes from offset %d lie outside the %d-byte object", length, off, size)
	}
	if err != nil {
		h.Close()
		return nil, 0, err
	}
	return h, length, nil
}

// header frames an answer. Should the error messages of thousands of
// failed items push it past MaxHeaderBytes, they are dropped (codes and
// reasons stay).
func (t *transferServer) header(c *transferConn, resp *agentv1.TransferResponse) ([]byte, error) {
	b, err := xfer.AppendFrame(c.wbuf[:0], resp)
	if err != nil {
		for _, r := range resp.GetResults() {
			if r.GetStatus() != nil {
				r.Status.Message = ""
			}
		}
		if b, err = xfer.AppendFrame(c.wbuf[:0], resp); err != nil {
			return nil, err
		}
	}
	if cap(b) <= maxKeptHeader {
		c.wbuf = b
	}
	return b, nil
}

// writev sends bufs with vectored writes, renewing the write deadline every
// ioStep bytes (slices of a large mapping are split, not copied).
func (t *transferServer) writev(c *transferConn, bufs net.Buffers) error {
	var group net.Buffers
	size := 0
	flush := func() error {
		if len(group) == 0 {
			return nil
		}
		_ = c.nc.SetWriteDeadline(t.deadline(t.cfg.IOTimeout))
		_, err := group.WriteTo(c.nc)
		group, size = group[:0], 0
		return err
	}
	for _, b := range bufs {
		for len(b) > 0 {
			k := min(len(b), ioStep-size)
			group = append(group, b[:k])
			b = b[k:]
			if size += k; size == ioStep {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	return flush()
}

// sendDisk streams n bytes of a disk allocation from off in pooled chunks.
func (t *transferServer) sendDisk(c *transferConn, h *segment.Handle, off, n uint64) error {
	bp := diskBufs.Get().(*[]byte)
	defer diskBufs.Put(bp)
	buf := *bp
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := h.ReadAt(buf[:k], off); err != nil {
			t.s.lg.Warn("transfer read of a disk allocation failed; closing the connection", "allocation_id", h.ID(), "err", err)
			return err
		}
		_ = c.nc.SetWriteDeadline(t.deadline(t.cfg.IOTimeout))
		if _, err := c.nc.Write(buf[:k]); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}
