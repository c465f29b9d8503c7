package testutil

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// Publisher is a scripted ZMQ PUB endpoint on a loopback port: Send writes
// a message to every subscribed connection. It stands in for the gateway
// in tests and examples of KV-event subscribers.
type Publisher struct {
	l  net.Listener
	wg sync.WaitGroup

	mu    sync.Mutex // guards raw, conns, pings
	raw   map[net.Conn]bool
	conns []*zmtp.Conn
	subs  chan struct{}
	// pings are the contexts of the PINGs read and not yet answered, per
	// connection; pinged signals each.
	pings  map[*zmtp.Conn][][]byte
	pinged chan struct{}
}

// StartPublisher listens on a loopback port; Close stops it.
func StartPublisher() (*Publisher, error) {
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Publisher{l: l, raw: map[net.Conn]bool{}, subs: make(chan struct{}, 64),
		pings: map[*zmtp.Conn][][]byte{}, pinged: make(chan struct{}, 64)}
	p.wg.Go(p.accept)
	return p, nil
}

// Endpoint is the publisher's "tcp://127.0.0.1:port".
func (p *Publisher) Endpoint() string { return zmtp.Endpoint(p.l) }

func (p *Publisher) accept() {
	for {
		nc, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.raw[nc] = true
		p.mu.Unlock()
		p.wg.Go(func() {
			c, err := zmtp.Handshake(nc, zmq4.Pub, true, 5*time.Second, zmtp.Limits{})
			if err != nil {
				_ = nc.Close()
				return
			}
			m, err := c.ReadMessage() // the subscription
			if err != nil || len(m.Frames) != 1 || len(m.Frames[0]) == 0 || m.Frames[0][0] != 1 {
				_ = c.Close()
				return
			}
			p.mu.Lock()
			p.conns = append(p.conns, c)
			p.mu.Unlock()
			p.subs <- struct{}{}
			for {
				m, err := c.ReadMessage()
				if err != nil {
					return
				}
				if m.Command == "PING" && len(m.Frames[0]) >= 2 {
					p.mu.Lock()
					p.pings[c] = append(p.pings[c], bytes.Clone(m.Frames[0][2:]))
					p.mu.Unlock()
					select {
					case p.pinged <- struct{}{}:
					default: // nobody waits for that many
					}
				}
			}
		})
	}
}

// WaitSubscriber waits until one more subscriber has subscribed (a PUB
// socket drops what it sends before that).
func (p *Publisher) WaitSubscriber(ctx context.Context) error {
	select {
	case <-p.subs:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// WaitPing waits until one more PING has arrived. The publisher answers
// none by itself (as a publisher without ZMTP 3.1 PING would): Pong does.
func (p *Publisher) WaitPing(ctx context.Context) error {
	select {
	case <-p.pinged:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Pong answers every PING read so far with a PONG carrying its context.
func (p *Publisher) Pong() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for c, ctxs := range p.pings {
		for _, pc := range ctxs {
			errs = append(errs, c.Write(zmtp.AppendCommand(nil, "PONG", pc), 5*time.Second))
		}
		delete(p.pings, c)
	}
	return errors.Join(errs...)
}

// Send writes one message of frames to every subscriber and returns the
// write errors, if any.
func (p *Publisher) Send(frames ...[]byte) error {
	msg := zmtp.AppendMessage(nil, frames...)
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, c := range p.conns {
		errs = append(errs, c.Write(msg, 5*time.Second))
	}
	return errors.Join(errs...)
}

// DropConns closes every subscriber connection (the listener stays, so
// subscribers reconnect).
func (p *Publisher) DropConns() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// Close stops listening and closes every connection.
func (p *Publisher) Close() {
	_ = p.l.Close()
	p.mu.Lock()
	for nc := range p.raw {
		_ = nc.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}
