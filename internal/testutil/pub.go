package testutil

import (
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

	mu    sync.Mutex // guards raw, conns
	raw   map[net.Conn]bool
	conns []*zmtp.Conn
	subs  chan struct{}
}

// StartPublisher listens on a loopback port; Close stops it.
func StartPublisher() (*Publisher, error) {
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Publisher{l: l, raw: map[net.Conn]bool{}, subs: make(chan struct{}, 64)}
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
				if _, err := c.ReadMessage(); err != nil {
					return
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
