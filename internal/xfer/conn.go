package xfer

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// conn is one client connection. Only the goroutine that took it from the
// pool touches it.
type conn struct {
	nc       net.Conn
	br       *bufio.Reader
	endpoint string
	greeted  bool      // the preamble went out
	reused   bool      // an earlier call completed on it
	lastUsed time.Time // when it went back to the pool
	wbuf     []byte    // request header scratch
	rbuf     []byte    // response header scratch

	// Per call.
	dirty    bool // bytes were sent: an error now leaves the stream unframed
	answered bool // the first byte of a response arrived
	// dl sets the call's deadline a step at a time; left is how many
	// payload bytes may still move under the current step's (step).
	dl   Deadlines
	left int
	// trace is the call's trace context, nil when it is not traced: the
	// header then holds not one byte more.
	trace *agentv1.TraceContext
}

// step starts a step of the call: the socket's deadline moves to
// StallTimeout from now (the call's deadline when sooner, or alone when
// the stall bound is off), and stallStep more payload bytes may move
// under it.
func (c *conn) step() {
	c.dl.Step()
	c.left = stallStep
}

// room is how many payload bytes may move before the next step, starting
// one when the current step has none left.
func (c *conn) room() int {
	if c.left <= 0 {
		c.step()
	}
	return c.left
}

// send writes one request frame (with the preamble on a fresh connection)
// followed by payload, a step at a time.
func (c *conn) send(op agentv1.TransferOp, items []*agentv1.TransferItem, payload [][]byte) error {
	b := c.wbuf[:0]
	if !c.greeted {
		b = append(b, Preamble...)
	}
	b, err := AppendFrame(b, &agentv1.TransferRequest{Op: op, Items: items, TraceContext: c.trace})
	if err != nil {
		return err // nothing sent: the connection stays usable
	}
	c.wbuf = b
	c.dirty, c.greeted = true, true
	Gather(c.nc)
	err = c.writeFrame(b, payload)
	if ferr := Flush(c.nc); err == nil {
		err = ferr
	}
	if err != nil {
		// The agent may have refused the request and closed the
		// connection; its answer says more than the broken pipe.
		if resp, rerr := c.response(); rerr == nil && resp.GetError() != nil {
			return c.refused(resp.GetError())
		}
		return unavailable(c.endpoint, err)
	}
	return nil
}

// writeFrame is WriteFrame(c.nc, hdr, payload) in writes of at most a
// step's room each (one vectored write when the frame fits, as it does
// but for the largest objects).
func (c *conn) writeFrame(hdr []byte, payload [][]byte) error {
	n := len(hdr)
	for _, p := range payload {
		n += len(p)
	}
	if n <= c.room() {
		c.left -= n
		return WriteFrame(c.nc, hdr, payload)
	}
	bufs := frameBuffers(hdr, payload)
	var piece net.Buffers
	for len(bufs) > 0 {
		room := c.room()
		piece = piece[:0]
		for len(bufs) > 0 && room > 0 {
			b := bufs[0]
			if len(b) > room {
				piece = append(piece, b[:room])
				bufs[0] = b[room:]
				c.left -= room
				break
			}
			piece = append(piece, b)
			bufs = bufs[1:]
			room -= len(b)
			c.left -= len(b)
		}
		if _, err := piece.WriteTo(c.nc); err != nil {
			return err
		}
	}
	return nil
}

// readFull reads len(p) payload bytes, a step's room at a time.
func (c *conn) readFull(p []byte) error {
	for len(p) > 0 {
		k := min(len(p), c.room())
		if _, err := io.ReadFull(c.br, p[:k]); err != nil {
			return err
		}
		c.left -= k
		p = p[k:]
	}
	return nil
}

// discard reads and drops n payload bytes, a step's room at a time.
func (c *conn) discard(n uint64) error {
	for n > 0 {
		k := min(n, uint64(c.room()))
		if _, err := io.CopyN(io.Discard, c.br, int64(k)); err != nil {
			return err
		}
		c.left -= int(k)
		n -= k
	}
	return nil
}

// response reads one response header and checks its envelope: no request
// error and one result per item. Waiting for it is a step of its own.
func (c *conn) response() (*agentv1.TransferResponse, error) {
	c.step()
	if _, err := c.br.Peek(1); err != nil {
		return nil, unavailable(c.endpoint, err)
	}
	c.answered = true
	resp := &agentv1.TransferResponse{}
	buf, err := ReadFrame(c.br, c.rbuf, resp)
	c.rbuf = buf
	switch {
	case errors.Is(err, ErrProtocol):
		return nil, c.violation("bad response frame: %v", err)
	case err != nil:
		return nil, unavailable(c.endpoint, err)
	}
	return resp, nil
}

// exchange sends one request and returns its per-item results (a READ's
// payloads follow on the connection).
func (c *conn) exchange(op agentv1.TransferOp, items []*agentv1.TransferItem, payload [][]byte) ([]*agentv1.TransferResult, error) {
	if err := c.send(op, items, payload); err != nil {
		return nil, err
	}
	resp, err := c.response()
	if err != nil {
		return nil, err
	}
	if e := resp.GetError(); e != nil {
		return nil, c.refused(e)
	}
	if len(resp.GetResults()) != len(items) {
		return nil, c.violation("%d results for %d items", len(resp.GetResults()), len(items))
	}
	return resp.GetResults(), nil
}

// refused is the error for a request the agent refused whole.
func (c *conn) refused(st *agentv1.ItemResult) error {
	err := ItemError(st)
	if err == nil {
		return c.violation("request refused with code OK")
	}
	return fmt.Errorf("xfer %s: request refused: %w", c.endpoint, err)
}

func (c *conn) violation(format string, args ...any) error {
	return fmt.Errorf("xfer %s: %w: %w", c.endpoint,
		rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "agent broke the transfer protocol: "+format, args...), ErrProtocol)
}

// write runs one WRITE exchange of at most MaxItems items.
func (c *conn) write(items []*agentv1.TransferItem, src [][]byte, errs []error) error {
	return c.writeEach(items, src, func(i int, err error, _ []byte) { errs[i] = err })
}

// writeSealed is write that keeps the seal receipts.
func (c *conn) writeSealed(items []*agentv1.TransferItem, src [][]byte, res []WriteResult) error {
	return c.writeEach(items, src, func(i int, err error, receipt []byte) { res[i] = WriteResult{Err: err, Receipt: receipt} })
}

// writeEach runs one WRITE exchange of at most MaxItems items and hands
// each item's outcome to set.
func (c *conn) writeEach(items []*agentv1.TransferItem, src [][]byte, set func(i int, err error, receipt []byte)) error {
	rs, err := c.exchange(agentv1.TransferOp_TRANSFER_OP_WRITE, items, src)
	if err != nil {
		return err
	}
	for i, r := range rs {
		err := ItemError(r.GetStatus())
		if err == nil && r.GetLength() != items[i].GetLength() {
			return c.violation("item %d: %d bytes written of %d sent", i, r.GetLength(), items[i].GetLength())
		}
		var receipt []byte
		if err == nil && items[i].SealChecksum != nil {
			receipt = r.GetSealReceipt() // decoded by copy (UnmarshalVT): it outlives rbuf
		}
		set(i, err, receipt)
	}
	return nil
}

// verify runs one VERIFY exchange of at most MaxItems items.
func (c *conn) verify(items []*agentv1.TransferItem, _ [][]byte, errs []error) error {
	rs, err := c.exchange(agentv1.TransferOp_TRANSFER_OP_VERIFY, items, nil)
	if err != nil {
		return err
	}
	for i, r := range rs {
		if r.GetLength() != 0 {
			return c.violation("item %d: a VERIFY answered with %d payload bytes", i, r.GetLength())
		}
		errs[i] = ItemError(r.GetStatus())
	}
	return nil
}

// read runs one READ exchange of at most MaxItems items.
func (c *conn) read(items []*agentv1.TransferItem, dst [][]byte, res []ReadResult) error {
	rs, err := c.exchange(agentv1.TransferOp_TRANSFER_OP_READ, items, nil)
	if err != nil {
		return err
	}
	for i, r := range rs {
		if err := ItemError(r.GetStatus()); err != nil {
			res[i] = ReadResult{Err: err} // no payload follows a failed item
			continue
		}
		n, want, off, size := r.GetLength(), uint64(len(dst[i])), items[i].GetOffset(), r.GetObjectSize()
		if off > size || n > size-off {
			return c.violation("item %d: %d bytes from offset %d of a %d-byte object", i, n, off, size)
		}
		if n != want {
			if want != 0 {
				return c.violation("item %d: %d payload bytes for a %d-byte read", i, n, want)
			}
			// An empty dst asked for the rest of the object: drop it.
			if n > math.MaxInt64 {
				return c.violation("item %d: %d payload bytes", i, n)
			}
			if err := c.discard(n); err != nil {
				return unavailable(c.endpoint, err)
			}
			res[i] = ReadResult{ObjectSize: size, Checksum: r.GetChecksum(),
				Err: errInvalid("item %d: the destination buffer is empty but the object has %d bytes from offset %d", i, n, off)}
			continue
		}
		if err := c.readFull(dst[i]); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return unavailable(c.endpoint, err)
		}
		res[i] = ReadResult{N: len(dst[i]), ObjectSize: size, Checksum: r.GetChecksum()}
	}
	return nil
}
