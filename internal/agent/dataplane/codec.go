package dataplane

import (
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the standard codec we delegate to
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// codec is the data plane server's gRPC codec: the standard proto codec for
// every message, with two copy-saving paths for the bulk messages.
//
//   - Receiving a Write message (*writeMsg): instead of flattening the
//     received frames into one buffer and then copying the data field out of
//     it (two copies of every byte), the codec parses the protobuf wire
//     format in place and keeps references to the received buffers; the
//     handler copies the data straight from them into the segment.
//   - Sending a Read chunk (*readChunk) that aliases segment memory: the
//     codec emits the few header bytes and then the segment memory itself as
//     a reference-counted buffer, so the bytes are copied only by the
//     transport. The buffer's release unpins the allocation, so its extent
//     cannot be reused while gRPC still holds it.
//
// Any message the fast path does not recognise takes the standard path.
type codec struct {
	base encoding.CodecV2
}

func newCodec() *codec { return &codec{base: rpccodec.NewServer()} }

func (c *codec) Name() string { return "proto" }

func (c *codec) Marshal(v any) (mem.BufferSlice, error) {
	if rc, ok := v.(*readChunk); ok && rc.pin != nil {
		return rc.marshal(), nil
	}
	return c.base.Marshal(v)
}

func (c *codec) Unmarshal(data mem.BufferSlice, v any) error {
	if wm, ok := v.(*writeMsg); ok {
		wm.reset()
		if wm.parse(data) {
			data.Ref()
			wm.bufs = data
			return nil
		}
		wm.reset()
	}
	return c.base.Unmarshal(data, v)
}

// writeMsg receives one WriteRequest. The standard codec fills the embedded
// WriteRequest; the data plane codec instead fills header and pieces (views
// into the received buffers, held by bufs until free).
type writeMsg struct {
	*agentv1.WriteRequest
	header *agentv1.WriteHeader
	pieces [][]byte
	n      int
	bufs   mem.BufferSlice
}

func newWriteMsg() *writeMsg { return &writeMsg{WriteRequest: &agentv1.WriteRequest{}} }

func (m *writeMsg) reset() {
	m.free()
	proto.Reset(m.WriteRequest)
	m.header = nil
	m.pieces = m.pieces[:0]
	m.n = 0
}

// free drops the references to received buffers. Call it once the data has
// been copied.
func (m *writeMsg) free() {
	if m.bufs != nil {
		m.bufs.Free()
		m.bufs = nil
	}
}

// hdr is the header of this message, or nil.
func (m *writeMsg) hdr() *agentv1.WriteHeader {
	if m.header != nil {
		return m.header
	}
	return m.WriteRequest.GetHeader()
}

// dataLen is the number of data bytes.
func (m *writeMsg) dataLen() int {
	if m.bufs != nil {
		return m.n
	}
	return len(m.WriteRequest.GetData())
}

// dataPieces are the data bytes, in order.
func (m *writeMsg) dataPieces() [][]byte {
	if m.bufs != nil {
		return m.pieces
	}
	if d := m.WriteRequest.GetData(); len(d) > 0 {
		return [][]byte{d}
	}
	return nil
}

// cursor walks a BufferSlice as one byte stream.
type cursor struct {
	bufs [][]byte
	i, j int // buffer, offset inside it
}

func (c *cursor) byte() (byte, bool) {
	for c.i < len(c.bufs) && c.j == len(c.bufs[c.i]) {
		c.i, c.j = c.i+1, 0
	}
	if c.i == len(c.bufs) {
		return 0, false
	}
	b := c.bufs[c.i][c.j]
	c.j++
	return b, true
}

func (c *cursor) done() bool {
	for c.i < len(c.bufs) && c.j == len(c.bufs[c.i]) {
		c.i, c.j = c.i+1, 0
	}
	return c.i == len(c.bufs)
}

func (c *cursor) varint() (uint64, bool) {
	var v uint64
	for shift := uint(0); shift < 64; shift += 7 {
		b, ok := c.byte()
		if !ok {
			return 0, false
		}
		if shift == 63 && b > 1 {
			return 0, false
		}
		v |= uint64(b&0x7f) << shift
		if b < 0x80 {
			return v, true
		}
	}
	return 0, false
}

// take returns the next n bytes as views, appended to out.
func (c *cursor) take(n uint64, out [][]byte) ([][]byte, bool) {
	for n > 0 {
		if c.i == len(c.bufs) {
			return out, false
		}
		avail := uint64(len(c.bufs[c.i]) - c.j)
		if avail == 0 {
			c.i, c.j = c.i+1, 0
			continue
		}
		k := min(avail, n)
		out = append(out, c.bufs[c.i][c.j:c.j+int(k)])
		c.j += int(k)
		n -= k
	}
	return out, true
}

func (c *cursor) skip(n uint64) bool {
	_, ok := c.take(n, nil)
	return ok
}

// parse decodes a WriteRequest from data without copying its data field. It
// reports false for anything it does not handle (the standard codec then
// decodes it, or reports the error).
func (m *writeMsg) parse(data mem.BufferSlice) bool {
	bufs := make([][]byte, len(data))
	for i, b := range data {
		bufs[i] = b.ReadOnlyData()
	}
	c := cursor{bufs: bufs}
	var hdrParts [][]byte
	sawHdr := false
	for !c.done() {
		tag, ok := c.varint()
		if !ok {
			return false
		}
		if tag>>3 < uint64(protowire.MinValidNumber) || tag>>3 > uint64(protowire.MaxValidNumber) {
			return false
		}
		num, typ := protowire.Number(tag>>3), protowire.Type(tag&7)
		switch typ {
		case protowire.VarintType:
			if _, ok := c.varint(); !ok || num == 1 || num == 2 {
				return false
			}
		case protowire.Fixed64Type:
			if !c.skip(8) || num == 1 || num == 2 {
				return false
			}
		case protowire.Fixed32Type:
			if !c.skip(4) || num == 1 || num == 2 {
				return false
			}
		case protowire.BytesType:
			n, ok := c.varint()
			if !ok {
				return false
			}
			switch num {
			case 1:
				// Repeated occurrences of a message field merge.
				sawHdr = true
				if hdrParts, ok = c.take(n, hdrParts); !ok {
					return false
				}
			case 2:
				// The last occurrence of a bytes field wins.
				m.pieces, m.n = m.pieces[:0], int(n)
				if m.pieces, ok = c.take(n, m.pieces); !ok {
					return false
				}
			default:
				if !c.skip(n) {
					return false
				}
			}
		default:
			return false
		}
	}
	if sawHdr {
		var b []byte
		for _, p := range hdrParts {
			b = append(b, p...)
		}
		h := &agentv1.WriteHeader{}
		if err := rpccodec.Unmarshal(b, h); err != nil {
			return false
		}
		m.header = h
	}
	return true
}

// readChunk is one ReadResponse. With a pin, Data aliases segment memory
// and the data plane codec sends it without copying; without one (or under
// the standard codec) it is marshalled as usual.
type readChunk struct {
	*agentv1.ReadResponse
	pin *pin
}

// marshal encodes the chunk as [fields before data][data][fields after]
// with the data as a buffer whose release unpins the allocation.
func (rc *readChunk) marshal() mem.BufferSlice {
	r := rc.ReadResponse
	data := r.GetData()
	head := make([]byte, 0, 32)
	if len(data) > 0 {
		head = protowire.AppendTag(head, 1, protowire.BytesType)
		head = protowire.AppendVarint(head, uint64(len(data)))
	}
	var tail []byte
	if v := r.GetObjectSize(); v != 0 {
		tail = protowire.AppendTag(tail, 2, protowire.VarintType)
		tail = protowire.AppendVarint(tail, v)
	}
	if v := r.GetChecksum(); v != 0 {
		tail = protowire.AppendTag(tail, 3, protowire.VarintType)
		tail = protowire.AppendVarint(tail, v)
	}
	if mem.IsBelowBufferPoolingThreshold(cap(data)) || mem.IsBelowBufferPoolingThreshold(len(data)) {
		// Too small for gRPC to reference-count: copy.
		out := append(append(head, data...), tail...)
		return mem.BufferSlice{mem.SliceBuffer(out)}
	}
	rc.pin.add()
	d := data
	out := mem.BufferSlice{mem.SliceBuffer(head), mem.NewBuffer(&d, pinRelease{rc.pin})}
	if len(tail) > 0 {
		out = append(out, mem.SliceBuffer(tail))
	}
	return out
}

// pinRelease is the "pool" of an aliased segment buffer: gRPC returns the
// buffer to it once the transport is done with the bytes.
type pinRelease struct{ p *pin }

func (pinRelease) Get(int) *[]byte {
	// Never used: gRPC only returns buffers to the pool they came from.
	b := []byte(nil)
	return &b
}

func (r pinRelease) Put(*[]byte) { r.p.release() }

// pinAbandon bounds how long an allocation stays pinned by buffers gRPC
// never returns (a connection torn down mid-write may drop them without a
// release). Past it the extent is unpinned anyway: nothing will read it.
const pinAbandon = 30 * time.Second

// pin keeps a read handle open while gRPC holds buffers that alias its
// bytes: one reference for the handler, one per buffer in flight.
type pin struct {
	n     atomic.Int64
	close func()
	once  sync.Once
	// mu guards timer.
	mu    sync.Mutex
	timer *time.Timer
}

func newPin(close func()) *pin {
	p := &pin{close: close}
	p.n.Store(1)
	return p
}

func (p *pin) add() { p.n.Add(1) }

func (p *pin) release() {
	if p.n.Add(-1) == 0 {
		p.fire()
	}
}

func (p *pin) fire() {
	p.once.Do(func() {
		p.mu.Lock()
		if p.timer != nil {
			p.timer.Stop()
		}
		p.mu.Unlock()
		p.close()
	})
}

// done drops the handler's reference; if buffers are still in flight it
// arms the abandonment timer.
func (p *pin) done() {
	if p.n.Add(-1) == 0 {
		p.fire()
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.timer == nil {
		p.timer = time.AfterFunc(pinAbandon, p.fire)
	}
}
