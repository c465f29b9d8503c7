// Package rpccodec is the gRPC codec every Crescent process uses: the
// standard "proto" wire format, encoded and decoded by the reflection-free
// code protoc-gen-go-vtproto writes beside the generated messages (gen/…
// *_vtproto.pb.go). A message without that code (health checks, reflection)
// goes through grpc-go's own proto codec, so the bytes on the wire and every
// peer's view of them are exactly those of the default codec.
//
// Why: with batch puts and gets of 4 KiB objects, reflective protobuf
// marshalling and unmarshalling was about a sixth of the CPU of the master,
// the agents, the gateway and the client. The generated code does the same
// work without reflection and with fewer allocations.
//
// The codec is scoped, not registered globally: servers take [ServerOption],
// clients [DialOption], so an application that embeds the SDK keeps its own
// codec for its own connections.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package rpccodec

import (
	"errors"
	"fmt"
	"slices"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	// The default codec, used for messages without generated fast paths.
	_ "google.golang.org/grpc/encoding/proto"
)

// Name is the codec's name; it is the standard "proto" content subtype.
const Name = "proto"

// vtMessage is what protoc-gen-go-vtproto generates with the features
// marshal+unmarshal+size.
type vtMessage interface {
	SizeVT() int
	MarshalToSizedBufferVT(dAtA []byte) (int, error)
	UnmarshalVT(dAtA []byte) error
}

// Codec implements encoding.CodecV2.
type Codec struct {
	fallback encoding.CodecV2
	// limited: decode only messages within MessageBudget (servers).
	limited bool
}

// New returns the codec.
func New() *Codec {
	fb := encoding.GetCodecV2(Name)
	if fb == nil {
		panic("rpccodec: grpc-go's proto codec is not registered")
	}
	return &Codec{fallback: fb}
}

// NewServer returns the codec a server decodes requests with: New's, but a
// message holding more nested messages than MessageBudget allows for its
// size is refused before anything is decoded (ErrTooManyMessages).
func NewServer() *Codec {
	c := New()
	c.limited = true
	return c
}

var (
	codec       = New()
	serverCodec = NewServer()
)

// ServerOption makes a gRPC server use the codec for every method, with
// requests held to MessageBudget.
func ServerOption() grpc.ServerOption { return grpc.ForceServerCodecV2(serverCodec) }

// Nested messages are what a hostile request can multiply: an empty one is
// two bytes on the wire and a struct of up to ~200 bytes (plus its pointer)
// once decoded, so a 256 MiB request of them would decode into ~25 GiB
// before any handler could count its items. A server therefore decodes a
// request only if it holds at most FreeMessages nested messages plus one
// per BytesPerMessage bytes of its size: a 10,000-item batch of anything
// and an agent's Register of millions of allocations (each well over 32
// bytes) pass, and decoding costs at most a few times the request's size.
const (
	FreeMessages    = 1 << 16
	BytesPerMessage = 32
)

// MessageBudget is the number of nested messages a server accepts in a
// request of n bytes.
func MessageBudget(n int) int { return FreeMessages + n/BytesPerMessage }

// ErrTooManyMessages refuses a request past MessageBudget. gRPC reports a
// request its codec refuses as INTERNAL, with this text in the message.
var ErrTooManyMessages = errors.New("rpccodec: request holds more nested messages than its size allows")

// DialOption makes every call on a client connection use the codec.
func DialOption() grpc.DialOption {
	return grpc.WithDefaultCallOptions(grpc.ForceCodecV2(codec))
}

// Name implements encoding.CodecV2.
func (c *Codec) Name() string { return Name }

// Marshal implements encoding.CodecV2. Large messages are written into a
// buffer from gRPC's pool, which gRPC returns once the frame is sent.
func (c *Codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(vtMessage)
	if !ok {
		return c.fallback.Marshal(v)
	}
	size := m.SizeVT()
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf := make([]byte, size)
		if _, err := m.MarshalToSizedBufferVT(buf); err != nil {
			return nil, fmt.Errorf("rpccodec: marshal %T: %w", v, err)
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(size)
	if _, err := m.MarshalToSizedBufferVT(*buf); err != nil {
		pool.Put(buf)
		return nil, fmt.Errorf("rpccodec: marshal %T: %w", v, err)
	}
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// Unmarshal implements encoding.CodecV2. The generated decoder copies every
// string and bytes field out of data, so gRPC may reuse data's buffers as
// soon as this returns. A message received in one buffer is decoded in
// place; one spread over several is joined first.
func (c *Codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if _, vt := v.(vtMessage); !ok || !vt {
		return c.fallback.Unmarshal(data, v)
	}
	if len(data) == 1 {
		return c.unmarshal(data[0].ReadOnlyData(), m)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	return c.unmarshal(buf.ReadOnlyData(), m)
}

func (c *Codec) unmarshal(b []byte, m proto.Message) error {
	if c.limited {
		return UnmarshalLimited(b, m)
	}
	return Unmarshal(b, m)
}

// errInvalidUTF8 is proto.Unmarshal's refusal, word for word.
var errInvalidUTF8 = errors.New("proto: string field contains invalid UTF-8")

// AppendMarshal appends m's encoding to b, like proto.MarshalOptions's
// MarshalAppend, through the generated code when m has it. The bulk
// transfer protocol (internal/xfer) frames its headers with it.
func AppendMarshal(b []byte, m proto.Message) ([]byte, error) {
	vm, ok := m.(vtMessage)
	if !ok {
		return proto.MarshalOptions{}.MarshalAppend(b, m)
	}
	size := vm.SizeVT()
	b = slices.Grow(b, size)
	out := b[len(b) : len(b)+size]
	if _, err := vm.MarshalToSizedBufferVT(out); err != nil {
		return b, err
	}
	return b[:len(b)+size], nil
}

// Unmarshal decodes b into m (replacing its contents), like proto.Unmarshal,
// through the generated code when m has it. m keeps no reference to b.
//
// It accepts exactly what proto.Unmarshal accepts, and refuses with its
// errors. The generated decoder differs from it in three ways: it does not
// check UTF-8, it skips unknown groups without matching their ends, and it
// refuses a known field sent with the wrong wire type (proto.Unmarshal keeps
// it as an unknown field). check covers the first two; for anything check or
// the generated decoder refuses, proto.Unmarshal decides (a slow path that
// conforming peers never take). Unknown fields are kept as their raw bytes
// (proto.Unmarshal re-encodes their tags; known fields decode the same), and
// vtprotobuf's well-known types drop theirs.
func Unmarshal(b []byte, m proto.Message) error { return unmarshal(b, m, unlimited) }

// UnmarshalLimited is Unmarshal for a request a server received: it also
// refuses, with ErrTooManyMessages and before decoding anything, b that holds
// more than MessageBudget(len(b)) nested messages. Messages without
// generated code are decoded by proto.Unmarshal, unchecked.
func UnmarshalLimited(b []byte, m proto.Message) error {
	return unmarshal(b, m, MessageBudget(len(b)))
}

// FastDecoder is a message with a decoder of its own for some encodings
// of it. DecodeFast is given the reset message; it either declines (false,
// the message left empty), and the codec decodes b as usual, or decodes b
// into the message exactly as the codec would and reports true, and the
// codec skips its own check of b, a walk of the whole message. So it must
// decline whatever the codec would refuse or treat specially: a string
// field that is not UTF-8, more than budget nested messages (each costs
// one, as in check), anything malformed. session.connectRequest decodes
// agents' allocation tables so.
type FastDecoder interface {
	DecodeFast(b []byte, budget int) bool
}

func unmarshal(b []byte, m proto.Message, budget int) error {
	vm, ok := m.(vtMessage)
	if !ok {
		return proto.Unmarshal(b, m)
	}
	if fd, ok := m.(FastDecoder); ok {
		proto.Reset(m)
		if fd.DecodeFast(b, budget) {
			return nil
		}
	}
	switch shapeOf(m.ProtoReflect().Descriptor()).check(b, &budget) {
	case badUTF8:
		return errInvalidUTF8
	case badWireFmt:
		return proto.Unmarshal(b, m)
	case tooMany:
		return fmt.Errorf("%w: more than %d in %d bytes", ErrTooManyMessages, MessageBudget(len(b)), len(b))
	}
	// UnmarshalVT merges into the message; proto.Unmarshal (and gRPC's
	// contract) replaces it.
	proto.Reset(m)
	if err := vm.UnmarshalVT(b); err != nil {
		proto.Reset(m)
		return proto.Unmarshal(b, m)
	}
	return nil
}
