package dataplane

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/conntrack"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// add registers a new connection. It returns nil and no error when the
// server is closing, and a LIMIT_EXCEEDED error when the connection is
// one too many (counted in crescent_agent_transfer_connections_refused_total).
func (t *transferServer) add(nc net.Conn) (*transferConn, error) {
	ip := conntrack.RemoteIP(nc)
	tc, err := t.conns.Add(nc, ip)
	switch {
	case errors.Is(err, conntrack.ErrClosing):
		return nil, nil
	case errors.Is(err, conntrack.ErrMaxConns):
		t.s.xferRefused.WithLabelValues("max_connections").Inc()
		return nil, errConnLimit("the agent holds its maximum of %d transfer connections", t.cfg.MaxConns)
	case errors.Is(err, conntrack.ErrMaxConnsPerKey):
		t.s.xferRefused.WithLabelValues("max_connections_per_ip").Inc()
		return nil, errConnLimit("%s holds the maximum of %d transfer connections per remote address", ip, t.cfg.MaxConnsPerIP)
	case err != nil:
		return nil, err
	}
	c := &transferConn{nc: nc, tc: tc}
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
			c.rvFn = c.readvOnce
		}
	}
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
	ok := !t.conns.Closing() && t.rejecting < maxRejecting
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

// remove forgets c and closes its connection; c's goroutine calls it as
// it ends.
func (t *transferServer) remove(c *transferConn) {
	if c.tc.Busy() {
		t.s.xferBusy.Dec()
	}
	t.conns.Remove(c.tc)
	t.s.xferConns.Dec()
}

// setBusy marks c busy or idle, moving crescent_agent_transfer_requests_in_flight
// on a change; it reports false when c should stop (the server is closing
// and c finished its request). Only c's goroutine calls it, so the check
// and the change need no lock, and neither does the flag shutdown reads
// (conntrack).
func (t *transferServer) setBusy(c *transferConn, busy bool) bool {
	if busy {
		if c.tc.MarkBusy() {
			t.s.xferBusy.Inc()
		}
		return true
	}
	if c.tc.Busy() {
		t.s.xferBusy.Dec()
	}
	return c.tc.MarkIdle()
}

// shutdown closes the idle connections at once, gives busy ones
// DrainTimeout to finish their request, then cuts them, and waits for
// every connection goroutine.
func (t *transferServer) shutdown() {
	// First closing, then freed: a request waiting in acquire wakes and
	// finds the tracker closing.
	t.conns.Shutdown()
	t.mu.Lock()
	if t.freed != nil {
		close(t.freed)
		t.freed = nil
	}
	t.mu.Unlock()
	drain(&t.wg, t.cfg.DrainTimeout, func() {
		n := t.conns.CloseAll()
		t.s.lg.Warn("transfer requests still running at shutdown were cut", "connections", n, "drain_timeout", t.cfg.DrainTimeout)
	})
}

// drain waits for wg; if it is still waiting after timeout, it calls cut
// (which closes the connections left) and waits for wg again. The bulk
// transfer and the shared-memory listeners shut down this way.
func drain(wg *sync.WaitGroup, timeout time.Duration, cut func()) {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-done:
		return
	case <-timer.C:
	}
	cut()
	<-done
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
		if t.conns.Closing() {
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
	var r io.Reader // nil: before the preamble, c has no buffer yet
	if c.br != nil {
		r = c.br
	}
	t.answer(c.nc, r, b)
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
