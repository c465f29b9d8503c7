package objectsvc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/callstream"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// callErr is a CallStreamResponse's status as the error a unary call
// would have returned (nil for OK).
func callErr(m *masterv1.CallStreamResponse) error {
	return status.ErrorProto(&spb.Status{Code: m.GetCode(), Message: m.GetMessage(), Details: m.GetDetails()})
}

func lookupCall(id uint64, timeoutMs uint32, tenant string, keys ...string) *masterv1.CallStreamRequest {
	req := &masterv1.BatchGetReplicaListRequest{}
	for _, k := range keys {
		req.Items = append(req.Items, &masterv1.GetReplicaListRequest{Tenant: tenant, Key: k})
	}
	return &masterv1.CallStreamRequest{RequestId: id, TimeoutMs: timeoutMs,
		Call: &masterv1.CallStreamRequest_BatchGetReplicaList{BatchGetReplicaList: req}}
}

// sendLookups sends n lookups of tenant t's key k, request ids 1 to n.
func sendLookups(t *testing.T, st masterv1.ObjectService_CallStreamClient, n int) {
	t.Helper()
	for i := range n {
		if err := st.Send(lookupCall(uint64(i+1), 0, "t", "k")); err != nil {
			t.Fatal(err)
		}
	}
}

// recvAll receives n answers, by request id.
func recvAll(t *testing.T, st masterv1.ObjectService_CallStreamClient, n int) map[uint64]*masterv1.CallStreamResponse {
	t.Helper()
	got := map[uint64]*masterv1.CallStreamResponse{}
	for range n {
		m, err := st.Recv()
		if err != nil {
			t.Fatalf("Recv after %d answers: %v", len(got), err)
		}
		if _, dup := got[m.GetRequestId()]; dup {
			t.Fatalf("request %d answered twice", m.GetRequestId())
		}
		got[m.GetRequestId()] = m
	}
	return got
}

// TestCallStreamAnswersAsUnary: each carried call is answered under its
// request id as its unary call is (the same per-item outcomes, the same
// whole-call refusals), an unknown call is UNIMPLEMENTED without ending
// the stream, and a client that closes its side gets every answer, then
// the end.
func TestCallStreamAnswersAsUnary(t *testing.T) {
	h := start(t, 2, 1, 1<<20)
	h.put(t, "t", "a", 100, nil)
	h.put(t, "t", "b", 200, nil)
	ctx := t.Context()
	st, err := h.cli.CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tooMany := make([]string, 257) // Config.MaxBatch is 256
	for i := range tooMany {
		tooMany[i] = fmt.Sprint("k", i)
	}
	reqs := []*masterv1.CallStreamRequest{
		lookupCall(7, 0, "t", "a", "missing", "b"),
		lookupCall(8, 0, "t", "b"),
		{RequestId: 9}, // no call: what a newer client might send
		lookupCall(10, 0, "t", tooMany...),
		lookupCall(11, 0, "t", ""), // an invalid key: per item
	}
	for _, r := range reqs {
		if err := st.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	got := recvAll(t, st, len(reqs))
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("after every answer: %v, want the stream's end", err)
	}
	for _, r := range reqs {
		m := got[r.GetRequestId()]
		if m == nil {
			t.Fatalf("request %d not answered", r.GetRequestId())
		}
		lookup := r.GetBatchGetReplicaList()
		if lookup == nil {
			if status.Code(callErr(m)) != codes.Unimplemented {
				t.Errorf("request %d with no call: %v, want UNIMPLEMENTED", r.GetRequestId(), callErr(m))
			}
			continue
		}
		want, werr := h.cli.BatchGetReplicaList(ctx, lookup)
		gerr := callErr(m)
		if status.Code(gerr) != status.Code(werr) || rpcerr.Reason(gerr) != rpcerr.Reason(werr) {
			t.Errorf("request %d: %v; the unary call: %v", r.GetRequestId(), gerr, werr)
			continue
		}
		if werr != nil {
			continue
		}
		if len(m.GetBatchGetReplicaList().GetResults()) != len(want.GetResults()) {
			t.Fatalf("request %d: %d results, unary %d", r.GetRequestId(), len(m.GetBatchGetReplicaList().GetResults()), len(want.GetResults()))
		}
		for i, res := range m.GetBatchGetReplicaList().GetResults() {
			w := want.GetResults()[i]
			if !proto.Equal(res.GetStatus(), w.GetStatus()) || res.GetReplicaList().GetSize() != w.GetReplicaList().GetSize() ||
				len(res.GetReplicaList().GetReplicas()) != len(w.GetReplicaList().GetReplicas()) {
				t.Errorf("request %d item %d: %v; unary %v", r.GetRequestId(), i, res, w)
			}
		}
	}
	if status.Code(callErr(got[10])) != codes.InvalidArgument {
		t.Errorf("257 items: %v, want INVALID_ARGUMENT as the unary call", callErr(got[10]))
	}
}

// TestCallStreamRunsTheUnaryChain: every carried call goes through
// Config.Unary under its unary method's name, with its deadline (capped),
// and the chain's error, ErrorInfo included, is the call's answer.
func TestCallStreamRunsTheUnaryChain(t *testing.T) {
	var mu sync.Mutex
	var methods []string
	deadlines := map[string]time.Duration{}
	refused := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING, "not yet")
	h := startWith(t, 1, 1, 1<<20, Config{MaxBatch: 256, Unary: func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		key := req.(*masterv1.BatchGetReplicaListRequest).GetItems()[0].GetKey()
		d, _ := ctx.Deadline()
		mu.Lock()
		methods = append(methods, info.FullMethod)
		deadlines[key] = time.Until(d)
		mu.Unlock()
		if key == "refuse" {
			return nil, rpcerr.Status(refused)
		}
		return next(ctx, req)
	}})
	st, err := h.cli.CallStream(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range []*masterv1.CallStreamRequest{
		lookupCall(1, 0, "t", "default"), lookupCall(2, 200, "t", "short"),
		lookupCall(3, 3_600_000, "t", "long"), lookupCall(4, 0, "t", "refuse"),
	} {
		if err := st.Send(r); err != nil {
			t.Fatal(i, err)
		}
	}
	got := recvAll(t, st, 4)
	if err := callErr(got[4]); status.Code(err) != codes.Unavailable || rpcerr.Reason(err) != "MASTER_RECOVERING" {
		t.Errorf("refused call: %v; want UNAVAILABLE / MASTER_RECOVERING as the chain answered", err)
	}
	for id := uint64(1); id <= 3; id++ {
		if err := callErr(got[id]); err != nil {
			t.Errorf("call %d: %v", id, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, m := range methods {
		if m != masterv1.ObjectService_BatchGetReplicaList_FullMethodName {
			t.Errorf("the chain saw method %q", m)
		}
	}
	if d := deadlines["short"]; d <= 0 || d > 200*time.Millisecond {
		t.Errorf("timeout_ms 200: deadline in %v", d)
	}
	for _, k := range []string{"default", "long"} {
		if d := deadlines[k]; d <= MaxCallTimeout-5*time.Second || d > MaxCallTimeout {
			t.Errorf("%s: deadline in %v, want the cap %v", k, d, MaxCallTimeout)
		}
	}
}

// TestCallStreamCapsCallsInFlight: no more than MaxStreamCalls calls of one
// stream run at once; the rest wait, and every one is answered.
func TestCallStreamCapsCallsInFlight(t *testing.T) {
	var mu sync.Mutex
	running, most := 0, 0
	gate := make(chan struct{})
	h := startWith(t, 1, 1, 1<<20, Config{MaxBatch: 256, Unary: func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		if req.(*masterv1.BatchGetReplicaListRequest).GetItems()[0].GetKey() == "free" {
			return next(ctx, req)
		}
		mu.Lock()
		running++
		most = max(most, running)
		mu.Unlock()
		<-gate
		mu.Lock()
		running--
		mu.Unlock()
		return next(ctx, req)
	}})
	st, err := h.cli.CallStream(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// One call first: the stream, its sender and receiver and one worker
	// are up.
	if err := st.Send(lookupCall(1000, 0, "t", "free")); err != nil {
		t.Fatal(err)
	}
	recvAll(t, st, 1)
	base := testutil.Goroutines("objectsvc.(*Service).CallStream")
	const n = 3 * MaxStreamCalls
	sendLookups(t, st, n)
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if running < MaxStreamCalls {
			return fmt.Errorf("%d calls running", running)
		}
		return nil
	})
	// The rest have been sent; had the stream started more, they would
	// be running by now.
	time.Sleep(50 * time.Millisecond)
	close(gate)
	recvAll(t, st, n)
	mu.Lock()
	if most != MaxStreamCalls {
		t.Fatalf("%d calls ran at once, want MaxStreamCalls (%d)", most, MaxStreamCalls)
	}
	mu.Unlock()
	// The burst's workers do not stay: at most keepIdle wait for calls
	// (base counted the handler, its sender and receiver, and one worker).
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		if g := testutil.Goroutines("objectsvc.(*Service).CallStream"); g > base-1+keepIdle {
			return fmt.Errorf("%d goroutines, %d before the burst: more than keepIdle (%d) workers stayed", g, base, keepIdle)
		}
		return nil
	})
}

// TestCallStreamClose: Close ends the streams open with UNAVAILABLE /
// MASTER_SHUTTING_DOWN, and refuses new ones the same way.
func TestCallStreamClose(t *testing.T) {
	h := start(t, 1, 1, 1<<20)
	ctx := t.Context()
	st, err := h.cli.CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(lookupCall(1, 0, "t", "k")); err != nil {
		t.Fatal(err)
	}
	recvAll(t, st, 1)
	h.svc.Close()
	if _, err := st.Recv(); rpcerr.Reason(err) != "MASTER_SHUTTING_DOWN" || status.Code(err) != codes.Unavailable {
		t.Fatalf("an open stream after Close: %v, want UNAVAILABLE / MASTER_SHUTTING_DOWN", err)
	}
	st2, err := h.cli.CallStream(ctx)
	if err == nil {
		_, err = st2.Recv()
	}
	if rpcerr.Reason(err) != "MASTER_SHUTTING_DOWN" {
		t.Fatalf("a new stream after Close: %v", err)
	}
	// Unary calls are not the service's to refuse.
	if _, err := h.cli.BatchGetReplicaList(ctx, lookupCall(0, 0, "t", "k").GetBatchGetReplicaList()); err != nil {
		t.Fatalf("a unary call after Close: %v", err)
	}
}

// TestCallStreamClientGone: a client that cancels its stream with calls
// running leaves nothing behind (goleak, TestMain).
func TestCallStreamClientGone(t *testing.T) {
	gate := make(chan struct{})
	entered := make(chan struct{}, MaxStreamCalls)
	h := startWith(t, 1, 1, 1<<20, Config{MaxBatch: 256, Unary: func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		entered <- struct{}{}
		select {
		case <-gate:
		case <-ctx.Done(): // the stream's end reaches a running call
			return nil, ctx.Err()
		}
		return next(ctx, req)
	}})
	ctx, cancel := context.WithCancel(t.Context())
	st, err := h.cli.CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendLookups(t, st, 4)
	<-entered
	cancel()
	if _, err := st.Recv(); !errors.Is(err, context.Canceled) && status.Code(err) != codes.Canceled {
		t.Fatalf("Recv after cancel: %v", err)
	}
	close(gate)
}

// TestCallStreamCarriesPuts: PutStart, PutEnd and their batch forms on the
// stream make objects readable as the unary calls do, and refuse as they
// refuse (a PutEnd by another client); the single lookups and Exists
// carried find them.
func TestCallStreamCarriesPuts(t *testing.T) {
	h := start(t, 2, 1, 1<<20)
	ctx := t.Context()
	st, err := h.cli.CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	send := func(m *masterv1.CallStreamRequest) *masterv1.CallStreamResponse {
		t.Helper()
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
		return recvAll(t, st, 1)[m.GetRequestId()]
	}
	start := send(&masterv1.CallStreamRequest{RequestId: 1, Call: &masterv1.CallStreamRequest_PutStart{
		PutStart: &masterv1.PutStartRequest{Tenant: "t", Key: "one", Size: 100, ClientId: "w"}}})
	if err := callErr(start); err != nil || len(start.GetPutStart().GetReplicas()) != 1 {
		t.Fatalf("PutStart: %v, %v", start.GetPutStart(), err)
	}
	if err := callErr(send(&masterv1.CallStreamRequest{RequestId: 2, Call: &masterv1.CallStreamRequest_PutEnd{
		PutEnd: &masterv1.PutEndRequest{Tenant: "t", Key: "one", ClientId: "intruder", Checksum: 1}}})); err == nil {
		t.Fatal("PutEnd by a client that did not start the put: no error")
	}
	if err := callErr(send(&masterv1.CallStreamRequest{RequestId: 3, Call: &masterv1.CallStreamRequest_PutEnd{
		PutEnd: &masterv1.PutEndRequest{Tenant: "t", Key: "one", ClientId: "w", Checksum: 1}}})); err != nil {
		t.Fatalf("PutEnd: %v", err)
	}
	bs := send(&masterv1.CallStreamRequest{RequestId: 4, Call: &masterv1.CallStreamRequest_BatchPutStart{BatchPutStart: &masterv1.BatchPutStartRequest{
		Items: []*masterv1.PutStartRequest{{Tenant: "t", Key: "two", Size: 10, ClientId: "w"}, {Tenant: "t", Key: "one", Size: 10, ClientId: "w"}}}}})
	if err := callErr(bs); err != nil || len(bs.GetBatchPutStart().GetResults()) != 2 {
		t.Fatalf("BatchPutStart: %v, %v", bs.GetBatchPutStart(), err)
	}
	wantItem(t, bs.GetBatchPutStart().GetResults()[1].GetStatus(), "OBJECT_ALREADY_EXISTS")
	be := send(&masterv1.CallStreamRequest{RequestId: 5, Call: &masterv1.CallStreamRequest_BatchPutEnd{BatchPutEnd: &masterv1.BatchPutEndRequest{
		Items: []*masterv1.PutEndRequest{{Tenant: "t", Key: "two", ClientId: "w", Checksum: 2}}}}})
	if err := callErr(be); err != nil || be.GetBatchPutEnd().GetResults()[0].GetCode() != 0 {
		t.Fatalf("BatchPutEnd: %v, %v", be.GetBatchPutEnd(), err)
	}
	for i, k := range []string{"one", "two"} {
		if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "t", Key: k}); err != nil {
			t.Errorf("%s after the carried put: %v", k, err)
		}
		// And the single lookups, carried.
		gl := send(&masterv1.CallStreamRequest{RequestId: uint64(10 + i), Call: &masterv1.CallStreamRequest_GetReplicaList{
			GetReplicaList: &masterv1.GetReplicaListRequest{Tenant: "t", Key: k}}})
		if err := callErr(gl); err != nil || len(gl.GetGetReplicaList().GetReplicas()) != 1 {
			t.Errorf("carried GetReplicaList %s: %v, %v", k, gl.GetGetReplicaList(), err)
		}
	}
	ex := send(&masterv1.CallStreamRequest{RequestId: 20, Call: &masterv1.CallStreamRequest_Exist{Exist: &masterv1.ExistRequest{Tenant: "t", Key: "two"}}})
	if err := callErr(ex); err != nil || !ex.GetExist().GetExists() {
		t.Errorf("carried Exist: %v, %v", ex.GetExist(), err)
	}
	bx := send(&masterv1.CallStreamRequest{RequestId: 21, Call: &masterv1.CallStreamRequest_BatchExist{BatchExist: &masterv1.BatchExistRequest{
		Items: []*masterv1.ExistRequest{{Tenant: "t", Key: "one"}, {Tenant: "t", Key: "none"}}}}})
	if err := callErr(bx); err != nil || len(bx.GetBatchExist().GetExists()) != 2 {
		t.Fatalf("carried BatchExist: %v, %v", bx.GetBatchExist(), err)
	}
	if r := bx.GetBatchExist().GetExists(); !r[0] || r[1] {
		t.Errorf("carried BatchExist: %v", r)
	}
	if err := callErr(send(lookupCall(22, 0, "t", "none"))); err != nil {
		t.Errorf("a lookup after them: %v", err)
	}
}

// TestCallStreamCloseAnswersRunningCalls: calls running when the service
// closes are answered before the stream ends (a put the master ran must
// reach its client, as a graceful stop lets a unary call finish).
func TestCallStreamCloseAnswersRunningCalls(t *testing.T) {
	gate := make(chan struct{})
	entered := make(chan struct{}, 2)
	h := startWith(t, 1, 1, 1<<20, Config{MaxBatch: 256, Unary: func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		entered <- struct{}{}
		<-gate
		return next(ctx, req)
	}})
	st, err := h.cli.CallStream(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	sendLookups(t, st, 2)
	<-entered
	<-entered
	h.svc.Close()
	close(gate)
	got := recvAll(t, st, 2)
	for id, m := range got {
		if err := callErr(m); err != nil {
			t.Errorf("call %d running at Close: %v", id, err)
		}
	}
	if _, err := st.Recv(); rpcerr.Reason(err) != "MASTER_SHUTTING_DOWN" {
		t.Fatalf("after the running calls: %v, want MASTER_SHUTTING_DOWN", err)
	}
}

// TestCallStreamHandlesEveryCarriedCall: every method the proto makes
// CallStream carry has a handler here (else the SDK's calls of it would be
// answered UNIMPLEMENTED and go again, unary).
func TestCallStreamHandlesEveryCarriedCall(t *testing.T) {
	s := New(Config{}, nil)
	for _, m := range callstream.Methods() {
		if _, ok := s.carried[m]; !ok {
			t.Errorf("CallStream carries %s, which the service does not handle", m)
		}
	}
	if len(s.carried) != len(callstream.Methods()) {
		t.Errorf("%d handlers for %d carried methods", len(s.carried), len(callstream.Methods()))
	}
}
