package publisher

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// delimiter is the empty frame (with MORE) that starts every reply: a
// ROUTER addresses [identity, b"", ...]; the DEALER receives [b"", ...].
var delimiter = []byte{0x01, 0x00}

// endMarker ends every replay: seq 0xFFFFFFFFFFFFFFFF, empty payload.
var (
	endMarker       = zmtp.AppendMessage(nil, nil, nil, kvevent.PutSeq(kvevent.EndSeq), nil)
	endMarkerLegacy = zmtp.AppendMessage(nil, nil, kvevent.PutSeq(kvevent.EndSeq), nil)
)

// replaySocket is the ROUTER that serves retained batches (vLLM's replay
// protocol). ZMQ's ROUTER is one socket over many peer connections; here
// each connection has one goroutine that reads a request and writes its
// replies, so it is that connection's only writer, and a slow requester
// holds only its own goroutine (writes carry a deadline).
//
// Slots: at most maxConns connections (handshaking ones included), at most
// maxPerPeer of them from one remote IP; a connection that does not finish
// its handshake within handshakeTimeout, or then sends no request for
// idleTimeout, is closed, so idle or half-open peers give their slots back.
type replaySocket struct {
	lg               *slog.Logger
	l                net.Listener
	ring             *ring
	legacy           bool
	maxConns         int
	maxPerPeer       int
	handshakeTimeout time.Duration
	idleTimeout      time.Duration
	writeTimeout     time.Duration

	requests atomic.Uint64
	invalid  atomic.Uint64
	refused  atomic.Uint64 // connections refused at accept (total or per-peer cap)
	dropped  atomic.Uint64 // dropped for a bad handshake or frame, or idleness

	wg sync.WaitGroup
	// mu guards conns, perPeer and closed.
	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	perPeer map[string]int // open connections per remote IP (TCP peers only)
	closed  bool
}

func newReplaySocket(lg *slog.Logger, l net.Listener, r *ring, cfg Config) *replaySocket {
	return &replaySocket{lg: lg, l: l, ring: r, legacy: cfg.ReplayLegacy,
		maxConns: cfg.MaxSubscribers, maxPerPeer: cfg.ReplayMaxConnsPerPeer,
		handshakeTimeout: cfg.HandshakeTimeout, idleTimeout: cfg.ReplayIdleTimeout, writeTimeout: cfg.ReplayWriteTimeout,
		conns: map[net.Conn]struct{}{}, perPeer: map[string]int{}}
}

// replayLimits bound what a DEALER may send: a request is [b"", 8 bytes].
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

func (s *replaySocket) serve() {
	acceptEach(s.l, s.lg, "replay", func(nc net.Conn) {
		peer, capped := peerKey(nc)
		s.mu.Lock()
		if s.closed || len(s.conns) >= s.maxConns || (capped && s.perPeer[peer] >= s.maxPerPeer) {
			s.mu.Unlock()
			s.refused.Add(1)
			s.lg.Debug("replay connection refused", "remote", nc.RemoteAddr().String(), "max_conns", s.maxConns, "max_conns_per_peer", s.maxPerPeer)
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

func (s *replaySocket) handle(nc net.Conn, peer string, capped bool) {
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
		s.lg.Debug("replay handshake failed", "remote", nc.RemoteAddr().String(), "err", err)
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
				s.lg.Debug("replay connection dropped", "remote", nc.RemoteAddr().String(), "err", err)
			}
			return
		}
		if m.Command != "" {
			continue
		}
		start, ok := parseRequest(m.Frames)
		if !ok {
			s.invalid.Add(1)
			s.lg.Debug("invalid replay request", "frames", len(m.Frames))
			continue
		}
		s.requests.Add(1)
		if err := s.reply(c, start); err != nil {
			s.lg.Debug("replay reply failed", "start_seq", start, "err", err)
			return
		}
	}
}

// parseRequest accepts [b"", start_seq] or a single [start_seq] frame.
func parseRequest(frames [][]byte) (uint64, bool) {
	var f []byte
	switch {
	case len(frames) == 2 && len(frames[0]) == 0:
		f = frames[1]
	case len(frames) == 1:
		f = frames[0]
	default:
		return 0, false
	}
	seq, err := kvevent.DecodeSeq(f)
	return seq, err == nil
}

// replyChunk bounds the messages written per vectored write.
const replyChunk = 256

func (s *replaySocket) reply(c *zmtp.Conn, start uint64) error {
	entries := s.ring.from(start)
	chunk := make(net.Buffers, 0, 2*replyChunk+1)
	write := func() error {
		b := chunk // WriteTo consumes its receiver; keep chunk's backing array
		err := c.WriteBuffers(&b, s.writeTimeout)
		clear(chunk)
		chunk = chunk[:0]
		return err
	}
	for i, e := range entries {
		if s.legacy {
			chunk = append(chunk, delimiter, e.wire[2:]) // skip the topic frame
		} else {
			chunk = append(chunk, delimiter, e.wire)
		}
		if (i+1)%replyChunk == 0 {
			if err := write(); err != nil {
				return err
			}
		}
	}
	if s.legacy {
		chunk = append(chunk, endMarkerLegacy)
	} else {
		chunk = append(chunk, endMarker)
	}
	return write()
}

func (s *replaySocket) close() {
	s.l.Close()
	s.mu.Lock()
	s.closed = true
	for nc := range s.conns {
		nc.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}
