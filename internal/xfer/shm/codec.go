package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// Protocol constants.
const (
	// Preamble opens every connection, sent once by the client.
	Preamble = "CSM1"
	// MaxSegments bounds the segments one hello shares (and so the
	// descriptors a client accepts).
	MaxSegments = 64
	// MaxSegmentIDBytes bounds a segment id in the hello.
	MaxSegmentIDBytes = 128
	// MaxHelloHeaderBytes bounds the hello's header: MaxSegments results
	// of a few varints each.
	MaxHelloHeaderBytes = 4 << 10
	// OffsetSize is the size of one grant offset.
	OffsetSize = 8
)

// Segment is one segment a hello shares.
type Segment struct {
	// ID is the segment id, as replica descriptors name it.
	ID string
	// Size is the size of the memfd's mapping.
	Size uint64
}

// Release is the frame that ends a grant: an empty header.
var Release = []byte{0, 0, 0, 0}

func errMalformed(format string, args ...any) error {
	return fmt.Errorf("%w: %w", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...), xfer.ErrProtocol)
}

// AppendHello appends the hello frame that shares segs.
func AppendHello(b []byte, segs []Segment) ([]byte, error) {
	if len(segs) > MaxSegments {
		return b, fmt.Errorf("shm: %d segments to share, at most %d", len(segs), MaxSegments)
	}
	resp := &agentv1.TransferResponse{Results: make([]*agentv1.TransferResult, len(segs))}
	for i, s := range segs {
		if len(s.ID) == 0 || len(s.ID) > MaxSegmentIDBytes {
			return b, fmt.Errorf("shm: segment id of %d bytes", len(s.ID))
		}
		resp.Results[i] = &agentv1.TransferResult{Length: uint64(len(s.ID)), ObjectSize: s.Size}
	}
	b, err := xfer.AppendFrame(b, resp)
	if err != nil {
		return b, err
	}
	for _, s := range segs {
		b = append(b, s.ID...)
	}
	return b, nil
}

// AppendRefusal appends the frame that refuses a connection or request
// whole with err.
func AppendRefusal(b []byte, err error) ([]byte, error) {
	return xfer.AppendFrame(b, &agentv1.TransferResponse{Error: xfer.ItemResult(err)})
}

// ReadHello reads a hello from r. A refusal is returned as the error it
// carries (an *rpcerr.Error or a gRPC status error); a malformed hello as
// an error wrapping xfer.ErrProtocol.
func ReadHello(r io.Reader) ([]Segment, error) {
	resp := &agentv1.TransferResponse{}
	if _, err := xfer.ReadFrameLimit(r, nil, resp, MaxHelloHeaderBytes); err != nil {
		return nil, err
	}
	if e := resp.GetError(); e != nil {
		if err := xfer.ItemError(e); err != nil {
			return nil, err
		}
		return nil, errMalformed("hello refused with code OK")
	}
	rs := resp.GetResults()
	if len(rs) > MaxSegments {
		return nil, errMalformed("hello shares %d segments, at most %d", len(rs), MaxSegments)
	}
	segs := make([]Segment, len(rs))
	total := 0
	for i, r := range rs {
		n := r.GetLength()
		if n == 0 || n > MaxSegmentIDBytes {
			return nil, errMalformed("segment %d: id of %d bytes", i, n)
		}
		if r.GetObjectSize() == 0 || r.GetObjectSize() > math.MaxInt {
			return nil, errMalformed("segment %d: mapping of %d bytes", i, r.GetObjectSize())
		}
		segs[i].Size = r.GetObjectSize()
		total += int(n)
	}
	ids := make([]byte, total)
	if _, err := io.ReadFull(r, ids); err != nil {
		return nil, unexpected(err)
	}
	for i, r := range rs {
		n := int(r.GetLength())
		segs[i].ID, ids = string(ids[:n]), ids[n:]
	}
	return segs, nil
}

// AppendGrant appends a grant: resp's header and offsets (one per result).
func AppendGrant(b []byte, resp *agentv1.TransferResponse, offsets []uint64) ([]byte, error) {
	if len(offsets) != len(resp.GetResults()) {
		return b, fmt.Errorf("shm: %d offsets for %d results", len(offsets), len(resp.GetResults()))
	}
	b, err := xfer.AppendFrame(b, resp)
	if err != nil {
		return b, err
	}
	for _, o := range offsets {
		b = binary.LittleEndian.AppendUint64(b, o)
	}
	return b, nil
}

// ReadGrant reads the grant of a request of n items from r, using buf as
// scratch space (returned for reuse), into resp. offsets is reused when
// large enough. A refusal is returned as its error; a grant that does not
// carry exactly n results as an error wrapping xfer.ErrProtocol.
func ReadGrant(r io.Reader, buf []byte, resp *agentv1.TransferResponse, n int, offsets []uint64) ([]uint64, []byte, error) {
	buf, err := xfer.ReadFrame(r, buf, resp)
	if err != nil {
		return offsets, buf, err
	}
	if e := resp.GetError(); e != nil {
		if err := xfer.ItemError(e); err != nil {
			return offsets, buf, err
		}
		return offsets, buf, errMalformed("request refused with code OK")
	}
	if len(resp.GetResults()) != n {
		return offsets, buf, errMalformed("%d results for %d items", len(resp.GetResults()), n)
	}
	if n > xfer.MaxItems {
		return offsets, buf, errMalformed("%d results, at most %d", n, xfer.MaxItems)
	}
	need := n * OffsetSize
	if cap(buf) < need {
		buf = make([]byte, need)
	}
	p := buf[:need]
	if _, err := io.ReadFull(r, p); err != nil {
		return offsets, buf, unexpected(err)
	}
	if cap(offsets) < n {
		offsets = make([]uint64, n)
	}
	offsets = offsets[:n]
	for i := range offsets {
		offsets[i] = binary.LittleEndian.Uint64(p[i*OffsetSize:])
	}
	return offsets, buf, nil
}

// ReadDone reads the answer to the release of a WRITE of n items into
// resp: an empty TransferResponse, a refusal, or, when items asked to be
// sealed (seal_checksum), one result per item with its seal receipt or
// its seal's error.
func ReadDone(r io.Reader, buf []byte, resp *agentv1.TransferResponse, n int) ([]byte, error) {
	buf, err := xfer.ReadFrame(r, buf, resp)
	if err != nil {
		return buf, err
	}
	if e := resp.GetError(); e != nil {
		if err := xfer.ItemError(e); err != nil {
			return buf, err
		}
	}
	if k := len(resp.GetResults()); k != 0 && k != n {
		return buf, errMalformed("release of %d items answered with %d results", n, k)
	}
	for i, res := range resp.GetResults() {
		if res == nil || res.GetLength() != 0 || res.GetObjectSize() != 0 || res.GetChecksum() != 0 {
			return buf, errMalformed("release answer %d is not a seal's outcome", i)
		}
	}
	return buf, nil
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
