package dataplane

import (
	"errors"
	"fmt"
	"io"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"golang.org/x/sys/unix"
)

// handles are the open allocations of one request, by item (nil where the
// item failed or is done).
type handles []*segment.Handle

// close closes every open handle; closing twice is harmless.
func (hs handles) close() {
	for i, h := range hs {
		if h != nil {
			h.Close()
			hs[i] = nil
		}
	}
}

// write serves a WRITE request: every item is opened and checked first, then
// the payload is received in order, straight into a memory segment's
// mapping (runs of such items with vectored reads) or through a pooled
// buffer into a disk segment, a failed item's bytes read and dropped. Every
// handle is closed before the answer, so a Seal that follows the client's
// return never finds the write open.
func (t *transferServer) write(c *transferConn, items []*agentv1.TransferItem) error {
	s := t.s
	hs := reuse(&c.hs, len(items))
	slab := reuse(&c.handles, len(items)) // hs[i] is &slab[i] or nil
	errs := reuse(&c.errs, len(items))
	defer func() {
		hs.close()
		// Kept for the next request: drop what they point to (closed
		// handles, errors) now, in this order.
		clear(slab)
		clear(errs)
	}()
	now, tenant := s.now(), c.callerTenant()
	for i, it := range items {
		h := &slab[i]
		err := s.openItemWrite(h, it, now, tenant)
		if err == nil {
			if err = h.CheckBounds(it.GetOffset(), it.GetLength()); err == nil && it.SealChecksum != nil {
				err = checkSealOnWrite(h, it)
			}
			if err != nil {
				h.Close()
			}
		}
		if err != nil {
			if it.GetLength() > xfer.MaxDrainBytes {
				err = fmt.Errorf("item %d failed and its %d payload bytes exceed the %d-byte drain limit: %w", i, it.GetLength(), xfer.MaxDrainBytes, err)
				t.refuse(c, "transfer_write", err)
				return err
			}
			errs[i] = err
			continue
		}
		hs[i] = h
	}
	run := c.run[:0]
	var sums []hashed
	for i, it := range items {
		n := it.GetLength()
		if hs[i] != nil {
			// Checked by CheckBounds: only a disk segment has no dst.
			if dst, err := hs[i].WritableBytes(it.GetOffset(), n); err == nil && dst != nil {
				if it.SealChecksum != nil {
					// To be sealed on write: hashed as it arrives.
					if err := t.readInto(c, run); err != nil {
						return err
					}
					run = run[:0]
					if sums == nil {
						sums = reuse(&c.sums, len(items))
					}
					sum, err := t.readHashed(c, dst)
					if err != nil {
						return err
					}
					sums[i] = hashed{ok: true, sum: sum}
					continue
				}
				if n > 0 {
					run = append(run, dst)
				}
				continue
			}
		}
		if err := t.readInto(c, run); err != nil {
			return err
		}
		run = run[:0]
		if hs[i] == nil {
			if err := t.discard(c, n); err != nil {
				return err
			}
			continue
		}
		ierr, err := t.receive(c, hs[i], it.GetOffset(), n)
		if err != nil {
			return err
		}
		errs[i] = ierr
	}
	err := t.readInto(c, run)
	clear(run[:cap(run)]) // drop the references to the mappings
	c.run = run[:0]
	if err != nil {
		return err
	}
	seals := c.sealsToDo(items, hs, errs, sums)
	now = s.now()
	for k := range seals {
		// Hashed while received: sealed before the handle closes, when
		// no other write of the allocation overlapped this one.
		if sw := &seals[k]; sw.hashed {
			sw.early = hs[sw.i].SealReceived(sw.checksum, sw.sum, now)
		}
	}
	hs.close()
	resp := &agentv1.TransferResponse{Results: reuse(&c.rptrs, len(items))}
	rs := reuse(&c.results, len(items))
	for _, sw := range seals {
		rs[sw.i].SealReceipt, errs[sw.i] = s.sealOnWrite(sw, items[sw.i].GetSegmentId(), now)
	}
	clear(seals)
	var in uint64
	for i, err := range errs {
		r := &rs[i]
		if err != nil {
			s.errs.WithLabelValues("transfer_write", rpcerr.Reason(err)).Inc()
			c.itemFailed(err)
			r.Status = xfer.ItemResult(err)
		} else {
			r.Length = items[i].GetLength()
			in += r.Length
		}
		resp.Results[i] = r
	}
	s.bytesIn.Add(float64(in))
	c.traced.bytes = in
	hdr, err := t.header(c, resp)
	if err != nil {
		return err
	}
	_ = c.nc.SetWriteDeadline(t.deadline(t.cfg.IOTimeout))
	_, err = c.nc.Write(hdr)
	return err
}

// receive reads the n payload bytes of h's item at off. A disk write
// failure is the item's error (the rest of its bytes are still read, to
// keep the stream framed); a read failure is the connection's.
func (t *transferServer) receive(c *transferConn, h *segment.Handle, off, n uint64) (itemErr, connErr error) {
	dst, err := h.WritableBytes(off, n)
	if err != nil {
		return err, t.discard(c, n)
	}
	if dst != nil {
		return nil, t.readFull(c, dst)
	}
	bp := diskBufs.Get().(*[]byte)
	defer diskBufs.Put(bp)
	buf := *bp
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := t.readFull(c, buf[:k]); err != nil {
			return nil, err
		}
		if itemErr == nil {
			if err := h.WriteAt(buf[:k], off); err != nil {
				itemErr = rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "write allocation %d", h.ID())
			}
		}
		off += k
		n -= k
	}
	return itemErr, nil
}

// readFull fills p from the connection, renewing the read deadline every
// ioStep bytes of the request.
func (t *transferServer) readFull(c *transferConn, p []byte) error {
	for len(p) > 0 {
		t.renewRead(c)
		k := min(len(p), c.rdLeft)
		if _, err := io.ReadFull(c.br, p[:k]); err != nil {
			return err
		}
		p = p[k:]
		c.rdLeft -= k
	}
	return nil
}

// renewRead renews the read deadline once the request has read ioStep
// bytes under the current one. Renewing it for every item instead cost 3 %
// of the agent's CPU on batches of 4 KiB objects (a timer update each).
func (t *transferServer) renewRead(c *transferConn) {
	if c.rdLeft <= 0 {
		_ = c.nc.SetReadDeadline(t.deadline(t.cfg.IOTimeout))
		c.rdLeft = ioStep
	}
}

// readInto fills bufs (non-empty slices) in order from the connection: from
// what the reader holds, then with vectored reads from the socket straight
// into bufs, as many of them per readv as the socket has bytes for. A
// batch of 4 KiB objects used to be read 64 KiB at a time into the reader
// and copied out (the copy alone was 5 % of the agent's CPU). bufs' slices
// are consumed.
func (t *transferServer) readInto(c *transferConn, bufs [][]byte) error {
	for len(bufs) > 0 && c.br.Buffered() > 0 {
		t.renewRead(c)
		b := bufs[0][:min(len(bufs[0]), c.rdLeft)]
		n, _ := c.br.Read(b) // buffered: no read from the socket
		c.rdLeft -= n
		if bufs[0] = bufs[0][n:]; len(bufs[0]) == 0 {
			bufs = bufs[1:]
		}
	}
	if c.rc == nil {
		for _, b := range bufs {
			if err := t.readFull(c, b); err != nil {
				return err
			}
		}
		return nil
	}
	for len(bufs) > 0 {
		t.renewRead(c)
		vec, want := c.vec[:0], 0
		for _, b := range bufs {
			if len(vec) == maxReadv || want == c.rdLeft {
				break
			}
			b = b[:min(len(b), c.rdLeft-want)]
			vec = append(vec, b)
			want += len(b)
		}
		n, err := c.readv(vec)
		clear(vec)
		c.vec = vec[:0]
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		c.rdLeft -= n
		for n > 0 {
			k := min(n, len(bufs[0]))
			n -= k
			if bufs[0] = bufs[0][k:]; len(bufs[0]) == 0 {
				bufs = bufs[1:]
			}
		}
	}
	return nil
}

// readv reads into vec from the socket, waiting for it to be readable
// (the read deadline applies).
func (c *transferConn) readv(vec [][]byte) (int, error) {
	c.vec = vec
	c.rvN, c.rvErr = 0, nil
	if err := c.rc.Read(c.rvFn); err != nil {
		return 0, err
	}
	return c.rvN, c.rvErr
}

// readvOnce is rc.Read's callback: one readv of c.vec; false (wait) when
// the socket has nothing yet.
func (c *transferConn) readvOnce(fd uintptr) bool {
	for {
		n, err := unix.Readv(int(fd), c.vec)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EAGAIN):
			return false
		}
		c.rvN, c.rvErr = max(n, 0), err
		return true
	}
}

// hashChunk is how much of an item sealed on write readHashed receives
// before it hashes it: small enough that the hashing of one chunk overlaps
// the arrival of the next (the socket buffer keeps filling meanwhile),
// large enough that a chunk is a few readvs.
const hashChunk = 256 << 10

// readHashed fills dst from the connection like readInto and returns the
// object checksum of its bytes, computed chunk by chunk as they arrive
// instead of in a second pass over the allocation when it is sealed.
func (t *transferServer) readHashed(c *transferConn, dst []byte) (uint64, error) {
	d := c.digest
	if d == nil {
		d = checksum.New()
		c.digest = d
	}
	d.Reset()
	for len(dst) > 0 {
		k := min(len(dst), hashChunk)
		c.one[0] = dst[:k]
		err := t.readInto(c, c.one[:])
		c.one[0] = nil
		if err != nil {
			return 0, err
		}
		_, _ = d.Write(dst[:k])
		dst = dst[k:]
	}
	return d.Sum64(), nil
}

// discard reads and drops n payload bytes (n <= MaxDrainBytes).
func (t *transferServer) discard(c *transferConn, n uint64) error {
	if n == 0 {
		return nil
	}
	bp := diskBufs.Get().(*[]byte)
	defer diskBufs.Put(bp)
	buf := *bp
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := t.readFull(c, buf[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// checkSealOnWrite refuses seal_checksum on an item that does not write
// the whole object: only then are the bytes the receipt vouches for all
// this item's.
func checkSealOnWrite(h *segment.Handle, it *agentv1.TransferItem) error {
	if it.GetOffset() != 0 || it.GetLength() != h.Size() {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"seal_checksum needs an item that writes the whole object: this one writes [%d, %d) of allocation %d's %d bytes",
			it.GetOffset(), it.GetOffset()+it.GetLength(), h.ID(), h.Size())
	}
	return nil
}

// errChecksumMismatch matches (errors.Is) any CHECKSUM_MISMATCH error.
var errChecksumMismatch = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "checksum mismatch")

// hashed is the checksum of an item's bytes computed as they arrived.
type hashed struct {
	ok  bool
	sum uint64
}

// sealWrite is one allocation a WRITE seals once its bytes are in.
type sealWrite struct {
	i        int // the item
	seg      *segment.Segment
	id       uint64
	size     uint64
	epoch    uint64
	checksum uint64
	// tenant and key: a spare's object, which its receipt binds (version
	// 2); empty for any other write (version 1).
	tenant, key string
	// hashed: sum is the checksum of the bytes as received; early is
	// what SealReceived made of it (segment.ErrSealLater: seal as usual).
	hashed bool
	sum    uint64
	early  error
}

// sealsToDo lists the items written whole and OK that asked to be sealed
// (seal_checksum), while their handles are open; nil (no allocation) when
// none did.
func (c *transferConn) sealsToDo(items []*agentv1.TransferItem, hs handles, errs []error, sums []hashed) []sealWrite {
	var out []sealWrite
	for i, it := range items {
		if it.SealChecksum == nil || hs[i] == nil || errs[i] != nil {
			continue
		}
		h := hs[i]
		if out == nil {
			out = c.seals[:0]
		}
		sw := sealWrite{i: i, seg: h.Segment(), id: h.ID(), size: h.Size(), epoch: h.Epoch(), checksum: it.GetSealChecksum(), early: segment.ErrSealLater}
		if it.GetKey() != "" {
			// Only a spare's item that opened names a key (openItemWrite):
			// its receipt binds the object the allocation now holds.
			sw.tenant, sw.key = h.Object()
		}
		if sums != nil && sums[i].ok {
			sw.hashed, sw.sum = true, sums[i].sum
		}
		out = append(out, sw)
	}
	if out != nil && cap(out) <= maxKeptItems {
		c.seals = out[:0]
	}
	return out
}

// sealOnWrite seals an allocation whose write completed (its handle
// closed) the way the master's Seal does (segment.Seal: the bytes hashed
// and compared with the checksum, a disk segment made durable, the change
// fed to standbys) and returns the seal receipt the client hands the
// master in PutEnd. A checksum mismatch is the item's error (the bytes are
// not what the client meant; it revokes the put). Any other failure to seal
// now (another write of the allocation in progress, a disk sync error, no
// key yet) leaves the allocation RESERVED and answers no receipt: the
// master's Seal at PutEnd decides, as it did before receipts. A spare's
// receipt (sw.key set) is version 2, bound to its tenant and key.
func (s *Server) sealOnWrite(sw sealWrite, segID string, now time.Time) ([]byte, error) {
	rk := s.keys.receipts()
	err := sw.early
	if errors.Is(err, segment.ErrSealLater) {
		if rk == nil {
			return nil, nil // no key to vouch with yet: the master's Seal seals it
		}
		err = sw.seg.Seal([]segment.SealArg{{ID: sw.id, Checksum: sw.checksum}}, now)[0]
	}
	switch {
	case errors.Is(err, errChecksumMismatch):
		return nil, err
	case err != nil:
		s.errs.WithLabelValues("transfer_seal", rpcerr.Reason(err)).Inc()
		return nil, nil
	case rk == nil:
		// Sealed on receipt but no key to vouch with: the master's Seal of
		// the sealed allocation answers OK.
		return nil, nil
	}
	s.sealsOnWrite.Inc()
	return rk.Sign(token.Receipt{SegmentID: segID, AllocationID: sw.id, Size: sw.size, Checksum: sw.checksum, Epoch: sw.epoch,
		Tenant: sw.tenant, Key: sw.key}), nil
}
