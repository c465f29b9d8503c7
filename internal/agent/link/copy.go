package link

import (
	"context"
	"errors"
	"sync"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc"
)

// MaxCopyItems bounds the items of one batched CopyRequest
// (proto/crescent/master/v1/segment.proto); a longer request is refused
// whole with RESOURCE_EXHAUSTED LIMIT_EXCEEDED before anything is looked at.
const MaxCopyItems = 4096

// copyResult runs one CopyRequest and builds its answer: the batch form
// (items) gets one status per item, the single form one status.
func (l *Link) copyResult(ctx context.Context, r *masterv1.CopyRequest) *masterv1.CopyResult {
	if err := checkCopy(r); err != nil {
		l.lg.Warn("copy refused", "items", len(r.GetItems()), "err", err)
		return &masterv1.CopyResult{RequestId: r.GetRequestId(), Status: rpcerr.Item(err)}
	}
	if len(r.GetItems()) == 0 {
		err := l.copyGRPC(ctx, r.GetSource(), r.GetTargetEndpoint(), r.GetTarget(), r.GetTargetToken())
		if err != nil {
			l.lg.Warn("copy failed", "source_segment", r.GetSource().GetSegmentId(), "source_allocation", r.GetSource().GetAllocationId(),
				"target", r.GetTargetEndpoint(), "err", err)
		}
		return &masterv1.CopyResult{RequestId: r.GetRequestId(), Status: rpcerr.Item(err)}
	}
	errs := l.copyBatch(ctx, r.GetItems())
	out := &masterv1.CopyResult{RequestId: r.GetRequestId(), Items: make([]*masterv1.ItemStatus, len(errs))}
	ok := &masterv1.ItemStatus{}
	failed, gone, first := 0, 0, error(nil)
	for i, err := range errs {
		if err == nil {
			out.Items[i] = ok
			continue
		}
		out.Items[i] = rpcerr.Item(err)
		if releasedMeanwhile(err) {
			gone++
			continue
		}
		if failed++; first == nil {
			first = err
		}
	}
	if failed > 0 {
		l.lg.Warn("copy items failed", "items", len(errs), "failed", failed, "released_meanwhile", gone, "first_err", first)
	} else if gone > 0 {
		l.lg.Debug("copy items whose allocation was released meanwhile", "items", len(errs), "released_meanwhile", gone)
	}
	return out
}

// releasedMeanwhile reports a copy item that failed because its source or
// its target allocation no longer exists. Only the master releases them:
// it removed the object, or gave up the move, after it sent the copy (an
// offload whose victim a forced RemoveByPrefix took, say). The master
// reads the item's status; at the agent it is not worth a warning.
func releasedMeanwhile(err error) bool {
	return rpcerr.Reason(err) == "ALLOCATION_NOT_FOUND"
}

// checkCopy refuses a request as a whole: too many items, or both forms at
// once. Items are checked one by one in copyBatch.
func checkCopy(r *masterv1.CopyRequest) error {
	n := len(r.GetItems())
	if n > MaxCopyItems {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED, "copy of %d items; at most %d per request", n, MaxCopyItems)
	}
	single := r.GetSource() != nil || r.GetTarget() != nil || r.GetTargetEndpoint() != "" || len(r.GetTargetToken()) > 0
	switch {
	case n > 0 && single:
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "copy has items and a single-form source or target; send one form")
	case n == 0 && (r.GetSource() == nil || r.GetTarget() == nil || r.GetTargetEndpoint() == ""):
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "copy needs a source, a target and a target endpoint")
	}
	return nil
}

// checkItem reports what is wrong with one batched copy item.
func checkItem(it *masterv1.CopyItem) error {
	if it.GetSource().GetSegmentId() == "" || it.GetTarget().GetSegmentId() == "" ||
		(it.GetTargetEndpoint() == "" && it.GetTargetTransferEndpoint() == "") {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "copy item needs a source, a target and a target endpoint")
	}
	return nil
}

// piece is a range of one copy item's object, sent as one transfer item.
type piece struct {
	item   int // index in the request
	off, n uint64
}

// copyJob is the state of one batched copy: the source handles and each
// item's outcome.
type copyJob struct {
	items []*masterv1.CopyItem
	hs    []*segment.Handle // open source handles, nil where the item failed
	// mu guards errs once the peers run concurrently.
	mu   sync.Mutex
	errs []error
}

func (j *copyJob) fail(i int, err error) {
	j.mu.Lock()
	if j.errs[i] == nil {
		j.errs[i] = err
	}
	j.mu.Unlock()
}

// copyBatch copies items (sealed allocations of this agent into
// allocations reserved at other agents) and returns one error per item.
// Items are grouped by target; the targets are served concurrently (at
// most CopyPeers at once). To a target with a bulk transfer endpoint the
// objects go in transfer requests of about CopyRequestBytes (many small
// objects per request, large ones in ranges), straight from a memory
// segment's mapping or read from a disk segment into a pooled buffer, with
// CopyConnsPerPeer requests in flight per target; to one without, one
// DataService Write stream per object. At most CopyMaxBytes are in flight
// over all targets, and each request to a target gets CopyPeerTimeout.
func (l *Link) copyBatch(ctx context.Context, items []*masterv1.CopyItem) []error {
	j := &copyJob{items: items, hs: make([]*segment.Handle, len(items)), errs: make([]error, len(items))}
	defer func() {
		for _, h := range j.hs {
			if h != nil {
				h.Close()
			}
		}
	}()
	type peer struct {
		endpoint string
		xfer     bool
		items    []int
	}
	var peers []*peer
	byTarget := map[string]*peer{}
	for i, it := range items {
		if err := checkItem(it); err != nil {
			j.errs[i] = err
			continue
		}
		src := it.GetSource()
		seg, ok := l.deps.Segments.Get(src.GetSegmentId())
		if !ok {
			j.errs[i] = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", src.GetSegmentId())
			continue
		}
		h, err := seg.OpenRead(src.GetAllocationId())
		if err != nil {
			j.errs[i] = err
			continue
		}
		j.hs[i] = h
		key, isXfer := it.GetTargetTransferEndpoint(), true
		if key == "" || l.pool == nil {
			key, isXfer = it.GetTargetEndpoint(), false
			if key == "" {
				j.errs[i] = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "copy item has only a transfer endpoint and this agent copies through DataService")
				continue
			}
		}
		p := byTarget[key]
		if p == nil {
			p = &peer{endpoint: key, xfer: isXfer}
			byTarget[key] = p
			peers = append(peers, p)
		}
		p.items = append(p.items, i)
	}
	sem := make(chan struct{}, l.cfg.CopyPeers)
	var wg sync.WaitGroup
	for _, p := range peers {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			for _, i := range p.items {
				j.fail(i, ctx.Err())
			}
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			if p.xfer {
				l.copyXfer(ctx, j, p.endpoint, p.items)
				return
			}
			for _, i := range p.items {
				it := items[i]
				if err := l.copyGRPC(ctx, it.GetSource(), it.GetTargetEndpoint(), it.GetTarget(), it.GetTargetToken()); err != nil {
					j.fail(i, err)
				}
			}
		})
	}
	wg.Wait()
	for i, err := range j.errs {
		if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			j.errs[i] = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "copy interrupted: %v", err)
		}
	}
	return j.errs
}

// copyXfer copies the items idx (all to endpoint, a bulk transfer
// listener) in requests of about CopyRequestBytes, CopyConnsPerPeer at a
// time.
func (l *Link) copyXfer(ctx context.Context, j *copyJob, endpoint string, idx []int) {
	// Cut the objects into pieces and the pieces into requests.
	var reqs [][]piece
	var cur []piece
	var curBytes uint64
	maxReq := uint64(l.cfg.CopyRequestBytes)
	for _, i := range idx {
		size := j.hs[i].Size()
		for off, first := uint64(0), true; first || off < size; first = false {
			n := min(size-off, maxReq)
			if len(cur) > 0 && (curBytes+n > maxReq || len(cur) == xfer.MaxItems) {
				reqs, cur, curBytes = append(reqs, cur), nil, 0
			}
			cur = append(cur, piece{item: i, off: off, n: n})
			curBytes += n
			off += n
		}
	}
	if len(cur) > 0 {
		reqs = append(reqs, cur)
	}
	conns := make(chan struct{}, l.cfg.CopyConnsPerPeer)
	var wg sync.WaitGroup
	for _, req := range reqs {
		select {
		case conns <- struct{}{}:
		case <-ctx.Done():
			for _, p := range req {
				j.fail(p.item, ctx.Err())
			}
			continue
		}
		wg.Go(func() {
			defer func() { <-conns }()
			l.copyRequest(ctx, j, endpoint, req)
		})
	}
	wg.Wait()
}

// copyBuffers pools the buffers a disk source is read into.
var copyBuffers = sync.Pool{New: func() any { return new([]byte) }}

// copyRequest sends one transfer request of pieces to endpoint, within
// CopyPeerTimeout and the agent's budget of bytes in flight.
func (l *Link) copyRequest(ctx context.Context, j *copyJob, endpoint string, req []piece) {
	var total uint64
	for _, p := range req {
		total += p.n
	}
	// A request never waits for more than the whole budget: one larger
	// than it (a piece is at most CopyRequestBytes, which Validate keeps
	// within CopyMaxBytes) takes all of it.
	weight := int64(min(total, uint64(l.cfg.CopyMaxBytes)))
	if err := l.copyBudget.Acquire(ctx, weight); err != nil {
		for _, p := range req {
			j.fail(p.item, err)
		}
		return
	}
	defer l.copyBudget.Release(weight)
	items := make([]*agentv1.TransferItem, 0, len(req))
	srcs := make([][]byte, 0, len(req))
	var buf *[]byte
	var used uint64
	for _, p := range req {
		h := j.hs[p.item]
		data, err := h.Bytes(p.off, p.n)
		if err == nil && data == nil && p.n > 0 {
			// A disk segment: pread into the request's pooled buffer.
			if buf == nil {
				buf = copyBuffers.Get().(*[]byte)
				if uint64(cap(*buf)) < total {
					*buf = make([]byte, total)
				}
			}
			data = (*buf)[used : used+p.n]
			used += p.n
			err = h.ReadAt(data, p.off)
			if err != nil {
				err = rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "read allocation %d", h.ID())
			}
		}
		if err != nil {
			j.fail(p.item, err)
			data = nil // the item still travels (empty), so the others keep their places
		}
		it := j.items[p.item]
		items = append(items, &agentv1.TransferItem{SegmentId: it.GetTarget().GetSegmentId(), AllocationId: it.GetTarget().GetAllocationId(),
			Token: it.GetTargetToken(), Offset: p.off})
		srcs = append(srcs, data)
	}
	if buf != nil {
		defer func() {
			if cap(*buf) <= l.cfg.CopyRequestBytes {
				copyBuffers.Put(buf)
			}
		}()
	}
	pctx, cancel := context.WithTimeout(ctx, l.cfg.CopyPeerTimeout)
	defer cancel()
	errs, err := l.pool.Write(pctx, endpoint, items, srcs)
	if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "copy to %s: no answer within %v", endpoint, l.cfg.CopyPeerTimeout)
	}
	var copied uint64
	for k, p := range req {
		switch {
		case err != nil:
			j.fail(p.item, err)
		case errs[k] != nil:
			j.fail(p.item, errs[k])
		default:
			copied += p.n
		}
	}
	l.met.copiedBytes.Add(float64(copied))
}

// copyGRPC streams a local sealed allocation into a reserved allocation at
// another agent through its DataService (the single form, and targets
// without a bulk transfer endpoint), within CopyPeerTimeout.
func (l *Link) copyGRPC(ctx context.Context, src *masterv1.AllocationRef, endpoint string, dst *masterv1.AllocationRef, tok []byte) error {
	seg, ok := l.deps.Segments.Get(src.GetSegmentId())
	if !ok {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", src.GetSegmentId())
	}
	h, err := seg.OpenRead(src.GetAllocationId())
	if err != nil {
		return err
	}
	defer h.Close()
	cc, err := l.conn(endpoint)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.CopyPeerTimeout)
	defer cancel()
	stream, err := agentv1.NewDataServiceClient(cc).Write(ctx)
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	size, chunk := h.Size(), uint64(l.cfg.CopyChunk)
	var buf []byte
	for off, first := uint64(0), true; first || off < size; first = false {
		n := min(chunk, size-off)
		data, err := h.Bytes(off, n)
		if err != nil {
			return err
		}
		if data == nil && n > 0 {
			if uint64(cap(buf)) < n {
				buf = make([]byte, n)
			}
			data = buf[:n]
			if err := h.ReadAt(data, off); err != nil {
				return rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "read allocation %d", src.GetAllocationId())
			}
		}
		req := &agentv1.WriteRequest{Data: data}
		if first {
			req.Header = &agentv1.WriteHeader{SegmentId: dst.GetSegmentId(), AllocationId: dst.GetAllocationId(), Token: tok}
		}
		if err := stream.Send(req); err != nil {
			break // the status comes from CloseAndRecv
		}
		off += n
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	if resp.GetBytesWritten() != size {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "target wrote %d of %d bytes", resp.GetBytesWritten(), size)
	}
	l.met.copiedBytes.Add(float64(size))
	return nil
}

// conn returns a cached connection to another agent's DataService.
func (l *Link) conn(endpoint string) (*grpc.ClientConn, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent is shutting down")
	}
	if c, ok := l.conns[endpoint]; ok {
		return c, nil
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(l.creds()),
		rpccodec.DialOption(),
		tracing.DialOption(),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(256<<20), grpc.MaxCallRecvMsgSize(256<<20)),
	}, l.deps.CopyDialOptions...)
	c, err := grpc.NewClient(endpoint, opts...)
	if err != nil {
		return nil, rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, err, "target endpoint %q", endpoint)
	}
	l.conns[endpoint] = c
	return c, nil
}
