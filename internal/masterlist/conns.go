package masterlist

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// KeepaliveTime is how long a client connection goes without traffic before
// it pings its peer (10 s is grpc-go's floor; the servers accept a ping
// every 5 s, internal/server), and KeepaliveTimeout how long the ping may go
// unanswered before the connection fails its calls and streams with
// UNAVAILABLE.
const (
	KeepaliveTime    = 10 * time.Second
	KeepaliveTimeout = 5 * time.Second
)

// Keepalive is the dial option that watches a connection to a master (or
// an agent) with pings, idle or not: a peer that stops answering with the
// connection open fails its calls within KeepaliveTime+KeepaliveTimeout of
// its last answer.
func Keepalive() grpc.DialOption {
	return grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: KeepaliveTime, Timeout: KeepaliveTimeout, PermitWithoutStream: true})
}

// Conns holds one ClientConn per address of a master list, made on first
// use, and one more for the last leader hint outside the list (replaced by
// the next such hint): at most MaxMasters+1. Safe for concurrent use.
type Conns struct {
	list []string
	opts []grpc.DialOption

	// mu guards conns, extra and closed.
	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	extra  string // the address outside the list with a conn, if any
	closed bool
}

// NewConns returns the connection set of list (Split's result), each
// connection dialled with Keepalive, then opts, and traced
// (tracing.DialOption). It dials nothing (grpc.NewClient connects lazily).
func NewConns(list []string, opts ...grpc.DialOption) (*Conns, error) {
	if len(list) == 0 || len(list) > MaxMasters {
		return nil, fmt.Errorf("%d master addresses, want 1 to %d", len(list), MaxMasters)
	}
	opts = append(append([]grpc.DialOption{Keepalive()}, opts...), tracing.DialOption())
	return &Conns{list: slices.Clone(list), opts: opts, conns: map[string]*grpc.ClientConn{}}, nil
}

// Get returns the connection to addr.
func (c *Conns) Get(addr string) (*grpc.ClientConn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errors.New("master connections closed")
	}
	if cc, ok := c.conns[addr]; ok {
		return cc, nil
	}
	inList := slices.Contains(c.list, addr)
	if !inList && c.extra != "" {
		_ = c.conns[c.extra].Close()
		delete(c.conns, c.extra)
		c.extra = ""
	}
	cc, err := grpc.NewClient(addr, c.opts...)
	if err != nil {
		return nil, fmt.Errorf("master address %q: %w", addr, err)
	}
	c.conns[addr] = cc
	if !inList {
		c.extra = addr
	}
	return cc, nil
}

// Close closes every connection. It is idempotent.
func (c *Conns) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	var errs []error
	for _, cc := range c.conns {
		errs = append(errs, cc.Close())
	}
	c.conns = nil
	return errors.Join(errs...)
}

// List is the master list the set was made of (a copy).
func (c *Conns) List() []string { return slices.Clone(c.list) }
