package client_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/callstream"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// rpcCounter counts the client's master RPCs by method name and can hold
// the first call of one method until released, so that the calls made
// meanwhile queue for a batch.
type rpcCounter struct {
	mu     sync.Mutex
	calls  map[string]int
	items  map[string][]int // batch sizes per method
	holdM  string
	held   bool
	gate   chan struct{}
	holdUp chan struct{} // closed when the held call is held
	// carried counts the calls among calls sent on the master's
	// CallStream rather than as unary calls.
	carried int
}

func newRPCCounter() *rpcCounter {
	return &rpcCounter{calls: map[string]int{}, items: map[string][]int{}}
}

func (r *rpcCounter) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	r.record(method[strings.LastIndex(method, "/")+1:], req)
	return invoker(ctx, method, req, reply, cc, opts...)
}

// interceptStream counts (and holds) the calls the client carries on the
// master's CallStream as the unary calls they stand for.
func (r *rpcCounter) interceptStream() grpc.StreamClientInterceptor {
	return onCallStream(func(cs grpc.ClientStream) grpc.ClientStream { return &countedStream{ClientStream: cs, r: r} })
}

type countedStream struct {
	grpc.ClientStream
	r *rpcCounter
}

func (s *countedStream) SendMsg(m any) error {
	if q, ok := m.(*masterv1.CallStreamRequest); ok {
		method, req, _ := callstream.Unwrap(q)
		s.r.mu.Lock()
		s.r.carried++
		s.r.mu.Unlock()
		s.r.record(method[strings.LastIndex(method, "/")+1:], req)
	}
	return s.ClientStream.SendMsg(m)
}

// dialOptions are the interceptors that count a client's calls.
func (r *rpcCounter) dialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(r.intercept), grpc.WithChainStreamInterceptor(r.interceptStream())}
}

// record counts a call of method m (its name alone) and holds it if asked.
func (r *rpcCounter) record(m string, req any) {
	r.mu.Lock()
	r.calls[m]++
	var n int
	switch q := req.(type) {
	case *masterv1.BatchExistRequest:
		n = len(q.GetItems())
	case *masterv1.BatchGetReplicaListRequest:
		n = len(q.GetItems())
	case *masterv1.BatchPutStartRequest:
		n = len(q.GetItems())
	case *masterv1.BatchPutEndRequest:
		n = len(q.GetItems())
	}
	if n > 0 {
		r.items[m] = append(r.items[m], n)
	}
	var gate chan struct{}
	if m == r.holdM && !r.held {
		r.held, gate = true, r.gate
		close(r.holdUp)
	}
	r.mu.Unlock()
	if gate != nil {
		<-gate
	}
}

// hold makes the next call of method wait; it returns when that call is
// held, and gives the function that lets it go.
func (r *rpcCounter) hold(t *testing.T, method string, start func()) (release func()) {
	r.mu.Lock()
	r.holdM, r.held, r.gate, r.holdUp = method, false, make(chan struct{}), make(chan struct{})
	up, gate := r.holdUp, r.gate
	r.mu.Unlock()
	start()
	select {
	case <-up:
	case <-time.After(10 * time.Second):
		t.Fatalf("no %s call to hold", method)
	}
	var once sync.Once
	release = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release)
	return release
}

func (r *rpcCounter) snapshot() (map[string]int, map[string][]int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, it := map[string]int{}, map[string][]int{}
	for k, v := range r.calls {
		c[k] = v
	}
	for k, v := range r.items {
		it[k] = append([]int(nil), v...)
	}
	return c, it
}

func (r *rpcCounter) reset() {
	r.mu.Lock()
	clear(r.calls)
	clear(r.items)
	r.carried = 0
	r.mu.Unlock()
}

func coalescingClient(t *testing.T, h *harness, r *rpcCounter, mod func(*client.Config)) *client.Client {
	cfg := client.Config{CoalesceInFlight: 1, DialOptions: r.dialOptions()}
	if mod != nil {
		mod(&cfg)
	}
	return h.client(t, cfg)
}

// TestCoalesceLoneCalls: calls made one at a time go out at once as their
// single RPCs, never as batches (issue 18, item 1: a lone call does not
// wait and costs what it cost before).
func TestCoalesceLoneCalls(t *testing.T) {
	h := start(t, testcluster.Options{})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	ctx := t.Context()
	for i := range 3 {
		k := fmt.Sprintf("lone-%d", i)
		if err := c.Put(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
		if got, err := c.Get(ctx, k); err != nil || string(got) != k {
			t.Fatalf("Get %s: %q, %v", k, got, err)
		}
		if ok, err := c.Exist(ctx, k); !ok || err != nil {
			t.Fatalf("Exist %s: %v, %v", k, ok, err)
		}
	}
	calls, _ := r.snapshot()
	for m, n := range calls {
		if strings.HasPrefix(m, "Batch") {
			t.Errorf("%d %s calls from lone calls", n, m)
		}
	}
	for _, m := range []string{"PutStart", "PutEnd", "GetReplicaList", "Exist"} {
		if calls[m] != 3 {
			t.Errorf("%s: %d calls, want 3 (calls %v)", m, calls[m], calls)
		}
	}
}

// TestCoalesceExist: Exist calls made while one is in flight leave as one
// BatchExist; duplicates and missing keys are answered each as its own;
// a batch the master refuses whole for one invalid key is answered item
// by item as the single calls would be.
func TestCoalesceExist(t *testing.T) {
	h := start(t, testcluster.Options{})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	ctx := t.Context()
	for _, k := range []string{"e-a", "e-b"} {
		if err := c.Put(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
	}
	_, lone := c.Exist(ctx, "")
	if !errors.Is(lone, client.ErrInvalid) {
		t.Fatalf("lone Exist of an empty key: %v, want INVALID_PARAMS", lone)
	}
	for _, tc := range []struct {
		name string
		keys []string
		want []any // bool or error sentinel
	}{
		{"valid", []string{"e-a", "e-missing", "e-b", "e-a"}, []any{true, false, true, true}},
		{"one invalid", []string{"e-a", "", "e-missing"}, []any{true, client.ErrInvalid, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r.reset()
			first := make(chan error, 1)
			release := r.hold(t, "Exist", func() {
				go func() { _, err := c.Exist(ctx, "e-b"); first <- err }()
			})
			type res struct {
				ok  bool
				err error
			}
			out := make([]chan res, len(tc.keys))
			for i, k := range tc.keys {
				out[i] = make(chan res, 1)
				go func() { ok, err := c.Exist(ctx, k); out[i] <- res{ok, err} }()
				testutil.Eventually(t, 10*time.Second, func() bool { return c.Queued("exist") == i+1 }, "Exist %d not queued", i)
			}
			release()
			if err := <-first; err != nil {
				t.Fatal(err)
			}
			for i, k := range tc.keys {
				got := <-out[i]
				switch w := tc.want[i].(type) {
				case bool:
					if got.ok != w || got.err != nil {
						t.Errorf("Exist %q: %v, %v; want %v", k, got.ok, got.err, w)
					}
				case error:
					if !errors.Is(got.err, w) || status.Code(got.err) != status.Code(lone) || rpcerr.Reason(got.err) != rpcerr.Reason(lone) {
						t.Errorf("Exist %q: %v; want %v as a lone call's", k, got.err, lone)
					}
				}
			}
			calls, items := r.snapshot()
			if calls["BatchExist"] != 1 || len(items["BatchExist"]) != 1 || items["BatchExist"][0] != len(tc.keys) {
				t.Fatalf("BatchExist calls %d with items %v, want one of %d", calls["BatchExist"], items["BatchExist"], len(tc.keys))
			}
		})
	}
}

// TestCoalesceGet: Gets made while one is in flight leave as one
// BatchGetReplicaList and shared agent reads, duplicates included; each
// caller gets its own object, a missing key NOT_FOUND and a GetInto with
// too small a buffer INVALID_PARAMS, as lone calls would.
func TestCoalesceGet(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		h := start(t, testcluster.Options{})
		r := newRPCCounter()
		c := coalescingClient(t, h, r, func(cfg *client.Config) { cfg.DisableTransfer = !transfer; cfg.SmallObject = 8 << 10 })
		ctx := t.Context()
		data := map[string][]byte{}
		for i := range 4 {
			k := fmt.Sprintf("g-%d", i)
			data[k] = []byte(strings.Repeat(k, 100*(i+1)))
			if err := c.Put(ctx, k, data[k]); err != nil {
				t.Fatal(err)
			}
		}
		big := make([]byte, 40<<10) // past SmallObject: read by its caller
		for i := range big {
			big[i] = byte(i)
		}
		data["g-big"] = big
		if err := c.Put(ctx, "g-big", big); err != nil {
			t.Fatal(err)
		}
		_, loneMissing := c.Get(ctx, "g-missing")
		_, loneSmall := c.GetInto(ctx, "g-1", make([]byte, 3))
		if !errors.Is(loneMissing, client.ErrNotFound) || !errors.Is(loneSmall, client.ErrInvalid) {
			t.Fatalf("lone calls: %v; %v", loneMissing, loneSmall)
		}
		r.reset()
		first := make(chan error, 1)
		release := r.hold(t, "GetReplicaList", func() {
			go func() { _, err := c.Get(ctx, "g-3"); first <- err }()
		})
		keys := []string{"g-0", "g-1", "g-missing", "g-0", "g-big", "g-2", "g-1"}
		type res struct {
			b   []byte
			err error
		}
		out := make([]chan res, len(keys)+1)
		for i, k := range keys {
			out[i] = make(chan res, 1)
			go func() { b, err := c.Get(ctx, k); out[i] <- res{b, err} }()
			testutil.Eventually(t, 10*time.Second, func() bool { return c.Queued("get") == i+1 }, "Get %d not queued", i)
		}
		out[len(keys)] = make(chan res, 1)
		go func() {
			_, err := c.GetInto(ctx, "g-1", make([]byte, 3))
			out[len(keys)] <- res{nil, err}
		}()
		testutil.Eventually(t, 10*time.Second, func() bool { return c.Queued("get") == len(keys)+1 }, "GetInto not queued")
		release()
		if err := <-first; err != nil {
			t.Fatal(err)
		}
		gots := make([][]byte, len(keys))
		for i, k := range keys {
			got := <-out[i]
			gots[i] = got.b
			if k == "g-missing" {
				if !errors.Is(got.err, client.ErrNotFound) || got.err.Error() != loneMissing.Error() || status.Code(got.err) != status.Code(loneMissing) {
					t.Errorf("Get %q: %v; want %v as a lone call's", k, got.err, loneMissing)
				}
				continue
			}
			if got.err != nil || string(got.b) != string(data[k]) {
				t.Errorf("Get %q (item %d): %d bytes, %v", k, i, len(got.b), got.err)
			}
		}
		// A batched Get hands its caller the buffer the batch read into:
		// one of its own, shared with no other caller (g-0 and g-1 were
		// asked for twice).
		for _, pair := range [][2]int{{0, 3}, {1, 6}} {
			a, b := gots[pair[0]], gots[pair[1]]
			if len(a) == 0 || len(b) == 0 {
				continue
			}
			a[0] ^= 0xff
			if b[0] == a[0] || cap(a) != len(a) {
				t.Errorf("Gets %d and %d of %q share memory (cap %d for %d bytes)", pair[0], pair[1], keys[pair[0]], cap(a), len(a))
			}
		}
		if got := <-out[len(keys)]; !errors.Is(got.err, client.ErrInvalid) || got.err.Error() != loneSmall.Error() {
			t.Errorf("GetInto with a small buffer: %v; want %v", got.err, loneSmall)
		}
		calls, items := r.snapshot()
		if calls["BatchGetReplicaList"] != 1 || items["BatchGetReplicaList"][0] != len(keys)+1 {
			t.Fatalf("BatchGetReplicaList calls %d, items %v; want one of %d", calls["BatchGetReplicaList"], items["BatchGetReplicaList"], len(keys)+1)
		}
		if calls["GetReplicaList"] != 1 {
			t.Fatalf("%d GetReplicaList calls, want only the first Get's", calls["GetReplicaList"])
		}
	})
}

// TestCoalesceLargeGetReadsAlone: a lone Get of a large object frees the
// coalescer once its lookup returns, so other Gets are not queued behind
// its read (issue 18, item 2: 1 MiB Gets from 4 goroutines took turns).
func TestCoalesceLargeGetReadsAlone(t *testing.T) {
	h := start(t, testcluster.Options{})
	gate, held := make(chan struct{}), make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release)
	// Holds the first streamed agent Read (the large object's) until
	// released.
	hold := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if strings.HasSuffix(method, "/Read") {
			select {
			case <-held:
			default:
				close(held)
				<-gate
			}
		}
		return streamer(ctx, desc, cc, method, opts...)
	}
	c := h.client(t, client.Config{
		DisableTransfer: true, SmallObject: 8 << 10,
		DialOptions: []grpc.DialOption{grpc.WithChainStreamInterceptor(hold)},
	})
	ctx := t.Context()
	big, small := make([]byte, 40<<10), []byte("small")
	for i := range big {
		big[i] = byte(i)
	}
	for k, v := range map[string][]byte{"lg-big": big, "lg-small": small} {
		if err := c.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}
	first := make(chan error, 1)
	go func() {
		b, err := c.Get(ctx, "lg-big")
		if err == nil && string(b) != string(big) {
			err = fmt.Errorf("got %d bytes, not the object", len(b))
		}
		first <- err
	}()
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the large Get never read")
	}
	// The large Get's read is held: another Get must not wait for it.
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if b, err := c.Get(sctx, "lg-small"); err != nil || string(b) != "small" {
		t.Fatalf("a Get while a large Get reads: %q, %v", b, err)
	}
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
}

// TestCoalescePut: puts made while one is in flight share BatchPutStart
// and BatchPutEnd; a put of an existing key fails alone with
// OBJECT_ALREADY_EXISTS; every other put is readable.
func TestCoalescePut(t *testing.T) {
	h := start(t, testcluster.Options{})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	ctx := t.Context()
	if err := c.Put(ctx, "p-old", []byte("old")); err != nil {
		t.Fatal(err)
	}
	loneExists := c.Put(ctx, "p-old", []byte("again"))
	if !errors.Is(loneExists, client.ErrExists) {
		t.Fatalf("lone put of an existing key: %v", loneExists)
	}
	r.reset()
	first := make(chan error, 1)
	release := r.hold(t, "PutStart", func() {
		go func() { first <- c.Put(ctx, "p-first", []byte("first")) }()
	})
	keys := []string{"p-0", "p-old", "p-1", "p-2"}
	out := make([]chan error, len(keys))
	for i, k := range keys {
		out[i] = make(chan error, 1)
		go func() { out[i] <- c.Put(ctx, k, []byte("v-"+k)) }()
		testutil.Eventually(t, 10*time.Second, func() bool { return c.Queued("putstart") == i+1 }, "put %d not queued", i)
	}
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for i, k := range keys {
		err := <-out[i]
		if k == "p-old" {
			if !errors.Is(err, client.ErrExists) || status.Code(err) != status.Code(loneExists) {
				t.Errorf("put %q: %v; want %v", k, err, loneExists)
			}
			continue
		}
		if err != nil {
			t.Errorf("put %q: %v", k, err)
			continue
		}
		if got, err := c.Get(ctx, k); err != nil || string(got) != "v-"+k {
			t.Errorf("Get %q after the put: %q, %v", k, got, err)
		}
	}
	if got, err := c.Get(ctx, "p-old"); err != nil || string(got) != "old" {
		t.Errorf("p-old after the failed put: %q, %v", got, err)
	}
	calls, items := r.snapshot()
	if calls["BatchPutStart"] != 1 || items["BatchPutStart"][0] != len(keys) {
		t.Fatalf("BatchPutStart calls %d, items %v; want one of %d", calls["BatchPutStart"], items["BatchPutStart"], len(keys))
	}
	// Coalesced or not, every PutEnd carried its agent's seal receipt
	// (issue 18 item 2): the master sent no Seal.
	if viaReceipt, viaSeal := h.Master().Store.PutSeals(); viaSeal != 0 || viaReceipt != uint64(len(keys)+1) {
		t.Fatalf("replicas sealed via receipt %d, via Seal %d; want %d, 0", viaReceipt, viaSeal, len(keys)+1)
	}
}

// TestCoalesceClientCloseWithWaiters: Close while calls wait for a batch fails
// them with the closed client's error and leaves no goroutine behind
// (TestMain's goleak).
func TestCoalesceClientCloseWithWaiters(t *testing.T) {
	h := start(t, testcluster.Options{})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	ctx := t.Context()
	first := make(chan error, 1)
	release := r.hold(t, "Exist", func() {
		go func() { _, err := c.Exist(ctx, "c-first"); first <- err }()
	})
	out := make([]chan error, 4)
	for i := range out {
		out[i] = make(chan error, 1)
		go func() { _, err := c.Exist(ctx, fmt.Sprintf("c-%d", i)); out[i] <- err }()
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return c.Queued("exist") == len(out) }, "Exists not queued")
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	for i, ch := range out {
		if err := <-ch; err == nil || !strings.Contains(err.Error(), "client: closed") {
			t.Errorf("waiter %d: %v, want the closed client's error", i, err)
		}
	}
	release()
	<-first
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exist(ctx, "c-late"); err == nil {
		t.Fatal("Exist after Close succeeded")
	}
}
