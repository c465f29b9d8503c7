package dataplane

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/conntrack"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/internal/xfer/shm"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Defaults for ShmConfig.
const (
	DefaultShmMaxConns        = 256
	DefaultShmMaxConnsPerPeer = 64
)

// ShmConfig tunes the shared-memory listener (ServeShm).
type ShmConfig struct {
	// AllowUIDs are the uids besides the agent's own whose processes may
	// connect (SO_PEERCRED); any other peer is answered PERMISSION_DENIED.
	AllowUIDs []uint32
	// MaxConns bounds the open connections (default 256), MaxConnsPerPeer
	// those of one process (default 64).
	MaxConns, MaxConnsPerPeer int
	// IdleTimeout, IOTimeout, DrainTimeout and MaxItemsInFlight are the
	// bulk transfer listener's (TransferConfig) when zero. IOTimeout also
	// bounds how long a grant waits for its release.
	IdleTimeout, IOTimeout, DrainTimeout time.Duration
	MaxItemsInFlight                     int

	// ownUID replaces the agent's uid in the peer check (tests).
	ownUID *uint32
}

// shmServer is one ServeShm.
type shmServer struct {
	s    *Server
	cfg  ShmConfig
	segs []shm.Segment // the shared segments, in hello order
	wg   sync.WaitGroup

	// conns admits connections under MaxConns and MaxConnsPerPeer (keyed
	// by the peer's pid), knows which are idle between requests and is
	// closing once shutdown began; its lock is never held with mu.
	conns *conntrack.Tracker[int32]

	// items counts the items of the requests being served; a request
	// over MaxItemsInFlight is refused, not queued (acquire).
	items atomic.Int64
}

// shmConn is one client connection.
type shmConn struct {
	uc   *net.UnixConn
	pid  int32
	tc   *conntrack.Conn[int32] // its entry in shmServer.conns
	br   *bufio.Reader
	hbuf []byte
	wbuf []byte
	hs   handles
	offs []uint64
}

// ServeShm serves the shared-memory data path (internal/xfer/shm) on lis
// until ctx ends: it checks each peer's credentials, hands it the memfds
// of the shared memory segments (made by segment.NewSharedMemory; the
// others are not shared, their items fail SEGMENT_NOT_FOUND), then grants
// reads and writes under the same token, lease and bounds checks as the
// bulk transfer listener. Shutdown is ServeTransfer's: lis closed, idle
// connections closed, requests in progress given DrainTimeout.
func (s *Server) ServeShm(ctx context.Context, lis *net.UnixListener, cfg ShmConfig) error {
	t := &shmServer{s: s, cfg: cfg.withDefaults(s.cfg.Transfer)}
	t.conns = conntrack.New[int32](t.cfg.MaxConns, t.cfg.MaxConnsPerPeer)
	for _, seg := range s.segs.All() {
		if fd, size, ok, _ := seg.DupSharedFD(); ok {
			// Only the size is wanted here; each connection gets a
			// descriptor of its own (hello).
			_ = unix.Close(fd)
			t.segs = append(t.segs, shm.Segment{ID: seg.ID(), Size: size})
		}
	}
	if len(t.segs) > shm.MaxSegments {
		_ = lis.Close()
		return fmt.Errorf("shm listener: %d memory segments to share, at most %d", len(t.segs), shm.MaxSegments)
	}
	stop := context.AfterFunc(ctx, func() { _ = lis.Close() })
	defer stop()
	var err error
	for {
		nc, aerr := retry.Accept(ctx, lis, s.lg, "shm")
		if aerr != nil {
			if ctx.Err() == nil {
				err = aerr
			}
			break
		}
		uc := nc.(*net.UnixConn) // a UnixListener's
		t.wg.Go(func() { t.serve(uc) })
	}
	_ = lis.Close()
	t.shutdown()
	return err
}

func (c ShmConfig) withDefaults(tc TransferConfig) ShmConfig {
	if c.MaxConns <= 0 {
		c.MaxConns = DefaultShmMaxConns
	}
	if c.MaxConnsPerPeer <= 0 {
		c.MaxConnsPerPeer = DefaultShmMaxConnsPerPeer
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = tc.IdleTimeout
	}
	if c.IOTimeout <= 0 {
		c.IOTimeout = tc.IOTimeout
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = tc.DrainTimeout
	}
	if c.MaxItemsInFlight <= 0 {
		c.MaxItemsInFlight = tc.MaxItemsInFlight
	}
	c.MaxItemsInFlight = max(c.MaxItemsInFlight, xfer.MaxItems)
	return c
}

// peer returns the credentials of uc's process.
func peer(uc *net.UnixConn) (*unix.Ucred, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return nil, err
	}
	return cred, cerr
}

// admit checks the peer and the connection limits; the error answers a
// refused peer.
func (t *shmServer) admit(uc *net.UnixConn) (*shmConn, error) {
	cred, err := peer(uc)
	if err != nil {
		return nil, status.Errorf(codes.PermissionDenied, "shm: peer credentials: %v", err)
	}
	own := uint32(os.Getuid())
	if t.cfg.ownUID != nil {
		own = *t.cfg.ownUID
	}
	if cred.Uid != own && !slices.Contains(t.cfg.AllowUIDs, cred.Uid) {
		t.s.xferRefused.WithLabelValues("shm_peer").Inc()
		return nil, status.Errorf(codes.PermissionDenied,
			"shm: uid %d may not map this agent's segments (the agent's uid %d and --shm-allow-uids may)", cred.Uid, own)
	}
	tc, err := t.conns.Add(uc, cred.Pid)
	switch {
	case errors.Is(err, conntrack.ErrClosing):
		return nil, nil
	case errors.Is(err, conntrack.ErrMaxConns):
		t.s.xferRefused.WithLabelValues("shm_max_connections").Inc()
		return nil, errConnLimit("the agent holds its maximum of %d shared-memory connections", t.cfg.MaxConns)
	case errors.Is(err, conntrack.ErrMaxConnsPerKey):
		t.s.xferRefused.WithLabelValues("shm_max_connections_per_peer").Inc()
		return nil, errConnLimit("process %d holds the maximum of %d shared-memory connections", cred.Pid, t.cfg.MaxConnsPerPeer)
	case err != nil:
		return nil, err
	}
	return &shmConn{uc: uc, pid: cred.Pid, tc: tc}, nil
}

func (t *shmServer) remove(c *shmConn) {
	c.hs.close()
	t.conns.Remove(c.tc)
}

// shutdown closes the idle connections at once, gives busy ones
// DrainTimeout to finish their request, then cuts them.
func (t *shmServer) shutdown() {
	t.conns.Shutdown()
	drain(&t.wg, t.cfg.DrainTimeout, func() { t.conns.CloseAll() })
}

// refuse answers a refused connection or request with err (best effort,
// within a second) and lets the caller close it.
func (t *shmServer) refuse(uc *net.UnixConn, method string, err error) {
	t.s.errs.WithLabelValues(method, rpcerr.Reason(err)).Inc()
	b, merr := shm.AppendRefusal(nil, err)
	if merr != nil {
		return
	}
	_ = uc.SetWriteDeadline(time.Now().Add(min(lingerTime, t.cfg.IOTimeout)))
	_, _ = uc.Write(b)
}

// serve runs one connection: peer check, preamble, hello, then requests.
func (t *shmServer) serve(uc *net.UnixConn) {
	c, err := t.admit(uc)
	if c == nil {
		if err != nil {
			t.refuse(uc, "shm", err)
			// Let the peer's preamble in, so that it reads the refusal
			// rather than meeting a reset.
			_ = uc.CloseWrite()
			_ = uc.SetReadDeadline(time.Now().Add(min(lingerTime, t.cfg.IOTimeout)))
			_, _ = io.CopyN(io.Discard, uc, 64<<10)
		}
		_ = uc.Close()
		return
	}
	defer t.remove(c)
	_ = uc.SetDeadline(time.Now().Add(t.cfg.IOTimeout))
	var pre [len(shm.Preamble)]byte
	if _, err := io.ReadFull(uc, pre[:]); err != nil {
		return
	}
	if string(pre[:]) != shm.Preamble {
		t.refuse(uc, "shm", errInvalid("not a shared-memory connection: preamble %q, want %q", pre[:], shm.Preamble))
		return
	}
	if err := t.hello(c); err != nil {
		t.s.lg.Debug("shm hello failed", "pid", c.pid, "err", err)
		return
	}
	c.br = bufio.NewReaderSize(uc, 4096)
	for {
		if !c.tc.MarkIdle() {
			return
		}
		_ = uc.SetReadDeadline(time.Now().Add(t.cfg.IdleTimeout))
		if _, err := c.br.Peek(1); err != nil {
			return
		}
		c.tc.MarkBusy()
		_ = uc.SetDeadline(time.Now().Add(t.cfg.IOTimeout))
		if err := t.request(c); err != nil {
			t.s.lg.Debug("shm connection ended", "pid", c.pid, "err", err)
			return
		}
	}
}

// hello sends the shared segments and their memfds in one sendmsg.
func (t *shmServer) hello(c *shmConn) error {
	b, err := shm.AppendHello(nil, t.segs)
	if err != nil {
		return err
	}
	fds := make([]int, 0, len(t.segs))
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	for _, sg := range t.segs {
		seg, ok := t.s.segs.Get(sg.ID)
		var fd int
		if ok {
			fd, _, ok, err = seg.DupSharedFD()
		}
		if err != nil || !ok {
			err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "segment %s is closed", sg.ID)
			t.refuse(c.uc, "shm", err)
			return err
		}
		fds = append(fds, fd)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.uc.WriteMsgUnix(b, oob, nil)
	if err == nil && n < len(b) {
		_, err = c.uc.Write(b[n:])
	}
	return err
}

// request serves one request: decode, open and check every item, send the
// grant, wait for the release, close the allocations (and answer a WRITE's
// release). An error ends the connection.
func (t *shmServer) request(c *shmConn) error {
	hdr, n, hbuf, err := xfer.ReadHeader(c.br, c.hbuf, xfer.MaxHeaderBytes)
	c.hbuf = hbuf
	if err != nil {
		if errors.Is(err, xfer.ErrProtocol) {
			t.refuse(c.uc, "shm", err)
		}
		return err
	}
	if len(hdr) == 0 {
		err := errInvalid("a release without a grant")
		t.refuse(c.uc, "shm", err)
		return err
	}
	if !t.acquire(n) {
		err := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
			"the agent serves its maximum of %d shared-memory items at once; retry later (or use the bulk path)", t.cfg.MaxItemsInFlight)
		t.refuse(c.uc, "shm", err)
		return err
	}
	defer t.release(n)
	req := &agentv1.TransferRequest{}
	if err = xfer.DecodeHeader(hdr, req); err == nil {
		err = xfer.CheckRequest(req)
	}
	if err == nil && req.GetOp() == agentv1.TransferOp_TRANSFER_OP_VERIFY {
		err = fmt.Errorf("%w: %w", errInvalid("VERIFY is served by the bulk transfer listener, not the shared-memory socket"), xfer.ErrProtocol)
	}
	if err != nil {
		t.refuse(c.uc, "shm", err)
		return err
	}
	if cap(c.hbuf) > maxKeptHeader {
		c.hbuf = nil
	}
	write := req.GetOp() == agentv1.TransferOp_TRANSFER_OP_WRITE
	method := "shm_read"
	if write {
		method = "shm_write"
	}
	items := req.GetItems()
	c.hs = reuse(&c.hs, len(items))
	defer c.hs.close()
	c.offs = reuse(&c.offs, len(items))
	resp := &agentv1.TransferResponse{Results: make([]*agentv1.TransferResult, len(items))}
	rs := make([]agentv1.TransferResult, len(items))
	var total uint64
	for i, it := range items {
		r := &rs[i]
		resp.Results[i] = r
		h, length, off, err := t.open(it, write)
		if err == nil && write && it.SealChecksum != nil {
			if err = checkSealOnWrite(h, it); err != nil {
				h.Close()
			}
		}
		if err != nil {
			t.s.errs.WithLabelValues(method, rpcerr.Reason(err)).Inc()
			r.Status = xfer.ItemResult(err)
			continue
		}
		c.hs[i], c.offs[i] = h, off
		r.Length = length
		total += length
		if !write {
			r.ObjectSize, r.Checksum = h.Size(), h.Checksum()
		}
	}
	if granted := countOpen(c.hs); granted > 0 {
		op := "read"
		if write {
			op = "write"
		}
		t.s.shmItems.WithLabelValues(op).Add(float64(granted))
	}
	b, err := shm.AppendGrant(c.wbuf[:0], resp, c.offs)
	if err != nil {
		return err
	}
	if cap(b) <= maxKeptHeader {
		c.wbuf = b
	}
	if _, err := c.uc.Write(b); err != nil {
		return err
	}
	// The client copies now; the allocations stay open until its release.
	_ = c.uc.SetReadDeadline(time.Now().Add(t.cfg.IOTimeout))
	hdr, _, c.hbuf, err = xfer.ReadHeader(c.br, c.hbuf, xfer.MaxHeaderBytes)
	if err == nil && len(hdr) != 0 {
		err = errInvalid("a request before the release of the previous grant")
		t.refuse(c.uc, "shm", err)
	}
	if err != nil {
		return fmt.Errorf("waiting for the release of a grant: %w", err)
	}
	if write {
		return t.done(c, items, total)
	}
	c.hs.close()
	t.s.bytesOut.Add(float64(total))
	return nil
}

// countOpen is how many of hs are open.
func countOpen(hs handles) int {
	n := 0
	for _, h := range hs {
		if h != nil {
			n++
		}
	}
	return n
}

// done closes a WRITE's allocations after the client's release, seals
// those whose items asked for it (seal_checksum: the bytes in the mapping
// hashed and compared, as the bulk path's seal on write) and answers the
// release: an empty TransferResponse when no item asked, else one result
// per item with its seal receipt or the seal's error (an item the grant
// refused, or that asked nothing, has an empty result).
func (t *shmServer) done(c *shmConn, items []*agentv1.TransferItem, total uint64) error {
	var seals []sealWrite
	for i, it := range items {
		if h := c.hs[i]; h != nil && it.SealChecksum != nil {
			seals = append(seals, sealWrite{i: i, seg: h.Segment(), id: h.ID(), size: h.Size(), epoch: h.Epoch(),
				checksum: it.GetSealChecksum(), early: segment.ErrSealLater})
		}
	}
	c.hs.close()
	t.s.bytesIn.Add(float64(total))
	_ = c.uc.SetWriteDeadline(time.Now().Add(t.cfg.IOTimeout))
	if len(seals) == 0 {
		_, err := c.uc.Write(shm.Release) // an empty TransferResponse: done
		return err
	}
	rs := make([]agentv1.TransferResult, len(items))
	resp := &agentv1.TransferResponse{Results: make([]*agentv1.TransferResult, len(items))}
	for i := range rs {
		resp.Results[i] = &rs[i]
	}
	now := t.s.now()
	for _, sw := range seals {
		receipt, err := t.s.sealOnWrite(sw, items[sw.i].GetSegmentId(), now)
		if err != nil {
			t.s.errs.WithLabelValues("shm_write", rpcerr.Reason(err)).Inc()
			rs[sw.i].Status = xfer.ItemResult(err)
			continue
		}
		rs[sw.i].SealReceipt = receipt
	}
	b, err := xfer.AppendFrame(c.wbuf[:0], resp)
	if err != nil {
		return err
	}
	if cap(b) <= maxKeptHeader {
		c.wbuf = b
	}
	_, err = c.uc.Write(b)
	return err
}

// open opens one item for the grant and returns its handle, length and
// offset in the segment's mapping, under the checks of the bulk path
// (openRange for reads; openWriteTo and CheckBounds for writes). Items of
// segments not shared fail SEGMENT_NOT_FOUND before their token is looked
// at, so the token check is never skipped for a granted item.
func (t *shmServer) open(it *agentv1.TransferItem, write bool) (*segment.Handle, uint64, uint64, error) {
	if !slices.ContainsFunc(t.segs, func(s shm.Segment) bool { return s.ID == it.GetSegmentId() }) {
		return nil, 0, 0, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND,
			"segment %q is not shared on this agent's shared-memory socket (not a memory segment, or not here): use the bulk path", it.GetSegmentId())
	}
	var h *segment.Handle
	length := it.GetLength()
	var err error
	if write {
		if it.GetKey() != "" {
			return nil, 0, 0, errInvalid("item of allocation %d names a key: key is only for a spare's write, over the bulk transfer listener", it.GetAllocationId())
		}
		h = new(segment.Handle)
		if err = t.s.openWriteTo(h, it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), t.s.now(), ""); err != nil {
			return nil, 0, 0, err
		}
	} else if h, length, err = t.s.openRange(it, ""); err != nil {
		return nil, 0, 0, err
	}
	off, err := h.MapOffset(it.GetOffset(), length)
	if err != nil {
		h.Close()
		return nil, 0, 0, err
	}
	return h, length, off, nil
}

// acquire takes n items of MaxItemsInFlight for a request; false when
// they are not free. No lock: requests on every connection call it.
func (t *shmServer) acquire(n int) bool {
	for {
		cur := t.items.Load()
		if cur+int64(n) > int64(t.cfg.MaxItemsInFlight) {
			return false
		}
		if t.items.CompareAndSwap(cur, cur+int64(n)) {
			return true
		}
	}
}

// release gives back n items acquire took.
func (t *shmServer) release(n int) { t.items.Add(-int64(n)) }
