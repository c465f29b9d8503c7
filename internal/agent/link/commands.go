package link

import (
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
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
		s.command("reserve", r.GetEpoch(), func() *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Reserve(r.GetItems(), l.now()),
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
		s.command("release", r.GetEpoch(), func() *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Release(r.GetItems()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{RequestId: r.GetRequestId(), Items: repeatItem(err, len(r.GetItems()))}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Seal:
		r := m.Seal
		s.command("seal", r.GetEpoch(), func() *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{
				RequestId: r.GetRequestId(), Items: l.deps.Segments.Seal(r.GetItems(), l.now()),
			}}}
		}, func(err error) *masterv1.ConnectRequest {
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{RequestId: r.GetRequestId(), Items: repeatItem(err, len(r.GetItems()))}}}
		}, rcv.held)
	case *masterv1.ConnectResponse_Copy:
		r := m.Copy
		s.command("copy", r.GetEpoch(), func() *masterv1.ConnectRequest {
			err := l.copy(s.ctx, r)
			if err != nil {
				l.lg.Warn("copy failed", "source_segment", r.GetSource().GetSegmentId(), "source_allocation", r.GetSource().GetAllocationId(),
					"target", r.GetTargetEndpoint(), "err", err)
			}
			return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: r.GetRequestId(), Status: rpcerr.Item(err)}}}
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

// command runs one master command on a worker (at most MaxInFlight at once)
// after the epoch check, and enqueues its result. A stale command is
// answered at once with every item refused. held, when not nil, holds the
// command's items: it is released once run or refuse has returned.
func (s *session) command(kind string, epoch uint64, run func() *masterv1.ConnectRequest, refuse func(error) *masterv1.ConnectRequest, held releaser) {
	l := s.l
	if !l.raiseEpoch(epoch) {
		l.met.commands.WithLabelValues(kind, "stale_epoch").Inc()
		l.lg.Warn("command from a stale master epoch refused", "kind", kind, "epoch", epoch, "accepted_epoch", l.epoch.Load())
		msg := refuse(errEpoch(epoch, l.epoch.Load()))
		if held != nil {
			held.release()
		}
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
		msg := run()
		if held != nil {
			held.release()
		}
		s.enqueue(msg)
	})
}
