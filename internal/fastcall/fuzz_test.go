package fastcall

import (
	"bytes"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
)

// FuzzRequest: whatever a peer sends after the preamble, reading a frame
// and decoding it as the server does never panics, never holds more than
// the frame's bytes, and refuses frames over the limit.
func FuzzRequest(f *testing.F) {
	for _, m := range []*masterv1.CallStreamRequest{lookup(1, "a", "b"), lookup(2), {RequestId: 3}} {
		b, err := AppendFrame(nil, m, MaxRequest)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0, 0, 0, 2, 0x0a, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		const limit = 1 << 16
		in, err := ReadFrame(bytes.NewReader(b), nil, limit)
		if err != nil {
			return
		}
		if len(in) > limit || len(in) > len(b) {
			t.Fatalf("a frame of %d bytes from %d", len(in), len(b))
		}
		var req masterv1.CallStreamRequest
		_ = rpccodec.UnmarshalLimited(in, &req)
	})
}
