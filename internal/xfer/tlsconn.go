package xfer

import (
	"crypto/tls"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// crypto/tls writes every record with its own Write on the connection
// beneath it, and reads about one record per Read: 64 writes and 64 reads
// for a 1 MiB payload, 129 of each for a request of 128 objects of 4 KiB,
// where plaintext moves either with one writev and a few readv. Each is a
// system call and, for the other side, a wake-up per 16 KiB. batchConn
// sits beneath the TLS connection and batches both:
//
//   - Writes, between Gather and Flush only: the records a frame's writes
//     produce are gathered into writes of up to batchSize, the rest sent
//     by Flush. Everything else (handshake flights, alerts, a refusal)
//     goes out as crypto/tls writes it. (The record type cannot tell them
//     apart: TLS 1.3 sends every encrypted record, alerts included, as
//     application data.)
//   - Reads: a read from the socket fills up to batchSize at once, and the
//     records are handed to crypto/tls from there. The buffer is taken from
//     a pool only once the socket is readable (syscall.RawConn) and given
//     back as soon as it is drained, so an idle connection blocked in a
//     read holds none.
//
// BenchmarkTransferTLS (internal/agent/dataplane) measures what it saves.

// batchSize is what one write of gathered records may carry.
const batchSize = 256 << 10

var batchBufs = sync.Pool{New: func() any { b := make([]byte, 0, batchSize); return &b }}

type batchConn struct {
	net.Conn
	// rc reads the socket once it is readable; nil when the connection is
	// no socket (tests), and then reads are not batched.
	rc syscall.RawConn

	// mu guards gather and buf (Close may run beside a write).
	mu     sync.Mutex
	gather bool    // between Gather and Flush
	buf    *[]byte // records not yet sent; nil when none (the pool has it)

	// Only the reader (under crypto/tls's input lock) touches these.
	rbuf  *[]byte // bytes read and not yet handed out; nil when none
	roff  int     // how many of them were handed out
	rn    int     // readFill's result
	rerr  error
	rfill func(fd uintptr) bool // readFill, bound once
}

func newBatchConn(nc net.Conn) *batchConn {
	c := &batchConn{Conn: nc}
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
			c.rfill = c.readFill
		}
	}
	return c
}

func (c *batchConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.gather || len(p) > batchSize {
		if err := c.flushLocked(); err != nil {
			return 0, err
		}
		return c.Conn.Write(p)
	}
	if c.buf != nil && len(*c.buf)+len(p) > batchSize {
		if err := c.flushLocked(); err != nil {
			return 0, err
		}
	}
	if c.buf == nil {
		c.buf = batchBufs.Get().(*[]byte)
	}
	*c.buf = append(*c.buf, p...)
	return len(p), nil
}

// Read reads from what an earlier read brought, else up to batchSize from
// the socket.
func (c *batchConn) Read(p []byte) (int, error) {
	if c.rbuf == nil {
		if c.rc == nil || len(p) >= batchSize {
			return c.Conn.Read(p)
		}
		c.rn, c.rerr = 0, nil
		if err := c.rc.Read(c.rfill); err != nil {
			return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
		}
		switch {
		case c.rerr != nil:
			return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.NewSyscallError("read", c.rerr)}
		case c.rn == 0:
			return 0, io.EOF
		}
	}
	n := copy(p, (*c.rbuf)[c.roff:c.rn])
	if c.roff += n; c.roff == c.rn {
		batchBufs.Put(c.rbuf)
		c.rbuf, c.roff = nil, 0
	}
	return n, nil
}

// readFill is the RawConn read function: it takes a buffer and reads into
// it once the socket is readable (false, with the buffer given back,
// while it is not).
func (c *batchConn) readFill(fd uintptr) bool {
	b := batchBufs.Get().(*[]byte)
	for {
		n, err := syscall.Read(int(fd), (*b)[:cap(*b)])
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			batchBufs.Put(b)
			return false
		case err != nil || n <= 0:
			batchBufs.Put(b)
			c.rerr = err
			return true
		}
		c.rbuf, c.rn = b, n
		return true
	}
}

// Gather starts gathering the TLS records written on nc into few writes,
// when nc is a TLS connection made by TLSClient or TLSListener (otherwise
// it does nothing); Flush ends it. Around the writes of one frame:
//
//	xfer.Gather(nc)
//	err := write(...)
//	if ferr := xfer.Flush(nc); err == nil {
//		err = ferr
//	}
func Gather(nc net.Conn) {
	if c := batchOf(nc); c != nil {
		c.mu.Lock()
		c.gather = true
		c.mu.Unlock()
	}
}

// Flush sends what Gather gathered on nc and ends gathering.
func Flush(nc net.Conn) error {
	c := batchOf(nc)
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gather = false
	return c.flushLocked()
}

func batchOf(nc net.Conn) *batchConn {
	if tc, ok := nc.(*tls.Conn); ok {
		c, _ := tc.NetConn().(*batchConn)
		return c
	}
	return nil
}

func (c *batchConn) flushLocked() error {
	if c.buf == nil {
		return nil
	}
	b := c.buf
	_, err := c.Conn.Write(*b)
	if err != nil {
		return err // b stays: the connection is broken; Close drops it
	}
	*b = (*b)[:0]
	c.buf = nil
	batchBufs.Put(b)
	return nil
}

// Close closes the connection without sending what was gathered (only a
// close that interrupts a frame's writes leaves any): it must not wait on a peer
// that does not read.
func (c *batchConn) Close() error {
	err := c.Conn.Close()
	// The reader's buffer is left to the collector: Close may run while
	// a Read is in progress.
	c.mu.Lock()
	if c.buf != nil {
		*c.buf = (*c.buf)[:0]
		batchBufs.Put(c.buf)
		c.buf = nil
	}
	c.mu.Unlock()
	return err
}

// TLSClient is tls.Client over a connection that gathers records (the
// Pool's connections).
func TLSClient(nc net.Conn, cfg *tls.Config) *tls.Conn {
	return tls.Client(newBatchConn(nc), cfg)
}

// TLSListener is tls.NewListener whose connections gather records the same
// way: what the agent's transfer listener should be wrapped in. A plain
// tls.NewListener works too, at the cost of a write per record.
func TLSListener(inner net.Listener, cfg *tls.Config) net.Listener {
	return &batchListener{Listener: inner, cfg: cfg}
}

type batchListener struct {
	net.Listener
	cfg *tls.Config
}

func (l *batchListener) Accept() (net.Conn, error) {
	nc, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return tls.Server(newBatchConn(nc), l.cfg), nil
}
