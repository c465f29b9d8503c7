// Package conntrack admits and tracks the connections of a raw-TCP
// listener that serves one request at a time per connection: the master's
// lookup listener (internal/fastcall) and the agent's bulk transfer
// listener (internal/agent/dataplane). Both bound their connections in
// total and per remote address, and both shut down the same way: refuse
// new connections, close the idle ones at once, let the busy ones finish
// their request, and, when that takes too long, cut them.
//
// Concurrency: a connection is added and removed once, under the
// tracker's mutex; it is marked busy and idle once per request, and that
// takes no lock. Shutdown must still never miss a connection that goes
// idle as it starts: each side writes its own flag, then reads the
// other's, and Go's atomics are sequentially consistent, so at least one
// of them sees the other.
//
//	connection (MarkIdle)          shutdown (Shutdown)
//	busy.Store(false)              closing.Store(true)
//	if closing.Load(): stop        for each c (under mu): if !c.busy.Load(): close c (after mu)
//
// Either the connection sees closing and stops itself, or shutdown sees
// it idle and closes it; often both, which is harmless.
//
// Internal to the Crescent module.
package conntrack

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
)

// Why Add refused a connection. The listeners count and answer each cap
// differently, so they are distinct.
var (
	// ErrClosing: the tracker is shutting down.
	ErrClosing = errors.New("conntrack: closing")
	// ErrMaxConns: the tracker holds its maximum of connections.
	ErrMaxConns = errors.New("conntrack: maximum connections reached")
	// ErrMaxConnsPerKey: the connection's key (a remote address, a peer
	// process) holds its maximum of connections.
	ErrMaxConnsPerKey = errors.New("conntrack: maximum connections per key reached")
)

// Tracker holds a listener's open connections: what the caps count, and
// what shutdown must close.
//
// K is what the per-key cap counts by: the remote IP of a TCP listener's
// connections (RemoteIP), the peer process of a Unix socket's.
type Tracker[K comparable] struct {
	maxConns, maxConnsPerKey int

	// closing is set once by Shutdown or CloseAll; read without the lock
	// by every MarkIdle (see the package doc for the ordering).
	closing atomic.Bool

	// mu guards conns and perKey. It is taken once when a connection
	// comes and once when it goes, never per request.
	mu     sync.Mutex
	conns  map[*Conn[K]]struct{}
	perKey map[K]int
}

// New returns a tracker that admits at most maxConns connections, at most
// maxConnsPerKey of them under one key. Callers apply their own defaults:
// a cap of 0 admits nothing.
func New[K comparable](maxConns, maxConnsPerKey int) *Tracker[K] {
	return &Tracker[K]{maxConns: maxConns, maxConnsPerKey: maxConnsPerKey, conns: map[*Conn[K]]struct{}{}, perKey: map[K]int{}}
}

// Conn is one admitted connection. Only the goroutine serving it marks it
// busy or idle.
type Conn[K comparable] struct {
	t   *Tracker[K]
	nc  net.Conn
	key K // what it counts under in Tracker.perKey
	// busy is set while a request is served, so Shutdown lets it finish;
	// a new connection is idle (a handshake or preamble is not a request).
	busy atomic.Bool
}

// RemoteIP is the key a TCP listener counts connections under for its
// per-address cap: the remote IP of a TCP connection (an IPv4-mapped IPv6 address as
// IPv4, so one client is one client whichever way it came), the zero Addr
// for anything else (a net.Pipe in tests; all of them share one count).
func RemoteIP(nc net.Conn) netip.Addr {
	if a, ok := nc.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// Add admits nc under key, idle, unless the tracker is closing
// (ErrClosing) or nc would pass a cap (ErrMaxConns, checked first, or
// ErrMaxConnsPerKey). It does not close a refused nc: the caller may
// answer it first.
func (t *Tracker[K]) Add(nc net.Conn, key K) (*Conn[K], error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	// Loaded under mu: Shutdown stores closing before it takes mu to close
	// the idle connections, so a connection added here is either refused
	// or in the set Shutdown walks.
	switch {
	case t.closing.Load():
		return nil, ErrClosing
	case len(t.conns) >= t.maxConns:
		return nil, ErrMaxConns
	case t.perKey[key] >= t.maxConnsPerKey:
		return nil, ErrMaxConnsPerKey
	}
	c := &Conn[K]{t: t, nc: nc, key: key}
	t.conns[c] = struct{}{}
	t.perKey[key]++
	return c, nil
}

// Remove forgets c and closes its connection; the goroutine serving c
// calls it once, as it ends.
func (t *Tracker[K]) Remove(c *Conn[K]) {
	t.mu.Lock()
	delete(t.conns, c)
	if t.perKey[c.key]--; t.perKey[c.key] <= 0 {
		delete(t.perKey, c.key)
	}
	t.mu.Unlock()
	_ = c.nc.Close()
}

// Len is the number of open connections.
func (t *Tracker[K]) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.conns)
}

// Closing reports whether Shutdown (or CloseAll) was called. A listener
// waiting for something else than a request (a budget, say) checks it to
// give up at shutdown.
func (t *Tracker[K]) Closing() bool { return t.closing.Load() }

// Shutdown refuses new connections and closes the idle ones; a busy one
// finishes its request, then MarkIdle tells it to stop. It walks the set
// under mu, after storing closing, so a connection Add admits
// concurrently is in the walk or refused.
func (t *Tracker[K]) Shutdown() {
	t.closing.Store(true) // before the busy loads below: see the package doc
	t.closeEach(func(c *Conn[K]) bool { return !c.busy.Load() })
}

// closeEach closes the connections pick picks, outside mu: closing a TLS
// connection writes its close_notify (for up to the connection's write
// deadline, to a peer that may not read), and neither Add nor Remove
// should wait behind that, nor one close behind another's.
func (t *Tracker[K]) closeEach(pick func(*Conn[K]) bool) int {
	t.mu.Lock()
	n := len(t.conns)
	var picked []net.Conn
	for c := range t.conns {
		if pick(c) {
			picked = append(picked, c.nc)
		}
	}
	t.mu.Unlock()
	for _, nc := range picked {
		_ = nc.Close()
	}
	return n
}

// CloseAll closes every open connection, busy or not, and returns how many
// there were: the cut, for requests that outlast a drain timeout. It
// refuses new connections too.
func (t *Tracker[K]) CloseAll() int {
	t.closing.Store(true)
	return t.closeEach(func(*Conn[K]) bool { return true })
}

// MarkBusy marks c busy: a request started, which Shutdown lets finish.
// It reports whether c was idle, for callers that count busy connections.
func (c *Conn[K]) MarkBusy() bool { return !c.busy.Swap(true) }

// MarkIdle marks c idle between requests; false when the tracker is
// closing and c is to stop rather than wait for another request. The
// store comes before the load: see the package doc.
func (c *Conn[K]) MarkIdle() bool {
	c.busy.Store(false)
	return !c.t.closing.Load()
}

// Busy reports whether c is marked busy.
func (c *Conn[K]) Busy() bool { return c.busy.Load() }
