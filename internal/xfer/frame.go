package xfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Protocol constants.
const (
	// Preamble opens every connection, sent once by the client.
	Preamble = "CXF1"
	// MaxHeaderBytes bounds the protobuf header of one frame. 4096 items
	// with 100-byte tokens need about 600 KiB.
	MaxHeaderBytes = 1 << 20
	// MaxItems bounds the items of one request.
	MaxItems = 4096
	// MaxVerifyItems bounds the items of a VERIFY (a client verifies the
	// replica whose read failed its checksum; each item costs the agent a
	// read of the whole allocation).
	MaxVerifyItems = 64
	// MaxDrainBytes bounds the payload the agent reads and drops for one
	// failed WRITE item; a failed item claiming more ends the connection.
	MaxDrainBytes = 256 << 20
	// lenSize is the size of a frame's length prefix.
	lenSize = 4
)

// ErrProtocol marks a peer that broke the protocol (malformed or oversized
// frame, wrong result count or lengths). The connection is unusable after it.
var ErrProtocol = errors.New("xfer: protocol violation")

// errMalformed builds a protocol error a refusing side reports on the wire:
// INVALID_ARGUMENT INVALID_PARAMS that also wraps ErrProtocol.
func errMalformed(format string, args ...any) error {
	return fmt.Errorf("%w: %w", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...), ErrProtocol)
}

// AppendFrame appends one frame header to b: u32le(len) and m marshalled.
// It refuses a header larger than MaxHeaderBytes (b is then returned
// unchanged).
func AppendFrame(b []byte, m proto.Message) ([]byte, error) {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	b, err := rpccodec.AppendMarshal(b, m)
	if err != nil {
		return b[:start], rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "marshal transfer header")
	}
	n := len(b) - start - lenSize
	if n > MaxHeaderBytes {
		return b[:start], rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"transfer header of %d bytes exceeds the %d-byte limit (fewer items or shorter tokens)", n, MaxHeaderBytes)
	}
	binary.LittleEndian.PutUint32(b[start:], uint32(n))
	return b, nil
}

// WriteFrame writes a frame (hdr as built by AppendFrame) and its payload
// with one vectored write: the payload slices go to the socket as they are,
// never copied. Empty slices are skipped.
func WriteFrame(w io.Writer, hdr []byte, payload [][]byte) error {
	if len(payload) == 0 {
		_, err := w.Write(hdr)
		return err
	}
	bufs := frameBuffers(hdr, payload)
	_, err := bufs.WriteTo(w)
	return err
}

// frameBuffers are a frame's header and its non-empty payload buffers.
func frameBuffers(hdr []byte, payload [][]byte) net.Buffers {
	bufs := make(net.Buffers, 0, 1+len(payload))
	bufs = append(bufs, hdr)
	for _, p := range payload {
		if len(p) > 0 {
			bufs = append(bufs, p)
		}
	}
	return bufs
}

// ReadFrame reads one frame header from r into m, using buf as scratch
// space (grown as needed and returned for reuse). It is ReadFrameLimit with
// the protocol's MaxHeaderBytes.
func ReadFrame(r io.Reader, buf []byte, m proto.Message) ([]byte, error) {
	return ReadFrameLimit(r, buf, m, MaxHeaderBytes)
}

// headerStep is how far ahead of the bytes received ReadFrameLimit grows
// its buffer for a large header: a peer that announces MaxHeaderBytes and
// stalls pins this much, not the megabyte it announced.
const headerStep = 64 << 10

// ReadFrameLimit reads one frame header from r into m, using buf as
// scratch space (grown as needed and returned for reuse): ReadHeader, then
// DecodeHeader.
func ReadFrameLimit(r io.Reader, buf []byte, m proto.Message, limit int) ([]byte, error) {
	hdr, _, buf, err := ReadHeader(r, buf, limit)
	if err != nil {
		return buf, err
	}
	return buf, DecodeHeader(hdr, m)
}

// ReadHeader reads one frame's header from r without decoding it, using
// buf as scratch space (grown as needed and returned for reuse), and
// returns it with the number of its items (TransferRequest.items,
// TransferResponse.results: field 2), counted on the raw bytes. limit (at
// most MaxHeaderBytes; <= 0 means MaxHeaderBytes) is the largest header
// the reader accepts.
//
// Nothing is allocated on the strength of the length prefix alone: a
// length over MaxHeaderBytes is refused with INVALID_PARAMS, one over limit
// with RESOURCE_EXHAUSTED LIMIT_EXCEEDED, and a header larger than buf is
// read into a buffer grown as its bytes arrive. A header of more than
// MaxItems items is refused with INVALID_PARAMS as soon as they are seen,
// so an oversized array is never decoded.
//
// It returns io.EOF when r ends cleanly before the frame,
// io.ErrUnexpectedEOF when it ends inside it, and an error wrapping
// ErrProtocol for the refusals above; the frame's payload, if any, is left
// unread in r.
func ReadHeader(r io.Reader, buf []byte, limit int) (hdr []byte, items int, scratch []byte, err error) {
	if cap(buf) < lenSize {
		buf = make([]byte, 0, 512)
	}
	if _, err := io.ReadFull(r, buf[:lenSize]); err != nil {
		return nil, 0, buf, err
	}
	n := binary.LittleEndian.Uint32(buf[:lenSize])
	if n > MaxHeaderBytes {
		return nil, 0, buf, errMalformed("transfer header of %d bytes exceeds the %d-byte limit", n, MaxHeaderBytes)
	}
	if limit > 0 && int64(n) > int64(limit) {
		return nil, 0, buf, fmt.Errorf("%w: %w", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
			"transfer header of %d bytes exceeds this agent's %d-byte limit (send fewer items per request)", n, limit), ErrProtocol)
	}
	b, buf, err := readHeader(r, buf, int(n))
	if err != nil {
		if err == errTooManyItems {
			return nil, 0, buf, err
		}
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, 0, buf, err
	}
	k := countItems(b)
	if k > MaxItems {
		return nil, 0, buf, errTooManyItems
	}
	return b, k, buf, nil
}

// DecodeHeader unmarshals a header ReadHeader returned into m; bytes that
// do not decode are refused with an error wrapping ErrProtocol
// (INVALID_PARAMS).
func DecodeHeader(hdr []byte, m proto.Message) error {
	if err := rpccodec.Unmarshal(hdr, m); err != nil {
		return errMalformed("transfer header does not decode: %v", err)
	}
	return nil
}

// readHeader reads n bytes from r into buf, or, when buf is too small,
// into a buffer grown headerStep at a time (doubling) as the bytes arrive.
// While it grows, it counts the items of what has arrived and stops with
// errTooManyItems once they pass MaxItems, so a header of tiny items is
// refused after its first headerStep bytes. It returns the header and the
// scratch buffer to keep.
func readHeader(r io.Reader, buf []byte, n int) (hdr, scratch []byte, err error) {
	if cap(buf) >= n {
		b := buf[:n]
		_, err := io.ReadFull(r, b)
		return b, buf, err
	}
	b := make([]byte, 0, min(n, max(cap(buf), headerStep)))
	for {
		k, err := io.ReadFull(r, b[len(b):cap(b)])
		b = b[:len(b)+k]
		if err != nil || len(b) == n {
			return b, b, err
		}
		if countItems(b) > MaxItems {
			return b, b, errTooManyItems
		}
		nb := make([]byte, len(b), min(n, 2*cap(b)))
		copy(nb, b)
		b = nb
	}
}

// errTooManyItems is readHeader's refusal of a header that names more
// than MaxItems items.
var errTooManyItems = errMalformed("a transfer frame names at most %d items", MaxItems)

// countItems counts the entries of field 2 in the top-level fields of b
// without decoding them, stopping past MaxItems. Bytes that are not valid
// wire format, or a field cut short (a prefix of a header), end the count;
// unmarshalling refuses what is invalid.
func countItems(b []byte) int {
	n := 0
	for len(b) > 0 && n <= MaxItems {
		num, typ, k := protowire.ConsumeTag(b)
		if k < 0 {
			break
		}
		b = b[k:]
		if k = protowire.ConsumeFieldValue(num, typ, b); k < 0 {
			break
		}
		b = b[k:]
		if num == itemsField && typ == protowire.BytesType {
			n++
		}
	}
	return n
}

// itemsField is the field number of TransferRequest.items and
// TransferResponse.results (transfer.proto).
const itemsField = 2

// CheckRequest validates a decoded request header: a known operation, 1
// to MaxItems non-nil items, and lengths whose sum fits in an int64. Its errors wrap ErrProtocol.
func CheckRequest(req *agentv1.TransferRequest) error {
	switch req.GetOp() {
	case agentv1.TransferOp_TRANSFER_OP_WRITE, agentv1.TransferOp_TRANSFER_OP_READ, agentv1.TransferOp_TRANSFER_OP_VERIFY:
	default:
		return errMalformed("unknown transfer op %d", req.GetOp())
	}
	n := len(req.GetItems())
	if n == 0 || n > MaxItems {
		return errMalformed("a transfer request names 1 to %d items, this one %d", MaxItems, n)
	}
	if req.GetOp() == agentv1.TransferOp_TRANSFER_OP_VERIFY && n > MaxVerifyItems {
		return errMalformed("a VERIFY names 1 to %d items, this one %d", MaxVerifyItems, n)
	}
	// The lengths' sum must fit in an int64, so no count of bytes derived
	// from a request (payload totals, metrics, int conversions) can wrap.
	var sum uint64
	for i, it := range req.GetItems() {
		if it == nil {
			return errMalformed("item %d is empty", i)
		}
		if sum += it.GetLength(); sum > math.MaxInt64 || it.GetLength() > math.MaxInt64 {
			return errMalformed("item %d takes the sum of the items' lengths past 2^63 bytes", i)
		}
	}
	return nil
}

// ItemError turns an item status from the wire into the error it stands for
// (nil for OK), the same *rpcerr.Error DataService callers get.
func ItemError(st *agentv1.ItemResult) error {
	if st == nil {
		return nil
	}
	return rpcerr.FromItem(&masterv1.ItemStatus{Code: st.GetCode(), Reason: st.GetReason(), Message: st.GetMessage()})
}

// ItemResult turns an error into its wire status; OK (nil error) is a nil
// status, which decodes as code 0.
func ItemResult(err error) *agentv1.ItemResult {
	if err == nil {
		return nil
	}
	st := rpcerr.Item(err)
	return &agentv1.ItemResult{Code: st.GetCode(), Reason: st.GetReason(), Message: st.GetMessage()}
}
