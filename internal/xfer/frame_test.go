package xfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"strconv"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

func TestFrameRoundTrip(t *testing.T) {
	req := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{
		{SegmentId: "s", AllocationId: 7, Token: []byte("tok"), Offset: 3, Length: 5},
	}}
	b, err := AppendFrame([]byte("prefix"), req)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("prefix")) || binary.LittleEndian.Uint32(b[6:]) != uint32(len(b)-10) {
		t.Fatalf("frame % x: want the prefix kept and a u32le length of the rest", b)
	}
	var buf bytes.Buffer
	if err := WriteFrame(&buf, b[6:], [][]byte{[]byte("ab"), nil, []byte("cde")}); err != nil {
		t.Fatal(err)
	}
	got := &agentv1.TransferRequest{}
	scratch, err := ReadFrame(&buf, nil, got)
	if err != nil || !proto.Equal(got, req) {
		t.Fatalf("ReadFrame = %v, %v; want %v", got, err, req)
	}
	if rest, _ := io.ReadAll(&buf); string(rest) != "abcde" {
		t.Fatalf("payload after the frame = %q, want abcde", rest)
	}
	// The scratch buffer is reused.
	buf.Write(b[6:])
	if again, err := ReadFrame(&buf, scratch, got); err != nil || &again[:1][0] != &scratch[:1][0] {
		t.Fatalf("second ReadFrame: %v (scratch reused: %v)", err, err == nil && &again[:1][0] == &scratch[:1][0])
	}
}

func TestReadFrameErrors(t *testing.T) {
	le := func(n uint32) []byte { return binary.LittleEndian.AppendUint32(nil, n) }
	tests := []struct {
		name     string
		wire     []byte
		want     error
		protocol bool
	}{
		{"clean end", nil, io.EOF, false},
		{"torn length", []byte{1, 0}, io.ErrUnexpectedEOF, false},
		{"torn header", append(le(10), 1, 2), io.ErrUnexpectedEOF, false},
		{"length only", le(10), io.ErrUnexpectedEOF, false},
		{"too large", le(MaxHeaderBytes + 1), nil, true},
		{"garbage", append(le(2), 0xff, 0xff), nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadFrame(bytes.NewReader(tc.wire), nil, &agentv1.TransferResponse{})
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if errors.Is(err, ErrProtocol) != tc.protocol {
				t.Fatalf("err = %v, protocol violation %v, want %v", err, errors.Is(err, ErrProtocol), tc.protocol)
			}
			if tc.protocol && rpcerr.Reason(err) != "INVALID_PARAMS" {
				t.Fatalf("reason of %v = %q, want INVALID_PARAMS", err, rpcerr.Reason(err))
			}
		})
	}
	// A zero-length header is an empty message.
	m := &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{}}}
	if _, err := ReadFrame(bytes.NewReader(le(0)), nil, m); err != nil || len(m.GetResults()) != 0 {
		t.Fatalf("zero-length frame = %v, %v; want an empty message", m, err)
	}
}

func TestAppendFrameLimit(t *testing.T) {
	req := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: []*agentv1.TransferItem{{Token: make([]byte, MaxHeaderBytes)}}}
	b, err := AppendFrame([]byte("x"), req)
	if rpcerr.Reason(err) != "INVALID_PARAMS" || string(b) != "x" {
		t.Fatalf("AppendFrame of an oversized header = %q, %v; want the input back and INVALID_PARAMS", b, err)
	}
}

func TestCheckRequest(t *testing.T) {
	many := make([]*agentv1.TransferItem, MaxItems+1)
	for i := range many {
		many[i] = &agentv1.TransferItem{}
	}
	tests := []struct {
		name string
		req  *agentv1.TransferRequest
		ok   bool
	}{
		{"write", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: many[:1]}, true},
		{"read max", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: many[:MaxItems]}, true},
		{"no op", &agentv1.TransferRequest{Items: many[:1]}, false},
		{"verify max", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_VERIFY, Items: many[:MaxVerifyItems]}, true},
		{"verify too many", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_VERIFY, Items: many[:MaxVerifyItems+1]}, false},
		{"unknown op", &agentv1.TransferRequest{Op: 4, Items: many[:1]}, false},
		{"no items", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ}, false},
		{"too many", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: many}, false},
		{"nil item", &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: []*agentv1.TransferItem{nil}}, false},
	}
	for _, tc := range tests {
		err := CheckRequest(tc.req)
		if (err == nil) != tc.ok || (err != nil && (!errors.Is(err, ErrProtocol) || rpcerr.Reason(err) != "INVALID_PARAMS")) {
			t.Errorf("%s: CheckRequest = %v, want ok=%v (else INVALID_PARAMS, ErrProtocol)", tc.name, err, tc.ok)
		}
	}
}

// FuzzReadFrame decodes arbitrary bytes as request and response frames:
// never a panic, and a decoded header re-encodes to a frame that decodes
// to the same message.
func FuzzReadFrame(f *testing.F) {
	resp, _ := AppendFrame(nil, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 3, ObjectSize: 9, Checksum: 1}, {Status: &agentv1.ItemResult{Code: 5, Reason: "ALLOCATION_NOT_FOUND"}}}})
	req, _ := AppendFrame(nil, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: []*agentv1.TransferItem{{SegmentId: "s", Token: []byte{1}}}})
	f.Add(resp)
	f.Add(req)
	f.Add([]byte{0, 0, 0, 0})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, in []byte) {
		for _, m := range []proto.Message{&agentv1.TransferResponse{}, &agentv1.TransferRequest{}} {
			if _, err := ReadFrame(bytes.NewReader(in), nil, m); err != nil {
				continue
			}
			b, err := AppendFrame(nil, m)
			if err != nil {
				t.Fatalf("re-encode of a decoded header: %v", err)
			}
			back := m.ProtoReflect().New().Interface()
			if _, err := ReadFrame(bytes.NewReader(b), nil, back); err != nil || !proto.Equal(back, m) {
				t.Fatalf("round trip: %v, %v != %v", err, back, m)
			}
			if r, ok := m.(*agentv1.TransferRequest); ok {
				_ = CheckRequest(r)
			}
		}
	})
}

// countingReader counts the bytes read from r.
type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// tinyItems is a header of n empty items (2 bytes each on the wire).
func tinyItems(n int) []byte {
	b := make([]byte, 0, 2*n)
	for range n {
		b = protowire.AppendTag(b, itemsField, protowire.BytesType)
		b = protowire.AppendVarint(b, 0)
	}
	return b
}

func withLen(hdr []byte) []byte {
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(hdr))), hdr...)
}

// TestReadFrameRefusesBeforeAllocating: a hostile length prefix or item
// count costs the reader no more than headerStep bytes of buffer.
func TestReadFrameRefusesBeforeAllocating(t *testing.T) {
	// A megabyte of tiny items is refused after its first headerStep bytes.
	r := &countingReader{r: bytes.NewReader(withLen(tinyItems(MaxHeaderBytes / 2)))}
	scratch, err := ReadFrame(r, nil, &agentv1.TransferRequest{})
	if !errors.Is(err, ErrProtocol) || rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("ReadFrame of %d items = %v, want INVALID_PARAMS", MaxHeaderBytes/2, err)
	}
	if r.n > lenSize+headerStep || cap(scratch) > headerStep {
		t.Fatalf("read %d bytes into a %d-byte buffer before refusing; want at most %d", r.n, cap(scratch), headerStep)
	}
	// Small enough to arrive whole, one item too many is refused before
	// decoding; exactly MaxItems decode.
	for _, tc := range []struct {
		n  int
		ok bool
	}{{MaxItems, true}, {MaxItems + 1, false}} {
		m := &agentv1.TransferRequest{}
		_, err := ReadFrame(bytes.NewReader(withLen(tinyItems(tc.n))), make([]byte, 0, 64<<10), m)
		if (err == nil) != tc.ok || (err == nil && len(m.GetItems()) != tc.n) {
			t.Fatalf("ReadFrame of %d items = %d items, %v; want ok=%v", tc.n, len(m.GetItems()), err, tc.ok)
		}
	}
	// A large header of MaxItems real items grows its buffer and decodes.
	big := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ}
	for i := range MaxItems {
		big.Items = append(big.Items, &agentv1.TransferItem{SegmentId: "segment", AllocationId: uint64(i), Token: make([]byte, 150), Length: 4096})
	}
	wire, err := AppendFrame(nil, big)
	if err != nil {
		t.Fatal(err)
	}
	got := &agentv1.TransferRequest{}
	if _, err := ReadFrame(bytes.NewReader(wire), nil, got); err != nil || !proto.Equal(got, big) {
		t.Fatalf("ReadFrame of a %d-byte header of %d items: %v", len(wire), MaxItems, err)
	}
	// A peer that announces a megabyte and stalls pins headerStep bytes.
	r = &countingReader{r: bytes.NewReader(append(binary.LittleEndian.AppendUint32(nil, MaxHeaderBytes), 1, 2, 3))}
	scratch, err = ReadFrame(r, nil, &agentv1.TransferRequest{})
	if !errors.Is(err, io.ErrUnexpectedEOF) || cap(scratch) > headerStep {
		t.Fatalf("ReadFrame of a stalled header = %v with a %d-byte buffer; want ErrUnexpectedEOF and at most %d", err, cap(scratch), headerStep)
	}
	// A reader's own limit below the protocol's: LIMIT_EXCEEDED, nothing read.
	r = &countingReader{r: bytes.NewReader(withLen(make([]byte, 5000)))}
	if _, err := ReadFrameLimit(r, nil, &agentv1.TransferRequest{}, 4096); !errors.Is(err, ErrProtocol) ||
		rpcerr.Reason(err) != "LIMIT_EXCEEDED" || status.Code(rpcerr.Status(err)) != codes.ResourceExhausted || r.n != lenSize {
		t.Fatalf("ReadFrameLimit over the limit = %v after %d bytes; want RESOURCE_EXHAUSTED LIMIT_EXCEEDED after the prefix", err, r.n)
	}
}

// TestItemsField: field 2 is TransferRequest.items and
// TransferResponse.results, as countItems assumes.
func TestItemsField(t *testing.T) {
	for _, m := range []proto.Message{&agentv1.TransferRequest{}, &agentv1.TransferResponse{}} {
		fd := m.ProtoReflect().Descriptor().Fields().ByNumber(itemsField)
		if fd == nil || !fd.IsList() || fd.Message() == nil {
			t.Fatalf("%s field %d = %v, want the repeated message of items", m.ProtoReflect().Descriptor().FullName(), itemsField, fd)
		}
	}
}

func TestCheckRequestLengthSum(t *testing.T) {
	for _, tc := range []struct {
		lengths []uint64
		ok      bool
	}{
		{[]uint64{math.MaxInt64}, true},
		{[]uint64{math.MaxInt64, 1}, false},
		{[]uint64{math.MaxUint64}, false},
		{[]uint64{1 << 62, 1 << 62, 1 << 62}, false},
		{[]uint64{1, math.MaxUint64}, false}, // would wrap to 0
	} {
		req := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE}
		for _, n := range tc.lengths {
			req.Items = append(req.Items, &agentv1.TransferItem{Length: n})
		}
		if err := CheckRequest(req); (err == nil) != tc.ok || (err != nil && rpcerr.Reason(err) != "INVALID_PARAMS") {
			t.Errorf("CheckRequest(lengths %v) = %v, want ok=%v (else INVALID_PARAMS)", tc.lengths, err, tc.ok)
		}
	}
}

// FuzzCountItems checks the raw item count against the decoder: for any
// header that decodes, countItems agrees with the decoded item and result
// counts (up to MaxItems+1, where it stops).
func FuzzCountItems(f *testing.F) {
	one, _ := AppendFrame(nil, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: []*agentv1.TransferItem{{SegmentId: "s"}, {}}})
	f.Add(one[lenSize:])
	f.Add(tinyItems(3))
	f.Add(tinyItems(MaxItems + 2))
	f.Add([]byte{0x13, 0x12, 0x00, 0x14}) // a group holding a field 2
	f.Fuzz(func(t *testing.T, b []byte) {
		n := countItems(b)
		if n > MaxItems+1 {
			t.Fatalf("countItems = %d, it stops at %d", n, MaxItems+1)
		}
		req, resp := &agentv1.TransferRequest{}, &agentv1.TransferResponse{}
		if proto.Unmarshal(b, req) == nil && min(len(req.GetItems()), MaxItems+1) != n {
			t.Fatalf("countItems = %d, the request decodes with %d items", n, len(req.GetItems()))
		}
		if proto.Unmarshal(b, resp) == nil && min(len(resp.GetResults()), MaxItems+1) != n {
			t.Fatalf("countItems = %d, the response decodes with %d results", n, len(resp.GetResults()))
		}
		// Every prefix counts at most as many.
		for _, k := range []int{len(b) / 2, len(b) - 1} {
			if k >= 0 && countItems(b[:k]) > n {
				t.Fatalf("a %d-byte prefix counts %d items, the whole %d", k, countItems(b[:k]), n)
			}
		}
	})
}

// BenchmarkReadFrame decodes a request header of 128 and 4096 items, as
// the agent does for every request (the raw item count included).
func BenchmarkReadFrame(b *testing.B) {
	for _, n := range []int{128, MaxItems} {
		req := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE}
		for i := range n {
			req.Items = append(req.Items, &agentv1.TransferItem{SegmentId: "6c3d1b7e-2f4a-4e8b-9c0d-1a2b3c4d5e6f", AllocationId: uint64(i), Token: make([]byte, 60), Length: 4096})
		}
		wire, err := AppendFrame(nil, req)
		if err != nil {
			b.Fatal(err)
		}
		b.Run("items="+strconv.Itoa(n), func(b *testing.B) {
			r := bytes.NewReader(wire)
			var scratch []byte
			m := &agentv1.TransferRequest{}
			b.SetBytes(int64(len(wire)))
			for b.Loop() {
				r.Reset(wire)
				if scratch, err = ReadFrame(r, scratch, m); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
