package conntrack

import (
	"errors"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeConn is a connection from addr that knows whether it was closed;
// the tracker calls only RemoteAddr and Close.
type fakeConn struct {
	net.Conn // nil
	addr     net.Addr
	once     sync.Once
	closed   chan struct{}
}

func newConn(addr string) *fakeConn {
	return &fakeConn{addr: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(addr)), closed: make(chan struct{})}
}

func (c *fakeConn) RemoteAddr() net.Addr { return c.addr }

func (c *fakeConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return nil
}

func (c *fakeConn) isClosed() bool {
	select {
	case <-c.closed:
		return true
	default:
		return false
	}
}

// add adds nc under its remote IP, as the TCP listeners do.
func add(tr *Tracker[netip.Addr], nc net.Conn) (*Conn[netip.Addr], error) {
	return tr.Add(nc, RemoteIP(nc))
}

func TestRemoteIP(t *testing.T) {
	pipe, other := net.Pipe()
	defer pipe.Close()
	defer other.Close()
	for _, tt := range []struct {
		name string
		nc   net.Conn
		want netip.Addr
	}{
		{"IPv4", newConn("10.0.0.1:5000"), netip.MustParseAddr("10.0.0.1")},
		{"IPv4-mapped IPv6 is IPv4", newConn("[::ffff:10.0.0.1]:5000"), netip.MustParseAddr("10.0.0.1")},
		{"IPv6", newConn("[2001:db8::1]:5000"), netip.MustParseAddr("2001:db8::1")},
		{"not TCP", pipe, netip.Addr{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := RemoteIP(tt.nc); got != tt.want {
				t.Errorf("RemoteIP = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestAdd(t *testing.T) {
	tr := New[netip.Addr](3, 2)
	for _, tt := range []struct {
		addr string
		want error
	}{
		{"10.0.0.1:1", nil},
		{"10.0.0.1:2", nil},
		{"10.0.0.1:3", ErrMaxConnsPerKey},
		{"[::ffff:10.0.0.1]:4", ErrMaxConnsPerKey}, // the same client
		{"10.0.0.2:1", nil},
		{"10.0.0.3:1", ErrMaxConns},
		{"10.0.0.1:5", ErrMaxConns}, // both caps: MaxConns is checked first
	} {
		nc := newConn(tt.addr)
		c, err := add(tr, nc)
		if !errors.Is(err, tt.want) {
			t.Errorf("Add(%s) = %v, want %v", tt.addr, err, tt.want)
		}
		if (c == nil) != (err != nil) {
			t.Errorf("Add(%s) = %v, %v: want a Conn exactly when admitted", tt.addr, c, err)
		}
		if nc.isClosed() {
			t.Errorf("Add(%s) closed the connection; the caller does", tt.addr)
		}
	}
	if got, want := tr.Len(), 3; got != want {
		t.Errorf("Len = %d, want %d", got, want)
	}
}

func TestRemove(t *testing.T) {
	tr := New[netip.Addr](2, 1)
	nc := newConn("10.0.0.1:1")
	c, err := add(tr, nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := add(tr, newConn("10.0.0.1:2")); !errors.Is(err, ErrMaxConnsPerKey) {
		t.Fatalf("second connection from one address: %v, want ErrMaxConnsPerKey", err)
	}
	tr.Remove(c)
	if !nc.isClosed() {
		t.Error("Remove left the connection open")
	}
	if got := tr.Len(); got != 0 {
		t.Errorf("Len after Remove = %d, want 0", got)
	}
	// The address's place is free again, and so is the total's.
	for _, addr := range []string{"10.0.0.1:2", "10.0.0.2:1"} {
		if _, err := add(tr, newConn(addr)); err != nil {
			t.Errorf("Add(%s) after Remove: %v", addr, err)
		}
	}
}

func TestBusy(t *testing.T) {
	tr := New[netip.Addr](1, 1)
	c, err := add(tr, newConn("10.0.0.1:1"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Busy() {
		t.Error("a new connection is busy; want idle")
	}
	if !c.MarkBusy() {
		t.Error("MarkBusy of an idle connection = false, want true (a change)")
	}
	if c.MarkBusy() {
		t.Error("MarkBusy of a busy connection = true, want false (no change)")
	}
	if !c.Busy() {
		t.Error("Busy after MarkBusy = false")
	}
	if !c.MarkIdle() {
		t.Error("MarkIdle before shutdown = false, want true")
	}
	if c.Busy() {
		t.Error("Busy after MarkIdle = true")
	}
}

func TestShutdown(t *testing.T) {
	tr := New[netip.Addr](10, 10)
	idleNC, busyNC := newConn("10.0.0.1:1"), newConn("10.0.0.1:2")
	_, err := add(tr, idleNC)
	if err != nil {
		t.Fatal(err)
	}
	busy, err := add(tr, busyNC)
	if err != nil {
		t.Fatal(err)
	}
	busy.MarkBusy()
	if tr.Closing() {
		t.Fatal("Closing before Shutdown")
	}
	tr.Shutdown()
	if !tr.Closing() {
		t.Error("Closing after Shutdown = false")
	}
	if !idleNC.isClosed() {
		t.Error("Shutdown left an idle connection open")
	}
	if busyNC.isClosed() {
		t.Error("Shutdown closed a busy connection; it should finish its request")
	}
	if busy.MarkIdle() {
		t.Error("MarkIdle after Shutdown = true; want false, the connection is to stop")
	}
	nc := newConn("10.0.0.2:1")
	if _, err := add(tr, nc); !errors.Is(err, ErrClosing) {
		t.Errorf("Add after Shutdown: %v, want ErrClosing", err)
	}
	// The cut closes what is left, busy or not.
	busy.MarkBusy()
	if got, want := tr.CloseAll(), 2; got != want {
		t.Errorf("CloseAll = %d, want %d (nothing was removed)", got, want)
	}
	if !busyNC.isClosed() {
		t.Error("CloseAll left a busy connection open")
	}
}

func TestCloseAllRefuses(t *testing.T) {
	tr := New[netip.Addr](10, 10)
	if got := tr.CloseAll(); got != 0 {
		t.Errorf("CloseAll of none = %d", got)
	}
	if _, err := add(tr, newConn("10.0.0.1:1")); !errors.Is(err, ErrClosing) {
		t.Errorf("Add after CloseAll: %v, want ErrClosing", err)
	}
}

// TestShutdownMissesNoIdle races connections going idle with Shutdown:
// each one that waits for a request after Shutdown must be closed, else it
// would wait forever; the others must have been told to stop. Each
// connection serves a different number of requests, then waits, so
// Shutdown lands on connections in every state. Run it with -race.
func TestShutdownMissesNoIdle(t *testing.T) {
	const rounds, conns = 300, 4
	for round := range rounds {
		tr := New[netip.Addr](conns, conns)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range conns {
			nc := newConn("10.0.0.1:1")
			c, err := add(tr, nc)
			if err != nil {
				t.Fatal(err)
			}
			requests := (round*conns + i) * 7 % 500
			wg.Go(func() {
				defer tr.Remove(c)
				<-start
				for range requests {
					if !c.MarkIdle() {
						return // told to stop
					}
					if nc.isClosed() {
						return // closed while idle: the next read fails
					}
					c.MarkBusy()
				}
				// No more requests: wait, as on a socket, until closed.
				if !c.MarkIdle() {
					return
				}
				<-nc.closed
			})
		}
		close(start)
		for range round % 50 {
			runtime.Gosched() // let the connections get going
		}
		tr.Shutdown()
		done := make(chan struct{})
		go func() {
			wg.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			// Unblock the waiters, so the failure is the message, not a leak.
			tr.CloseAll()
			<-done
			t.Fatalf("round %d: a connection idle at shutdown was neither closed nor told to stop", round)
		}
		if got := tr.Len(); got != 0 {
			t.Fatalf("round %d: %d connections left after their goroutines ended", round, got)
		}
	}
}

// TestAddDuringShutdown races Add with Shutdown: every connection is
// either refused or in the set Shutdown closes (new ones are idle).
func TestAddDuringShutdown(t *testing.T) {
	for round := range 200 {
		tr := New[netip.Addr](1000, 1000)
		added := make(chan *fakeConn, 1000)
		var wg sync.WaitGroup
		wg.Go(func() {
			defer close(added)
			for range 1000 {
				nc := newConn("10.0.0.1:1")
				if _, err := add(tr, nc); err != nil {
					if !errors.Is(err, ErrClosing) {
						t.Errorf("Add: %v, want nil or ErrClosing", err)
					}
					return
				}
				added <- nc
			}
		})
		tr.Shutdown()
		wg.Wait()
		for nc := range added {
			if !nc.isClosed() {
				t.Fatalf("round %d: a connection added as Shutdown ran was left open", round)
			}
		}
	}
}

// BenchmarkRequest is what a request costs the tracker: one MarkBusy and
// one MarkIdle, from connections served in parallel.
func BenchmarkRequest(b *testing.B) {
	tr := New[netip.Addr](1<<20, 1<<20)
	b.RunParallel(func(pb *testing.PB) {
		c, err := add(tr, newConn("10.0.0.1:1"))
		if err != nil {
			b.Error(err)
			return
		}
		defer tr.Remove(c)
		for pb.Next() {
			c.MarkBusy()
			if !c.MarkIdle() {
				b.Error("MarkIdle = false before Shutdown")
				return
			}
		}
	})
}
