package rpccodec

import (
	"sync"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// proto.Unmarshal rejects a proto3 string field that is not valid UTF-8; the
// generated UnmarshalVT does not check. Every key, tenant and id the master
// stores arrives in a string field, and a stored invalid string would later
// make every standard decoder (grpcurl, Python, the default Go codec) fail on
// any message that carries it. So before the generated decoder runs, one pass
// over the encoded bytes checks every string field, at any depth, exactly as
// proto.Unmarshal would: the same messages are accepted and refused.

// shape is what the check needs to know of a message type: which field
// numbers hold strings and which hold messages (and their shapes), indexed by
// field number.
type shape struct {
	kinds []fieldKind
	msgs  []*shape
}

type fieldKind uint8

const (
	other fieldKind = iota
	str
	msg
)

var shapes sync.Map // protoreflect.FullName → *shape

// shapeOf returns the (cached) shape of md.
func shapeOf(md protoreflect.MessageDescriptor) *shape {
	if s, ok := shapes.Load(md.FullName()); ok {
		return s.(*shape)
	}
	s := build(md, map[protoreflect.FullName]*shape{})
	actual, _ := shapes.LoadOrStore(md.FullName(), s)
	return actual.(*shape)
}

// build computes md's shape; seen breaks recursive message types.
func build(md protoreflect.MessageDescriptor, seen map[protoreflect.FullName]*shape) *shape {
	if s, ok := seen[md.FullName()]; ok {
		return s
	}
	s := &shape{}
	seen[md.FullName()] = s
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		var k fieldKind
		switch fd.Kind() {
		case protoreflect.StringKind:
			k = str
		case protoreflect.MessageKind:
			k = msg
		default:
			continue
		}
		n := int(fd.Number())
		if n >= len(s.kinds) {
			s.kinds = append(s.kinds, make([]fieldKind, n+1-len(s.kinds))...)
			s.msgs = append(s.msgs, make([]*shape, n+1-len(s.msgs))...)
		}
		s.kinds[n] = k
		if k == msg {
			s.msgs[n] = build(fd.Message(), seen)
		}
	}
	return s
}

// verdict is what check found.
type verdict uint8

const (
	valid      verdict = iota
	badUTF8            // a string field is not UTF-8
	badWireFmt         // malformed wire data (the decoder words the error)
	tooMany            // more nested messages than the budget allows
)

// unlimited is a message budget no input can exhaust.
const unlimited = int(^uint(0) >> 1)

// check walks b, a message of shape s, and every message field in it, at
// any depth: each string field must be valid UTF-8, and the wire format
// must be well formed (the generated decoder skips unknown groups without
// matching their ends; proto.Unmarshal refuses a mismatched end group).
// Each message field found costs one from *budget; check answers tooMany
// once it goes negative.
func (s *shape) check(b []byte, budget *int) verdict {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num > protowire.MaxValidNumber {
			return badWireFmt
		}
		b = b[n:]
		if typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return badWireFmt
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return badWireFmt
		}
		b = b[n:]
		if int(num) >= len(s.kinds) {
			continue
		}
		switch s.kinds[num] {
		case str:
			if !utf8.Valid(v) {
				return badUTF8
			}
		case msg:
			if *budget--; *budget < 0 {
				return tooMany
			}
			if r := s.msgs[num].check(v, budget); r != valid {
				return r
			}
		}
	}
	return valid
}
