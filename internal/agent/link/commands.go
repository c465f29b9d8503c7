package link

import (
	"context"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
)

// errEpoch is a command's answer when its epoch is stale.
func errEpoch(got, highest uint64) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_STALE_EPOCH,
		"command from master epoch %d; this agent has accepted epoch %d", got, highest)
}

// handle applies one master message.
func (s *session) handle(rcv received) error {
	l := s.l
	msg := rcv.msg
	switch m := msg.GetMsg().(type) {
	case *masterv1.ConnectResponse_Settings:
		return s.applySettings(m.Settings)
	case *masterv1.ConnectResponse_Reserve:
		r := m.Reserve
		s.command("reserve", r.GetEpoch(), traced{r.GetTraceContext(), r.GetTraceLinks(), len(r.GetItems())}, func(context.Context) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.ReserveUnder(r.GetItems(), l.now(), r.GetEpoch()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			items := make([]*masterv1.ReserveItemResult, len(r.GetItems()))
			for i := range items {
				items[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(err)}
			}
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{RequestId: r.GetRequestId(), Items: items}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Release:
		r := m.Release
		s.command("release", r.GetEpoch(), traced{r.GetTraceContext(), r.GetTraceLinks(), len(r.GetItems())}, func(context.Context) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Release(r.GetItems()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{RequestId: r.GetRequestId(), Items: repeatItem(err, len(r.GetItems()))}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Seal:
		r := m.Seal
		s.command("seal", r.GetEpoch(), traced{r.GetTraceContext(), r.GetTraceLinks(), len(r.GetItems())}, func(context.Context) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Seal(r.GetItems(), l.now()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{RequestId: r.GetRequestId(), Items: repeatItem(err, len(r.GetItems()))}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Copy:
		r := m.Copy
		n := max(len(r.GetItems()), 1)
		s.command("copy", r.GetEpoch(), traced{r.GetTraceContext(), nil, n}, func(ctx context.Context) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: l.copyResult(ctx, r)}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: r.GetRequestId(), Status: rpcerr.Item(err)}}}
		}, nil)
	default:
		// A newer master may send messages this agent does not know.
		l.lg.Debug("master message ignored", "msg", fmt.Sprintf("%T", msg.GetMsg()))
	}
	return nil
}

func repeatItem(err error, n int) []*masterv1.ItemStatus {
	out := make([]*masterv1.ItemStatus, n)
	for i := range out {
		out[i] = rpcerr.Item(err)
	}
	return out
}

// traced is what a command says about its trace: the master span it runs
// under, other callers' spans that share it, and its item count.
type traced struct {
	parent *masterv1.TraceContext
	links  []*masterv1.TraceContext
	items  int
}

// tracer makes the agent's command spans.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/agent/link")

// span starts the span of a command ("agent.<kind>") as a child of the
// master's span it names; none when it names no sampled span (or an
// invalid one: the command runs untraced).
func (s *session) span(kind string, tr traced) (context.Context, trace.Span) {
	if tr.parent == nil {
		return s.ctx, trace.SpanFromContext(context.Background())
	}
	ctx, span := tracer.Remote(s.ctx, "agent."+kind, tracectx.ParseCommand(tr.parent), tracectx.ParseLinks(tr.links), tracectx.ServerKind...)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Agent.String(s.l.cfg.AgentID), tracectx.Items.Int(tr.items))
	}
	return ctx, span
}

// endSpan ends a command's span with the outcome its result reports.
func endSpan(span trace.Span, msg *masterv1.ConnectRequest) {
	if !span.IsRecording() {
		return
	}
	var statuses []*masterv1.ItemStatus
	switch r := msg.GetMsg().(type) {
	case *masterv1.ConnectRequest_ReserveResult:
		for _, it := range r.ReserveResult.GetItems() {
			statuses = append(statuses, it.GetStatus())
		}
	case *masterv1.ConnectRequest_SealResult:
		statuses = r.SealResult.GetItems()
	case *masterv1.ConnectRequest_ReleaseResult:
		statuses = r.ReleaseResult.GetItems()
	case *masterv1.ConnectRequest_CopyResult:
		if len(r.CopyResult.GetItems()) == 0 {
			tracectx.End(span, rpcerr.FromItem(r.CopyResult.GetStatus()))
			return
		}
		statuses = r.CopyResult.GetItems()
	}
	failed, first := 0, ""
	for _, st := range statuses {
		if st.GetCode() != 0 {
			if failed++; first == "" {
				first = st.GetReason()
			}
		}
	}
	tracectx.Outcome(span, failed, first)
	span.End()
}

// command runs one master command on a worker (at most MaxInFlight at once)
// after the epoch check, and enqueues its result. A stale command is
// answered at once with every item refused. held, when not nil, holds the
// command's items: it is released once run or refuse has returned. run
// gets the context of the command's span (tr: a child of the master's).
func (s *session) command(kind string, epoch uint64, tr traced, run func(context.Context) *masterv1.ConnectRequest, refuse func(error) *masterv1.ConnectRequest, held releaser) {
	l := s.l
	if !l.raiseEpoch(epoch) {
		l.met.commands.WithLabelValues(kind, "stale_epoch").Inc()
		l.lg.Warn("command from a stale master epoch refused", "kind", kind, "epoch", epoch, "accepted_epoch", l.epoch.Load())
		err := errEpoch(epoch, l.epoch.Load())
		_, span := s.span(kind, tr)
		msg := refuse(err)
		if held != nil {
			held.release()
		}
		tracectx.End(span, err)
		s.enqueue(msg)
		return
	}
	select {
	case s.sem <- struct{}{}:
	case <-s.ctx.Done():
		return
	}
	l.met.commands.WithLabelValues(kind, "accepted").Inc()
	s.wg.Go(func() {
		defer func() { <-s.sem }()
		ctx, span := s.span(kind, tr)
		msg := run(ctx)
		if held != nil {
			held.release()
		}
		endSpan(span, msg)
		s.enqueue(msg)
	})
}
