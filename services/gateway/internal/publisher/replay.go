package publisher

import (
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
type replaySocket struct {
	lg               *slog.Logger
	l                net.Listener
	ring             *ring
	legacy           bool
	maxConns         int
	handshakeTimeout time.Duration
	writeTimeout     time.Duration

	requests atomic.Uint64
	invalid  atomic.Uint64

	wg sync.WaitGroup
	// mu guards conns and closed.
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

func newReplaySocket(lg *slog.Logger, l net.Listener, r *ring, legacy bool, maxConns int, handshakeTimeout, writeTimeout time.Duration) *replaySocket {
	return &replaySocket{lg: lg, l: l, ring: r, legacy: legacy, maxConns: maxConns,
		handshakeTimeout: handshakeTimeout, writeTimeout: writeTimeout, conns: map[net.Conn]struct{}{}}
}

func (s *replaySocket) serve() {
	acceptEach(s.l, s.lg, "replay", func(nc net.Conn) {
		s.mu.Lock()
		if s.closed || len(s.conns) >= s.maxConns {
			s.mu.Unlock()
			nc.Close()
			return
		}
		s.conns[nc] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(nc)
	})
}

func (s *replaySocket) handle(nc net.Conn) {
	defer s.wg.Done()
	defer func() {
		nc.Close()
		s.mu.Lock()
		delete(s.conns, nc)
		s.mu.Unlock()
	}()
	c, err := zmtp.Handshake(nc, zmq4.Router, true, s.handshakeTimeout, zmtp.Limits{MaxFrame: 256, MaxFrames: 4})
	if err != nil {
		s.lg.Debug("replay handshake failed", "err", err)
		return
	}
	for {
		m, err := c.ReadMessage()
		if err != nil {
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
