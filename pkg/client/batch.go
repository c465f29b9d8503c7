package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Item is one object of a BatchPut.
type Item struct {
	Key  string
	Data []byte
}

// Limits of one data-plane batch call.
const (
	maxBatchItems = 256
	maxBatchBytes = 32 << 20
	// masterBatch bounds the items of one metadata batch RPC.
	masterBatch = 4096
)

// BatchPut stores many objects: one BatchPutStart, data writes grouped per
// agent (small objects in shared BatchWrite calls, large ones streamed) with
// bounded concurrency, then one BatchPutEnd; items whose writes failed are
// revoked. It returns one error per item (nil = stored).
//
// Items whose put a failover interrupted (PutEnd on a new leader that never
// saw their PutStart: issue 15), that the master dropped before their
// PutEnd (PUT_EXPIRED: their segments went away mid-write), or whose
// segment could not seal them (SEGMENT_UNAVAILABLE), were not
// acknowledged; they are put again, once, like Put's.
func (c *Client) BatchPut(ctx context.Context, items []Item, opts ...PutOption) []error {
	errs := make([]error, len(items))
	ctx, span := c.startCall(ctx, "client.batch_put", len(items), itemBytes(items), "")
	defer endBatch(span, errs)
	o := newPutOptions(c, opts)
	for lo := 0; lo < len(items); lo += masterBatch {
		hi := min(lo+masterBatch, len(items))
		again := c.batchPut(ctx, items[lo:hi], errs[lo:hi], o)
		if len(again) == 0 {
			continue
		}
		retry := make([]Item, len(again))
		for j, i := range again {
			retry[j] = items[lo+i]
		}
		rerrs := make([]error, len(retry))
		c.batchPut(ctx, retry, rerrs, o)
		for j, i := range again {
			errs[lo+i] = rerrs[j]
		}
	}
	return errs
}

// route is where a replica's bytes move: an agent's bulk transfer
// listener or its DataService. Batch code groups items by route.
type route struct {
	endpoint string
	transfer bool
}

func (c *Client) routeOf(d *masterv1.ReplicaDescriptor) route {
	if t := c.transferEndpoint(d); t != "" {
		return route{endpoint: t, transfer: true}
	}
	return route{endpoint: d.GetDataEndpoint()}
}

// write is one replica write of a batch.
type write struct {
	item int
	desc *masterv1.ReplicaDescriptor
	data []byte
}

// batchPut puts items, setting errs, and returns the indices of the items
// to put again (endAgain): those whose PutEnd found their put dropped
// (PUT_EXPIRED) or, on a master other than the one that started them,
// not there (NOT_FOUND), and those no segment could seal
// (SEGMENT_UNAVAILABLE).
func (c *Client) batchPut(ctx context.Context, items []Item, errs []error, o *putOptions) (again []int) {
	req := &masterv1.BatchPutStartRequest{Items: make([]*masterv1.PutStartRequest, len(items))}
	for i, it := range items {
		req.Items[i] = &masterv1.PutStartRequest{
			Tenant: c.tenant, Key: it.Key, Size: uint64(len(it.Data)), Config: o.cfg, ClientId: c.s.cfg.ClientID, Upsert: o.upsert,
		}
	}
	resp, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.BatchPutStartResponse, error) {
		return s.BatchPutStart(ctx, req)
	})
	if err == nil && len(resp.GetResults()) != len(items) {
		err = fmt.Errorf("master answered %d results for %d items", len(resp.GetResults()), len(items))
	}
	if err != nil {
		for i := range errs {
			errs[i] = fmt.Errorf("put %q: %w", items[i].Key, err)
		}
		if abandoned(err) {
			all := make([]int, len(items))
			for i := range all {
				all[i] = i
			}
			c.batchRevoke(ctx, items, all)
		}
		return nil
	}
	startedAt, _ := c.s.masters.current() // the master that answered BatchPutStart
	var writes []write
	for i, r := range resp.GetResults() {
		if e := rpcerr.FromItem(r.GetStatus()); e != nil {
			errs[i] = fmt.Errorf("put %q: %w", items[i].Key, e)
			continue
		}
		for _, d := range r.GetReplicas() {
			writes = append(writes, write{item: i, desc: d, data: items[i].Data})
		}
	}
	werrs := c.runWrites(ctx, writes)
	var end, revoke []int
	for i := range items {
		if errs[i] != nil {
			continue
		}
		if werrs[i] != nil {
			errs[i] = fmt.Errorf("put %q: write replica: %w", items[i].Key, werrs[i])
			revoke = append(revoke, i)
			continue
		}
		end = append(end, i)
	}
	if len(revoke) > 0 {
		c.batchRevoke(ctx, items, revoke)
	}
	if len(end) == 0 {
		return nil
	}
	ereq := &masterv1.BatchPutEndRequest{Items: make([]*masterv1.PutEndRequest, len(end))}
	for j, i := range end {
		ereq.Items[j] = &masterv1.PutEndRequest{Tenant: c.tenant, Key: items[i].Key, ClientId: c.s.cfg.ClientID, Checksum: checksum.Sum(items[i].Data)}
	}
	eresp, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.BatchPutEndResponse, error) {
		return s.BatchPutEnd(ctx, ereq)
	})
	if err == nil && len(eresp.GetResults()) != len(end) {
		err = fmt.Errorf("master answered %d results for %d items", len(eresp.GetResults()), len(end))
	}
	if err != nil {
		for _, i := range end {
			errs[i] = fmt.Errorf("put %q: %w", items[i].Key, err)
		}
		c.batchRevoke(ctx, items, end)
		return nil
	}
	endedAt, _ := c.s.masters.current()
	var failed []int
	for j, i := range end {
		if e := rpcerr.FromItem(eresp.GetResults()[j]); e != nil {
			errs[i] = fmt.Errorf("put %q: %w", items[i].Key, e)
			failed = append(failed, i)
			if endAgain(e, startedAt, endedAt) {
				again = append(again, i)
			}
		}
	}
	if len(failed) > 0 {
		c.batchRevoke(ctx, items, failed)
	}
	if endedAt != startedAt {
		var ok []int
		var keys []string
		for _, i := range end {
			if errs[i] == nil {
				ok = append(ok, i)
				keys = append(keys, items[i].Key)
			}
		}
		for j, err := range c.fewerReplicas(ctx, keys, o) {
			if err != nil {
				errs[ok[j]] = fmt.Errorf("put %q: %w", items[ok[j]].Key, err)
			}
		}
	}
	return again
}

func (c *Client) batchRevoke(ctx context.Context, items []Item, idx []int) {
	req := &masterv1.BatchPutRevokeRequest{Items: make([]*masterv1.PutRevokeRequest, len(idx))}
	for j, i := range idx {
		req.Items[j] = &masterv1.PutRevokeRequest{Tenant: c.tenant, Key: items[i].Key, ClientId: c.s.cfg.ClientID}
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_, _ = c.Objects().BatchPutRevoke(rctx, req)
}

// runWrites performs replica writes: small ones grouped per agent endpoint
// into BatchWrite calls, large ones streamed, at most MaxConcurrency calls
// at once. It returns the first error per item index.
func (c *Client) runWrites(ctx context.Context, writes []write) map[int]error {
	var mu sync.Mutex
	errs := map[int]error{}
	fail := func(item int, err error) {
		mu.Lock()
		if errs[item] == nil {
			errs[item] = err
		}
		mu.Unlock()
	}
	var tasks []func()
	groups := map[route][]write{}
	var order []route
	for _, w := range writes {
		if len(w.data) > c.s.cfg.SmallObject {
			tasks = append(tasks, func() {
				if err := c.writeOne(ctx, w.desc, int64(len(w.data)), sliceSource(w.data), func(int) {}, nil); err != nil {
					fail(w.item, err)
				}
			})
			continue
		}
		rt := c.routeOf(w.desc)
		if _, ok := groups[rt]; !ok {
			order = append(order, rt)
		}
		groups[rt] = append(groups[rt], w)
	}
	for _, rt := range order {
		ep := rt.endpoint
		for _, chunk := range chunkWrites(groups[rt]) {
			if rt.transfer {
				tasks = append(tasks, func() { c.batchWriteTransfer(ctx, ep, chunk, fail) })
				continue
			}
			tasks = append(tasks, func() {
				dc, err := c.agent(ep)
				if err == nil {
					req := &agentv1.BatchWriteRequest{Items: make([]*agentv1.BatchWriteItem, len(chunk))}
					for k, w := range chunk {
						req.Items[k] = &agentv1.BatchWriteItem{SegmentId: w.desc.GetSegmentId(), AllocationId: w.desc.GetAllocationId(), Token: w.desc.GetToken(), Data: w.data}
					}
					var resp *agentv1.BatchWriteResponse
					resp, err = dc.BatchWrite(ctx, req)
					if err == nil && len(resp.GetResults()) != len(chunk) {
						err = fmt.Errorf("agent %s answered %d results for %d items", ep, len(resp.GetResults()), len(chunk))
					}
					if err == nil {
						for k, r := range resp.GetResults() {
							if e := itemErr(r); e != nil {
								fail(chunk[k].item, e)
							}
						}
						return
					}
				}
				err = rpcerr.FromStatus(err)
				for _, w := range chunk {
					fail(w.item, err)
				}
			})
		}
	}
	c.runBounded(tasks)
	return errs
}

func chunkWrites(ws []write) [][]write {
	var out [][]write
	start, bytes := 0, 0
	for i, w := range ws {
		if i > start && (i-start >= maxBatchItems || bytes+len(w.data) > maxBatchBytes) {
			out = append(out, ws[start:i])
			start, bytes = i, 0
		}
		bytes += len(w.data)
	}
	if start < len(ws) {
		out = append(out, ws[start:])
	}
	return out
}

// runBounded runs tasks with at most MaxConcurrency at once. When they
// all fit, the first runs in the caller's goroutine (one goroutine fewer to
// start and wait for: a coalesced Get's reads are one task per agent).
func (c *Client) runBounded(tasks []func()) {
	switch {
	case len(tasks) == 0:
		return
	case len(tasks) == 1:
		tasks[0]()
		return
	case len(tasks) <= c.s.cfg.MaxConcurrency:
		var wg sync.WaitGroup
		for _, t := range tasks[1:] {
			wg.Go(t)
		}
		tasks[0]()
		wg.Wait()
		return
	}
	sem := make(chan struct{}, c.s.cfg.MaxConcurrency)
	var wg sync.WaitGroup
	for _, t := range tasks {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			t()
		})
	}
	wg.Wait()
}

// BatchGet reads many objects: one BatchGetReplicaList, reads grouped per
// agent (nearest replica first), falling back per item to the other replicas
// on failure. It returns the data and one error per key.
func (c *Client) BatchGet(ctx context.Context, keys []string) ([][]byte, []error) {
	out := make([][]byte, len(keys))
	errs := make([]error, len(keys))
	ctx, span := c.startCall(ctx, "client.batch_get", len(keys), -1, "")
	defer endBatch(span, errs)
	for lo := 0; lo < len(keys); lo += masterBatch {
		hi := min(lo+masterBatch, len(keys))
		c.batchGet(ctx, keys[lo:hi], out[lo:hi], errs[lo:hi], nil)
	}
	return out, errs
}

// BatchGetInto is BatchGet reading each object straight into the caller's
// buffer (bufs[i] must hold object i whole), with no allocation per object:
// what an engine does when KV blocks land in memory it owns. It returns
// each object's size and one error per key; a buffer too small for its
// object is an INVALID_PARAMS error for that key.
func (c *Client) BatchGetInto(ctx context.Context, keys []string, bufs [][]byte) ([]int, []error) {
	sizes := make([]int, len(keys))
	errs := make([]error, len(keys))
	ctx, span := c.startCall(ctx, "client.batch_get", len(keys), -1, "")
	defer endBatch(span, errs)
	if len(bufs) != len(keys) {
		err := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "%d buffers for %d keys", len(bufs), len(keys))
		for i := range errs {
			errs[i] = err
		}
		return sizes, errs
	}
	out := make([][]byte, len(keys))
	for lo := 0; lo < len(keys); lo += masterBatch {
		hi := min(lo+masterBatch, len(keys))
		c.batchGet(ctx, keys[lo:hi], out[lo:hi], errs[lo:hi], bufs[lo:hi])
	}
	for i, b := range out {
		if errs[i] == nil {
			sizes[i] = len(b)
		}
	}
	return sizes, errs
}

type read struct {
	item int
	rl   *masterv1.GetReplicaListResponse
	// dst is the caller's buffer (BatchGetInto), sized to the object; nil
	// lets the read allocate.
	dst []byte
	// own, with dst nil, gives the bytes a buffer of their own, not a
	// share of the chunk's slab: the caller keeps them (Get).
	own bool
	// err is why the read of the first replica failed (set on the reads
	// batchReadChunk returns).
	err error
}

// failedWith returns r with the failure of its first replica, err.
func (r read) failedWith(err error) read {
	d := r.rl.GetReplicas()[0]
	r.err = fmt.Errorf("replica %d on %s: %w", d.GetReplicaId(), d.GetDataEndpoint(), err)
	return r
}

// errChecksum is the failure of a replica whose bytes do not match the
// object checksum.
var errChecksum = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "checksum mismatch")

// buf returns where r's bytes go: the caller's buffer or a new one.
func (r *read) buf() []byte {
	if r.dst != nil {
		return r.dst
	}
	return make([]byte, r.rl.GetSize())
}

// batchGet reads keys into out (errors into errs); with into, object i
// lands in into[i].
func (c *Client) batchGet(ctx context.Context, keys []string, out [][]byte, errs []error, into [][]byte) {
	req := &masterv1.BatchGetReplicaListRequest{Items: make([]*masterv1.GetReplicaListRequest, len(keys))}
	for i, k := range keys {
		req.Items[i] = &masterv1.GetReplicaListRequest{Tenant: c.tenant, Key: k, ClientHost: c.s.cfg.HostID}
	}
	resp, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.BatchGetReplicaListResponse, error) {
		return s.BatchGetReplicaList(ctx, req)
	})
	if err == nil && len(resp.GetResults()) != len(keys) {
		err = fmt.Errorf("master answered %d results for %d items", len(resp.GetResults()), len(keys))
	}
	if err != nil {
		for i := range errs {
			errs[i] = fmt.Errorf("get %q: %w", keys[i], err)
		}
		return
	}
	var reads, local readPlan
	var tasks []func()
	var mu sync.Mutex
	var retry []read
	for i, r := range resp.GetResults() {
		if e := rpcerr.FromItem(r.GetStatus()); e != nil {
			errs[i] = fmt.Errorf("get %q: %w", keys[i], e)
			continue
		}
		rl := r.GetReplicaList()
		c.orderReplicas(rl.GetReplicas())
		if len(rl.GetReplicas()) == 0 {
			errs[i] = fmt.Errorf("get %q: %w", keys[i], rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY, "no readable replica"))
			continue
		}
		rd := read{item: i, rl: rl}
		if into != nil {
			if uint64(len(into[i])) < rl.GetSize() {
				errs[i] = fmt.Errorf("get %q: %w", keys[i], rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "buffer of %d bytes is smaller than the %d-byte object", len(into[i]), rl.GetSize()))
				continue
			}
			rd.dst = into[i][:rl.GetSize()]
		}
		if rl.GetSize() > uint64(c.s.cfg.SmallObject) {
			if d := rl.GetReplicas()[0]; rl.GetSize() <= shmChunkBytes && c.transferEndpoint(d) != "" && c.shmFor(ctx, d.GetSegmentId()) != nil {
				// A large object in the memory of an agent on this host:
				// grouped with the others there, shmChunkBytes per
				// request, so a batch pays one round trip on the socket
				// per chunk, not per object, and the chunks' copies run
				// in parallel.
				local.maxBytes = shmChunkBytes
				local.add(c.routeOf(d), rd)
				continue
			}
			tasks = append(tasks, func() {
				buf := rd.buf()
				if err := c.readAny(ctx, rl, rl.GetReplicas(), buf); err != nil {
					if err = c.getAgain(ctx, keys[i], allocItem(keys, into, i, &buf), err); err != nil {
						errs[i] = err
						return
					}
				}
				out[i] = buf
			})
			continue
		}
		reads.add(c.routeOf(rl.GetReplicas()[0]), rd)
	}
	failed := func(failed []read) {
		mu.Lock()
		retry = append(retry, failed...)
		mu.Unlock()
	}
	tasks = append(tasks, reads.tasks(ctx, c, out, failed)...)
	tasks = append(tasks, local.tasks(ctx, c, out, failed)...)
	c.runBounded(tasks)
	// Fall back, per item, to the remaining replicas, then to a fresh list
	// as Get does (getAgain).
	var fallbacks []func()
	for _, r := range retry {
		fallbacks = append(fallbacks, func() {
			err := r.err
			if rest := r.rl.GetReplicas()[1:]; len(rest) > 0 {
				buf := r.buf()
				if ferr := c.readAny(ctx, r.rl, rest, buf); ferr != nil {
					err = errors.Join(err, ferr)
				} else {
					out[r.item] = buf
				}
			}
			if errors.Is(r.err, errChecksum) {
				// Once the others were tried, and before a fresh list, so
				// that it lacks the replica when the agent drops it.
				c.verifyReplica(ctx, r.rl.GetReplicas()[0])
			}
			if out[r.item] != nil {
				return
			}
			var buf []byte
			if err = c.getAgain(ctx, keys[r.item], allocItem(keys, into, r.item, &buf), err); err == nil {
				out[r.item] = buf
				return
			}
			// The first replica's own failure (a checksum mismatch, an
			// agent that is down) stays in err, not only "no readable
			// replica".
			errs[r.item] = err
		})
	}
	c.runBounded(fallbacks)
}

// allocItem is the alloc of a batch get's second round for item i
// (getAgain): a new buffer, or the caller's into[i] (BatchGetInto); *buf
// is set to the buffer handed out.
func allocItem(keys []string, into [][]byte, i int, buf *[]byte) func(size uint64) ([]byte, error) {
	return func(size uint64) ([]byte, error) {
		switch {
		case into == nil:
			*buf = make([]byte, size)
		case uint64(len(into[i])) < size:
			return nil, fmt.Errorf("get %q: %w", keys[i], rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "buffer of %d bytes is smaller than the %d-byte object", len(into[i]), size))
		default:
			*buf = into[i][:size]
		}
		return *buf, nil
	}
}

// readPlan is the small-object reads of a batch get (or its large ones
// over shared memory), grouped by the agent route of their first replica,
// in the order the routes first appear.
type readPlan struct {
	groups map[route][]read
	order  []route
	// maxBytes, when set, also bounds the bytes of one request (a request
	// holds at least one read).
	maxBytes uint64
}

// shmChunkBytes bounds the bytes of one shared-memory read request of a
// batch get (readPlan.maxBytes): a few MiB amortise the socket's round
// trip, and several chunks keep the cores copying in parallel.
const shmChunkBytes = 4 << 20

func (p *readPlan) add(rt route, r read) {
	if p.groups == nil {
		p.groups = map[route][]read{}
	}
	if _, ok := p.groups[rt]; !ok {
		p.order = append(p.order, rt)
	}
	p.groups[rt] = append(p.groups[rt], r)
}

// tasks returns one task per request of at most maxBatchItems reads to one
// route (batchReadChunk into out), each passing the reads that failed, if
// any, to failed (called from the tasks' goroutines).
func (p *readPlan) tasks(ctx context.Context, c *Client, out [][]byte, failed func([]read)) []func() {
	var tasks []func()
	for _, rt := range p.order {
		g := p.groups[rt]
		for lo, hi := 0, 0; lo < len(g); lo = hi {
			hi = lo + 1
			for bytes := g[lo].rl.GetSize(); hi < min(lo+maxBatchItems, len(g)); hi++ {
				if bytes += g[hi].rl.GetSize(); p.maxBytes > 0 && bytes > p.maxBytes {
					break
				}
			}
			chunk := g[lo:hi]
			tasks = append(tasks, func() {
				if bad := c.batchReadChunk(ctx, rt, chunk, out); len(bad) > 0 {
					failed(bad)
				}
			})
		}
	}
	return tasks
}

// batchReadChunk reads the first replica of each item from one agent in one
// BatchRead and returns the items that failed.
func (c *Client) batchReadChunk(ctx context.Context, rt route, chunk []read, out [][]byte) []read {
	if rt.transfer {
		return c.batchReadTransfer(ctx, rt.endpoint, chunk, out)
	}
	dc, err := c.agent(rt.endpoint)
	if err != nil {
		return failAll(chunk, err)
	}
	req := &agentv1.BatchReadRequest{Items: make([]*agentv1.BatchReadItem, len(chunk))}
	for k, r := range chunk {
		d := r.rl.GetReplicas()[0]
		req.Items[k] = &agentv1.BatchReadItem{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken()}
	}
	resp, err := dc.BatchRead(ctx, req)
	if err != nil {
		return failAll(chunk, rpcerr.FromStatus(err))
	}
	if len(resp.GetResults()) != len(chunk) {
		return failAll(chunk, fmt.Errorf("agent %s answered %d results for %d items", rt.endpoint, len(resp.GetResults()), len(chunk)))
	}
	var failed []read
	for k, res := range resp.GetResults() {
		r := chunk[k]
		data := res.GetData()
		switch err := itemErr(res.GetStatus()); {
		case err != nil:
			failed = append(failed, r.failedWith(err))
			continue
		case uint64(len(data)) != r.rl.GetSize():
			failed = append(failed, r.failedWith(fmt.Errorf("%d bytes of a %d-byte object", len(data), r.rl.GetSize())))
			continue
		case checksum.Sum(data) != r.rl.GetChecksum():
			failed = append(failed, r.failedWith(errChecksum))
			continue
		}
		if r.dst != nil {
			data = r.dst[:copy(r.dst, data)]
		}
		out[r.item] = slices.Clip(data) // the decoder's own copy
	}
	return failed
}

// failAll returns chunk's reads, each failed with err.
func failAll(chunk []read, err error) []read {
	failed := make([]read, len(chunk))
	for k, r := range chunk {
		failed[k] = r.failedWith(err)
	}
	return failed
}

// BatchRemove removes many objects in one RPC; one error per key.
func (c *Client) BatchRemove(ctx context.Context, keys []string, force bool) []error {
	errs := make([]error, len(keys))
	for lo := 0; lo < len(keys); lo += masterBatch {
		hi := min(lo+masterBatch, len(keys))
		req := &masterv1.BatchRemoveRequest{Items: make([]*masterv1.RemoveRequest, hi-lo)}
		for i, k := range keys[lo:hi] {
			req.Items[i] = &masterv1.RemoveRequest{Tenant: c.tenant, Key: k, Force: force}
		}
		resp, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.BatchRemoveResponse, error) {
			return s.BatchRemove(ctx, req)
		})
		if err == nil && len(resp.GetResults()) != hi-lo {
			err = fmt.Errorf("master answered %d results for %d items", len(resp.GetResults()), hi-lo)
		}
		for i := lo; i < hi; i++ {
			if err != nil {
				errs[i] = fmt.Errorf("remove %q: %w", keys[i], err)
			} else if e := rpcerr.FromItem(resp.GetResults()[i-lo]); e != nil {
				errs[i] = fmt.Errorf("remove %q: %w", keys[i], e)
			}
		}
	}
	return errs
}

// BatchExist answers Exist for many keys in one RPC.
func (c *Client) BatchExist(ctx context.Context, keys []string) ([]bool, error) {
	req := &masterv1.BatchExistRequest{Items: make([]*masterv1.ExistRequest, len(keys))}
	for i, k := range keys {
		req.Items[i] = &masterv1.ExistRequest{Tenant: c.tenant, Key: k}
	}
	resp, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.BatchExistResponse, error) {
		return s.BatchExist(ctx, req)
	})
	if err != nil {
		return nil, fmt.Errorf("batch exist: %w", err)
	}
	if len(resp.GetExists()) != len(keys) {
		return nil, fmt.Errorf("batch exist: master answered %d results for %d keys", len(resp.GetExists()), len(keys))
	}
	return resp.GetExists(), nil
}
