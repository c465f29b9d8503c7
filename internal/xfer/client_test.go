package xfer

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeAgent is a hand-written transfer server: each connection's requests
// go to handle, after the preamble was checked.
type fakeAgent struct {
	lis     net.Listener
	accepts atomic.Int32
	handle  func(c net.Conn, br *bufio.Reader) error
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
}

func startFake(t *testing.T, handle func(c net.Conn, br *bufio.Reader) error) *fakeAgent {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return startFakeOn(t, lis, handle)
}

// startFakeOn is startFake on lis (a TLS listener, say).
func startFakeOn(t *testing.T, lis net.Listener, handle func(c net.Conn, br *bufio.Reader) error) *fakeAgent {
	t.Helper()
	a := &fakeAgent{lis: lis, handle: handle}
	a.wg.Go(func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			a.accepts.Add(1)
			a.mu.Lock()
			a.conns = append(a.conns, c)
			a.mu.Unlock()
			a.wg.Go(func() {
				defer c.Close()
				br := bufio.NewReader(c)
				var pre [4]byte
				if _, err := io.ReadFull(br, pre[:]); err != nil || string(pre[:]) != Preamble {
					return
				}
				for a.handle(c, br) == nil {
				}
			})
		}
	})
	t.Cleanup(func() {
		_ = lis.Close()
		a.mu.Lock()
		for _, c := range a.conns {
			_ = c.Close()
		}
		a.mu.Unlock()
		a.wg.Wait()
	})
	return a
}

func (a *fakeAgent) addr() string { return a.lis.Addr().String() }

// request reads a request header and its write payload.
func request(br *bufio.Reader) (*agentv1.TransferRequest, [][]byte, error) {
	req := &agentv1.TransferRequest{}
	if _, err := ReadFrame(br, nil, req); err != nil {
		return nil, nil, err
	}
	var payload [][]byte
	if req.GetOp() == agentv1.TransferOp_TRANSFER_OP_WRITE {
		for _, it := range req.GetItems() {
			p := make([]byte, it.GetLength())
			if _, err := io.ReadFull(br, p); err != nil {
				return nil, nil, err
			}
			payload = append(payload, p)
		}
	}
	return req, payload, nil
}

func respond(c net.Conn, resp *agentv1.TransferResponse, payload ...[]byte) error {
	b, err := AppendFrame(nil, resp)
	if err != nil {
		return err
	}
	return WriteFrame(c, b, payload)
}

// store is a well-behaved fake: allocation id → bytes; id 0 fails.
type store struct {
	mu   sync.Mutex
	objs map[uint64][]byte
}

func (s *store) handle(c net.Conn, br *bufio.Reader) error {
	req, payload, err := request(br)
	if err != nil {
		return err
	}
	resp := &agentv1.TransferResponse{}
	var out [][]byte
	s.mu.Lock()
	for i, it := range req.GetItems() {
		r := &agentv1.TransferResult{}
		obj, ok := s.objs[it.GetAllocationId()]
		switch {
		case it.GetAllocationId() == 0:
			r.Status = ItemResult(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND, "no allocation 0"))
		case req.GetOp() == agentv1.TransferOp_TRANSFER_OP_WRITE:
			s.objs[it.GetAllocationId()] = payload[i]
			r.Length = uint64(len(payload[i]))
		case !ok:
			r.Status = ItemResult(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE, "not sealed"))
		default:
			n := it.GetLength()
			if n == 0 {
				n = uint64(len(obj)) - it.GetOffset()
			}
			r.Length, r.ObjectSize, r.Checksum = n, uint64(len(obj)), 42
			out = append(out, obj[it.GetOffset():it.GetOffset()+n])
		}
		resp.Results = append(resp.Results, r)
	}
	s.mu.Unlock()
	return respond(c, resp, out...)
}

func newStore() *store { return &store{objs: map[uint64][]byte{}} }

func items(ids ...uint64) []*agentv1.TransferItem {
	out := make([]*agentv1.TransferItem, len(ids))
	for i, id := range ids {
		out[i] = &agentv1.TransferItem{SegmentId: "seg", AllocationId: id, Token: []byte("t")}
	}
	return out
}

func TestWriteReadPooled(t *testing.T) {
	s := newStore()
	a := startFake(t, s.handle)
	p := NewPool(Config{})
	defer p.Close()
	ctx := t.Context()
	src := [][]byte{[]byte("hello"), bytes.Repeat([]byte{7}, 3<<20), {}, []byte("x")}
	its := items(1, 2, 3, 0)
	errs, err := p.Write(ctx, a.addr(), its, src)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range errs[:3] {
		if e != nil || its[i].GetLength() != uint64(len(src[i])) {
			t.Fatalf("item %d: %v, length %d", i, e, its[i].GetLength())
		}
	}
	// A per-item error is an *rpcerr.Error with code and reason.
	var re *rpcerr.Error
	if !errors.As(errs[3], &re) || status.Code(errs[3]) != codes.NotFound || !errors.Is(errs[3], &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND}) {
		t.Fatalf("item error = %#v, want NOT_FOUND ALLOCATION_NOT_FOUND", errs[3])
	}
	dst := [][]byte{make([]byte, 5), make([]byte, 3<<20), {}, make([]byte, 1)}
	res, err := p.Read(ctx, a.addr(), items(1, 2, 3, 0), dst)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if res[i].Err != nil || res[i].N != len(src[i]) || !bytes.Equal(dst[i], src[i]) || res[i].ObjectSize != uint64(len(src[i])) || res[i].Checksum != 42 {
			t.Fatalf("item %d: %+v", i, res[i])
		}
	}
	if rpcerr.Reason(res[3].Err) != "ALLOCATION_NOT_FOUND" || res[3].N != 0 {
		t.Fatalf("failed item: %+v", res[3])
	}
	// A range.
	it := items(2)
	it[0].Offset = 100
	if res, err := p.Read(ctx, a.addr(), it, [][]byte{make([]byte, 10)}); err != nil || res[0].Err != nil || it[0].GetLength() != 10 {
		t.Fatalf("range read: %+v, %v", res, err)
	}
	if n := a.accepts.Load(); n != 1 {
		t.Fatalf("%d connections for sequential calls, want 1 reused", n)
	}
}

func TestEmptyDestinationReadsTheRest(t *testing.T) {
	s := newStore()
	s.objs[1], s.objs[2] = []byte("abc"), []byte{}
	a := startFake(t, s.handle)
	p := NewPool(Config{})
	defer p.Close()
	res, err := p.Read(t.Context(), a.addr(), items(1, 2, 1), [][]byte{{}, {}, make([]byte, 3)})
	if err != nil {
		t.Fatal(err)
	}
	if rpcerr.Reason(res[0].Err) != "INVALID_PARAMS" || res[1].Err != nil || res[2].Err != nil || res[2].N != 3 {
		t.Fatalf("results = %+v; want item 0 INVALID_PARAMS (3 bytes, no room), 1 empty OK, 2 OK", res)
	}
	if _, err := p.Read(t.Context(), a.addr(), items(1), [][]byte{make([]byte, 3)}); err != nil || a.accepts.Load() != 1 {
		t.Fatalf("connection not reused after a drained item: %v, %d accepts", err, a.accepts.Load())
	}
}

func TestArguments(t *testing.T) {
	p := NewPool(Config{})
	defer p.Close()
	ctx := t.Context()
	if _, err := p.Write(ctx, "x:1", items(1, 2), [][]byte{nil}); rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("Write with mismatched lengths = %v", err)
	}
	if _, err := p.Read(ctx, "x:1", []*agentv1.TransferItem{nil}, [][]byte{nil}); rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("Read of a nil item = %v", err)
	}
	if errs, err := p.Write(ctx, "x:1", nil, nil); err != nil || len(errs) != 0 {
		t.Fatalf("empty Write = %v, %v", errs, err)
	}
	if res, err := p.Read(ctx, "x:1", nil, nil); err != nil || len(res) != 0 {
		t.Fatalf("empty Read = %v, %v", res, err)
	}
	big := items(1)
	big[0].Token = make([]byte, MaxHeaderBytes)
	if _, err := p.Read(ctx, "127.0.0.1:1", big, [][]byte{nil}); rpcerr.Reason(err) != "INVALID_PARAMS" && rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("Read with a huge token = %v", err)
	}
}

func TestManyItemsSplit(t *testing.T) {
	s := newStore()
	var reqs atomic.Int32
	a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
		err := s.handle(c, br)
		if err == nil {
			reqs.Add(1)
		}
		return err
	})
	p := NewPool(Config{})
	defer p.Close()
	n := MaxItems + 10
	ids := make([]uint64, n)
	src := make([][]byte, n)
	for i := range ids {
		ids[i] = uint64(i + 1)
		src[i] = []byte(fmt.Sprint(i))
	}
	errs, err := p.Write(t.Context(), a.addr(), items(ids...), src)
	if err != nil || len(errs) != n || errs[n-1] != nil {
		t.Fatalf("Write of %d items: %v", n, err)
	}
	dst := make([][]byte, n)
	for i := range dst {
		dst[i] = make([]byte, len(src[i]))
	}
	res, err := p.Read(t.Context(), a.addr(), items(ids...), dst)
	if err != nil || res[n-1].Err != nil || string(dst[n-1]) != fmt.Sprint(n-1) {
		t.Fatalf("Read of %d items: %v", n, err)
	}
	// The fake counts a request after it has answered it: the client can
	// see the last answer a moment before the count moves.
	for deadline := time.Now().Add(time.Second); reqs.Load() < 4 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if reqs.Load() != 4 || a.accepts.Load() != 1 {
		t.Fatalf("%d requests on %d connections, want 4 on 1", reqs.Load(), a.accepts.Load())
	}
}

func TestConcurrentCallsAndIdleLimit(t *testing.T) {
	s := newStore()
	a := startFake(t, s.handle)
	p := NewPool(Config{MaxIdlePerEndpoint: 2})
	defer p.Close()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 20 {
				id := uint64(g*100 + i + 1)
				data := bytes.Repeat([]byte{byte(id)}, 1000+i)
				if _, err := p.Write(t.Context(), a.addr(), items(id), [][]byte{data}); err != nil {
					t.Error(err)
					return
				}
				got := make([]byte, len(data))
				if res, err := p.Read(t.Context(), a.addr(), items(id), [][]byte{got}); err != nil || res[0].Err != nil || !bytes.Equal(got, data) {
					t.Errorf("Read = %+v, %v", res, err)
					return
				}
			}
		})
	}
	wg.Wait()
	p.mu.Lock()
	idle := len(p.idle[a.addr()])
	p.mu.Unlock()
	if idle > 2 {
		t.Fatalf("%d idle connections, want at most 2", idle)
	}
}

// Each misbehaving agent gets a clear error, and the connection is never
// reused.
func TestProtocolViolations(t *testing.T) {
	tests := []struct {
		name   string
		write  bool
		answer func(c net.Conn) error
		reason string
	}{
		{"too few results", false, func(c net.Conn) error { return respond(c, &agentv1.TransferResponse{}) }, "INTERNAL"},
		{"read length differs", false, func(c net.Conn) error {
			return respond(c, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 3, ObjectSize: 10}}}, []byte("abc"))
		}, "INTERNAL"},
		{"range past the object", false, func(c net.Conn) error {
			return respond(c, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 4, ObjectSize: 2}}}, []byte("abcd"))
		}, "INTERNAL"},
		{"write length differs", true, func(c net.Conn) error {
			return respond(c, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 1}}})
		}, "INTERNAL"},
		{"header too large", false, func(c net.Conn) error { _, err := c.Write([]byte{0xff, 0xff, 0xff, 0x7f}); return err }, "INTERNAL"},
		{"garbage header", false, func(c net.Conn) error { _, err := c.Write([]byte{2, 0, 0, 0, 0xff, 0xff}); return err }, "INTERNAL"},
		{"refusal with code OK", false, func(c net.Conn) error { return respond(c, &agentv1.TransferResponse{Error: &agentv1.ItemResult{}}) }, "INTERNAL"},
		{"refusal", false, func(c net.Conn) error {
			return respond(c, &agentv1.TransferResponse{Error: ItemResult(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "no"))})
		}, "INVALID_PARAMS"},
		{"payload cut short", false, func(c net.Conn) error {
			if err := respond(c, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 4, ObjectSize: 4}}}, []byte("ab")); err != nil {
				return err
			}
			return errors.New("hang up")
		}, "AGENT_UNAVAILABLE"},
		{"hang up", false, func(net.Conn) error { return errors.New("hang up") }, "AGENT_UNAVAILABLE"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
				if _, _, err := request(br); err != nil {
					return err
				}
				if calls.Add(1) == 1 {
					if err := tc.answer(c); err != nil {
						return err
					}
					// Stay open: the client must still drop the connection.
					return nil
				}
				return respond(c, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 4, ObjectSize: 4}}}, []byte("abcd"))
			})
			p := NewPool(Config{})
			defer p.Close()
			var err error
			if tc.write {
				_, err = p.Write(t.Context(), a.addr(), items(1), [][]byte{[]byte("abcd")})
			} else {
				_, err = p.Read(t.Context(), a.addr(), items(1), [][]byte{make([]byte, 4)})
			}
			if rpcerr.Reason(err) != tc.reason {
				t.Fatalf("err = %v, want reason %s", err, tc.reason)
			}
			if tc.reason == "INTERNAL" && !errors.Is(err, ErrProtocol) {
				t.Fatalf("err = %v, want ErrProtocol", err)
			}
			if _, err := p.Read(t.Context(), a.addr(), items(1), [][]byte{make([]byte, 4)}); err != nil {
				t.Fatalf("next call: %v", err)
			}
			if a.accepts.Load() != 2 {
				t.Fatalf("%d connections, want 2 (the broken one is not reused)", a.accepts.Load())
			}
		})
	}
}

func TestContextCancelAndDeadline(t *testing.T) {
	// An agent that reads requests and never answers.
	a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
		_, _, err := request(br)
		return err
	})
	p := NewPool(Config{})
	defer p.Close()

	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(20*time.Millisecond, cancel)
	start := time.Now()
	if _, err := p.Read(ctx, a.addr(), items(1), [][]byte{make([]byte, 4)}); err != context.Canceled {
		t.Fatalf("cancelled Read = %v, want context.Canceled itself", err)
	}
	dctx, dcancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer dcancel()
	if _, err := p.Write(dctx, a.addr(), items(1), [][]byte{[]byte("x")}); err != context.DeadlineExceeded {
		t.Fatalf("Write past its deadline = %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("cancellation took %v", d)
	}
	if _, err := p.Read(ctx, a.addr(), items(1), [][]byte{nil}); err != context.Canceled {
		t.Fatalf("Read with a done context = %v", err)
	}
	p.mu.Lock()
	idle := len(p.idle[a.addr()])
	p.mu.Unlock()
	if idle != 0 {
		t.Fatalf("%d idle connections after interrupted calls, want 0", idle)
	}
}

// TestStaleConnectionRetried: an agent that dropped an idle connection
// costs a transparent retry on a fresh one, not an error.
func TestStaleConnectionRetried(t *testing.T) {
	s := newStore()
	s.objs[1] = []byte("abcd")
	a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
		if err := s.handle(c, br); err != nil {
			return err
		}
		return errors.New("one request per connection")
	})
	p := NewPool(Config{})
	defer p.Close()
	for i := range 3 {
		dst := make([]byte, 4)
		if res, err := p.Read(t.Context(), a.addr(), items(1), [][]byte{dst}); err != nil || res[0].Err != nil || string(dst) != "abcd" {
			t.Fatalf("call %d: %+v, %v", i, res, err)
		}
	}
	if a.accepts.Load() != 3 {
		t.Fatalf("%d connections, want 3", a.accepts.Load())
	}
}

func TestDialFailure(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close()
	p := NewPool(Config{DialTimeout: time.Second})
	defer p.Close()
	_, err = p.Read(t.Context(), addr, items(1), [][]byte{nil})
	if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" || status.Code(err) != codes.Unavailable {
		t.Fatalf("Read of a closed port = %v, want UNAVAILABLE AGENT_UNAVAILABLE", err)
	}
}

func TestPoolClose(t *testing.T) {
	started := make(chan struct{}, 1)
	a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
		if _, _, err := request(br); err != nil {
			return err
		}
		started <- struct{}{}
		return nil // never answers
	})
	p := NewPool(Config{})
	done := make(chan error, 1)
	go func() {
		_, err := p.Read(context.Background(), a.addr(), items(1), [][]byte{nil})
		done <- err
	}()
	<-started
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("in-flight Read at Close = %v, want ErrClosed", err)
	}
	if _, err := p.Write(t.Context(), a.addr(), items(1), [][]byte{nil}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Write after Close = %v, want ErrClosed", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close = %v", err)
	}
}

// FuzzClientResponse answers a Read and a Write with arbitrary bytes: the
// client must not panic, and a nil error must come with sane results.
func FuzzClientResponse(f *testing.F) {
	ok := func(resp *agentv1.TransferResponse, payload string) []byte {
		b, _ := AppendFrame(nil, resp)
		return append(b, payload...)
	}
	f.Add(ok(&agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 4, ObjectSize: 4}, {Status: &agentv1.ItemResult{Code: 5}}}}, "abcd"))
	f.Add(ok(&agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 0, ObjectSize: 9}, {Length: 2, ObjectSize: 2}}}, "abcdefghi"))
	f.Add(ok(&agentv1.TransferResponse{Error: &agentv1.ItemResult{Code: 3, Reason: "INVALID_PARAMS"}}, ""))
	f.Add(ok(&agentv1.TransferResponse{Results: []*agentv1.TransferResult{{ObjectSize: 4}, {Status: &agentv1.ItemResult{Code: 15, Reason: "CHECKSUM_MISMATCH"}}}}, ""))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, in []byte) {
		p := NewPool(Config{})
		defer p.Close()
		p.dial = func(context.Context, string, string) (net.Conn, error) {
			client, server := net.Pipe()
			go func() {
				defer server.Close()
				go func() { _, _ = io.Copy(io.Discard, server) }()
				_, _ = server.Write(in)
			}()
			return client, nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		dst := [][]byte{make([]byte, 4), nil}
		res, err := p.Read(ctx, "fuzz", items(1, 2), dst)
		if err == nil {
			for i, r := range res {
				if r.Err == nil && r.N != len(dst[i]) {
					t.Fatalf("item %d: ok with %d of %d bytes", i, r.N, len(dst[i]))
				}
			}
		} else if res != nil {
			t.Fatal("results with a call error")
		}
		errs, err := p.Write(ctx, "fuzz", items(1, 2), [][]byte{[]byte("abcd"), nil})
		if (err == nil) != (errs != nil) {
			t.Fatalf("Write = %v, %v", errs, err)
		}
		if errs, err = p.Verify(ctx, "fuzz", items(1, 2)); (err == nil) != (errs != nil) {
			t.Fatalf("Verify = %v, %v", errs, err)
		}
	})
}
