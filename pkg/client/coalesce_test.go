package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// fakeKind is a coalescer over fake calls: requests are "tenant/key"
// strings, the single call answers "one:"+key, the batch call "many:"+key,
// keys starting with "bad" fail with NOT_FOUND, keys starting with "redo"
// come back errRedo from a batch. gate, when set, holds every call until
// it is closed.
type fakeKind struct {
	co      *coalescer[string, string]
	gate    chan struct{}
	mu      sync.Mutex
	ones    []string
	batches [][]string
	lost    []string // discarded
	ctxErrs int      // batch calls that saw their context end
}

func newFake(limit, maxBatch int) *fakeKind {
	f := &fakeKind{}
	cfg := &Config{CoalesceInFlight: limit}
	f.co = newCoalescer(cfg, maxBatch,
		func(q string) string { t, _, _ := cut(q); return t },
		func(ctx context.Context, q string) (string, error) {
			f.mu.Lock()
			f.ones = append(f.ones, q)
			gate := f.gate
			f.mu.Unlock()
			if gate != nil {
				select {
				case <-gate:
				case <-ctx.Done():
					return "", contextError(ctx)
				}
			}
			if _, k, _ := cut(q); len(k) >= 3 && k[:3] == "bad" {
				return "", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "%s not found", k)
			}
			return "one:" + q, nil
		},
		func(ctx context.Context, qs []string) ([]string, []error) {
			f.mu.Lock()
			f.batches = append(f.batches, slices.Clone(qs))
			gate := f.gate
			f.mu.Unlock()
			rs, errs := make([]string, len(qs)), make([]error, len(qs))
			if gate != nil {
				select {
				case <-gate:
				case <-ctx.Done():
					f.mu.Lock()
					f.ctxErrs++
					f.mu.Unlock()
					return rs, fill(errs, contextError(ctx))
				}
			}
			for i, q := range qs {
				_, k, _ := cut(q)
				switch {
				case len(k) >= 3 && k[:3] == "bad":
					errs[i] = rpcerr.FromItem(&masterv1.ItemStatus{Code: int32(codes.NotFound), Reason: "OBJECT_NOT_FOUND", Message: k + " not found"})
				case len(k) >= 4 && k[:4] == "redo":
					errs[i] = errRedo
				default:
					rs[i] = fmt.Sprintf("many:%s#%d", q, i)
				}
			}
			return rs, errs
		})
	f.co.patient = true
	f.co.discard = func(_ context.Context, qs []string, _ []string, _ []error) {
		f.mu.Lock()
		f.lost = append(f.lost, qs...)
		f.mu.Unlock()
	}
	return f
}

func cut(q string) (string, string, bool) {
	for i := range len(q) {
		if q[i] == '/' {
			return q[:i], q[i+1:], true
		}
	}
	return "", q, false
}

type answer struct {
	r   string
	err error
}

// hold makes the calls from now on wait at a gate.
func (f *fakeKind) hold() {
	f.mu.Lock()
	f.gate = make(chan struct{})
	f.mu.Unlock()
}

// open lets every held call go, and the calls from now on.
func (f *fakeKind) open() {
	f.mu.Lock()
	g := f.gate
	f.gate = nil
	f.mu.Unlock()
	if g != nil {
		close(g)
	}
}

// step lets the held calls go and holds the calls from now on.
func (f *fakeKind) step() {
	f.mu.Lock()
	g := f.gate
	f.gate = make(chan struct{})
	f.mu.Unlock()
	close(g)
}

// start runs do(q) in a goroutine; the answer arrives on the channel.
func (f *fakeKind) start(ctx context.Context, q string) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		r, err := f.co.do(ctx, q)
		ch <- answer{r, err}
	}()
	return ch
}

func TestCoalesceLoneCallGoesOutAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 8)
		defer f.co.close()
		for i := range 5 {
			r, err := f.co.do(t.Context(), fmt.Sprintf("t/k%d", i))
			if want := fmt.Sprintf("one:t/k%d", i); r != want || err != nil {
				t.Fatalf("call %d: %q, %v; want %q", i, r, err, want)
			}
		}
		if len(f.ones) != 5 || len(f.batches) != 0 {
			t.Fatalf("%d single and %d batch calls, want 5 and 0", len(f.ones), len(f.batches))
		}
		// Even with two slots, a call goes out on its own only when none
		// is in flight: the second of two concurrent calls waits for the
		// first and leaves as a batch (of one) when it returns.
		f = newFake(2, 8)
		defer f.co.close()
		f.hold()
		a := f.start(t.Context(), "t/a")
		synctest.Wait()
		b := f.start(t.Context(), "t/b")
		synctest.Wait()
		if len(f.ones) != 1 || f.co.queued() != 1 {
			t.Fatalf("%d single calls out, %d queued; want 1 and 1", len(f.ones), f.co.queued())
		}
		f.open()
		if x, y := <-a, <-b; x.r != "one:t/a" || y.r != "many:t/b#0" {
			t.Fatalf("answers %+v %+v", x, y)
		}
		// Not patient (PutStart, PutEnd): with two slots, two concurrent
		// calls both go out at once.
		f = newFake(2, 8)
		f.co.patient = false
		defer f.co.close()
		f.hold()
		a, b = f.start(t.Context(), "t/a"), f.start(t.Context(), "t/b")
		synctest.Wait()
		if len(f.ones) != 2 || f.co.queued() != 0 {
			t.Fatalf("not patient: %d single calls out, %d queued; want 2 and 0", len(f.ones), f.co.queued())
		}
		f.open()
		if x, y := <-a, <-b; x.r != "one:t/a" || y.r != "one:t/b" {
			t.Fatalf("answers %+v %+v", x, y)
		}
	})
}

// heldThenQueued starts t/first and holds it in flight, then queues n
// calls t/0..t/n-1 behind it, one at a time.
func (f *fakeKind) heldThenQueued(t *testing.T, n int) (first <-chan answer, chs []<-chan answer) {
	f.hold()
	first = f.start(t.Context(), "t/first")
	synctest.Wait()
	for i := range n {
		chs = append(chs, f.start(t.Context(), fmt.Sprintf("t/%d", i)))
		synctest.Wait()
	}
	return first, chs
}

// answeredInBatches checks that first was answered by a single call and
// every call of chs by a batch.
func answeredInBatches(t *testing.T, first <-chan answer, chs []<-chan answer) {
	t.Helper()
	if a := <-first; a.r != "one:t/first" {
		t.Fatalf("first: %+v", a)
	}
	for i, ch := range chs {
		if a := <-ch; a.err != nil || a.r[:5] != "many:" {
			t.Fatalf("call %d: %+v", i, a)
		}
	}
}

// TestCoalesceFullBatchLeavesAtOnce: a full batch does not wait for the
// call in flight while a slot is free; past CoalesceInFlight RPCs, full
// batches wait too.
func TestCoalesceFullBatchLeavesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(2, 3)
		defer f.co.close()
		first, chs := f.heldThenQueued(t, 7)
		// t/0..t/2 filled a batch that left at once (the second slot); the
		// next three filled one too, but no slot was free.
		if len(f.batches) != 1 || !slices.Equal(f.batches[0], []string{"t/0", "t/1", "t/2"}) {
			t.Fatalf("batches in flight %q, want [[t/0 t/1 t/2]]", f.batches)
		}
		if n := f.co.queued(); n != 4 {
			t.Fatalf("%d queued, want 4", n)
		}
		f.open()
		answeredInBatches(t, first, chs)
		if len(f.ones) != 1 || len(f.batches) != 3 {
			t.Fatalf("%d single calls and batches %q; want 1 and 3 batches", len(f.ones), f.batches)
		}
	})
}

// TestCoalescePatientLaunchAt: a lookup queue that reaches launchAt leaves
// as a second batch while the first is in flight (its lookup overlapping
// the first's reads); below it, the queue waits for the slot.
func TestCoalescePatientLaunchAt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(2, 16)
		f.co.launchAt = 3
		defer f.co.close()
		first, chs := f.heldThenQueued(t, 5)
		// t/0..t/2 reached launchAt and left; t/3 and t/4 wait (both
		// slots are taken).
		if len(f.batches) != 1 || !slices.Equal(f.batches[0], []string{"t/0", "t/1", "t/2"}) || f.co.queued() != 2 {
			t.Fatalf("batches in flight %q, %d queued; want [[t/0 t/1 t/2]] and 2", f.batches, f.co.queued())
		}
		f.open()
		answeredInBatches(t, first, chs)
		if len(f.batches) != 2 || !slices.Equal(f.batches[1], []string{"t/3", "t/4"}) {
			t.Fatalf("batches %q, want the last [t/3 t/4]", f.batches)
		}
	})
}

// TestCoalesceBatchAnswersEachItsOwn: calls queued behind a call in flight
// leave together, in order, duplicates included, and each caller gets its
// own item's answer: results, per-item errors that errors.Is and
// status.Code see as the single call's, and errRedo items answered by the
// single call.
func TestCoalesceBatchAnswersEachItsOwn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 16)
		defer f.co.close()
		f.hold()
		first := f.start(t.Context(), "t/first")
		synctest.Wait()
		keys := []string{"t/a", "t/b", "t/a", "t/bad1", "t/redo1", "t/c"}
		chs := make([]<-chan answer, len(keys))
		for i, k := range keys {
			chs[i] = f.start(t.Context(), k)
			synctest.Wait() // queue in this order
		}
		if n := f.co.queued(); n != len(keys) {
			t.Fatalf("%d queued, want %d", n, len(keys))
		}
		f.open()
		if a := <-first; a.r != "one:t/first" || a.err != nil {
			t.Fatalf("first: %+v", a)
		}
		for i, k := range keys {
			a := <-chs[i]
			switch {
			case k == "t/bad1":
				if !errors.Is(a.err, ErrNotFound) || status.Code(a.err) != codes.NotFound {
					t.Errorf("%s: %v (code %v), want NOT_FOUND", k, a.err, status.Code(a.err))
				}
			case k == "t/redo1":
				if a.r != "one:t/redo1" || a.err != nil {
					t.Errorf("%s: %+v, want the single call's answer", k, a)
				}
			default:
				if want := fmt.Sprintf("many:%s#%d", k, i); a.r != want || a.err != nil {
					t.Errorf("%s: %q, %v; want %q", k, a.r, a.err, want)
				}
			}
		}
		if len(f.batches) != 1 || !slices.Equal(f.batches[0], keys) {
			t.Fatalf("batches %q, want one of %q", f.batches, keys)
		}
	})
}

func TestCoalesceBatchBoundsAndTenants(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 2)
		defer f.co.close()
		f.hold()
		first := f.start(t.Context(), "t/first")
		synctest.Wait()
		keys := []string{"t/1", "u/1", "t/2", "t/3", "u/2"}
		var chs []<-chan answer
		for _, k := range keys {
			chs = append(chs, f.start(t.Context(), k))
			synctest.Wait()
		}
		f.open()
		<-first
		for _, ch := range chs {
			if a := <-ch; a.err != nil {
				t.Fatal(a.err)
			}
		}
		want := [][]string{{"t/1", "t/2"}, {"u/1", "u/2"}, {"t/3"}}
		if !slices.EqualFunc(f.batches, want, slices.Equal) {
			t.Fatalf("batches %q, want %q (one tenant each, at most 2 items, in order)", f.batches, want)
		}
	})
}

// TestCoalesceCancelQueued: a waiter that gives up while queued returns at
// once with the context's status and is not sent.
func TestCoalesceCancelQueued(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 16)
		defer f.co.close()
		f.hold()
		first := f.start(t.Context(), "t/first")
		synctest.Wait()
		ctx, cancel := context.WithCancel(t.Context())
		gone := f.start(ctx, "t/gone")
		synctest.Wait()
		stay := f.start(t.Context(), "t/stay")
		synctest.Wait()
		cancel()
		a := <-gone
		if status.Code(a.err) != codes.Canceled || !abandoned(a.err) {
			t.Fatalf("cancelled waiter: %v (code %v), want CANCELLED", a.err, status.Code(a.err))
		}
		if n := f.co.queued(); n != 1 {
			t.Fatalf("%d queued after the cancel, want 1", n)
		}
		f.open()
		<-first
		if a := <-stay; a.r != "many:t/stay#0" {
			t.Fatalf("the other waiter: %+v", a)
		}
		if len(f.batches) != 1 || !slices.Equal(f.batches[0], []string{"t/stay"}) {
			t.Fatalf("batches %q", f.batches)
		}
	})
}

// TestCoalesceCancelInFlight: a waiter that gives up while its batch is in
// flight returns at once; the others get their answers; its answer is
// discarded; when every waiter has given up the batch is cancelled.
func TestCoalesceCancelInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 16)
		defer f.co.close()
		f.hold()
		first := f.start(t.Context(), "t/first")
		synctest.Wait()
		ctx, cancel := context.WithCancel(t.Context())
		gone := f.start(ctx, "t/gone")
		synctest.Wait()
		stay := f.start(t.Context(), "t/stay")
		synctest.Wait()
		// Let the first call return: the queue leaves as a batch, held.
		f.step()
		<-first
		synctest.Wait()
		if len(f.batches) != 1 {
			t.Fatalf("%d batches in flight, want 1", len(f.batches))
		}
		cancel()
		if a := <-gone; status.Code(a.err) != codes.Canceled {
			t.Fatalf("cancelled waiter: %v", a.err)
		}
		f.open()
		if a := <-stay; a.r != "many:t/stay#1" || a.err != nil {
			t.Fatalf("the other waiter: %+v", a)
		}
		synctest.Wait()
		if !slices.Equal(f.lost, []string{"t/gone"}) || f.ctxErrs != 0 {
			t.Fatalf("discarded %q, %d cancelled batches; want [t/gone] and 0", f.lost, f.ctxErrs)
		}

		// Every waiter gives up: the batch's context ends.
		f.hold()
		first = f.start(t.Context(), "t/first2")
		synctest.Wait()
		ctx1, cancel1 := context.WithCancel(t.Context())
		ctx2, cancel2 := context.WithCancel(t.Context())
		w1, w2 := f.start(ctx1, "t/x"), f.start(ctx2, "t/y")
		synctest.Wait()
		f.step()
		<-first
		synctest.Wait()
		cancel1()
		cancel2()
		<-w1
		<-w2
		synctest.Wait()
		if f.ctxErrs != 1 {
			t.Fatalf("%d batches saw their context end, want 1", f.ctxErrs)
		}
		f.open()
	})
}

// TestCoalesceCloseWithWaiters: Close fails the queued waiters with
// errClosed, ends the batch in flight and returns once its goroutine has;
// later calls fail at once.
func TestCoalesceCloseWithWaiters(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 2)
		f.hold()
		defer f.open()
		first := f.start(t.Context(), "t/first")
		synctest.Wait()
		var chs []<-chan answer
		for i := range 5 {
			chs = append(chs, f.start(t.Context(), fmt.Sprintf("t/%d", i)))
			synctest.Wait()
		}
		// Free the slot: two leave as a batch (held), three stay queued.
		f.step()
		<-first
		synctest.Wait()
		if n := f.co.queued(); n != 3 {
			t.Fatalf("%d queued, want 3", n)
		}
		f.co.close()
		for i, ch := range chs {
			a := <-ch
			if i < 2 && status.Code(a.err) != codes.Canceled {
				t.Errorf("waiter %d, in flight at close: %v, want CANCELLED", i, a.err)
			}
			if i >= 2 && !errors.Is(a.err, errClosed) {
				t.Errorf("waiter %d, queued at close: %v, want errClosed", i, a.err)
			}
		}
		if _, err := f.co.do(t.Context(), "t/late"); !errors.Is(err, errClosed) {
			t.Fatalf("call after close: %v", err)
		}
		f.co.close() // idempotent
	})
}

func TestCoalesceOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1, 8)
		f.co.off = true
		defer f.co.close()
		f.hold()
		a, b := f.start(t.Context(), "t/a"), f.start(t.Context(), "t/b")
		synctest.Wait()
		if len(f.ones) != 2 || f.co.queued() != 0 {
			t.Fatalf("off: %d single calls, %d queued; want 2, 0", len(f.ones), f.co.queued())
		}
		f.open()
		<-a
		<-b
	})
}
