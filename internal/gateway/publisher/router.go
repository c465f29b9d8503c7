package publisher

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// router is the ROUTER side shared by the replay and the snapshot sockets.
// ZMQ's ROUTER is one socket over many peer connections; here each
// connection has one goroutine that reads a request and writes its reply,
// so it is that connection's only writer, and a slow requester holds only
// its own goroutine (writes carry a deadline).
//
// Slots: at most maxConns connections (handshaking ones included), at most
// maxPerPeer of them from one remote IP; a connection that does not finish
// its handshake within handshakeTimeout, or then sends no request for
// idleTimeout, is closed, so idle or half-open peers give their slots back.
// A peer's frames are bounded by routerLimits.
type router struct {
	what             string // "replay", "snapshot": for logs
	lg               *slog.Logger
	l                net.Listener
	maxConns         int
	maxPerPeer       int
	handshakeTimeout time.Duration
	idleTimeout      time.Duration
	// request serves one data message of a connection; an error closes
	// the connection. ctx ends when the socket closes.
	request func(ctx context.Context, c *zmtp.Conn, frames [][]byte) error

	refused atomic.Uint64 // connections refused at accept (total or per-peer cap)
	dropped atomic.Uint64 // dropped for a bad handshake or frame, or idleness

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// mu guards conns, perPeer and closed.
	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	perPeer map[string]int // open connections per remote IP (TCP peers only)
	closed  bool
}

func newRouter(what string, lg *slog.Logger, l net.Listener, cfg Config, request func(context.Context, *zmtp.Conn, [][]byte) error) router {
	ctx, cancel := context.WithCancel(context.Background())
	return router{what: what, lg: lg, l: l, request: request,
		maxConns: cfg.MaxSubscribers, maxPerPeer: cfg.ReplayMaxConnsPerPeer,
		handshakeTimeout: cfg.HandshakeTimeout, idleTimeout: cfg.ReplayIdleTimeout,
		ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}, perPeer: map[string]int{}}
}

// replayLimits bound what a DEALER or REQ may send to the replay and the
// snapshot sockets: a replay request is [b"", 8 bytes], a snapshot request
// [b"", b"snapshot"].
var replayLimits = zmtp.Limits{MaxFrame: 256, MaxFrames: 4}

// peerKey is the remote IP of a TCP connection; ok is false for other
// transports (ipc peers are local processes and share no IP to cap by).
func peerKey(nc net.Conn) (key string, ok bool) {
	a, ok := nc.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return "", false
	}
	return a.IP.String(), true
}

func (s *router) serve() {
	acceptEach(s.l, s.lg, s.what, func(nc net.Conn) {
		peer, capped := peerKey(nc)
		s.mu.Lock()
		if s.closed || len(s.conns) >= s.maxConns || (capped && s.perPeer[peer] >= s.maxPerPeer) {
			s.mu.Unlock()
			s.refused.Add(1)
			s.lg.Debug(s.what+" connection refused", "remote", nc.RemoteAddr().String(), "max_conns", s.maxConns, "max_conns_per_peer", s.maxPerPeer)
			nc.Close()
			return
		}
		s.conns[nc] = struct{}{}
		if capped {
			s.perPeer[peer]++
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(nc, peer, capped)
	})
}

func (s *router) handle(nc net.Conn, peer string, capped bool) {
	defer s.wg.Done()
	defer func() {
		nc.Close()
		s.mu.Lock()
		delete(s.conns, nc)
		if capped {
			if s.perPeer[peer]--; s.perPeer[peer] <= 0 {
				delete(s.perPeer, peer)
			}
		}
		s.mu.Unlock()
	}()
	c, err := zmtp.Handshake(nc, zmq4.Router, true, s.handshakeTimeout, replayLimits)
	if err != nil {
		s.dropped.Add(1)
		s.lg.Debug(s.what+" handshake failed", "remote", nc.RemoteAddr().String(), "err", err)
		return
	}
	for {
		if err := c.SetReadDeadline(time.Now().Add(s.idleTimeout)); err != nil {
			return
		}
		m, err := c.ReadMessage()
		if err != nil {
			if ne, ok := errors.AsType[net.Error](err); (ok && ne.Timeout()) || isPeerFault(err) {
				s.dropped.Add(1)
				s.lg.Debug(s.what+" connection dropped", "remote", nc.RemoteAddr().String(), "err", err)
			}
			return
		}
		if m.Command != "" {
			continue
		}
		if err := s.request(s.ctx, c, m.Frames); err != nil {
			s.lg.Debug(s.what+" reply failed", "remote", nc.RemoteAddr().String(), "err", err)
			return
		}
	}
}

func (s *router) close() {
	s.l.Close()
	s.cancel()
	s.mu.Lock()
	s.closed = true
	for nc := range s.conns {
		nc.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// vecWriter gathers a reply's buffers and writes them in vectored writes
// of at most vecMax buffers and about vecMaxBytes, each within timeout.
// Headers it is handed are copied into its scratch; bodies are referenced
// (immutable, shared).
type vecWriter struct {
	c       *zmtp.Conn
	timeout time.Duration
	bufs    net.Buffers
	scratch []byte // never grown between flushes: bufs point into it
	pending int    // bytes in bufs
}

// vecMax bounds the buffers of one vectored write: replyChunk messages of
// a delimiter and a body.
const vecMax = 2*replyChunk + 1

// vecMaxBytes bounds the bytes of one vectored write (a single larger body
// goes alone). A goroutine in a write(2) keeps its P until the kernel has
// copied what it was given or the runtime hands the P off, so 512 snapshot
// chunks (~5 MB) per writev held one of the gateway's 2 Ps for
// milliseconds at a time: a go tool trace of BenchmarkGatewayStateLive
// (issue 13) found the snapshot socket's writes in a syscall during half
// of the time live-path goroutines waited 2 ms or more for a P.
const vecMaxBytes = 256 << 10

func newVecWriter(c *zmtp.Conn, timeout time.Duration) *vecWriter {
	return &vecWriter{c: c, timeout: timeout, bufs: make(net.Buffers, 0, vecMax), scratch: make([]byte, 0, 16*vecMax)}
}

// put adds head (copied, at most 16 bytes) and body (referenced); either may be empty.
func (w *vecWriter) put(head, body []byte) error {
	if len(w.bufs)+2 > cap(w.bufs) || len(w.scratch)+len(head) > cap(w.scratch) ||
		(w.pending > 0 && w.pending+len(head)+len(body) > vecMaxBytes) {
		if err := w.flush(); err != nil {
			return err
		}
	}
	w.pending += len(head) + len(body)
	if len(head) > 0 {
		n := len(w.scratch)
		w.scratch = append(w.scratch, head...)
		w.bufs = append(w.bufs, w.scratch[n:])
	}
	if len(body) > 0 {
		w.bufs = append(w.bufs, body)
	}
	return nil
}

// flush writes what was put.
func (w *vecWriter) flush() error {
	b := w.bufs // WriteTo consumes its receiver; keep bufs' backing array
	err := w.c.WriteBuffers(&b, w.timeout)
	clear(w.bufs)
	w.bufs, w.scratch, w.pending = w.bufs[:0], w.scratch[:0], 0
	return err
}
