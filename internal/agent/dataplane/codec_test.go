package dataplane

import (
	"bytes"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// split cuts b into buffers at the given cut points (mod len).
func split(b []byte, cuts []byte) mem.BufferSlice {
	var out mem.BufferSlice
	prev := 0
	for _, c := range cuts {
		if len(b) == 0 {
			break
		}
		at := int(c) % (len(b) + 1)
		if at < prev {
			continue
		}
		out = append(out, mem.SliceBuffer(b[prev:at]))
		prev = at
	}
	return append(out, mem.SliceBuffer(b[prev:]))
}

func concat(p [][]byte) []byte {
	var b []byte
	for _, x := range p {
		b = append(b, x...)
	}
	return b
}

// checkWriteDecode compares the fast path with proto.Unmarshal: both accept
// with the same header and data, or the fast path declines.
func checkWriteDecode(t *testing.T, wire []byte, cuts []byte) {
	t.Helper()
	var want agentv1.WriteRequest
	wantErr := proto.Unmarshal(wire, &want)
	m := newWriteMsg()
	ok := m.parse(split(wire, cuts))
	if !ok {
		return // the standard codec takes it
	}
	if wantErr != nil {
		t.Fatalf("fast path accepted bytes proto.Unmarshal rejects (%v): %x", wantErr, wire)
	}
	if got := concat(m.pieces); !bytes.Equal(got, want.GetData()) || m.n != len(got) {
		t.Fatalf("data %x (n %d), want %x", got, m.n, want.GetData())
	}
	if !proto.Equal(m.header, want.GetHeader()) {
		t.Fatalf("header %v, want %v", m.header, want.GetHeader())
	}
}

func TestWriteDecode(t *testing.T) {
	hdr := &agentv1.WriteHeader{SegmentId: "seg", AllocationId: 7, Token: []byte("tok"), Offset: 9}
	std, _ := proto.Marshal(&agentv1.WriteRequest{Header: hdr, Data: bytes.Repeat([]byte("ab"), 5000)})
	dataFirst := protowire.AppendTag(nil, 2, protowire.BytesType)
	dataFirst = protowire.AppendBytes(dataFirst, []byte("first"))
	hb, _ := proto.Marshal(hdr)
	dataFirst = protowire.AppendTag(dataFirst, 1, protowire.BytesType)
	dataFirst = protowire.AppendBytes(dataFirst, hb)
	twice := protowire.AppendTag(append([]byte(nil), dataFirst...), 2, protowire.BytesType)
	twice = protowire.AppendBytes(twice, []byte("second wins"))
	unknown := protowire.AppendTag(append([]byte(nil), std...), 99, protowire.VarintType)
	unknown = protowire.AppendVarint(unknown, 5)
	tests := []struct {
		name   string
		wire   []byte
		wantOK bool
	}{
		{"standard order", std, true},
		{"data before header", dataFirst, true},
		{"repeated data field", twice, true},
		{"unknown field", unknown, true},
		{"empty", nil, true},
		{"truncated", std[:len(std)-1], false},
		{"header as varint", []byte{0x08, 0x01}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, cuts := range [][]byte{nil, {1}, {3, 17, 200}, {0, 0, 5}} {
				checkWriteDecode(t, tc.wire, cuts)
				if ok := newWriteMsg().parse(split(tc.wire, cuts)); ok != tc.wantOK {
					t.Fatalf("parse = %v, want %v", ok, tc.wantOK)
				}
			}
		})
	}
}

// FuzzWriteDecode: the in-place WriteRequest decoder (bytes from the
// network) never panics and agrees with proto.Unmarshal whenever it accepts.
func FuzzWriteDecode(f *testing.F) {
	std, _ := proto.Marshal(&agentv1.WriteRequest{Header: &agentv1.WriteHeader{SegmentId: "s", AllocationId: 1, Token: []byte{1, 2}}, Data: []byte("hello world")})
	f.Add(std, []byte{3, 9})
	f.Add([]byte{0x12, 0x80, 0x80, 0x80, 0x80, 0x10}, []byte{1})
	f.Add([]byte{0x0a, 0x02, 0x08, 0x01, 0x12, 0x00}, []byte{})
	f.Fuzz(func(t *testing.T, wire, cuts []byte) {
		checkWriteDecode(t, wire, cuts)
	})
}

func TestReadChunkMarshal(t *testing.T) {
	c := newCodec()
	closed := 0
	p := newPin(func() { closed++ })
	big := bytes.Repeat([]byte{7}, 64<<10)
	for _, tc := range []struct {
		name string
		r    *agentv1.ReadResponse
	}{
		{"first chunk", &agentv1.ReadResponse{Data: big, ObjectSize: 1 << 40, Checksum: 0xfeed}},
		{"later chunk", &agentv1.ReadResponse{Data: big}},
		{"small chunk copied", &agentv1.ReadResponse{Data: []byte("tiny"), ObjectSize: 4}},
		{"empty object", &agentv1.ReadResponse{ObjectSize: 0, Checksum: 5}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs, err := c.Marshal(&readChunk{ReadResponse: tc.r, pin: p})
			if err != nil {
				t.Fatal(err)
			}
			var got agentv1.ReadResponse
			if err := proto.Unmarshal(bs.Materialize(), &got); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&got, tc.r) {
				t.Fatalf("round trip = %v, want %v", &got, tc.r)
			}
			want, _ := proto.Marshal(tc.r)
			if !bytes.Equal(bs.Materialize(), want) {
				t.Fatal("encoding differs from proto.Marshal")
			}
			bs.Free()
		})
	}
	if closed != 0 {
		t.Fatal("pin fired while the handler holds it")
	}
	p.done()
	if closed != 1 {
		t.Fatalf("pin fired %d times after every buffer and the handler let go, want 1", closed)
	}
}

func TestPinWaitsForBuffers(t *testing.T) {
	closed := 0
	p := newPin(func() { closed++ })
	bs, err := newCodec().Marshal(&readChunk{ReadResponse: &agentv1.ReadResponse{Data: make([]byte, 1<<20)}, pin: p})
	if err != nil {
		t.Fatal(err)
	}
	p.done()
	if closed != 0 {
		t.Fatal("handle closed while gRPC still holds a buffer aliasing it")
	}
	bs.Free()
	if closed != 1 {
		t.Fatalf("closed %d times after the buffer was freed, want 1", closed)
	}
}
