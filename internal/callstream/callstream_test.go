package callstream

import (
	"slices"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// TestCarried: the proto's oneofs make these methods carried, each call
// goes in and out of its envelope unchanged, and its answer too.
func TestCarried(t *testing.T) {
	want := []string{
		masterv1.ObjectService_BatchExist_FullMethodName, masterv1.ObjectService_BatchGetReplicaList_FullMethodName,
		masterv1.ObjectService_BatchPutEnd_FullMethodName, masterv1.ObjectService_BatchPutStart_FullMethodName,
		masterv1.ObjectService_Exist_FullMethodName, masterv1.ObjectService_GetReplicaList_FullMethodName,
		masterv1.ObjectService_PutEnd_FullMethodName, masterv1.ObjectService_PutStart_FullMethodName,
	}
	got := Methods()
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("carried methods %v, want %v", got, want)
	}
	svc := requestDesc.ParentFile().Services().ByName("ObjectService")
	for _, method := range got {
		md := svc.Methods().ByName(protoreflect.Name(method[len("/crescent.master.v1.ObjectService/"):]))
		in, err := protoregistry.GlobalTypes.FindMessageByName(md.Input().FullName())
		if err != nil {
			t.Fatal(err)
		}
		req := in.New().Interface()
		env, ok := Wrap(method, req)
		if !ok {
			t.Fatalf("%s: not wrapped", method)
		}
		m, back, ok := Unwrap(env)
		if !ok || m != method || back != req {
			t.Fatalf("%s: unwrapped as %s, %v, %v", method, m, back, ok)
		}
		out, _ := protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
		resp := out.New().Interface()
		a := &masterv1.CallStreamResponse{}
		if !SetAnswer(a, resp) || Answer(a) != resp {
			t.Fatalf("%s: answer %v not set", method, resp)
		}
	}
	// Not carried, or not the method's request: no envelope.
	if _, ok := Wrap(masterv1.ObjectService_Remove_FullMethodName, &masterv1.RemoveRequest{}); ok {
		t.Error("Remove wrapped")
	}
	if _, ok := Wrap(masterv1.ObjectService_PutStart_FullMethodName, &masterv1.PutEndRequest{}); ok {
		t.Error("a PutEndRequest wrapped as PutStart")
	}
	if _, _, ok := Unwrap(&masterv1.CallStreamRequest{RequestId: 1}); ok {
		t.Error("an envelope with no call unwrapped")
	}
	if SetAnswer(&masterv1.CallStreamResponse{}, &masterv1.RemoveResponse{}) || Answer(&masterv1.CallStreamResponse{}) != nil ||
		Answer(&masterv1.RemoveResponse{}) != nil {
		t.Error("an answer of a type CallStream does not carry")
	}
}
