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
//
// With a feed the Register offers to resume: it carries the table's
// position and no table. The master answers Settings (it followed this
// agent's table to that position on a Follow stream) or TableRequest, after
// which the agent registers again in full on the same stream.
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
		uploads:   make(chan *upload, 1),
		interval:  make(chan time.Duration, 1),
		closeSend: make(chan struct{}),
		sem:       make(chan struct{}, l.cfg.MaxInFlight),
	}
	graceful := sh.stopping()
	register := func() *masterv1.Register {
		return &masterv1.Register{
			AgentId: l.cfg.AgentID, HostId: l.cfg.HostID, DataEndpoint: l.cfg.DataEndpoint, TransferEndpoint: l.cfg.TransferEndpoint,
			Segments:   l.deps.Segments.Infos(),
			KnownEpoch: l.epoch.Load(), GracefulUnmount: graceful, Version: l.cfg.Version,
		}
	}
	var first *upload
	if l.deps.Feed != nil {
		// The table is not taken: at a million allocations that alone
		// is seconds, which a resumed registration saves.
		first = &upload{reg: resumeRegistration(register(), l.position()), done: make(chan struct{})}
	} else {
		r := register()
		first = &upload{reg: newRegistration(r, tableParts(l.deps.Segments, r)), done: make(chan struct{})}
	}
	recvc := make(chan received)
	recvErr := make(chan error, 1)
	s.wg.Go(func() {
		// The sender opens the stream with the registration, so nothing
		// enqueued meanwhile (a SegmentsUpdate) lands inside the table.
		if s.upload(first) {
			s.sendLoop()
		}
	})
	s.wg.Go(func() { s.recvLoop(recvc, recvErr) })
	defer func() {
		cancel(nil)
		s.wg.Wait()
	}()

	answer, err := s.awaitAnswer(first, recvc, recvErr)
	if err != nil {
		return false, err
	}
	if tr := answer.msg.GetTableRequest(); tr != nil {
		if !first.reg.register.GetResume() {
			return false, errors.New("master sent TableRequest to a registration that carried the table")
		}
		l.met.resumes.WithLabelValues("table_requested").Inc()
		l.lg.Info("master asked for the table; registering in full", "master", l.Master(), "reason", tr.GetReason())
		full := &upload{reg: l.fullRegistration(register()), done: make(chan struct{})}
		s.uploads <- full // buffered: the only upload after the first
		if answer, err = s.awaitAnswer(full, recvc, recvErr); err != nil {
			return false, err
		}
		if answer.msg.GetTableRequest() != nil {
			return false, errors.New("master sent TableRequest to a registration that carried the table")
		}
	}
	st := answer.msg.GetSettings()
	if st == nil {
		return false, fmt.Errorf("master sent %T before Settings", answer.msg.GetMsg())
	}
	if err := s.applySettings(st); err != nil {
		return false, err
	}
	if graceful {
		l.setState(StateDeregistering)
	} else {
		l.setState(StateConnected)
	}
	if st.GetResumed() {
		l.met.resumes.WithLabelValues("resumed").Inc()
	}
	l.lg.Info("registered with master", "master", l.Master(), "epoch", l.epoch.Load(), "segments", len(l.deps.Segments.All()),
		"graceful", graceful, "resumed", st.GetResumed())

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
		case <-l.lost.wake:
			if err := s.sendLost(); err != nil {
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

// position is the feed's position as the wire carries it.
func (l *Link) position() *masterv1.TablePosition {
	inst, v := l.deps.Feed.Position()
	return &masterv1.TablePosition{Instance: inst, Version: v}
}

// fullRegistration is r with the whole table; with a feed it also carries
// the position, read before the table is taken.
func (l *Link) fullRegistration(r *masterv1.Register) *registration {
	if l.deps.Feed != nil {
		r.TablePosition = l.position()
	}
	return newRegistration(r, tableParts(l.deps.Segments, r))
}

// upload is a registration for the sender to send, and done, which it
// closes once every message of it is sent.
type upload struct {
	reg  *registration
	done chan struct{}
}

// upload sends u's messages; false when the stream is over.
func (s *session) upload(u *upload) bool {
	if !u.reg.messages(s.send) {
		return false
	}
	close(u.done)
	return true
}

// awaitAnswer waits for the master's first message after the registration
// u: the wait is bounded by SettingsTimeout once the whole registration is
// sent (sending paces itself by the master's progress, flow control,
// however long the table). The master may answer before the sender has
// noticed its last Send returned; the answer then arrives while u.done is
// still open, which is fine.
func (s *session) awaitAnswer(u *upload, recvc <-chan received, recvErr <-chan error) (received, error) {
	var t *time.Timer
	var settingsC <-chan time.Time
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	uploaded := u.done
	for {
		select {
		case <-uploaded:
			uploaded = nil
			t = time.NewTimer(s.l.cfg.SettingsTimeout)
			settingsC = t.C
			if r := u.reg.register; r.GetResume() {
				s.l.lg.Info("registration sent", "resume", true, "instance", r.GetTablePosition().GetInstance(), "version", r.GetTablePosition().GetVersion())
			} else {
				s.l.lg.Info("registration sent", "allocations", u.reg.count)
			}
		case rcv := <-recvc:
			return rcv, nil
		case err := <-recvErr:
			return received{}, err
		case <-settingsC:
			return received{}, errSettingsTimeout
		case <-s.ctx.Done():
			return received{}, context.Cause(s.ctx)
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
	uploads   chan *upload       // a full registration after a TableRequest
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
		case u := <-s.uploads:
			if !s.upload(u) {
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
	// The keys first: the master makes this agent's segments readable
	// once it has the answer below, and a release list may be long.
	if l.deps.OnSettings != nil {
		l.deps.OnSettings(st)
	}
	if rel := st.GetReleaseAllocations(); len(rel) > 0 {
		l.deps.Segments.ReleaseRefs(rel)
		l.lg.Info("released allocations the master did not claim", "count", len(rel))
	}
	l.met.epoch.Set(float64(l.epoch.Load()))
	applied := &masterv1.SettingsApplied{}
	if keys := st.GetTokenKeys(); len(keys) > 0 {
		applied.TokenKeyId = keys[0].GetId()
	}
	s.enqueue(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SettingsApplied{SettingsApplied: applied}})
	return nil
}
