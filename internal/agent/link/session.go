package link

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"
)

var errSettingsTimeout = errors.New("no Settings from the master in time")

// session runs one Connect stream. established reports whether Settings
// arrived (the session was healthy, so the backoff resets).
func (l *Link) session(parent context.Context, client masterv1.SegmentServiceClient, sh *shutdown) (established bool, err error) {
	ctx, cancel := context.WithCancelCause(parent)
	defer cancel(nil)
	stream, err := client.Connect(ctx, grpc.ForceCodecV2(newConnectCodec()))
	if err != nil {
		return false, err
	}
	s := &session{
		l: l, ctx: ctx, cancel: cancel, stream: stream,
		out:       make(chan *masterv1.ConnectRequest, l.cfg.SendQueue),
		interval:  make(chan time.Duration, 1),
		closeSend: make(chan struct{}),
		sem:       make(chan struct{}, l.cfg.MaxInFlight),
	}
	graceful := sh.stopping()
	reg := newRegistration(&masterv1.Register{
		AgentId: l.cfg.AgentID, HostId: l.cfg.HostID, DataEndpoint: l.cfg.DataEndpoint, TransferEndpoint: l.cfg.TransferEndpoint,
		Segments:   l.deps.Segments.Infos(),
		KnownEpoch: l.epoch.Load(), GracefulUnmount: graceful, Version: l.cfg.Version,
	}, l.deps.Segments.Table())
	uploaded := make(chan struct{})
	recvc := make(chan received)
	recvErr := make(chan error, 1)
	s.wg.Go(func() {
		// The sender opens the stream with the registration, so nothing
		// enqueued meanwhile (a SegmentsUpdate) lands inside the table.
		if reg.messages(s.send) {
			close(uploaded)
			s.sendLoop()
		}
	})
	s.wg.Go(func() { s.recvLoop(recvc, recvErr) })
	defer func() {
		cancel(nil)
		s.wg.Wait()
	}()

	// The first message must be Settings. The wait starts once the whole
	// table is sent: sending paces itself by the master's progress (flow
	// control), however long the table. The master may answer before the
	// sender has noticed its last Send returned; Settings then arrives
	// while uploaded is still open, which is fine.
	var t *time.Timer
	var settingsC <-chan time.Time
	var first *received
	for t == nil && first == nil {
		select {
		case <-uploaded:
			t = time.NewTimer(l.cfg.SettingsTimeout)
			settingsC = t.C
			l.lg.Info("registration sent", "allocations", len(reg.table))
		case rcv := <-recvc:
			first = &rcv
		case err := <-recvErr:
			return false, err
		case <-ctx.Done():
			return false, context.Cause(ctx)
		}
	}
	if first == nil {
		select {
		case rcv := <-recvc:
			first = &rcv
		case err := <-recvErr:
			t.Stop()
			return false, err
		case <-settingsC:
			return false, errSettingsTimeout
		case <-ctx.Done():
			t.Stop()
			return false, context.Cause(ctx)
		}
	}
	if t != nil {
		t.Stop()
	}
	st := first.msg.GetSettings()
	if st == nil {
		return false, fmt.Errorf("master sent %T before Settings", first.msg.GetMsg())
	}
	if err := s.applySettings(st); err != nil {
		return false, err
	}
	if graceful {
		l.setState(StateDeregistering)
	} else {
		l.setState(StateConnected)
	}
	l.lg.Info("registered with master", "master", l.Master(), "epoch", l.epoch.Load(), "segments", len(l.deps.Segments.All()), "graceful", graceful)

	deregistered := false
	var graceC <-chan time.Time
	var closeC <-chan time.Time
	stopC := sh.stop
	for {
		select {
		case rcv := <-recvc:
			if err := s.handle(rcv); err != nil {
				return true, err
			}
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				err = nil
			}
			if deregistered && closeC != nil && err == nil {
				l.lg.Info("master closed the stream after deregistration")
			}
			return true, err
		case <-stopC:
			stopC = nil
			if !deregistered {
				deregistered = true
				l.setState(StateDeregistering)
				grace := max(time.Until(sh.deadlineAt()), 0)
				s.enqueue(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Deregister{Deregister: &masterv1.Deregister{
					Grace: durationpb.New(grace), Reason: "agent shutting down",
				}}})
				l.lg.Info("deregistering from master", "grace", grace)
			}
			gt := time.NewTimer(max(time.Until(sh.deadlineAt()), 0))
			defer gt.Stop()
			graceC = gt.C
		case <-graceC:
			graceC = nil
			close(s.closeSend)
			ct := time.NewTimer(l.cfg.CloseTimeout)
			defer ct.Stop()
			closeC = ct.C
		case <-closeC:
			return true, nil
		case <-ctx.Done():
			return true, context.Cause(ctx)
		}
	}
}

// session is one Connect stream's state.
type session struct {
	l      *Link
	ctx    context.Context
	cancel context.CancelCauseFunc
	stream masterv1.SegmentService_ConnectClient

	// out is the only way to the stream: sendLoop is its sole reader and
	// the only caller of Send and CloseSend.
	out       chan *masterv1.ConnectRequest
	interval  chan time.Duration // heartbeat interval updates for sendLoop
	closeSend chan struct{}      // closed to make sendLoop flush and CloseSend
	sem       chan struct{}      // command workers in flight
	wg        sync.WaitGroup     // sendLoop, recvLoop, workers
}

// enqueue hands msg to the sender; it gives up when the session ends.
func (s *session) enqueue(msg *masterv1.ConnectRequest) {
	select {
	case s.out <- msg:
	case <-s.ctx.Done():
	}
}

// send sends msg; false when the stream is over. io.EOF means the master
// ended it: its status (a NOT_LEADER with the leader's address, say) is
// what recvLoop receives next, so the session is not cut before it does.
func (s *session) send(msg *masterv1.ConnectRequest) bool {
	if err := s.stream.Send(msg); err != nil {
		if !errors.Is(err, io.EOF) {
			s.cancel(fmt.Errorf("send to master: %w", err))
		}
		return false
	}
	return true
}

// sendLoop is the only goroutine that calls Send or CloseSend.
func (s *session) sendLoop() {
	var tick <-chan time.Time
	var ticker *time.Ticker
	defer func() {
		if ticker != nil {
			ticker.Stop()
		}
	}()
	var seq uint64
	for {
		select {
		case <-s.ctx.Done():
			return
		case msg := <-s.out:
			if !s.send(msg) {
				return
			}
		case d := <-s.interval:
			if ticker == nil {
				ticker = time.NewTicker(d)
				tick = ticker.C
			} else {
				ticker.Reset(d)
			}
		case <-tick:
			seq++
			if !s.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{
				Seq: seq, Segments: s.l.deps.Segments.Infos(),
			}}}) {
				return
			}
			s.l.met.heartbeats.Inc()
		case <-s.closeSend:
			for {
				select {
				case msg := <-s.out:
					if !s.send(msg) {
						return
					}
					continue
				default:
				}
				break
			}
			if err := s.stream.CloseSend(); err != nil {
				s.cancel(fmt.Errorf("close send: %w", err))
			}
			return
		}
	}
}

// received is a master message and, when its items are in the decoder's
// pooled arrays, their releaser (decode.go).
type received struct {
	msg  *masterv1.ConnectResponse
	held releaser
}

func (s *session) recvLoop(out chan<- received, errc chan<- error) {
	in := &connectResponse{ids: s.l.deps.Segments.SegmentID}
	for {
		in.ConnectResponse, in.held = new(masterv1.ConnectResponse), nil
		if err := s.stream.RecvMsg(in); err != nil {
			errc <- err
			return
		}
		select {
		case out <- received{msg: in.ConnectResponse, held: in.held}:
		case <-s.ctx.Done():
			return
		}
	}
}

func (s *session) applySettings(st *masterv1.Settings) error {
	l := s.l
	if !l.raiseEpoch(st.GetEpoch()) {
		return fmt.Errorf("master epoch %d is older than the accepted epoch %d", st.GetEpoch(), l.epoch.Load())
	}
	iv := st.GetHeartbeatInterval().AsDuration()
	if st.GetHeartbeatInterval() == nil || iv <= 0 {
		iv = time.Second
	}
	select {
	case <-s.interval:
	default:
	}
	s.interval <- iv
	if g := st.GetReservedGrace(); g != nil && g.AsDuration() > 0 && int64(g.AsDuration()) != l.resGrce.Load() {
		l.resGrce.Store(int64(g.AsDuration()))
		select {
		case l.graceCh <- struct{}{}:
		default:
		}
	}
	if rel := st.GetReleaseAllocations(); len(rel) > 0 {
		l.deps.Segments.ReleaseRefs(rel)
		l.lg.Info("released allocations the master did not claim", "count", len(rel))
	}
	if l.deps.OnSettings != nil {
		l.deps.OnSettings(st)
	}
	l.met.epoch.Set(float64(l.epoch.Load()))
	return nil
}
