package session

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
)

// kind is a command type.
type kind uint8

const (
	kindReserve kind = iota
	kindSeal
	kindRelease
	kindCopy
	numKinds
)

var kindNames = [numKinds]string{"reserve", "seal", "release", "copy"}

func (k kind) String() string { return kindNames[k] }

// call is one caller's request: its items travel in one message, possibly
// with other calls' items.
type call struct {
	kind    kind
	reserve []*masterv1.ReserveItem
	seal    []*masterv1.SealItem
	release []*masterv1.AllocationRef
	copy    []*masterv1.CopyItem
	// sc is the span the call runs under (tracectx.Carried: the master's
	// command span, or a sampled caller's when the master does not trace;
	// zero otherwise): the message carrying the call names it, so the
	// agent's span for the command is its child (or links to it).
	sc *trace.SpanContext

	// state is callWaiting until either the result is delivered or the
	// caller abandons the call; whichever wins the CAS decides who owns the
	// result (an abandoned reservation is released by the session).
	state atomic.Int32
	done  chan outcome // capacity 1
}

const (
	callWaiting int32 = iota
	callDelivered
	callAbandoned
)

type outcome struct {
	reserve []*masterv1.ReserveItemResult
	status  []*masterv1.ItemStatus
	err     error
}

func (c *call) items() int {
	switch c.kind {
	case kindReserve:
		return len(c.reserve)
	case kindSeal:
		return len(c.seal)
	case kindRelease:
		return len(c.release)
	case kindCopy:
		return len(c.copy)
	}
	return 1
}

func (c *call) deliver(o outcome) bool {
	if !c.state.CompareAndSwap(callWaiting, callDelivered) {
		return false
	}
	c.done <- o
	return true
}

func (c *call) abandon() bool { return c.state.CompareAndSwap(callWaiting, callAbandoned) }

// flight is one command message awaiting its result.
type flight struct {
	kind    kind
	calls   []*call
	items   int
	sentAt  time.Time
	timeout time.Duration
	// counted: the flight holds one of MaxInFlight slots (copies do not).
	counted bool
	// expired: older than timeout; its slot was given back.
	expired bool
}

// batchLoop coalesces the session's calls into command messages: per kind,
// the calls that arrive within BatchWindow of the first (or until
// MaxBatchItems items) share one message, with at most MaxInFlight messages
// unanswered; past that, calls accumulate into larger batches.
func (s *session) batchLoop() {
	defer s.m.wg.Done()
	select {
	case <-s.ready:
	case <-s.ctx.Done():
		return
	}
	cfg := s.m.cfg
	var queues [numKinds][]*call
	var queued [numKinds]int
	window := time.NewTimer(time.Hour)
	window.Stop()
	armed := false
	janitor := time.NewTicker(max(cfg.RequestTimeout/4, time.Millisecond))
	defer janitor.Stop()
	defer window.Stop()

	flushAll := func() bool {
		for k := range numKinds {
			if !s.flush(k, &queues[k], &queued[k]) {
				return false
			}
		}
		return true
	}
	for {
		select {
		case c := <-s.submit:
			// Take whatever else is already waiting, then decide: an idle
			// agent gets the batch at once (no added latency at low load);
			// a busy one gets BatchWindow more to fill it.
			for more := true; more; {
				k := c.kind
				queues[k] = append(queues[k], c)
				queued[k] += c.items()
				if k == kindCopy || queued[k] >= cfg.MaxBatchItems {
					if !s.flush(k, &queues[k], &queued[k]) {
						return
					}
				}
				select {
				case c = <-s.submit:
				default:
					more = false
				}
			}
			switch {
			case s.idle():
				if armed {
					window.Stop()
					armed = false
				}
				if !flushAll() {
					return
				}
			case !armed:
				window.Reset(cfg.BatchWindow)
				armed = true
			}
		case <-window.C:
			armed = false
			if !flushAll() {
				return
			}
		case <-s.slot:
			if armed && s.idle() {
				window.Stop()
				armed = false
			}
			if !armed && !flushAll() {
				return
			}
		case now := <-janitor.C:
			if s.expire(now) && !armed && !flushAll() {
				return
			}
		case <-s.ctx.Done():
			return
		}
	}
}

// flush sends the queued calls of one kind, as many messages as in-flight
// slots allow. It returns false when the session ended.
func (s *session) flush(k kind, q *[]*call, queued *int) bool {
	cfg := s.m.cfg
	for len(*q) > 0 {
		counted := k != kindCopy
		if counted && !s.acquire() {
			return true
		}
		var batch []*call
		n := 0
		i := 0
		for ; i < len(*q); i++ {
			c := (*q)[i]
			cn := c.items()
			if len(batch) > 0 && (n+cn > cfg.MaxBatchItems || k == kindCopy) {
				break
			}
			*queued -= cn
			if c.state.Load() != callWaiting {
				continue // the caller gave up before it was sent
			}
			batch = append(batch, c)
			n += cn
		}
		clear((*q)[:i])
		*q = (*q)[i:]
		if len(batch) == 0 {
			if counted {
				s.releaseSlot()
			}
			continue
		}
		id := s.nextID.Add(1)
		timeout := cfg.RequestTimeout
		if k == kindCopy {
			timeout = cfg.CopyTimeout
		}
		s.mu.Lock()
		s.pending[id] = &flight{kind: k, calls: batch, items: n, sentAt: time.Now(), timeout: timeout, counted: counted}
		s.mu.Unlock()
		msg := s.build(k, id, batch, n)
		select {
		case s.sendq <- msg:
		case <-s.ctx.Done():
			return false
		}
		s.m.met.batches.WithLabelValues(k.String()).Inc()
		s.m.met.batchItems.WithLabelValues(k.String()).Observe(float64(n))
	}
	if len(*q) == 0 {
		*q = nil
	}
	return true
}

// idle reports whether no counted command is in flight.
func (s *session) idle() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inflight == 0
}

func (s *session) acquire() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inflight >= s.m.cfg.MaxInFlight {
		return false
	}
	s.inflight++
	return true
}

func (s *session) releaseSlot() {
	s.mu.Lock()
	s.inflight--
	s.mu.Unlock()
}

// build assembles one command message, stamped with the master's epoch
// and the trace context of the calls it carries (traceOf).
func (s *session) build(k kind, id uint64, batch []*call, n int) *masterv1.ConnectResponse {
	epoch := s.m.epoch.Load()
	tc, links := traceOf(batch)
	switch k {
	case kindReserve:
		items := make([]*masterv1.ReserveItem, 0, n)
		for _, c := range batch {
			items = append(items, c.reserve...)
		}
		return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: id, Epoch: epoch, Items: items,
			TraceContext: tc, TraceLinks: links}}}
	case kindSeal:
		items := make([]*masterv1.SealItem, 0, n)
		for _, c := range batch {
			items = append(items, c.seal...)
		}
		return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: id, Epoch: epoch, Items: items,
			TraceContext: tc, TraceLinks: links}}}
	case kindRelease:
		items := make([]*masterv1.AllocationRef, 0, n)
		for _, c := range batch {
			items = append(items, c.release...)
		}
		return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: id, Epoch: epoch, Items: items,
			TraceContext: tc, TraceLinks: links}}}
	default:
		// One call per copy message (flush): a copy's items are its own.
		return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Copy{Copy: &masterv1.CopyRequest{RequestId: id, Epoch: epoch, Items: batch[0].copy,
			TraceContext: tc}}}
	}
}

// traceOf is the trace context of a message carrying batch: the first
// traced call's span is the parent of the agent's span, and up to
// tracectx.MaxLinks other calls' spans are links (concurrent callers
// share one message). Nil, nil when no call is traced: nothing more on the
// wire.
func traceOf(batch []*call) (*masterv1.TraceContext, []*masterv1.TraceContext) {
	var parent *trace.SpanContext
	var tc *masterv1.TraceContext
	var links []*masterv1.TraceContext
	for _, c := range batch {
		if c.sc == nil || c.sc == parent {
			continue
		}
		if tc == nil {
			parent, tc = c.sc, tracectx.CommandOf(*c.sc)
			continue
		}
		if len(links) == tracectx.MaxLinks {
			break
		}
		if l := tracectx.CommandOf(*c.sc); l != nil && !slices.ContainsFunc(links, func(x *masterv1.TraceContext) bool { return x.GetTraceparent() == l.GetTraceparent() }) {
			links = append(links, l)
		}
	}
	return tc, links
}

// do submits a call to the agent's session and waits for its outcome, the
// call's timeout, the caller's context or the end of the session, whichever
// comes first.
func (m *Manager) do(ctx context.Context, agentID string, c *call, timeout time.Duration) (outcome, error) {
	s := m.session(agentID)
	if s == nil {
		return outcome{}, unavailable("agent %q is not connected", agentID)
	}
	c.done = make(chan outcome, 1)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case s.submit <- c:
	case <-ctx.Done():
		return outcome{}, m.ctxErr(ctx, c.kind, agentID)
	case <-t.C:
		m.met.timeouts.WithLabelValues(c.kind.String()).Inc()
		return outcome{}, unavailable("agent %q: %s not accepted within %v", agentID, c.kind, timeout)
	case <-s.ctx.Done():
		return outcome{}, unavailable("session to agent %q ended", agentID)
	}
	var err error
	timedOut := false
	select {
	case o := <-c.done:
		return o, o.err
	case <-ctx.Done():
		err = m.ctxErr(ctx, c.kind, agentID)
	case <-t.C:
		err = unavailable("agent %q did not answer %s within %v", agentID, c.kind, timeout)
		timedOut = true
	case <-s.ctx.Done():
		err = unavailable("session to agent %q ended", agentID)
	}
	if !c.abandon() {
		// The result was delivered while we were giving up: it is ours.
		o := <-c.done
		return o, o.err
	}
	if timedOut {
		m.met.timeouts.WithLabelValues(c.kind.String()).Inc()
	}
	return outcome{}, err
}

func (m *Manager) ctxErr(ctx context.Context, k kind, agentID string) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return unavailable("agent %q: %s: caller deadline exceeded", agentID, k)
	}
	return ctx.Err()
}

// Reserve asks the agent to reserve allocations; results are in item order.
func (m *Manager) Reserve(ctx context.Context, agentID string, items []*masterv1.ReserveItem) ([]*masterv1.ReserveItemResult, error) {
	if len(items) == 0 {
		return nil, nil
	}
	for i, it := range items {
		if it == nil || it.GetSegmentId() == "" {
			return nil, invalid("reserve item %d: segment_id is required", i)
		}
	}
	ctx, span := startCommand(ctx, kindReserve, agentID, len(items))
	sc := carried(ctx, span)
	out := make([]*masterv1.ReserveItemResult, 0, len(items))
	err := m.doChunked(ctx, agentID, len(items), m.cfg.MaxBatchItems, m.cfg.RequestTimeout, func(lo, hi int) *call {
		return &call{kind: kindReserve, reserve: items[lo:hi], sc: sc}
	}, func(o outcome) { out = append(out, o.reserve...) })
	endCommand(span, err, out, (*masterv1.ReserveItemResult).GetStatus)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// tracer makes the master's command spans.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/master/session")

// startCommand starts the span of one command call to an agent (its
// chunks, in as many messages): a child of the caller's span when that is
// recording, else none.
func startCommand(ctx context.Context, k kind, agentID string, n int) (context.Context, trace.Span) {
	ctx, span := tracer.Child(ctx, commandSpans[k], tracectx.ClientKind...)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Agent.String(agentID), tracectx.Items.Int(n))
	}
	return ctx, span
}

// carried is the span context a command call names (tracectx.Carried), or
// nil: one pointer per call, shared by its chunks, so an untraced call
// costs the call no bytes.
func carried(ctx context.Context, span trace.Span) *trace.SpanContext {
	sc := tracectx.Carried(ctx, span)
	if !sc.IsValid() {
		return nil
	}
	p := new(trace.SpanContext) // only now: &sc would put sc on the heap every time
	*p = sc
	return p
}

// commandSpans are the names of the master's command spans, by kind.
var commandSpans = [numKinds]string{"master.reserve", "master.seal", "master.release", "master.copy"}

// endCommand ends a command span with the call's error, or the count and
// first reason of the items that failed.
func endCommand[T any](span trace.Span, err error, out []T, status func(T) *masterv1.ItemStatus) {
	if err == nil && span.IsRecording() {
		failed, first := 0, ""
		for _, o := range out {
			if st := status(o); st.GetCode() != 0 {
				if failed++; first == "" {
					first = st.GetReason()
				}
			}
		}
		tracectx.Outcome(span, failed, first)
	}
	tracectx.End(span, err)
}

// Seal asks the agent to seal written allocations; statuses are in item order.
func (m *Manager) Seal(ctx context.Context, agentID string, items []*masterv1.SealItem) ([]*masterv1.ItemStatus, error) {
	if len(items) == 0 {
		return nil, nil
	}
	for i, it := range items {
		if it == nil || it.GetSegmentId() == "" {
			return nil, invalid("seal item %d: segment_id is required", i)
		}
	}
	ctx, span := startCommand(ctx, kindSeal, agentID, len(items))
	sc := carried(ctx, span)
	out := make([]*masterv1.ItemStatus, 0, len(items))
	err := m.doChunked(ctx, agentID, len(items), m.cfg.MaxBatchItems, m.cfg.RequestTimeout, func(lo, hi int) *call {
		return &call{kind: kindSeal, seal: items[lo:hi], sc: sc}
	}, func(o outcome) { out = append(out, o.status...) })
	endCommand(span, err, out, func(st *masterv1.ItemStatus) *masterv1.ItemStatus { return st })
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Release frees allocations (unknown ids are no-ops at the agent).
func (m *Manager) Release(ctx context.Context, agentID string, items []*masterv1.AllocationRef) error {
	if len(items) == 0 {
		return nil
	}
	for i, it := range items {
		if it == nil || it.GetSegmentId() == "" {
			return invalid("release item %d: segment_id is required", i)
		}
	}
	ctx, span := startCommand(ctx, kindRelease, agentID, len(items))
	sc := carried(ctx, span)
	var failed *cluster.ReleaseFailed
	next := 0 // the item the next outcome's first status is for
	err := m.doChunked(ctx, agentID, len(items), m.cfg.MaxBatchItems, m.cfg.RequestTimeout, func(lo, hi int) *call {
		return &call{kind: kindRelease, release: items[lo:hi], sc: sc}
	}, func(o outcome) {
		for i, st := range o.status {
			if st.GetCode() != 0 && next+i < len(items) {
				if failed == nil {
					failed = &cluster.ReleaseFailed{Err: rpcerr.FromItem(st)}
				}
				failed.Refs = append(failed.Refs, items[next+i])
			}
		}
		next += len(o.status)
	})
	if err == nil && failed != nil {
		err = failed
	}
	tracectx.End(span, err)
	return err
}

// doChunked runs a call of n items as calls of at most size items each
// (MaxBatchItems for Reserve, Seal and Release) — a single call is never
// split across messages, and one huge call (a RemoveByPrefix releasing 100k
// allocations) would otherwise become one message past the agent's receive
// limit. Each chunk waits at most timeout. The chunks run concurrently;
// merge sees their outcomes in item order. Any chunk's failure fails the
// call.
func (m *Manager) doChunked(ctx context.Context, agentID string, n, size int, timeout time.Duration, mk func(lo, hi int) *call, merge func(outcome)) error {
	size = max(size, 1)
	if n <= size {
		o, err := m.do(ctx, agentID, mk(0, n), timeout)
		if err != nil {
			return err
		}
		merge(o)
		return nil
	}
	chunks := (n + size - 1) / size
	outs := make([]outcome, chunks)
	errs := make([]error, chunks)
	var wg sync.WaitGroup
	for i := range chunks {
		wg.Go(func() {
			outs[i], errs[i] = m.do(ctx, agentID, mk(i*size, min((i+1)*size, n)), timeout)
		})
	}
	wg.Wait()
	for i := range chunks {
		if errs[i] != nil {
			return errs[i]
		}
	}
	for _, o := range outs {
		merge(o)
	}
	return nil
}

// MaxCopyItems bounds the items of one copy message, as agents enforce it
// (CopyRequest in proto/crescent/master/v1/segment.proto).
const MaxCopyItems = 4096

// Copy asks the agent to copy sealed allocations of its own into
// allocations reserved at other agents (items[i].source into
// items[i].target); statuses are in item order. The items travel in
// messages of at most min(MaxBatchItems, MaxCopyItems), each given
// CopyTimeout (a message moves whole objects). The request id and epoch
// are set here.
func (m *Manager) Copy(ctx context.Context, agentID string, items []*masterv1.CopyItem) ([]*masterv1.ItemStatus, error) {
	if len(items) == 0 {
		return nil, nil
	}
	for i, it := range items {
		if it == nil || it.GetSource().GetSegmentId() == "" || it.GetTarget().GetSegmentId() == "" ||
			(it.GetTargetEndpoint() == "" && it.GetTargetTransferEndpoint() == "") {
			return nil, invalid("copy item %d: source, target and a target endpoint are required", i)
		}
	}
	ctx, span := startCommand(ctx, kindCopy, agentID, len(items))
	if span.IsRecording() {
		span.SetAttributes(tracectx.Segment.String(items[0].GetSource().GetSegmentId()))
	}
	sc := carried(ctx, span)
	out := make([]*masterv1.ItemStatus, 0, len(items))
	err := m.doChunked(ctx, agentID, len(items), min(m.cfg.MaxBatchItems, MaxCopyItems), m.cfg.CopyTimeout, func(lo, hi int) *call {
		return &call{kind: kindCopy, copy: items[lo:hi], sc: sc}
	}, func(o outcome) { out = append(out, o.status...) })
	endCommand(span, err, out, func(st *masterv1.ItemStatus) *masterv1.ItemStatus { return st })
	if err != nil {
		return nil, err
	}
	return out, nil
}
