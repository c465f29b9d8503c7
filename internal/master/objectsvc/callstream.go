package objectsvc

import (
	"context"
	"io"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/callstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Limits of one CallStream.
const (
	// MaxStreamCalls is how many calls of one stream are answered at once;
	// the stream's further messages wait unread (HTTP/2 flow control then
	// holds the client back). The SDK keeps two or three in flight.
	MaxStreamCalls = 16
	// MaxCallTimeout caps a carried call's deadline (CallStreamRequest's
	// timeout_ms; 0 is the cap). A unary call's deadline is the client's;
	// a carried call's bounds what one message can hold on the master.
	MaxCallTimeout = 10 * time.Second
	// keepIdle is how many of a stream's workers may wait for a call.
	keepIdle = 4
)

// carriedCall is the handler of a carried call, and what the interceptors
// see of it: its unary method's name, so that its metrics, logs,
// authorization rule, gates and test hooks are the unary call's.
type carriedCall struct {
	info    *grpc.UnaryServerInfo
	handler grpc.UnaryHandler
}

// carriedCalls are the service's handlers of the calls CallStream carries
// (callstream.Methods: the proto decides which), by full method name.
func (s *Service) carriedCalls() map[string]carriedCall {
	hs := map[string]grpc.UnaryHandler{
		masterv1.ObjectService_GetReplicaList_FullMethodName:      handle(s.GetReplicaList),
		masterv1.ObjectService_BatchGetReplicaList_FullMethodName: handle(s.BatchGetReplicaList),
		masterv1.ObjectService_Exist_FullMethodName:               handle(s.Exist),
		masterv1.ObjectService_BatchExist_FullMethodName:          handle(s.BatchExist),
		masterv1.ObjectService_PutStart_FullMethodName:            handle(s.PutStart),
		masterv1.ObjectService_PutEnd_FullMethodName:              handle(s.PutEnd),
		masterv1.ObjectService_BatchPutStart_FullMethodName:       handle(s.BatchPutStart),
		masterv1.ObjectService_BatchPutEnd_FullMethodName:         handle(s.BatchPutEnd),
	}
	out := make(map[string]carriedCall, len(hs))
	for m, h := range hs {
		out[m] = carriedCall{info: &grpc.UnaryServerInfo{Server: s, FullMethod: m}, handler: h}
	}
	return out
}

// handle is h as a grpc.UnaryHandler.
func handle[Q, R any](h func(context.Context, Q) (R, error)) grpc.UnaryHandler {
	return func(ctx context.Context, req any) (any, error) {
		resp, err := h(ctx, req.(Q))
		if err != nil {
			return nil, err
		}
		return resp, nil
	}
}

// CallStream implements ObjectService.CallStream: each message carries a
// call that is otherwise unary, answered by request id as that call would
// be. Why a stream: a message on an open stream costs 40-46 % less CPU
// than a unary call and comes back 37-44 % sooner (BenchmarkRPCShape,
// BENCHMARKS.md), and the SDK's coalesced lookups are bound by that round
// trip (issue 18).
//
// Each call runs through Config.Unary, the server's chain of unary
// interceptors, under its unary method's name: the stream adds no way
// around a rule, a gate or a limit. The stream's own authorization rule
// admits the roles that may make the calls it carries; each call is then
// authorized, its tenant included, as the unary call is.
//
// Up to MaxStreamCalls calls run at once, on workers started as calls need
// them, of which up to keepIdle stay while the stream lives (a goroutine
// per call would grow its stack anew each time); one goroutine receives
// and one sends. When the
// client closes its side, the calls running are answered and the stream
// ends OK. When the service closes (the master stops), the stream takes no
// more calls, answers the ones running — as a graceful stop lets unary
// calls finish: a put the master ran is answered — and ends with
// UNAVAILABLE / MASTER_SHUTTING_DOWN; the SDK makes the calls it sent
// after that again, as unary calls, which find the next leader.
func (s *Service) CallStream(st masterv1.ObjectService_CallStreamServer) error {
	if s.stopping.Err() != nil {
		return errShuttingDown()
	}
	if a := s.lookupAddr.Load(); a != nil {
		// Where this master's lookup listener is (internal/fastcall): the
		// SDK sends its lookups there while this stream lives.
		if err := st.SendHeader(metadata.Pairs(LookupAddrHeader, *a)); err != nil {
			return err
		}
	}
	// ctx ends with the stream, or when sending fails.
	ctx, cancel := context.WithCancel(st.Context())
	defer cancel()

	// The sender: the only goroutine that calls Send. It stops when out
	// is closed (every answer sent) or ctx ends (the stream is over).
	out := make(chan *masterv1.CallStreamResponse, MaxStreamCalls)
	sent := make(chan error, 1)
	go func() {
		for {
			select {
			case m, ok := <-out:
				if !ok {
					sent <- nil
					return
				}
				if err := st.Send(m); err != nil {
					cancel()
					sent <- err
					return
				}
			case <-ctx.Done():
				sent <- ctx.Err()
				return
			}
		}
	}()

	// The receiver: the only goroutine that calls Recv and writes to work.
	// A call no idle worker takes at once starts a worker of its own,
	// under mu, while fewer than MaxStreamCalls run and draining is not
	// set; past that it waits for a worker to finish. A worker that has
	// answered waits for the next call only while fewer than keepIdle
	// others do, else it leaves: a stream that once had many calls in
	// flight does not keep their goroutines. Only that choice adds to
	// idle (a new worker starts with its call), so idle never exceeds
	// keepIdle, however the receiver and the workers interleave.
	var (
		work     = make(chan *masterv1.CallStreamRequest)
		drain    = make(chan struct{}) // closed with draining set: take no more calls
		mu       sync.Mutex
		draining bool
		workers  int // running, under mu
		idle     int // waiting for a call, under mu
		wg       sync.WaitGroup
	)
	worker := func(r *masterv1.CallStreamRequest) {
		for {
			m := s.answer(ctx, r)
			select {
			case out <- m:
			case <-ctx.Done():
				return
			}
			mu.Lock()
			if idle >= keepIdle {
				workers--
				mu.Unlock()
				return
			}
			idle++
			mu.Unlock()
			select {
			case r = <-work:
				mu.Lock()
				idle--
				mu.Unlock()
			case <-drain:
				return
			case <-ctx.Done():
				return
			}
		}
	}
	received := make(chan error, 1)
	go func() {
		for {
			req, err := st.Recv()
			if err != nil {
				received <- err
				return
			}
			select {
			case work <- req: // an idle worker took it
				continue
			default:
			}
			mu.Lock()
			if draining {
				mu.Unlock()
				received <- nil
				return
			}
			if workers < MaxStreamCalls {
				workers++
				wg.Go(func() { worker(req) })
				mu.Unlock()
				continue
			}
			mu.Unlock()
			select {
			case work <- req:
			case <-drain:
				received <- nil
				return
			case <-ctx.Done():
				received <- ctx.Err()
				return
			}
		}
	}()

	var err error
	select {
	case err = <-received:
	case <-ctx.Done():
	case <-s.stopping.Done():
	}
	if err == io.EOF || s.stopping.Err() != nil {
		// The client closed its side, or the master stops: answer the
		// calls running, then end. After draining is set no worker
		// starts, so Wait cannot race a new one; an idle worker leaves
		// on drain, a busy one when its answer is queued.
		mu.Lock()
		draining = true
		close(drain)
		mu.Unlock()
		wg.Wait()
		close(out)
		if sendErr := <-sent; sendErr != nil && err == io.EOF {
			return sendErr
		}
		if err == io.EOF {
			return nil
		}
		return errShuttingDown()
	}
	// Broken or cancelled: the workers and the receiver stop on ctx (the
	// receiver once the stream ends, when this returns).
	cancel()
	sendErr := <-sent
	if err == nil {
		err = sendErr
	}
	return err
}

// LookupAddrHeader is the CallStream response header that names the
// master's lookup listener: "host:port", or ":port" on the host the
// client dialed.
const LookupAddrHeader = "crescent-lookup-addr"

// SetLookupAddr makes CallStream name the lookup listener (addr as
// LookupAddrHeader has it); "" names none.
func (s *Service) SetLookupAddr(addr string) {
	if addr == "" {
		s.lookupAddr.Store(nil)
		return
	}
	s.lookupAddr.Store(&addr)
}

// Answer runs a call that came on the lookup listener (internal/fastcall)
// as CallStream runs a carried call: through the unary chain, under ctx
// (which carries the connection's peer). Once the service closes it
// answers UNAVAILABLE / MASTER_SHUTTING_DOWN, as CallStream does: the SDK
// makes the call again elsewhere.
func (s *Service) Answer(ctx context.Context, r *masterv1.CallStreamRequest) *masterv1.CallStreamResponse {
	if s.stopping.Err() != nil {
		return failed(&masterv1.CallStreamResponse{RequestId: r.GetRequestId()}, errShuttingDown())
	}
	return s.answer(ctx, r)
}

// answer runs one carried call through the unary chain.
func (s *Service) answer(ctx context.Context, r *masterv1.CallStreamRequest) *masterv1.CallStreamResponse {
	timeout := time.Duration(r.GetTimeoutMs()) * time.Millisecond
	if timeout <= 0 || timeout > MaxCallTimeout {
		timeout = MaxCallTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	m := &masterv1.CallStreamResponse{RequestId: r.GetRequestId()}
	var err error
	method, req, ok := callstream.Unwrap(r)
	if c, known := s.carried[method]; ok && known {
		var resp any
		if resp, err = s.unary(ctx, req, c.info, c.handler); err == nil && !callstream.SetAnswer(m, resp.(proto.Message)) {
			err = status.Errorf(codes.Internal, "call stream: no answer field for %T", resp)
		}
	} else {
		err = status.Error(codes.Unimplemented, "call stream: the master does not know this call (an older master): make it as a unary call")
	}
	if err != nil {
		return failed(m, err)
	}
	return m
}

// failed sets m's status to err's.
func failed(m *masterv1.CallStreamResponse, err error) *masterv1.CallStreamResponse {
	sp := status.Convert(err).Proto()
	m.Code, m.Message, m.Details = sp.GetCode(), sp.GetMessage(), sp.GetDetails()
	return m
}
