package client_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// getMany runs Gets of keys from 16 goroutines, twice over, and checks
// every answer against data.
func getMany(t *testing.T, c *client.Client, data map[string][]byte) {
	t.Helper()
	var wg sync.WaitGroup
	keys := make([]string, 0, len(data))
	for k := range data {
		keys = append(keys, k)
	}
	for g := range 16 {
		wg.Go(func() {
			for i := range 2 * len(keys) {
				k := keys[(g+i)%len(keys)]
				got, err := c.Get(t.Context(), k)
				if err != nil || string(got) != string(data[k]) {
					t.Errorf("Get %s: %d bytes, %v", k, len(got), err)
					return
				}
			}
		})
	}
	wg.Wait()
}

func putKeys(t *testing.T, c *client.Client, n int) map[string][]byte {
	t.Helper()
	data := map[string][]byte{}
	for i := range n {
		k := fmt.Sprintf("%s/cs-%d", t.Name(), i)
		data[k] = []byte(k + "-value")
		if err := c.Put(t.Context(), k, data[k]); err != nil {
			t.Fatal(err)
		}
	}
	return data
}

// TestCallStreamCarriesCalls: Gets' lookups, Exists and puts' PutStart
// and PutEnd (single and batched) go on the master's CallStream, not as
// unary calls, and the master runs each through its unary method's
// interceptors (the cluster's hook counts them by that name). With
// DisableCallStream they are unary calls.
func TestCallStreamCarriesCalls(t *testing.T) {
	h := start(t, testcluster.Options{})
	carriedKinds := []string{"GetReplicaList", "BatchGetReplicaList", "Exist", "BatchExist", "PutStart", "PutEnd", "BatchPutStart", "BatchPutEnd"}
	for _, off := range []bool{false, true} {
		t.Run(fmt.Sprint("DisableCallStream=", off), func(t *testing.T) {
			r := newRPCCounter()
			c := coalescingClient(t, h, r, func(cfg *client.Config) { cfg.DisableCallStream = off })
			// The connection is up after this: the next calls may use the stream.
			if err := c.Put(t.Context(), t.Name()+"/warm", []byte("w")); err != nil {
				t.Fatal(err)
			}
			before := map[string]int{}
			for _, k := range carriedKinds {
				before[k] = h.Calls(k)
			}
			r.reset()
			data := putKeys(t, c, 16)
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Go(func() {
					for i := range 4 {
						k := fmt.Sprintf("%s/par-%d-%d", t.Name(), g, i)
						if err := c.Put(t.Context(), k, []byte(k)); err != nil {
							t.Error(err)
						}
					}
				})
			}
			wg.Wait()
			getMany(t, c, data)
			for k := range data {
				if ok, err := c.Exist(t.Context(), k); !ok || err != nil {
					t.Fatalf("Exist %s: %v, %v", k, ok, err)
				}
			}
			calls, _ := r.snapshot()
			r.mu.Lock()
			carried := r.carried
			r.mu.Unlock()
			total := 0
			for _, k := range carriedKinds {
				total += calls[k]
				if got := h.Calls(k) - before[k]; got != calls[k] {
					t.Errorf("%s: the master's interceptors saw %d, the client sent %d", k, got, calls[k])
				}
			}
			if calls["BatchGetReplicaList"] == 0 || calls["PutStart"] == 0 || calls["PutEnd"] == 0 {
				t.Fatalf("calls %v: the test made no batched lookups or no single puts", calls)
			}
			if want := map[bool]int{false: total, true: 0}[off]; carried != want {
				t.Errorf("%d of %d calls on the stream, want %d (%v)", carried, total, want, calls)
			}
		})
	}
}

// TestCallStreamFallsBack: a master that does not have CallStream (an
// older one: the cluster's hook answers UNIMPLEMENTED, as grpc-go does
// for an unknown method) is asked once; the lookups go as unary calls
// and every Get is answered.
func TestCallStreamFallsBack(t *testing.T) {
	h := start(t, testcluster.Options{})
	h.SetMasterHook(func(m string) error {
		if m == "CallStream" {
			return status.Error(codes.Unimplemented, "unknown method CallStream for service crescent.master.v1.ObjectService")
		}
		return nil
	})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	data := putKeys(t, c, 16)
	// The stream is tried once the connection is up (here, or during the
	// puts). Every call sent on it before the master's refusal came back
	// went again as a unary call, and had its answer before getMany
	// returned; how many were sent depends on how the callers raced the
	// refusal, so the test counts the calls after it, once the refused
	// stream's sender has stopped (it may still be sending one it had
	// taken when the refusal came).
	getMany(t, c, data)
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		if n := testutil.Goroutines("client.(*callStream).open.func1"); n > 0 {
			return fmt.Errorf("%d call stream senders still running", n)
		}
		return nil
	})
	stream := func() (lookups, carried int) {
		calls, _ := r.snapshot()
		r.mu.Lock()
		defer r.mu.Unlock()
		return calls["BatchGetReplicaList"], r.carried
	}
	lookups0, carried0 := stream()
	if n := h.Calls("CallStream"); n != 1 {
		t.Fatalf("the stream was opened %d times before the test's Gets were answered, want once", n)
	}
	for range 3 {
		getMany(t, c, data)
	}
	if lookups, carried := stream(); carried != carried0 || lookups <= lookups0 {
		t.Fatalf("after the refusal: %d more lookups, %d more sent on a stream; want unary calls only", lookups-lookups0, carried-carried0)
	}
	if n := h.Calls("CallStream"); n != 1 {
		t.Fatalf("the stream was opened %d times; a master without it is not asked again for a while", n)
	}
}

// TestCallStreamAcrossMasterRestart: the stream breaks when the master
// restarts; the lookups in flight and the next ones go as unary calls
// (which follow the master back), and a new stream carries them once the
// backoff has passed.
func TestCallStreamAcrossMasterRestart(t *testing.T) {
	h := start(t, testcluster.Options{})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	data := putKeys(t, c, 16)
	getMany(t, c, data)
	key := t.Name() + "/cs-1"
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		// Gets while the master restarts: each either answers right or
		// fails as a unary call would while no master answers.
		for ctx.Err() == nil {
			if got, err := c.Get(ctx, key); err == nil && string(got) != string(data[key]) {
				t.Errorf("Get across the restart: %q", got)
			}
		}
	})
	h.RestartMaster()
	h.WaitSegments(h.Agents())
	cancel()
	wg.Wait()
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		r.reset()
		getMany(t, c, data)
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.carried == 0 {
			return errors.New("no lookup on a stream yet")
		}
		return nil
	})
}

// TestCallStreamDeadline: a carried lookup honours its caller's deadline
// (the caller is answered DEADLINE_EXCEEDED when it passes, whatever the
// master does), and the stream goes on serving the next calls.
func TestCallStreamDeadline(t *testing.T) {
	h := start(t, testcluster.Options{})
	r := newRPCCounter()
	c := coalescingClient(t, h, r, nil)
	putKeys(t, c, 1)
	key := t.Name() + "/cs-0"
	// The first lookup goes unary (the connection is not up yet); make
	// sure the next ones find the stream.
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		r.reset()
		if _, err := c.Lookup(t.Context(), key); err != nil {
			return err
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.carried == 0 {
			return errors.New("not on the stream yet")
		}
		return nil
	})
	gate := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	defer release()
	h.SetMasterHook(func(m string) error {
		if m == "BatchGetReplicaList" {
			<-gate
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if _, err := c.Lookup(ctx, key); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a held lookup past its deadline: %v", err)
	}
	release()
	h.SetMasterHook(nil)
	errs, err := c.Lookup(t.Context(), key, "nope")
	if err != nil || errs[0] != nil || !errors.Is(errs[1], client.ErrNotFound) {
		t.Fatalf("after the deadline: %v, %v", errs, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.carried < 3 {
		t.Fatalf("%d lookups carried; the stream should have served the last two", r.carried)
	}
}

// TestCallStreamCloseEndsOK: a client's Close ends its call stream as a
// finished call (OK in the master's metrics), not as a cancelled one.
func TestCallStreamCloseEndsOK(t *testing.T) {
	h := start(t, testcluster.Options{})
	handled := func(code string) float64 {
		t.Helper()
		for line := range strings.SplitSeq(testutil.Metrics(t, h.MasterAdminAddr()), "\n") {
			if strings.HasPrefix(line, "grpc_server_handled_total{") && strings.Contains(line, `grpc_method="CallStream"`) &&
				strings.Contains(line, `grpc_code="`+code+`"`) {
				v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
				return v
			}
		}
		return 0
	}
	r := newRPCCounter()
	c, err := client.New(t.Context(), client.Config{Master: h.MasterAddr(), DialOptions: r.dialOptions()})
	if err != nil {
		t.Fatal(err)
	}
	putKeys(t, c, 4) // the first put connects; the others go on the stream
	r.mu.Lock()
	carried := r.carried
	r.mu.Unlock()
	if carried == 0 {
		t.Fatal("no call on the stream")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		if ok, cancelled := handled("OK"), handled("Canceled"); ok != 1 || cancelled != 0 {
			return fmt.Errorf("CallStream handled: %v OK, %v Canceled", ok, cancelled)
		}
		return nil
	})
}
