package client

import (
	"bytes"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// split cuts b into pieces of at most n bytes (the transport hands the codec
// a frame in several buffers).
func split(b []byte, n int) [][]byte {
	var out [][]byte
	for len(b) > n {
		out, b = append(out, b[:n]), b[n:]
	}
	return append(out, b)
}

func decodeSink(bufs [][]byte) (*readSink, []byte, error) {
	var got []byte
	s := &readSink{put: func(p []byte) error { got = append(got, p...); return nil }}
	err := s.decode(bufs)
	return s, got, err
}

func TestReadSinkMatchesProto(t *testing.T) {
	msg := &agentv1.ReadResponse{Data: bytes.Repeat([]byte("abcdefg"), 1000), ObjectSize: 123456, Checksum: 0xdeadbeefcafe}
	b, err := proto.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	// An unknown field (number 9, bytes) must be skipped.
	b = protowire.AppendTag(b, 9, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("future"))
	for _, n := range []int{1, 3, 100, len(b)} {
		s, got, err := decodeSink(split(b, n))
		if err != nil {
			t.Fatalf("pieces of %d: %v", n, err)
		}
		if !bytes.Equal(got, msg.GetData()) || s.objectSize != msg.GetObjectSize() || s.checksum != msg.GetChecksum() {
			t.Fatalf("pieces of %d: decoded %d bytes size=%d sum=%x", n, len(got), s.objectSize, s.checksum)
		}
	}
	if _, _, err := decodeSink([][]byte{b[:len(b)-3]}); err == nil {
		t.Fatal("a truncated message must fail")
	}
}

// FuzzReadSink: the hand-written decoder of network bytes never panics and
// agrees with proto.Unmarshal on every message both accept.
func FuzzReadSink(f *testing.F) {
	b, _ := proto.Marshal(&agentv1.ReadResponse{Data: []byte("hello"), ObjectSize: 5, Checksum: 7})
	f.Add(b, 2)
	f.Add([]byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f}, 1)
	f.Add([]byte{0x0a, 0x01, 'a', 0x0a, 0x01, 'b'}, 1)
	f.Fuzz(func(t *testing.T, b []byte, n int) {
		if n <= 0 {
			n = 1
		}
		s, got, err := decodeSink(split(b, n))
		var want agentv1.ReadResponse
		perr := proto.Unmarshal(b, &want)
		if err != nil || perr != nil {
			return
		}
		if !bytes.Equal(got, want.GetData()) || s.objectSize != want.GetObjectSize() || s.checksum != want.GetChecksum() {
			t.Fatalf("decoder disagrees with proto.Unmarshal on %x", b)
		}
	})
}
