package client

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// Coalescing (issue 18, item 1). Inference engines issue many single
// lookups from many goroutines, and a unary gRPC call costs the same
// whether it carries one item or hundreds. So concurrent single calls of
// one kind — Get (its master lookup and its read at the agent), Exist,
// GetReplicaList, Put's PutStart and PutEnd — share the batch RPCs, with
// no timer ("natural batching"):
//
//   - while no RPC of the kind is in flight, a call goes out at once, as
//     the single RPC it always was (a lone call never waits, and sees
//     exactly what it saw before); for PutStart and PutEnd, while fewer
//     than Config.CoalesceInFlight are;
//   - a call that finds that many in flight queues; whenever one returns,
//     the queue leaves as one batch RPC of up to the kind's item limit
//     (the goroutine of a batch that returns sends the next itself), and
//     each caller gets its item's answer: the batch's per-item status
//     turned into the error the single RPC would have returned (same
//     code, reason, errors.Is). A full batch does not wait: it leaves at
//     once while fewer than Config.CoalesceInFlight RPCs of the kind are
//     in flight (for the lookups, "full" is patientLaunch calls). For the lookups (Get, Exist, GetReplicaList: patient),
//     which cost CPU rather than waits, a second call sent on its own
//     while one is in flight would cost a whole RPC for one item; waiting
//     makes the batches as large as the callers make them (issue 18: with
//     64 callers, batches of about 43 instead of 16, with the yield in
//     runOne, and 40% less CPU per Get). PutStart and PutEnd wait on the
//     agents (Reserve, Seal), and lost 10-25% at 64 callers that way, so
//     they keep two in flight;
//   - every waiter honours its own context: one that gives up while queued
//     leaves the queue, one whose batch is in flight has its answer dropped
//     (and a put it started revoked); the batch RPC runs under a context
//     that carries the first waiter's values (its trace), the latest of
//     their deadlines when all have one, and is cancelled when every
//     waiter has given up or the client closes;
//   - one batch holds one tenant's items (the tenant views of one client
//     share its coalescers), so a tenant's certificate never meets a
//     batch that names another tenant;
//   - an item the master answers with a transient reason the single call
//     would have retried (AGENT_UNAVAILABLE, MASTER_RECOVERING), or a batch
//     the master refuses as a whole as invalid (BatchExist fails the whole
//     call for one invalid key), goes again on its own, as the single RPC,
//     in its caller's goroutine;
//   - the queue is bounded (maxQueue): past it a call goes out on its own.
//
// Config.DisableCoalescing sends every call on its own.

// Coalescing limits.
const (
	// defaultCoalesceInFlight is Config.CoalesceInFlight's default.
	defaultCoalesceInFlight = 2
	// maxQueue bounds the calls of one kind waiting for a batch.
	maxQueue = 4 * masterBatch
)

// errRedo marks an item a batch could not answer as its single RPC
// would: the waiter makes the single call itself.
var errRedo = errors.New("client: item goes again on its own")

// coalescer merges concurrent calls of one kind: single requests Q with
// answers R.
type coalescer[Q, R any] struct {
	off   bool // Config.DisableCoalescing: every call goes on its own
	limit int  // RPCs in flight before calls queue
	// patient: a call goes on its own only when no RPC of the kind is in
	// flight, not while fewer than limit are.
	patient  bool
	maxBatch int
	// launchAt is how many queued calls make a batch that leaves without
	// waiting for the one in flight (while fewer than limit are): maxBatch,
	// or patientLaunch for the lookups.
	launchAt int
	// one makes the single call; many the batch call, answering each
	// item (errs[i] == errRedo sends item i again through one).
	one  func(ctx context.Context, q Q) (R, error)
	many func(ctx context.Context, qs []Q) ([]R, []error)
	// group is the tenant of a request: a batch holds one group.
	group func(q Q) string
	// discard, when set, is given the answers nobody waits for any more
	// (their waiters gave up while the batch was in flight).
	discard func(ctx context.Context, qs []Q, rs []R, errs []error)

	closing context.Context // cancelled by close: ends in-flight batches
	stop    context.CancelFunc
	wg      sync.WaitGroup // the batch goroutines

	mu       sync.Mutex // guards inflight, queue, closed, and the waiters' b and gone
	inflight int        // single calls and batches out now
	queue    []*waiter[Q, R]
	closed   bool
	batches  int // batch RPCs sent
	items    int // calls they carried
}

// waiter is one queued call.
type waiter[Q, R any] struct {
	ctx  context.Context
	q    Q
	done chan struct{} // closed (under coalescer.mu) once res and err are set
	res  R
	err  error
	b    *flight // the batch that took it; nil while queued
	gone bool    // it gave up while b was in flight
}

// flight is one batch RPC in flight.
type flight struct {
	live   int // waiters still waiting
	cancel context.CancelFunc
}

func newCoalescer[Q, R any](cfg *Config, maxBatch int, group func(Q) string,
	one func(context.Context, Q) (R, error), many func(context.Context, []Q) ([]R, []error)) *coalescer[Q, R] {
	ctx, stop := context.WithCancel(context.Background())
	return &coalescer[Q, R]{
		off: cfg.DisableCoalescing, limit: cfg.CoalesceInFlight, maxBatch: maxBatch, launchAt: maxBatch,
		one: one, many: many, group: group, closing: ctx, stop: stop,
	}
}

// patientLaunch is the lookups' launchAt: a queue of this many is a batch
// worth a second RPC in flight, whose master lookup then overlaps the
// first batch's agent reads. Waiting for a full batch (4096) kept one Get
// batch in flight and used 1.2 of 2 cores at 64 callers (issue 18:
// BenchmarkSingleOps get-c64 on a quiet VM, 1.08-1.16x the health
// baseline; with 8, 16 and 32 here, 1.27-1.36, 1.29-1.40 and 1.57-1.62).
const patientLaunch = 32

// do makes the call q: at once when it may go alone (none of its kind in
// flight; fewer than limit unless patient), else in the next batch.
func (co *coalescer[Q, R]) do(ctx context.Context, q Q) (R, error) {
	if co.off {
		return co.one(ctx, q)
	}
	var zero R
	co.mu.Lock()
	if co.closed {
		co.mu.Unlock()
		return zero, errClosed
	}
	alone := co.inflight < co.limit
	if co.patient {
		alone = co.inflight == 0
	}
	if alone || len(co.queue) >= maxQueue {
		co.inflight++
		co.mu.Unlock()
		defer co.release()
		return co.one(ctx, q)
	}
	w := &waiter[Q, R]{ctx: ctx, q: q, done: make(chan struct{})}
	co.queue = append(co.queue, w)
	co.launchLocked(co.launchAt) // a full batch has nothing to wait for
	co.mu.Unlock()
	if done := ctx.Done(); done == nil {
		<-w.done // a context that never ends: no select to set up
	} else {
		select {
		case <-w.done:
		case <-done:
			if !co.abandon(w) {
				return zero, contextError(ctx)
			}
		}
	}
	if errors.Is(w.err, errRedo) {
		return co.one(ctx, q)
	}
	return w.res, w.err
}

// abandon takes w, whose caller's context ended, out of the queue or out
// of its batch. It reports false, or true when the answer arrived first
// (the caller then takes it).
func (co *coalescer[Q, R]) abandon(w *waiter[Q, R]) bool {
	co.mu.Lock()
	defer co.mu.Unlock()
	select {
	case <-w.done:
		return true
	default:
	}
	if w.b == nil {
		if i := slices.Index(co.queue, w); i >= 0 {
			co.queue = slices.Delete(co.queue, i, i+1)
		}
		return false
	}
	w.gone = true
	if w.b.live--; w.b.live == 0 {
		w.b.cancel()
	}
	return false
}

// contextError is what a call that gave up waiting returns: the status
// gRPC gives a call whose context ended (CANCELLED or DEADLINE_EXCEEDED),
// as call returns it.
func contextError(ctx context.Context) error {
	return rpcerr.FromStatus(status.FromContextError(ctx.Err()).Err())
}

// release ends a call or batch and sends the queue on if it waits.
func (co *coalescer[Q, R]) release() {
	co.mu.Lock()
	co.inflight--
	co.launchLocked(1)
	co.mu.Unlock()
}

// launchLocked sends queued calls as batches while slots are free and at
// least least calls queue.
func (co *coalescer[Q, R]) launchLocked(least int) {
	for !co.closed && co.inflight < co.limit && len(co.queue) >= max(least, 1) {
		ws := co.takeLocked()
		ctx, cancel := co.batchContext(ws)
		f := &flight{live: len(ws), cancel: cancel}
		for _, w := range ws {
			w.b = f
		}
		co.inflight++
		co.batches++
		co.items += len(ws)
		co.wg.Add(1)
		go co.run(ctx, f, ws)
	}
}

// nextLocked takes the next batch for the goroutine of a batch that has
// just returned, which runs it itself (no goroutine to start and wake):
// nil when the slot is not needed.
func (co *coalescer[Q, R]) nextLocked() (context.Context, *flight, []*waiter[Q, R]) {
	if co.closed || co.inflight > co.limit || len(co.queue) == 0 {
		return nil, nil, nil
	}
	ws := co.takeLocked()
	ctx, cancel := co.batchContext(ws)
	f := &flight{live: len(ws), cancel: cancel}
	for _, w := range ws {
		w.b = f
	}
	co.batches++
	co.items += len(ws)
	return ctx, f, ws
}

// takeLocked takes from the queue, in order, up to maxBatch calls of the
// first call's group.
func (co *coalescer[Q, R]) takeLocked() []*waiter[Q, R] {
	g := co.group(co.queue[0].q)
	var take []*waiter[Q, R]
	rest := co.queue[:0]
	for _, w := range co.queue {
		if len(take) < co.maxBatch && co.group(w.q) == g {
			take = append(take, w)
		} else {
			rest = append(rest, w)
		}
	}
	clear(co.queue[len(rest):])
	co.queue = rest
	return take
}

// batchContext is the context of a batch of ws: the first waiter's values
// without its cancellation, the latest deadline when every waiter has one,
// cancelled by close.
func (co *coalescer[Q, R]) batchContext(ws []*waiter[Q, R]) (context.Context, context.CancelFunc) {
	var latest time.Time
	all := true
	for _, w := range ws {
		d, ok := w.ctx.Deadline()
		if !ok {
			all = false
			break
		}
		if d.After(latest) {
			latest = d
		}
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ws[0].ctx))
	if all {
		var dl context.CancelFunc
		ctx, dl = context.WithDeadline(ctx, latest)
		c := cancel
		cancel = func() { dl(); c() }
	}
	stop := context.AfterFunc(co.closing, cancel)
	return ctx, func() { stop(); cancel() }
}

// run makes batch calls, the one it was given and then, while calls
// queue, the next, handing each waiter its answer.
func (co *coalescer[Q, R]) run(ctx context.Context, f *flight, ws []*waiter[Q, R]) {
	defer co.wg.Done()
	for ws != nil {
		ctx, f, ws = co.runOne(ctx, f, ws)
	}
}

// runOne makes one batch call, answers its waiters and, keeping the slot,
// takes the next batch if calls queue (nil if not: the slot is then free).
func (co *coalescer[Q, R]) runOne(ctx context.Context, f *flight, ws []*waiter[Q, R]) (context.Context, *flight, []*waiter[Q, R]) {
	qs := make([]Q, len(ws))
	for i, w := range ws {
		qs[i] = w.q
	}
	rs, errs := co.many(ctx, qs)
	f.cancel()
	var lost []int
	co.mu.Lock()
	for i, w := range ws {
		if w.gone {
			lost = append(lost, i)
			continue
		}
		w.res, w.err = rs[i], errs[i]
		close(w.done)
	}
	if co.patient && len(ws) > 1 && len(co.queue) > 0 {
		// The next batch leaves from here now. Let the callers just woken
		// run first: one that calls again at once (a loop of Gets) joins
		// it instead of waiting for the one after (issue 18: batches of
		// about 40 instead of 30 with 64 callers on 2 cores). The slot
		// stays held, so nobody goes out alone meanwhile; with nobody
		// queued there is no yield, and the slot frees at once.
		co.mu.Unlock()
		runtime.Gosched()
		co.mu.Lock()
	}
	nctx, nf, next := co.nextLocked()
	if next == nil {
		co.inflight--
		co.launchLocked(1)
	}
	co.mu.Unlock()
	if co.discard != nil && len(lost) > 0 {
		lq, lr, le := make([]Q, len(lost)), make([]R, len(lost)), make([]error, len(lost))
		for j, i := range lost {
			lq[j], lr[j], le[j] = qs[i], rs[i], errs[i]
		}
		co.discard(co.closing, lq, lr, le)
	}
	return nctx, nf, next
}

// close fails the queued calls, cancels the batches in flight and waits
// for their goroutines. Idempotent.
func (co *coalescer[Q, R]) close() {
	co.mu.Lock()
	if co.closed {
		co.mu.Unlock()
		return
	}
	co.closed = true
	for _, w := range co.queue {
		w.err = errClosed
		close(w.done)
	}
	co.queue = nil
	co.mu.Unlock()
	co.stop()
	co.wg.Wait()
}

// sent is how many batch RPCs the coalescer has sent, and how many calls
// they carried.
func (co *coalescer[Q, R]) sent() (batches, items int) {
	co.mu.Lock()
	defer co.mu.Unlock()
	return co.batches, co.items
}

// queued is how many calls wait for a batch.
func (co *coalescer[Q, R]) queued() int {
	co.mu.Lock()
	defer co.mu.Unlock()
	return len(co.queue)
}

// redoable reports whether an item's error is one the single call would
// have retried (masters.do): it then goes again on its own.
func redoable(err error) bool {
	v, _ := classify(err, false)
	return v == again || v == recovering
}

// itemError is the error of one batch item as its single call would have
// returned it, or errRedo.
func itemError(st *masterv1.ItemStatus) error {
	e := rpcerr.FromItem(st)
	if e != nil && redoable(e) {
		return errRedo
	}
	return e
}

// fill sets every entry of errs to err.
func fill(errs []error, err error) []error {
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// perItem turns a batch RPC's answer into its items' answers, as the
// single RPC would have given them: the call's error for every item (also
// when the master answered a wrong number of results), else each result's
// status (itemError) and, where it is OK, answer(result).
func perItem[Res, R any](n int, results []Res, err error, status func(Res) *masterv1.ItemStatus, answer func(Res) R) ([]R, []error) {
	out, errs := make([]R, n), make([]error, n)
	if err == nil {
		err = answered(len(results), n)
	}
	if err != nil {
		return out, fill(errs, rpcerr.FromStatus(err))
	}
	for i, res := range results {
		if errs[i] = itemError(status(res)); errs[i] == nil {
			out[i] = answer(res)
		}
	}
	return out, errs
}

// answered checks that a batch response has one result per item.
func answered(got, want int) error {
	if got != want {
		return fmt.Errorf("master answered %d results for %d items", got, want)
	}
	return nil
}

// coalescers are a client's, one per kind of call.
type coalescers struct {
	get    *coalescer[getQ, getR]
	exist  *coalescer[*masterv1.ExistRequest, bool]
	lists  *coalescer[*masterv1.GetReplicaListRequest, *masterv1.GetReplicaListResponse]
	starts *coalescer[*masterv1.PutStartRequest, *masterv1.PutStartResponse]
	ends   *coalescer[*masterv1.PutEndRequest, *masterv1.PutEndResponse]
}

func (cs *coalescers) close() {
	cs.get.close()
	cs.exist.close()
	cs.lists.close()
	cs.starts.close()
	cs.ends.close()
}

// newCoalescers builds the coalescers of the client whose shared state is s.
func newCoalescers(s *shared) *coalescers {
	objects := func() masterv1.ObjectServiceClient { return masterv1.NewObjectServiceClient(s.masters) }
	cs := &coalescers{}
	cs.get = newCoalescer(&s.cfg, masterBatch, func(q getQ) string { return q.c.tenant },
		func(ctx context.Context, q getQ) (getR, error) { return q.c.getOne(ctx, q) },
		func(ctx context.Context, qs []getQ) ([]getR, []error) { return qs[0].c.getMany(ctx, qs) })
	cs.get.patient, cs.get.launchAt = true, patientLaunch

	cs.exist = newCoalescer(&s.cfg, masterBatch, (*masterv1.ExistRequest).GetTenant,
		func(ctx context.Context, q *masterv1.ExistRequest) (bool, error) {
			r, err := objects().Exist(ctx, q)
			return r.GetExists(), rpcerr.FromStatus(err)
		},
		func(ctx context.Context, qs []*masterv1.ExistRequest) ([]bool, []error) {
			errs := make([]error, len(qs))
			r, err := objects().BatchExist(ctx, &masterv1.BatchExistRequest{Items: qs})
			if err == nil {
				err = answered(len(r.GetExists()), len(qs))
			} else if err = rpcerr.FromStatus(err); errors.Is(err, ErrInvalid) {
				// BatchExist fails as a whole for one invalid key, where
				// Exist fails for that key alone.
				err = errRedo
			}
			if err != nil {
				return make([]bool, len(qs)), fill(errs, err)
			}
			return r.GetExists(), errs
		})
	cs.exist.patient, cs.exist.launchAt = true, patientLaunch

	cs.lists = newCoalescer(&s.cfg, masterBatch, (*masterv1.GetReplicaListRequest).GetTenant,
		func(ctx context.Context, q *masterv1.GetReplicaListRequest) (*masterv1.GetReplicaListResponse, error) {
			r, err := objects().GetReplicaList(ctx, q)
			return r, rpcerr.FromStatus(err)
		},
		func(ctx context.Context, qs []*masterv1.GetReplicaListRequest) ([]*masterv1.GetReplicaListResponse, []error) {
			r, err := objects().BatchGetReplicaList(ctx, &masterv1.BatchGetReplicaListRequest{Items: qs})
			return perItem(len(qs), r.GetResults(), err, (*masterv1.GetReplicaListResult).GetStatus,
				(*masterv1.GetReplicaListResult).GetReplicaList)
		})
	cs.lists.patient, cs.lists.launchAt = true, patientLaunch

	cs.starts = newCoalescer(&s.cfg, masterBatch, (*masterv1.PutStartRequest).GetTenant,
		func(ctx context.Context, q *masterv1.PutStartRequest) (*masterv1.PutStartResponse, error) {
			r, err := objects().PutStart(ctx, q)
			return r, rpcerr.FromStatus(err)
		},
		func(ctx context.Context, qs []*masterv1.PutStartRequest) ([]*masterv1.PutStartResponse, []error) {
			r, err := objects().BatchPutStart(ctx, &masterv1.BatchPutStartRequest{Items: qs})
			return perItem(len(qs), r.GetResults(), err, (*masterv1.PutStartResult).GetStatus,
				func(res *masterv1.PutStartResult) *masterv1.PutStartResponse {
					return &masterv1.PutStartResponse{Replicas: res.GetReplicas(), Spares: res.GetSpares()}
				})
		})
	// A put started for a caller that gave up is revoked, as the single
	// call's caller revokes it (putOnce).
	cs.starts.discard = func(ctx context.Context, qs []*masterv1.PutStartRequest, rs []*masterv1.PutStartResponse, errs []error) {
		req := &masterv1.BatchPutRevokeRequest{}
		for i, q := range qs {
			if errs[i] == nil || errors.Is(errs[i], errRedo) || abandoned(errs[i]) {
				req.Items = append(req.Items, &masterv1.PutRevokeRequest{Tenant: q.GetTenant(), Key: q.GetKey(), ClientId: q.GetClientId()})
			}
		}
		if len(req.Items) == 0 {
			return
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, _ = objects().BatchPutRevoke(rctx, req)
	}

	cs.ends = newCoalescer(&s.cfg, masterBatch, (*masterv1.PutEndRequest).GetTenant,
		func(ctx context.Context, q *masterv1.PutEndRequest) (*masterv1.PutEndResponse, error) {
			r, err := objects().PutEnd(ctx, q)
			return r, rpcerr.FromStatus(err)
		},
		func(ctx context.Context, qs []*masterv1.PutEndRequest) ([]*masterv1.PutEndResponse, []error) {
			r, err := objects().BatchPutEnd(ctx, &masterv1.BatchPutEndRequest{Items: qs})
			out, errs := perItem(len(qs), r.GetResults(), err, func(st *masterv1.ItemStatus) *masterv1.ItemStatus { return st },
				func(*masterv1.ItemStatus) *masterv1.PutEndResponse { return &masterv1.PutEndResponse{} })
			if a := r.GetAnswers(); len(a) == len(qs) {
				for i := range out {
					if out[i] != nil {
						out[i] = a[i]
					}
				}
			}
			return out, errs
		})
	return cs
}

// getQ is one Get or GetInto: alloc gives the buffer for an object of a
// given size. Only the caller's goroutine calls alloc (a batch reads into
// buffers of its own), so a caller that gives up never has its buffer
// written behind its back. keep, when set (Get: any buffer will do), takes
// the buffer a batch read the object into instead: the batch then reads
// it into a buffer of its own size, allocated for it alone, and the
// caller copies nothing.
type getQ struct {
	c     *Client
	key   string
	alloc func(size uint64) ([]byte, error)
	keep  func([]byte)
}

// getR is a get's answer: direct when the whole get ran on its own (its
// error is then final); else the replica list and, when read, the bytes.
type getR struct {
	direct bool
	rl     *masterv1.GetReplicaListResponse
	read   bool
	data   []byte
}

// getMany looks up the objects of qs (one tenant) in one
// BatchGetReplicaList and reads the small ones, their first replica, in
// one request per agent, into buffers of its own. Objects it did not read
// (large ones, failed first replicas) go back with their replica list, for
// their caller to read as a single Get would.
func (c *Client) getMany(ctx context.Context, qs []getQ) ([]getR, []error) {
	res, errs := make([]getR, len(qs)), make([]error, len(qs))
	req := &masterv1.BatchGetReplicaListRequest{Items: make([]*masterv1.GetReplicaListRequest, len(qs))}
	for i, q := range qs {
		req.Items[i] = &masterv1.GetReplicaListRequest{Tenant: c.tenant, Key: q.key, ClientHost: c.s.cfg.HostID}
	}
	// The generated client's call (on the master's call stream or as a
	// unary call: callstream.go), into a lookupReply (lookupcodec.go).
	reply := &lookupReply{}
	err := c.s.masters.Invoke(ctx, masterv1.ObjectService_BatchGetReplicaList_FullMethodName, req, reply, grpc.StaticMethod())
	resp := &reply.BatchGetReplicaListResponse
	if err != nil {
		err = rpcerr.FromStatus(err)
	} else {
		err = answered(len(resp.GetResults()), len(qs))
	}
	if err != nil {
		return res, fill(errs, err)
	}
	var reads readPlan
	for i, r := range resp.GetResults() {
		if errs[i] = itemError(r.GetStatus()); errs[i] != nil {
			continue
		}
		rl := r.GetReplicaList()
		c.orderReplicas(rl.GetReplicas())
		res[i].rl = rl
		if len(rl.GetReplicas()) == 0 || rl.GetSize() > uint64(c.s.cfg.SmallObject) {
			continue
		}
		rd := read{item: i, rl: rl, own: qs[i].keep != nil}
		reads.add(c.routeOf(rl.GetReplicas()[0]), rd)
	}
	out := make([][]byte, len(qs))
	var mu sync.Mutex
	failed := map[int]bool{}
	c.runBounded(reads.tasks(ctx, c, out, func(bad []read) {
		mu.Lock()
		for _, r := range bad {
			failed[r.item] = true
		}
		mu.Unlock()
	}))
	for _, g := range reads.groups {
		for _, r := range g {
			if !failed[r.item] {
				res[r.item].read, res[r.item].data = true, out[r.item]
			}
		}
	}
	return res, errs
}

// getOne is a Get that goes alone: its lookup, and the read of a small
// object, hold the coalescer's slot; a large object's read, like a batch's
// large objects, is left to the caller, outside it. Were a lone 1 MiB Get
// to hold the slot through its read, every other Get would queue behind
// the whole of it (the lookups are patient) and large Gets from a few
// goroutines would take turns: at 4 workers, 1 MiB Gets ran at 0.77-0.82
// of a raw TCP stream with the read inside the slot, 1.08-1.09 without
// coalescing (BENCHMARKS.md, issue 18).
func (c *Client) getOne(ctx context.Context, q getQ) (getR, error) {
	rl, err := c.replicaList(ctx, q.key)
	if err != nil {
		return getR{direct: true}, fmt.Errorf("get %q: %w", q.key, err)
	}
	if len(rl.GetReplicas()) > 0 && rl.GetSize() > uint64(c.s.cfg.SmallObject) {
		return getR{rl: rl}, nil
	}
	return getR{direct: true}, c.getDirect(ctx, q.key, q.alloc, rl)
}

// getCoalesced is get through the coalescer. The bytes a batch read go
// into the caller's buffer here, in the caller's goroutine; an object the
// batch did not read is read as a single Get reads it, from the replica
// list the batch fetched.
func (c *Client) getCoalesced(ctx context.Context, key string, alloc func(size uint64) ([]byte, error), keep func([]byte)) error {
	r, err := c.s.co.get.do(ctx, getQ{c: c, key: key, alloc: alloc, keep: keep})
	if r.direct {
		return err
	}
	if err != nil {
		return fmt.Errorf("get %q: %w", key, err)
	}
	if !r.read {
		return c.getDirect(ctx, key, alloc, r.rl)
	}
	if keep != nil {
		keep(r.data)
		return nil
	}
	buf, err := alloc(r.rl.GetSize())
	if err != nil {
		return err
	}
	copy(buf, r.data)
	return nil
}

// putStart is PutStart through the coalescer.
func (c *Client) putStart(ctx context.Context, req *masterv1.PutStartRequest) (*masterv1.PutStartResponse, error) {
	return c.s.co.starts.do(ctx, req)
}

// putEnd is PutEnd through the coalescer.
func (c *Client) putEnd(ctx context.Context, req *masterv1.PutEndRequest) (*masterv1.PutEndResponse, error) {
	return c.s.co.ends.do(ctx, req)
}
