// Package fastcall is the master's lookup listener: the calls
// ObjectService.CallStream carries, framed on plain connections instead of
// one gRPC stream (issue 18, item 1).
//
// Why: a lookup's cost is mostly its transport. On the call stream a
// message passes about eight goroutines (the client's sender, its HTTP/2
// writer, the master's HTTP/2 reader, the stream's receiver and a worker,
// the master's HTTP/2 writer, the client's HTTP/2 reader and its
// receiver), each a wake-up that waits for a core when the machine is
// busy; the master's own work is a small part (BENCHMARKS.md, "What a
// lookup without gRPC could give item 1"). Here the caller's goroutine
// writes its request and reads the answer on a connection of its own, and
// the master's goroutine of that connection reads the request, runs the
// call and writes the answer: two wake-ups.
//
// The protocol, on TCP (TLS when the master has it):
//
//	client: Preamble ("CFC1"), once per connection
//	then, one call at a time: client frame (a CallStreamRequest),
//	                          master frame (its CallStreamResponse)
//	frame:  4-byte big-endian length, then that many bytes of protobuf
//
// The master answers every call, as CallStream does, through its unary
// interceptors under the carried method's name (authorization and tenant
// checks from the connection's TLS certificate, leader gate, metrics,
// logs): the listener adds no way around a rule. A request it cannot
// decode, or one over MaxRequest, ends the connection.
//
// Internal to the Crescent module.
package fastcall

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"google.golang.org/protobuf/proto"
)

const (
	// Preamble opens every connection, sent once by the client.
	Preamble = "CFC1"
	// MaxRequest bounds a request frame: a BatchGetReplicaList of the most
	// items a batch may name (4096) with keys of the longest (4 KiB) fits.
	MaxRequest = 20 << 20
	// MaxResponse is the most a client accepts in one answer.
	MaxResponse = 256 << 20
	// readStep is how much a frame's buffer grows at a time: a peer that
	// announces MaxRequest and sends nothing holds little.
	readStep = 64 << 10
)

// ErrProtocol is a peer that broke the protocol (a bad preamble, a frame
// over the limit, bytes that do not decode).
var ErrProtocol = errors.New("fastcall: protocol violation")

// vtMarshaler is a message vtprotobuf generated a marshaler for.
type vtMarshaler interface {
	SizeVT() int
	MarshalToSizedBufferVT(b []byte) (int, error)
}

// AppendFrame appends m, framed, to b; an error for a frame over limit.
func AppendFrame(b []byte, m proto.Message, limit int) ([]byte, error) {
	vm, vt := m.(vtMarshaler)
	var n int
	if vt {
		n = vm.SizeVT()
	} else {
		n = proto.Size(m)
	}
	if n > limit {
		return b, fmt.Errorf("%w: a frame of %d bytes, over the %d-byte limit", ErrProtocol, n, limit)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(n))
	if !vt {
		return proto.MarshalOptions{}.MarshalAppend(b, m)
	}
	start := len(b)
	b = append(b, make([]byte, n)...)
	if _, err := vm.MarshalToSizedBufferVT(b[start:]); err != nil {
		return b[:start-4], err
	}
	return b, nil
}

// ReadFrame reads one frame's bytes into buf (grown as the bytes arrive,
// never past limit) and returns them; io.EOF when the connection ended
// between frames.
func ReadFrame(r io.Reader, buf []byte, limit int) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return buf[:0], err
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n > limit {
		return buf[:0], fmt.Errorf("%w: a frame of %d bytes, over the %d-byte limit", ErrProtocol, n, limit)
	}
	buf = buf[:0]
	for len(buf) < n {
		step := min(n-len(buf), readStep)
		if cap(buf)-len(buf) < step {
			buf = append(buf[:cap(buf)], make([]byte, step)...)[:len(buf)]
		}
		k, err := io.ReadFull(r, buf[len(buf):len(buf)+step])
		buf = buf[:len(buf)+k]
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return buf, err
		}
	}
	return buf, nil
}
