package xfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/pkg/rpcerr"
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
		{"unknown op", &agentv1.TransferRequest{Op: 3, Items: many[:1]}, false},
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
