// Package callstream maps the unary calls ObjectService.CallStream carries
// to and from its envelopes, from the proto's descriptors alone: a method
// is carried when CallStreamRequest's `call` oneof has a field of its
// request type, and its answer goes in the `answer` field of its response
// type. Adding a carried call is then a proto change (and the master's
// handler for it, objectsvc); the SDK and the master's dispatch follow.
//
// Internal to the Crescent module.
package callstream

import (
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

var (
	requestDesc  = (&masterv1.CallStreamRequest{}).ProtoReflect().Descriptor()
	responseDesc = (&masterv1.CallStreamResponse{}).ProtoReflect().Descriptor()
	callOneof    = requestDesc.Oneofs().ByName("call")
	answerOneof  = responseDesc.Oneofs().ByName("answer")

	// callField is the request field of each carried method (by full
	// method name, "/crescent.master.v1.ObjectService/PutStart"), and
	// methodOf the method of each request field (by its number).
	callField = map[string]protoreflect.FieldDescriptor{}
	methodOf  = map[protoreflect.FieldNumber]string{}
	// answerField is the answer field of each response type.
	answerField = map[protoreflect.FullName]protoreflect.FieldDescriptor{}
)

func init() {
	svc := requestDesc.ParentFile().Services().ByName("ObjectService")
	byType := func(o protoreflect.OneofDescriptor, t protoreflect.FullName) protoreflect.FieldDescriptor {
		for i := range o.Fields().Len() {
			if f := o.Fields().Get(i); f.Message() != nil && f.Message().FullName() == t {
				return f
			}
		}
		return nil
	}
	for i := range svc.Methods().Len() {
		md := svc.Methods().Get(i)
		in := byType(callOneof, md.Input().FullName())
		if in == nil {
			continue
		}
		out := byType(answerOneof, md.Output().FullName())
		if out == nil {
			panic(fmt.Sprintf("callstream: CallStreamResponse.answer has no field of %s, the answer of %s", md.Output().FullName(), md.Name()))
		}
		full := "/" + string(svc.FullName()) + "/" + string(md.Name())
		if prev, dup := methodOf[in.Number()]; dup {
			panic(fmt.Sprintf("callstream: %s and %s take the same request type: a carried call must name its method", prev, full))
		}
		callField[full], methodOf[in.Number()] = in, full
		answerField[md.Output().FullName()] = out
	}
}

// Carries reports whether CallStream carries method (a full method name).
func Carries(method string) bool { return callField[method] != nil }

// Methods are the full names of the methods CallStream carries.
func Methods() []string {
	out := make([]string, 0, len(callField))
	for m := range callField {
		out = append(out, m)
	}
	return out
}

// Wrap is the envelope carrying req as a call of method; false when
// CallStream does not carry method or req is not its request.
func Wrap(method string, req any) (*masterv1.CallStreamRequest, bool) {
	f := callField[method]
	q, ok := req.(proto.Message)
	if f == nil || !ok || q.ProtoReflect().Descriptor() != f.Message() {
		return nil, false
	}
	m := &masterv1.CallStreamRequest{}
	m.ProtoReflect().Set(f, protoreflect.ValueOfMessage(q.ProtoReflect()))
	return m, true
}

// Unwrap is the call an envelope carries, with its full method name; false
// when it carries none this build knows (a newer client's).
func Unwrap(m *masterv1.CallStreamRequest) (method string, req proto.Message, ok bool) {
	rm := m.ProtoReflect()
	f := rm.WhichOneof(callOneof)
	if f == nil {
		return "", nil, false
	}
	return methodOf[f.Number()], rm.Get(f).Message().Interface(), true
}

// SetAnswer puts resp, a carried method's response, in m's answer; false
// when no answer field has resp's type.
func SetAnswer(m *masterv1.CallStreamResponse, resp proto.Message) bool {
	f := answerField[resp.ProtoReflect().Descriptor().FullName()]
	if f == nil {
		return false
	}
	m.ProtoReflect().Set(f, protoreflect.ValueOfMessage(resp.ProtoReflect()))
	return true
}

// Answer is the response an answer carries, or nil. m is a
// CallStreamResponse, or a type that embeds one (its ProtoReflect is the
// embedded message's).
func Answer(m proto.Message) proto.Message {
	rm := m.ProtoReflect()
	if rm.Descriptor() != responseDesc {
		return nil
	}
	f := rm.WhichOneof(answerOneof)
	if f == nil {
		return nil
	}
	return rm.Get(f).Message().Interface()
}
