package shm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"golang.org/x/sys/unix"
)

// Defaults for Config.
const (
	DefaultMaxIdle     = 16
	DefaultDialTimeout = time.Second
	// DefaultRetryAfter is how long a socket that could not be used
	// (absent, refused) is left alone before the next try.
	DefaultRetryAfter = 5 * time.Second
	// DefaultStallTimeout is Config.StallTimeout's default, as the bulk
	// TCP path's (xfer.DefaultStallTimeout).
	DefaultStallTimeout = xfer.DefaultStallTimeout
	// refreshAfter is how often a socket is asked again for its segments
	// when a descriptor names one it did not share.
	refreshAfter = time.Second
)

// Config configures a Client.
type Config struct {
	// Path is the agent's Unix socket (crescent-agent --shm-socket).
	Path string
	// MaxIdle bounds the idle connections kept (default 16).
	MaxIdle int
	// DialTimeout bounds a connection's dial and hello (default 1 s).
	DialTimeout time.Duration
	// RetryAfter is how long a socket that failed is not tried again
	// (default 5 s): callers use the bulk TCP path meanwhile.
	RetryAfter time.Duration
	// StallTimeout bounds each wait on the agent: for a request's grant
	// and for a release's answer (default 5 s, negative for none). A call
	// to an agent that is stopped or hung fails then with UNAVAILABLE
	// AGENT_UNAVAILABLE, and the socket waits out RetryAfter, instead of
	// the call holding until its deadline (or for ever, without one).
	StallTimeout time.Duration
}

// ErrClosed is returned by a closed Client.
var ErrClosed = errors.New("shm: client is closed")

// Client moves object bytes through the shared memory of the agent
// listening on one Unix socket. It is safe for concurrent use; each call
// takes a connection of its own (dialled when none is idle).
type Client struct {
	cfg Config

	mu     sync.Mutex
	idle   []*conn
	maps   map[string]*mapping // by segment id, while a connection holds it
	known  map[string]bool     // the segments of the latest hello
	seenAt time.Time           // when known was learned
	failAt time.Time           // when the socket last failed
	// dialing is set while a Has dials (others do not wait for it).
	dialing bool
	closed  bool
	lastErr error
	// populating counts the goroutines populating new mappings (Close
	// waits for them).
	populating sync.WaitGroup

	// Items copied, by direction (Served), the read requests that carried
	// the reads the agent granted (ReadRequests), and the reads copied
	// straight from a mapping and the copies that did not match (Mapped).
	reads, writes, readRequests atomic.Uint64
	mappedReads, mappedMisses   atomic.Uint64
}

// Served is how many items this client has read and written through
// shared memory, the reads AppendMapped served included.
func (c *Client) Served() (reads, writes uint64) { return c.reads.Load(), c.writes.Load() }

// ReadRequests is how many read requests carried Served's reads.
func (c *Client) ReadRequests() uint64 { return c.readRequests.Load() }

// Mapped is how many reads AppendMapped served, and how many of the copies
// it made its caller found stale (MappedMiss).
func (c *Client) Mapped() (reads, misses uint64) { return c.mappedReads.Load(), c.mappedMisses.Load() }

// MappedMiss records that a copy AppendMapped made did not hold the object
// (its checksum did not match); the caller reads it again by request.
func (c *Client) MappedMiss() {
	c.mappedMisses.Add(1)
	c.mappedReads.Add(^uint64(0))
	c.reads.Add(^uint64(0))
}

// AppendMapped appends the n bytes at offset off of segment id's mapping
// to dst, without asking the agent, and reports whether it could: false
// when no connection of this client holds a mapping of the segment or the
// range lies outside it. With no room in dst, append allocates the new
// buffer without zeroing what the copy overwrites — for a fresh buffer
// (dst nil) that is half the work of make and copy. Nothing keeps the
// bytes from changing under the copy — the agent holds no allocation open
// for it — so the caller must check them against the object's checksum
// (and call MappedMiss, then read by request, when they do not match).
// What makes the copy worth trying is the master's read lease: an object
// leased to a reader is neither evicted nor replaced, so its extent holds
// its bytes for as long as the lease lasts unless it is removed by force
// (docs/ARCHITECTURE.md, "mapped reads").
func (c *Client) AppendMapped(dst []byte, id string, off, n uint64) ([]byte, bool) {
	c.mu.Lock()
	m := c.maps[id]
	if c.closed || m == nil || off > uint64(len(m.data)) || n > uint64(len(m.data))-off {
		c.mu.Unlock()
		return dst, false
	}
	m.refs++ // kept mapped while the copy runs
	c.mu.Unlock()
	dst = append(dst, m.data[off:off+n]...)
	c.mu.Lock()
	c.unrefLocked(m)
	c.mu.Unlock()
	c.mappedReads.Add(1)
	c.reads.Add(1)
	return dst, true
}

// mapping is this process's mapping of one shared segment, unmapped when
// the last connection whose hello shared it closes.
type mapping struct {
	id   string
	data []byte
	refs int
}

// conn is one connection. Only the goroutine that took it touches it.
type conn struct {
	uc   *net.UnixConn
	br   *bufio.Reader
	segs map[string]*mapping
	wbuf []byte
	rbuf []byte
	offs []uint64
	// dl sets each wait's deadline within a call (Client.wait).
	dl xfer.Deadlines
}

// New returns a client of the socket at cfg.Path; it does no I/O.
func New(cfg Config) *Client {
	if cfg.MaxIdle <= 0 {
		cfg.MaxIdle = DefaultMaxIdle
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.RetryAfter <= 0 {
		cfg.RetryAfter = DefaultRetryAfter
	}
	if cfg.StallTimeout == 0 {
		cfg.StallTimeout = DefaultStallTimeout
	}
	return &Client{cfg: cfg, maps: map[string]*mapping{}}
}

// Path is the socket's path.
func (c *Client) Path() string { return c.cfg.Path }

// Err is the error of the socket's last failure, nil after a success.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastErr
}

// Has reports whether the agent on the socket shares segment id. It
// connects when it knows nothing yet, or learned its segments over a
// second ago and id is not among them, unless the socket failed within
// RetryAfter or another Has is connecting: a caller that gets false uses
// the bulk path, so Has never waits for another caller.
func (c *Client) Has(ctx context.Context, id string) bool {
	c.mu.Lock()
	now := time.Now()
	if c.known[id] {
		c.mu.Unlock()
		return true
	}
	if c.closed || c.dialing || (!c.failAt.IsZero() && now.Sub(c.failAt) < c.cfg.RetryAfter) ||
		(c.known != nil && now.Sub(c.seenAt) < refreshAfter) {
		c.mu.Unlock()
		return false
	}
	c.dialing = true
	c.mu.Unlock()
	cn, err := c.dial(ctx)
	c.mu.Lock()
	c.dialing = false
	c.mu.Unlock()
	if err != nil {
		return false
	}
	c.put(cn, true)
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.known[id]
}

// Forget drops what the client learned of the socket, after a failure, so
// that it is not used again before RetryAfter.
func (c *Client) forget(err error) {
	c.mu.Lock()
	c.known, c.failAt, c.lastErr = nil, time.Now(), err
	idle := c.idle
	c.idle = nil
	c.mu.Unlock()
	for _, cn := range idle {
		c.closeConn(cn)
	}
}

// Close closes the idle connections and unmaps what only they held;
// connections in use close when their calls end. It waits for the
// populating of new mappings to stop (within one chunk).
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	idle := c.idle
	c.idle = nil
	c.mu.Unlock()
	for _, cn := range idle {
		c.closeConn(cn)
	}
	c.populating.Wait()
	return nil
}

// dial connects, reads the hello and maps the segments it shares.
func (c *Client) dial(parent context.Context) (cn *conn, err error) {
	defer func() {
		if err != nil && parent.Err() == nil {
			c.forget(err)
		}
	}()
	ctx, cancel := context.WithTimeout(parent, c.cfg.DialTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", c.cfg.Path)
	if err != nil {
		return nil, unavailable(c.cfg.Path, err)
	}
	uc := nc.(*net.UnixConn)
	if dl, ok := ctx.Deadline(); ok {
		_ = uc.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = uc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	// A refused peer's preamble may meet a closed socket: the refusal
	// (read below) says more than the broken pipe.
	_, werr := uc.Write([]byte(Preamble))
	// The descriptors come with the hello's first bytes.
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(MaxSegments*4))
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	fds, perr := parseRights(oob[:oobn])
	closeFDs := func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}
	if err == nil && n == 0 {
		err = io.ErrUnexpectedEOF
	}
	if err != nil && werr != nil {
		err = werr
	}
	if err == nil && flags&unix.MSG_CTRUNC != 0 {
		err = violation(c.cfg.Path, "hello carries more than %d descriptors", MaxSegments)
	}
	if err == nil {
		err = perr
	}
	if err != nil {
		closeFDs()
		_ = uc.Close()
		return nil, unavailable(c.cfg.Path, err)
	}
	br := bufio.NewReaderSize(io.MultiReader(bytes.NewReader(buf[:n]), uc), 4096)
	segs, err := ReadHello(br)
	if err == nil && len(segs) != len(fds) {
		err = violation(c.cfg.Path, "hello shares %d segments with %d descriptors", len(segs), len(fds))
	}
	if err != nil {
		closeFDs()
		_ = uc.Close()
		if errors.Is(err, xfer.ErrProtocol) || rpcerr.Reason(err) != "" {
			return nil, fmt.Errorf("shm %s: %w", c.cfg.Path, err)
		}
		return nil, unavailable(c.cfg.Path, err)
	}
	cn = &conn{uc: uc, br: br, segs: make(map[string]*mapping, len(segs))}
	err = c.mapAll(cn, segs, fds)
	closeFDs() // mapped (or not): the descriptors are not needed any more
	if err != nil {
		c.closeConn(cn)
		return nil, err
	}
	_ = uc.SetDeadline(time.Time{})
	known := make(map[string]bool, len(segs))
	for _, s := range segs {
		known[s.ID] = true
	}
	c.mu.Lock()
	c.known, c.seenAt, c.failAt, c.lastErr = known, time.Now(), time.Time{}, nil
	c.mu.Unlock()
	return cn, nil
}

// mapAll maps the hello's segments into cn, reusing the mappings other
// connections hold.
func (c *Client) mapAll(cn *conn, segs []Segment, fds []int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range segs {
		if _, dup := cn.segs[s.ID]; dup {
			return violation(c.cfg.Path, "hello shares segment %q twice", s.ID)
		}
		m := c.maps[s.ID]
		if m == nil || uint64(len(m.data)) != s.Size {
			var st unix.Stat_t
			if err := unix.Fstat(fds[i], &st); err != nil {
				return fmt.Errorf("shm %s: segment %s: %w", c.cfg.Path, s.ID, err)
			}
			if st.Size < 0 || uint64(st.Size) < s.Size {
				return violation(c.cfg.Path, "segment %s: a descriptor of %d bytes for a %d-byte mapping", s.ID, st.Size, s.Size)
			}
			data, err := unix.Mmap(fds[i], 0, int(s.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			if err != nil {
				return fmt.Errorf("shm %s: map segment %s: %w", c.cfg.Path, s.ID, err)
			}
			if m != nil {
				// A segment of the same id and another size: a stale
				// mapping. The connections that hold it keep it.
				delete(c.maps, s.ID)
			}
			m = &mapping{id: s.ID, data: data}
			c.maps[s.ID] = m
			if !c.closed { // else Close may be past its wait
				m.refs++ // the populator's
				c.populating.Go(func() { c.populate(m) })
			}
		}
		m.refs++
		cn.segs[s.ID] = m
	}
	return nil
}

// populateChunk is how much of a mapping one populate call faults in
// between checks that the client is still open.
const populateChunk = 64 << 20

// populate faults m's pages into this process's page tables, writable,
// ahead of the first copies (MADV_POPULATE_WRITE, Linux 5.14; nothing on
// an older kernel): on the development VM a copy into pages never touched
// through this mapping took a minor fault per 4 KiB page, 93 per 1 MiB
// put against 22 with the mapping populated, and 1.5 times the CPU. It
// runs in the background (a segment of many GiB takes seconds), holds a
// reference to m, and stops at a chunk's end once the client closes.
func (c *Client) populate(m *mapping) {
	defer func() {
		c.mu.Lock()
		c.unrefLocked(m)
		c.mu.Unlock()
	}()
	for off := 0; off < len(m.data); off += populateChunk {
		c.mu.Lock()
		closed := c.closed
		c.mu.Unlock()
		if closed {
			return
		}
		if unix.Madvise(m.data[off:min(off+populateChunk, len(m.data))], unix.MADV_POPULATE_WRITE) != nil {
			return
		}
	}
}

// closeConn closes cn and unmaps the segments no other connection holds.
func (c *Client) closeConn(cn *conn) {
	_ = cn.uc.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range cn.segs {
		c.unrefLocked(m)
	}
	cn.segs = nil
}

// unrefLocked drops a reference to m and unmaps it with the last.
func (c *Client) unrefLocked(m *mapping) {
	if m.refs--; m.refs == 0 {
		if c.maps[m.id] == m {
			delete(c.maps, m.id)
		}
		_ = unix.Munmap(m.data)
		m.data = nil
	}
}

// get takes an idle connection or dials one.
func (c *Client) get(ctx context.Context) (*conn, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	if n := len(c.idle); n > 0 {
		cn := c.idle[n-1]
		c.idle = c.idle[:n-1]
		c.mu.Unlock()
		return cn, nil
	}
	c.mu.Unlock()
	return c.dial(ctx)
}

// put returns cn to the pool, or closes it.
func (c *Client) put(cn *conn, healthy bool) {
	c.mu.Lock()
	if healthy && !c.closed && len(c.idle) < c.cfg.MaxIdle {
		c.idle = append(c.idle, cn)
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	c.closeConn(cn)
}

// Read reads items[i] into dst[i] as xfer.Pool.Read does (it sets
// items[i].Length to len(dst[i]); the same results and errors), copying
// from the shared mapping. Every item's segment must be one Has reported.
// The caller verifies the bytes against the object's checksum, as for the
// bulk path.
func (c *Client) Read(ctx context.Context, items []*agentv1.TransferItem, dst [][]byte) ([]xfer.ReadResult, error) {
	out := make([]xfer.ReadResult, len(items))
	err := c.run(ctx, items, dst, func(cn *conn, items []*agentv1.TransferItem, dst [][]byte, lo int) error {
		return c.read(cn, items, dst, out[lo:])
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Write writes src[i] into items[i] as xfer.Pool.Write does, copying into
// the shared mapping.
func (c *Client) Write(ctx context.Context, items []*agentv1.TransferItem, src [][]byte) ([]error, error) {
	res, err := c.WriteSealed(ctx, items, src)
	if err != nil {
		return nil, err
	}
	out := make([]error, len(res))
	for i, r := range res {
		out[i] = r.Err
	}
	return out, nil
}

// WriteSealed is Write that also returns each item's seal receipt, as
// xfer.Pool.WriteSealed does: an item that sets SealChecksum (whole objects
// only) asks the agent to verify and seal the allocation once the client
// has released it, and its receipt then comes with the release's answer.
func (c *Client) WriteSealed(ctx context.Context, items []*agentv1.TransferItem, src [][]byte) ([]xfer.WriteResult, error) {
	out := make([]xfer.WriteResult, len(items))
	err := c.run(ctx, items, src, func(cn *conn, items []*agentv1.TransferItem, src [][]byte, lo int) error {
		return c.write(cn, items, src, out[lo:])
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// run checks the arguments and runs fn on one connection for each run of
// at most xfer.MaxItems items, with ctx's deadline on the socket and its
// cancellation unblocking it. A connection that failed is closed and the
// socket is not used again before RetryAfter.
func (c *Client) run(ctx context.Context, items []*agentv1.TransferItem, bufs [][]byte,
	fn func(cn *conn, items []*agentv1.TransferItem, bufs [][]byte, lo int) error) error {
	if len(items) != len(bufs) {
		return errInvalid("%d transfer items but %d buffers", len(items), len(bufs))
	}
	for i, it := range items {
		if it == nil {
			return errInvalid("transfer item %d is nil", i)
		}
		it.Length = uint64(len(bufs[i]))
	}
	if len(items) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	cn, err := c.get(ctx)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		return err
	}
	stop := cn.dl.Begin(ctx, cn.uc, c.cfg.StallTimeout)
	for lo := 0; lo < len(items) && err == nil; lo += xfer.MaxItems {
		hi := min(lo+xfer.MaxItems, len(items))
		err = fn(cn, items[lo:hi], bufs[lo:hi], lo)
	}
	interrupted := !stop()
	c.put(cn, err == nil && !interrupted)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if dl, ok := ctx.Deadline(); ok && errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(dl) {
			return context.DeadlineExceeded
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("shm %s: %w: %w", c.cfg.Path, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE,
				"shared-memory transfer stalled: the agent did not answer for %s", c.cfg.StallTimeout), os.ErrDeadlineExceeded)
		}
		c.forget(err)
	}
	return err
}

// request sends a request and reads its grant.
func (c *Client) request(cn *conn, op agentv1.TransferOp, items []*agentv1.TransferItem) (*agentv1.TransferResponse, error) {
	b, err := xfer.AppendFrame(cn.wbuf[:0], &agentv1.TransferRequest{Op: op, Items: items})
	if err != nil {
		return nil, err
	}
	cn.wbuf = b
	cn.dl.Step() // StallTimeout for the agent's answer
	if _, err := cn.uc.Write(b); err != nil {
		return nil, unavailable(c.cfg.Path, err)
	}
	resp := &agentv1.TransferResponse{}
	cn.offs, cn.rbuf, err = ReadGrant(cn.br, cn.rbuf, resp, len(items), cn.offs)
	switch {
	case errors.Is(err, xfer.ErrProtocol):
		return nil, violation(c.cfg.Path, "bad grant: %v", err)
	case err != nil && rpcerr.Reason(err) != "":
		return nil, fmt.Errorf("shm %s: request refused: %w", c.cfg.Path, err)
	case err != nil:
		return nil, unavailable(c.cfg.Path, err)
	}
	return resp, nil
}

// span returns the granted bytes of item i: n bytes at its offset in its
// segment's mapping.
func (c *Client) span(cn *conn, it *agentv1.TransferItem, off, n uint64) ([]byte, error) {
	m := cn.segs[it.GetSegmentId()]
	if m == nil {
		return nil, violation(c.cfg.Path, "a grant in segment %q, which the hello did not share", it.GetSegmentId())
	}
	if off > uint64(len(m.data)) || n > uint64(len(m.data))-off {
		return nil, violation(c.cfg.Path, "a grant of %d bytes at %d in a %d-byte mapping", n, off, len(m.data))
	}
	return m.data[off : off+n : off+n], nil
}

func (c *Client) read(cn *conn, items []*agentv1.TransferItem, dst [][]byte, res []xfer.ReadResult) error {
	resp, err := c.request(cn, agentv1.TransferOp_TRANSFER_OP_READ, items)
	if err != nil {
		return err
	}
	for i, r := range resp.GetResults() {
		if err := xfer.ItemError(r.GetStatus()); err != nil {
			res[i] = xfer.ReadResult{Err: err}
			continue
		}
		n, want, off, size := r.GetLength(), uint64(len(dst[i])), items[i].GetOffset(), r.GetObjectSize()
		if off > size || n > size-off {
			return violation(c.cfg.Path, "item %d: %d bytes from offset %d of a %d-byte object", i, n, off, size)
		}
		if n != want {
			if want != 0 {
				return violation(c.cfg.Path, "item %d: %d bytes granted for a %d-byte read", i, n, want)
			}
			res[i] = xfer.ReadResult{ObjectSize: size, Checksum: r.GetChecksum(),
				Err: errInvalid("item %d: the destination buffer is empty but the object has %d bytes from offset %d", i, n, off)}
			continue
		}
		src, err := c.span(cn, items[i], cn.offs[i], n)
		if err != nil {
			return err
		}
		copy(dst[i], src)
		res[i] = xfer.ReadResult{N: len(dst[i]), ObjectSize: size, Checksum: r.GetChecksum()}
	}
	// Not answered: the next request follows on the connection.
	if _, err := cn.uc.Write(Release); err != nil {
		return unavailable(c.cfg.Path, err)
	}
	c.reads.Add(uint64(len(items)))
	c.readRequests.Add(1)
	return nil
}

func (c *Client) write(cn *conn, items []*agentv1.TransferItem, src [][]byte, res []xfer.WriteResult) error {
	resp, err := c.request(cn, agentv1.TransferOp_TRANSFER_OP_WRITE, items)
	if err != nil {
		return err
	}
	for i, r := range resp.GetResults() {
		if err := xfer.ItemError(r.GetStatus()); err != nil {
			res[i].Err = err
			continue
		}
		if r.GetLength() != items[i].GetLength() {
			return violation(c.cfg.Path, "item %d: %d bytes granted of %d", i, r.GetLength(), items[i].GetLength())
		}
		dst, err := c.span(cn, items[i], cn.offs[i], uint64(len(src[i])))
		if err != nil {
			return err
		}
		copy(dst, src[i])
	}
	if _, err := cn.uc.Write(Release); err != nil {
		return unavailable(c.cfg.Path, err)
	}
	done := &agentv1.TransferResponse{}
	cn.dl.Step() // StallTimeout for the agent's answer
	cn.rbuf, err = ReadDone(cn.br, cn.rbuf, done, len(items))
	switch {
	case errors.Is(err, xfer.ErrProtocol):
		return violation(c.cfg.Path, "bad release answer: %v", err)
	case err != nil && rpcerr.Reason(err) != "":
		return fmt.Errorf("shm %s: write refused: %w", c.cfg.Path, err)
	case err != nil:
		return unavailable(c.cfg.Path, err)
	}
	// The seals of the items that asked (seal_checksum), in item order.
	for i, r := range done.GetResults() {
		if res[i].Err != nil {
			continue
		}
		if err := xfer.ItemError(r.GetStatus()); err != nil {
			res[i].Err = err
			continue
		}
		if len(r.GetSealReceipt()) > 0 && items[i].SealChecksum == nil {
			return violation(c.cfg.Path, "item %d: a seal receipt for an item that asked for no seal", i)
		}
		res[i].Receipt = r.GetSealReceipt()
	}
	c.writes.Add(uint64(len(items)))
	return nil
}

// parseRights returns the descriptors of SCM_RIGHTS messages in oob.
func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("%w: control message: %v", xfer.ErrProtocol, err)
	}
	var fds []int
	var perr error
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			perr = fmt.Errorf("%w: rights: %v", xfer.ErrProtocol, err)
			continue
		}
		fds = append(fds, got...)
	}
	return fds, perr
}

func errInvalid(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...)
}

func unavailable(path string, err error) error {
	return fmt.Errorf("shm %s: %w: %w", path, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent shared-memory socket: %v", err), err)
}

func violation(path, format string, args ...any) error {
	return fmt.Errorf("shm %s: %w: %w", path,
		rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "agent broke the shared-memory protocol: "+format, args...), xfer.ErrProtocol)
}
