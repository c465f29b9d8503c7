package dataplane

import (
	"errors"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// directRead is a client-side ReadResponse sink for the benchmarks: with
// directCodec it receives each chunk's data straight from the transport's
// buffers into dst (one copy), where the standard codec flattens the frames
// and then unmarshals into a fresh slice before the caller copies it out.
// It shows what a client (pkg/client) gains from the same technique the
// server codec uses.
type directRead struct {
	dst        []byte
	n          int
	objectSize uint64
	checksum   uint64
}

type directCodec struct{ base encoding.CodecV2 }

func (c directCodec) Name() string                           { return "proto" }
func (c directCodec) Marshal(v any) (mem.BufferSlice, error) { return c.base.Marshal(v) }

var errDirect = errors.New("direct read: unexpected wire format")

func (c directCodec) Unmarshal(data mem.BufferSlice, v any) error {
	d, ok := v.(*directRead)
	if !ok {
		return c.base.Unmarshal(data, v)
	}
	bufs := make([][]byte, len(data))
	for i, b := range data {
		bufs[i] = b.ReadOnlyData()
	}
	cur := cursor{bufs: bufs}
	for !cur.done() {
		tag, ok := cur.varint()
		if !ok {
			return errDirect
		}
		switch {
		case tag == uint64(protowire.EncodeTag(1, protowire.BytesType)):
			n, ok := cur.varint()
			if !ok || n > uint64(len(d.dst)-d.n) {
				return errDirect
			}
			pieces, ok := cur.take(n, nil)
			if !ok {
				return errDirect
			}
			for _, p := range pieces {
				d.n += copy(d.dst[d.n:], p)
			}
		case tag == uint64(protowire.EncodeTag(2, protowire.VarintType)):
			if d.objectSize, ok = cur.varint(); !ok {
				return errDirect
			}
		case tag == uint64(protowire.EncodeTag(3, protowire.VarintType)):
			if d.checksum, ok = cur.varint(); !ok {
				return errDirect
			}
		default:
			return errDirect
		}
	}
	return nil
}
