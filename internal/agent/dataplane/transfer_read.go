package dataplane

import (
	"net"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// read serves a READ request: every item is opened (pinning its extent)
// and checked, the answer's header lists the results, and the payloads
// follow, sent straight from a memory segment's mapping or through a pooled
// buffer from a disk segment. Handles close once the bytes are on the
// socket. A disk error in the middle of a payload cannot be reported any
// more (its length was promised): it ends the connection.
func (t *transferServer) read(c *transferConn, items []*agentv1.TransferItem) error {
	s := t.s
	hs := make(handles, len(items))
	defer hs.close()
	resp := &agentv1.TransferResponse{Results: make([]*agentv1.TransferResult, len(items))}
	rs := make([]agentv1.TransferResult, len(items))
	for i, it := range items {
		r := &rs[i]
		resp.Results[i] = r
		h, length, err := s.openRange(it, c.callerTenant())
		if err != nil {
			s.errs.WithLabelValues("transfer_read", rpcerr.Reason(err)).Inc()
			c.itemFailed(err)
			r.Status = xfer.ItemResult(err)
			continue
		}
		hs[i] = h
		r.Length, r.ObjectSize, r.Checksum = length, h.Size(), h.Checksum()
	}
	hdr, err := t.header(c, resp)
	if err != nil {
		return err
	}
	// On TLS, the answer's records go out in few writes.
	xfer.Gather(c.nc)
	out, err := t.sendRead(c, items, hs, rs, hdr)
	if ferr := xfer.Flush(c.nc); err == nil {
		err = ferr
	}
	if err != nil {
		return err
	}
	s.bytesOut.Add(float64(out))
	c.traced.bytes = out
	return nil
}

// sendRead sends a READ's answer: its header, then the payloads; out is
// how many payload bytes.
func (t *transferServer) sendRead(c *transferConn, items []*agentv1.TransferItem, hs handles, rs []agentv1.TransferResult, hdr []byte) (out uint64, err error) {
	iov := append(c.iov[:0], hdr)
	defer func() {
		c.iov = iov[:0]
		clear(iov[:cap(iov)]) // drop the references to the mappings
	}()
	for i, h := range hs {
		if h == nil || rs[i].Length == 0 {
			continue
		}
		off, n := items[i].GetOffset(), rs[i].Length
		data, err := h.Bytes(off, n)
		if err != nil {
			return out, err // checked by openRange: cannot happen
		}
		if data != nil {
			iov = append(iov, data)
			out += n
			continue
		}
		if err := t.writev(c, iov); err != nil {
			return out, err
		}
		iov = iov[:0]
		if err := t.sendDisk(c, h, off, n); err != nil {
			return out, err
		}
		out += n
	}
	return out, t.writev(c, iov)
}

// openRange opens a READ item and resolves its range: length 0 reads to
// the end of the object.
func (s *Server) openRange(it *agentv1.TransferItem, callerTenant string) (*segment.Handle, uint64, error) {
	h, err := s.open(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), token.Read, callerTenant)
	if err != nil {
		return nil, 0, err
	}
	size, off, length := h.Size(), it.GetOffset(), it.GetLength()
	switch {
	case off > size:
		err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "offset %d is past the end of the %d-byte object", off, size)
	case length == 0:
		length = size - off
	case length > size-off:
		err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "%d bytes from offset %d lie outside the %d-byte object", length, off, size)
	}
	if err != nil {
		h.Close()
		return nil, 0, err
	}
	return h, length, nil
}

// header frames an answer. Should the error messages of thousands of
// failed items push it past MaxHeaderBytes, they are dropped (codes and
// reasons stay).
func (t *transferServer) header(c *transferConn, resp *agentv1.TransferResponse) ([]byte, error) {
	b, err := xfer.AppendFrame(c.wbuf[:0], resp)
	if err != nil {
		for _, r := range resp.GetResults() {
			if r.GetStatus() != nil {
				r.Status.Message = ""
			}
		}
		if b, err = xfer.AppendFrame(c.wbuf[:0], resp); err != nil {
			return nil, err
		}
	}
	if cap(b) <= maxKeptHeader {
		c.wbuf = b
	}
	return b, nil
}

// writev sends bufs with vectored writes, renewing the write deadline every
// ioStep bytes (slices of a large mapping are split, not copied).
func (t *transferServer) writev(c *transferConn, bufs net.Buffers) error {
	var group net.Buffers
	size := 0
	flush := func() error {
		if len(group) == 0 {
			return nil
		}
		_ = c.nc.SetWriteDeadline(t.deadline(t.cfg.IOTimeout))
		_, err := group.WriteTo(c.nc)
		group, size = group[:0], 0
		return err
	}
	for _, b := range bufs {
		for len(b) > 0 {
			k := min(len(b), ioStep-size)
			group = append(group, b[:k])
			b = b[k:]
			if size += k; size == ioStep {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	return flush()
}

// sendDisk streams n bytes of a disk allocation from off in pooled chunks.
func (t *transferServer) sendDisk(c *transferConn, h *segment.Handle, off, n uint64) error {
	bp := diskBufs.Get().(*[]byte)
	defer diskBufs.Put(bp)
	buf := *bp
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := h.ReadAt(buf[:k], off); err != nil {
			t.s.lg.WarnContext(c.logContext(), "transfer read of a disk allocation failed; closing the connection", "allocation_id", h.ID(), "err", err)
			return err
		}
		_ = c.nc.SetWriteDeadline(t.deadline(t.cfg.IOTimeout))
		if _, err := c.nc.Write(buf[:k]); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}
