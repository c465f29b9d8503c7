package link

import (
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
)

// connectCodec is the codec of the Connect stream: internal/rpccodec, with one
// shortcut. A master message received into a connectResponse (recvLoop)
// first takes its fast path (decode.go) with that path's own UTF-8 check of
// the strings it decodes; only when the path declines does rpccodec decode
// the message, with its check pass over every field (UTF-8 and wire format)
// first. That pass was a quarter of the agent's decoding of a batched
// command. An input the fast path accepts is one the pass accepts (every
// field known, well formed and of its declared wire type, every string
// UTF-8), so the result is the same.
type connectCodec struct {
	base encoding.CodecV2
}

func newConnectCodec() connectCodec { return connectCodec{base: rpccodec.New()} }

// Name implements encoding.CodecV2.
func (c connectCodec) Name() string { return c.base.Name() }

// Marshal implements encoding.CodecV2.
func (c connectCodec) Marshal(v any) (mem.BufferSlice, error) { return c.base.Marshal(v) }

// Unmarshal implements encoding.CodecV2.
func (c connectCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(*connectResponse)
	if !ok {
		return c.base.Unmarshal(data, v)
	}
	var b []byte
	if len(data) == 1 {
		b = data[0].ReadOnlyData()
	} else {
		buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
		defer buf.Free()
		b = buf.ReadOnlyData()
	}
	m.ConnectResponse.Reset()
	if m.fast(b, true) {
		return nil
	}
	m.ConnectResponse.Reset()
	// What c.base.Unmarshal does, on the bytes already joined: a message
	// spread over several buffers (a large Settings) is not copied again.
	return rpccodec.Unmarshal(b, m)
}
