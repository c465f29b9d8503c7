package publisher

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// pubSocket is the PUB side of the event stream. The publishing goroutine
// is its only caller of broadcast; each subscriber connection has its own
// bounded queue and exactly one writer goroutine, so a subscriber that
// stops reading loses its oldest messages (a visible sequence gap, counted)
// instead of stalling the others or growing memory: at most queueBytes
// queued plus one write in flight (≤ queueBytes) per connection.
type pubSocket struct {
	lg               *slog.Logger
	l                net.Listener
	topic            string // every message's topic frame
	queueBatches     int
	queueBytes       int
	maxConns         int
	handshakeTimeout time.Duration
	writeTimeout     time.Duration

	droppedBatches atomic.Uint64 // messages dropped from subscriber queues
	droppedBytes   atomic.Uint64
	// unanswered counts PINGs left without a PONG: over maxQueuedPongs,
	// or their PONG pushed out of a full queue.
	unanswered  atomic.Uint64
	refused     atomic.Uint64 // connections refused at accept
	dropped     atomic.Uint64 // connections dropped for a bad handshake or frame
	subsChanged chan struct{} // cap 1: a connection subscribed or unsubscribed

	wg sync.WaitGroup
	// mu guards conns and closed.
	mu     sync.Mutex
	conns  map[*subConn]struct{}
	closed bool
}

// subConn is one subscriber connection.
type subConn struct {
	nc     net.Conn      // closed by close, also during the handshake
	c      *zmtp.Conn    // set after the handshake
	notify chan struct{} // cap 1

	// subs counts subscriptions matching the topic: the prefixes of it
	// (only the empty prefix when the topic is empty). Written by the
	// reader, read by broadcast.
	subs atomic.Int32

	// mu guards q, qBytes, pongs, closed.
	mu     sync.Mutex
	q      [][]byte
	qBytes int
	pongs  int // PONGs in q
	closed bool
}

func newPubSocket(lg *slog.Logger, l net.Listener, topic string, queueBatches, queueBytes, maxConns int, handshakeTimeout, writeTimeout time.Duration) *pubSocket {
	return &pubSocket{
		lg: lg, l: l, topic: topic, queueBatches: queueBatches, queueBytes: queueBytes, maxConns: maxConns,
		handshakeTimeout: handshakeTimeout, writeTimeout: writeTimeout, conns: map[*subConn]struct{}{},
		subsChanged: make(chan struct{}, 1),
	}
}

// serve accepts subscribers until the listener closes.
func (p *pubSocket) serve() {
	acceptEach(p.l, p.lg, "pub", func(nc net.Conn) {
		p.mu.Lock()
		if p.closed || len(p.conns) >= p.maxConns {
			p.mu.Unlock()
			p.refused.Add(1)
			p.lg.Warn("pub subscriber refused", "remote", nc.RemoteAddr().String(), "max_subscribers", p.maxConns)
			nc.Close()
			return
		}
		sc := &subConn{nc: nc, notify: make(chan struct{}, 1)}
		p.conns[sc] = struct{}{} // reserved before the handshake bounds pending handshakes too
		p.wg.Add(1)
		p.mu.Unlock()
		go p.handle(sc, nc)
	})
}

func (p *pubSocket) handle(sc *subConn, nc net.Conn) {
	defer p.wg.Done()
	defer p.remove(sc)
	c, err := zmtp.Handshake(nc, zmq4.Pub, true, p.handshakeTimeout, subLimits)
	if err != nil {
		p.dropped.Add(1)
		p.lg.Debug("pub handshake failed", "remote", nc.RemoteAddr().String(), "err", err)
		nc.Close()
		return
	}
	sc.mu.Lock()
	sc.c = c
	closed := sc.closed
	sc.mu.Unlock()
	if closed {
		c.Close()
		return
	}
	p.lg.Info("subscriber connected", "remote", c.RemoteAddr().String())
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc.writeLoop(p)
	}()
	if err := sc.readLoop(p); isPeerFault(err) {
		p.dropped.Add(1)
		p.lg.Debug("subscriber dropped", "remote", c.RemoteAddr().String(), "err", err)
	}
	sc.close()
	<-done
	p.lg.Info("subscriber disconnected", "remote", c.RemoteAddr().String())
}

// subLimits bound what a SUB may send: subscriptions (\x01prefix; only the
// topic's prefixes matter), commands (READY, SUBSCRIBE, PING) of at most
// zmtp.DefaultMaxCommand. Anything larger drops the connection.
var subLimits = zmtp.Limits{MaxFrame: 1024, MaxFrames: 4}

// maxPingContext is the most of a PING's context a PONG echoes (ZMTP 3.1:
// at most 16 bytes).
const maxPingContext = 16

// maxQueuedPongs is the most PONGs a subscriber's queue holds; a PING past
// it is not answered. A subscriber sends one PING per heartbeat interval
// (libzmq) or one to learn its subscription is in effect (pkg/kvevent),
// and its queue is written as fast as it reads: more than a few waiting
// means it floods PINGs without reading, and their PONGs would push its
// own batches out of its queue.
const maxQueuedPongs = 4

// isPeerFault reports whether a read error is the peer's doing (a protocol
// violation or an oversized frame) rather than a closed connection.
func isPeerFault(err error) bool {
	return errors.Is(err, zmtp.ErrProtocol) || errors.Is(err, zmtp.ErrFrameTooLarge) || errors.Is(err, zmtp.ErrMessageTooLarge)
}

// readLoop tracks subscriptions until the connection fails, and returns
// why. Subscriptions are data messages \x01prefix / \x00prefix (ZMTP 3.0,
// what libzmq sends a 3.0 peer) or SUBSCRIBE / CANCEL commands (ZMTP 3.1).
// Each change of the count of matching subscriptions is signalled on
// p.subsChanged.
//
// A PING (ZMTP 3.1) is answered with a PONG carrying its context, queued
// behind the batches already queued, by the connection's writer. It also
// tells a subscriber when its subscription is in effect: the subscriptions
// it sent before the PING are, once the PONG is queued, so every batch
// published later reaches it, and every batch published earlier is in the
// replay ring (send adds to the ring before it broadcasts). A subscriber
// that replays from where it stands after the PONG misses nothing
// (pkg/kvevent: without it, a subscriber that caught up before its
// subscription took effect could lose the batches in between for good
// when nothing followed them).
func (sc *subConn) readLoop(p *pubSocket) error {
	subs := newSubscriptions(p.topic)
	for {
		m, err := sc.c.ReadMessage()
		if err != nil {
			return err
		}
		if m.Command == "PING" {
			if b := m.Frames[0]; len(b) >= 2 {
				sc.push(p, zmtp.AppendCommand(nil, "PONG", b[2:min(len(b), 2+maxPingContext)]), true)
			}
			continue
		}
		var sub, prefix []byte
		switch {
		case m.Command == "SUBSCRIBE":
			sub, prefix = []byte{1}, m.Frames[0]
		case m.Command == "CANCEL":
			sub, prefix = []byte{0}, m.Frames[0]
		case m.Command == "" && len(m.Frames) == 1 && len(m.Frames[0]) > 0:
			sub, prefix = m.Frames[0][:1], m.Frames[0][1:]
		default:
			continue
		}
		if sub[0] > 1 || !subs.apply(sub[0] == 1, prefix) {
			continue
		}
		// Under p.mu, which broadcast holds: a batch broadcast before this
		// skipped the connection, and is in the ring before the PONG of a
		// PING read after it.
		p.mu.Lock()
		sc.subs.Store(subs.total)
		p.mu.Unlock()
		select {
		case p.subsChanged <- struct{}{}:
		default:
		}
	}
}

// subscriptions counts one connection's subscriptions that match the
// topic, as libzmq's PUB does: per prefix, a cancel undoing one earlier
// subscription of the same prefix. Only the topic's prefixes can match, so
// only they are kept, by length: at most MaxTopicLen+1 counters.
type subscriptions struct {
	topic  string
	counts []int32 // counts[n] is topic[:n]'s
	total  int32
}

func newSubscriptions(topic string) *subscriptions {
	return &subscriptions{topic: topic, counts: make([]int32, len(topic)+1)}
}

// apply takes a subscription (on) or a cancel of prefix and reports
// whether total changed: not for a prefix of no message, nor for a cancel
// of a prefix not subscribed.
func (s *subscriptions) apply(on bool, prefix []byte) bool {
	n := len(prefix)
	if n > len(s.topic) || string(prefix) != s.topic[:n] {
		return false
	}
	if on {
		s.counts[n]++
		s.total++
		return true
	}
	if s.counts[n] == 0 {
		return false
	}
	s.counts[n]--
	s.total--
	return true
}

// writeLoop is the connection's only writer.
func (sc *subConn) writeLoop(p *pubSocket) {
	var batch [][]byte
	for {
		<-sc.notify
		sc.mu.Lock()
		if sc.closed {
			sc.mu.Unlock()
			return
		}
		batch = append(batch[:0], sc.q...)
		clear(sc.q)
		sc.q = sc.q[:0]
		sc.qBytes, sc.pongs = 0, 0
		sc.mu.Unlock()
		if len(batch) == 0 {
			continue
		}
		bufs := net.Buffers(batch) // WriteTo consumes bufs, not batch
		if err := sc.c.WriteBuffers(&bufs, p.writeTimeout); err != nil {
			p.lg.Debug("subscriber write failed", "remote", sc.c.RemoteAddr().String(), "err", err)
			sc.close()
			return
		}
		clear(batch)
	}
}

// enqueue adds a batch, dropping the oldest messages when the queue is
// full.
func (sc *subConn) enqueue(p *pubSocket, wire []byte) { sc.push(p, wire, false) }

// push adds a message, a PONG when pong, dropping the oldest when the
// queue is full. Dropped batches count as subscriber_dropped_batches, a
// dropped PONG, or one not queued past maxQueuedPongs, as an unanswered
// PING: a subscriber's PINGs do not count against it as lost batches.
func (sc *subConn) push(p *pubSocket, wire []byte, pong bool) {
	sc.mu.Lock()
	if sc.closed {
		sc.mu.Unlock()
		return
	}
	if pong && sc.pongs >= maxQueuedPongs {
		sc.mu.Unlock()
		p.unanswered.Add(1)
		return
	}
	for len(sc.q) > 0 && (len(sc.q) >= p.queueBatches || sc.qBytes+len(wire) > p.queueBytes) {
		if zmtp.IsCommand(sc.q[0]) {
			sc.pongs--
			p.unanswered.Add(1)
		} else {
			p.droppedBatches.Add(1)
			p.droppedBytes.Add(uint64(len(sc.q[0])))
		}
		sc.qBytes -= len(sc.q[0])
		sc.q[0] = nil
		sc.q = sc.q[1:]
	}
	sc.q = append(sc.q, wire)
	sc.qBytes += len(wire)
	if pong {
		sc.pongs++
	}
	sc.mu.Unlock()
	select {
	case sc.notify <- struct{}{}:
	default:
	}
}

func (sc *subConn) close() {
	sc.mu.Lock()
	if sc.closed {
		sc.mu.Unlock()
		return
	}
	sc.closed = true
	clear(sc.q)
	sc.q, sc.qBytes = nil, 0
	sc.mu.Unlock()
	sc.nc.Close()
	select {
	case sc.notify <- struct{}{}:
	default:
	}
}

func (p *pubSocket) remove(sc *subConn) {
	p.mu.Lock()
	delete(p.conns, sc)
	p.mu.Unlock()
}

// broadcast hands one framed message to every subscribed connection. It
// never blocks on the network.
func (p *pubSocket) broadcast(wire []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for sc := range p.conns {
		if sc.subs.Load() > 0 {
			sc.enqueue(p, wire)
		}
	}
}

// subscribers counts connections subscribed to the stream.
func (p *pubSocket) subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for sc := range p.conns {
		if sc.subs.Load() > 0 {
			n++
		}
	}
	return n
}

// close stops accepting, closes every connection and waits for their goroutines.
func (p *pubSocket) close() {
	p.l.Close()
	p.mu.Lock()
	p.closed = true
	conns := make([]*subConn, 0, len(p.conns))
	for sc := range p.conns {
		conns = append(conns, sc)
	}
	p.mu.Unlock()
	for _, sc := range conns {
		sc.close()
	}
	p.wg.Wait()
}
