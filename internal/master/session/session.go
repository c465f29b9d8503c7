package session

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// session is one agent's Connect stream.
type session struct {
	m       *Manager
	agentID string
	gen     uint64
	ctx     context.Context
	cancel  context.CancelCauseFunc
	stream  sender

	// sendq is the only way to the stream: sendLoop is its sole reader and
	// the only caller of Send.
	sendq chan *masterv1.ConnectResponse
	// submit carries calls to the batcher.
	submit chan *call
	// ready is closed once Settings is queued; the batcher sends nothing
	// before it, so Settings is always the first message.
	ready chan struct{}
	// resend (capacity 1, never blocks the kicker) asks sendLoop to send
	// Settings again, after ready: the token keys rotated.
	resend chan struct{}
	// slot wakes the batcher when an in-flight slot frees up.
	slot   chan struct{}
	nextID atomic.Uint64

	// sendMu guards sending and sendClosed, so the handler can return
	// without waiting for a Send blocked on a dead peer (returning is what
	// unblocks it) while never letting Send start after it returned.
	sendMu     sync.Mutex
	sending    bool
	sendClosed bool

	// mu guards pending and inflight (taken after Manager.mu, never before).
	mu       sync.Mutex
	pending  map[uint64]*flight
	inflight int
}

type sender interface {
	Send(*masterv1.ConnectResponse) error
}

func newSession(m *Manager, agentID string, gen uint64, ctx context.Context, cancel context.CancelCauseFunc, stream sender) *session {
	return &session{
		m: m, agentID: agentID, gen: gen, ctx: ctx, cancel: cancel, stream: stream,
		sendq:   make(chan *masterv1.ConnectResponse, m.cfg.SendQueue),
		submit:  make(chan *call, m.cfg.SendQueue),
		ready:   make(chan struct{}),
		resend:  make(chan struct{}, 1),
		slot:    make(chan struct{}, 1),
		pending: map[uint64]*flight{},
	}
}

// kickSettings asks for Settings to be sent again (coalesced; never blocks).
func (s *session) kickSettings() {
	select {
	case s.resend <- struct{}{}:
	default:
	}
}

// sendLoop is the only goroutine that calls Send on the stream. Every
// Settings it sends carries the token keys current at the time of sending,
// and a kick (resend) is served only after the handshake's Settings was
// queued (ready), so the first message stays the handshake's.
func (s *session) sendLoop() {
	defer s.m.wg.Done()
	ready, resend := s.ready, chan struct{}(nil)
	for {
		var msg *masterv1.ConnectResponse
		select {
		case <-s.ctx.Done():
			return
		case <-ready:
			ready, resend = nil, s.resend
			continue
		case <-resend:
			msg = &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: s.m.settings(nil)}}
		case msg = <-s.sendq:
		}
		if st := msg.GetSettings(); st != nil {
			st.TokenKeys = s.m.tokenKeys()
			// As late as can be: the agent measures its clock against it.
			st.MasterTime = timestamppb.Now()
		}
		s.sendMu.Lock()
		if s.sendClosed {
			s.sendMu.Unlock()
			return
		}
		s.sending = true
		s.sendMu.Unlock()
		err := s.stream.Send(msg)
		s.sendMu.Lock()
		s.sending = false
		s.sendMu.Unlock()
		if err != nil {
			s.m.lg.Info("agent stream send failed", "agent_id", s.agentID, "err", err)
			s.cancel(errEnded)
			return
		}
	}
}

// stopSend forbids further Sends. A Send already running is unblocked by the
// handler's return.
func (s *session) stopSend() {
	s.sendMu.Lock()
	s.sendClosed = true
	s.sendMu.Unlock()
}

// handle applies one agent message after registration.
func (s *session) handle(msg *masterv1.ConnectRequest) error {
	m := s.m
	switch v := msg.GetMsg().(type) {
	case *masterv1.ConnectRequest_Heartbeat:
		infos := v.Heartbeat.GetSegments()
		if err := validateInfos(infos, false); err != nil {
			// Liveness still counts; nonsense usage is not recorded.
			m.lg.Warn("agent heartbeat usage ignored", "agent_id", s.agentID, "err", err)
			infos = nil
		}
		m.reg.Heartbeat(s.agentID, s.gen, infos)
	case *masterv1.ConnectRequest_ReserveResult:
		r := v.ReserveResult
		s.complete(kindReserve, r.GetRequestId(), len(r.GetItems()), func(c *call, off, n int) outcome {
			return outcome{reserve: r.GetItems()[off : off+n]}
		})
	case *masterv1.ConnectRequest_SealResult:
		r := v.SealResult
		s.complete(kindSeal, r.GetRequestId(), len(r.GetItems()), func(c *call, off, n int) outcome {
			return outcome{status: r.GetItems()[off : off+n]}
		})
	case *masterv1.ConnectRequest_ReleaseResult:
		r := v.ReleaseResult
		s.complete(kindRelease, r.GetRequestId(), len(r.GetItems()), func(c *call, off, n int) outcome {
			return outcome{status: r.GetItems()[off : off+n]}
		})
	case *masterv1.ConnectRequest_CopyResult:
		r := v.CopyResult
		if len(r.GetItems()) == 0 {
			// The agent refused the whole request (a limit, a stale epoch)
			// or knows only the single form: its status fails every item.
			err := rpcerr.FromItem(r.GetStatus())
			if err == nil {
				err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "agent %q answered copy request %d without item statuses", s.agentID, r.GetRequestId())
			}
			s.complete(kindCopy, r.GetRequestId(), wholeRequest, func(*call, int, int) outcome { return outcome{err: err} })
			break
		}
		s.complete(kindCopy, r.GetRequestId(), len(r.GetItems()), func(c *call, off, n int) outcome {
			return outcome{status: r.GetItems()[off : off+n]}
		})
	case *masterv1.ConnectRequest_Deregister:
		grace := v.Deregister.GetGrace().AsDuration()
		if v.Deregister.GetGrace() == nil || grace < 0 {
			grace = 0
		}
		m.reg.Deregister(s.agentID, s.gen, grace)
		m.lg.Info("agent deregistering", "agent_id", s.agentID, "grace", grace, "reason", v.Deregister.GetReason())
	case *masterv1.ConnectRequest_SegmentsUpdate:
		u := v.SegmentsUpdate
		if err := validateInfos(u.GetMounted(), true); err != nil {
			return err
		}
		if err := s.checkMountCap(u.GetMounted()); err != nil {
			return err
		}
		if skipped := m.reg.Mount(s.agentID, s.gen, u.GetMounted()); len(skipped) > 0 {
			m.lg.Warn("agent mounted segments the master cannot take", "agent_id", s.agentID, "segment_ids", skipped)
		}
		if ids := m.reg.Unmount(s.agentID, s.gen, u.GetUnmountedSegmentIds()); len(ids) > 0 {
			m.unmount(ids)
		}
	case *masterv1.ConnectRequest_AllocationsLost:
		return s.lost(v.AllocationsLost)
	case *masterv1.ConnectRequest_SettingsApplied:
		// Connect waited for the registration's (awaitApplied); later
		// ones answer key rotations, which the activation delay covers.
	case *masterv1.ConnectRequest_Register:
		return invalid("Register is only allowed as the first message of a stream")
	case *masterv1.ConnectRequest_RegisterChunk:
		return invalid("RegisterChunk is only allowed after a chunked Register, before Settings")
	default:
		// A newer agent may send messages this master does not know;
		// ignoring them keeps the protocol forward compatible.
		m.lg.Debug("agent message ignored", "agent_id", s.agentID, "msg", msgName(msg))
	}
	return nil
}

// lost removes the replicas of allocations the agent dropped while
// serving (their bytes failed their sealed checksum or could not be read).
// The message is checked first; allocations on segments that are not the
// agent's now are left to the metadata to ignore (a segment unmounted
// meanwhile already lost its replicas).
func (s *session) lost(l *masterv1.AllocationsLost) error {
	if err := validateLost(l); err != nil {
		return err
	}
	allocs := l.GetAllocations()
	if len(allocs) == 0 {
		return nil
	}
	m := s.m
	removed := m.metadata().Lost(s.ctx, s.agentID, m.agentSegments(s.agentID), allocs)
	m.lg.Warn("agent reported lost allocations; their replicas are removed", "agent_id", s.agentID,
		"count", len(allocs), "removed", removed, "reason", clipReason(l.GetReason()), "first_key", allocs[0].GetKey())
	return nil
}

// wholeRequest is complete's item count for a result that answers the
// whole request with one outcome (a refused copy).
const wholeRequest = -1

// complete routes one result to the calls of its request.
func (s *session) complete(k kind, id uint64, n int, split func(c *call, off, n int) outcome) {
	s.mu.Lock()
	f := s.pending[id]
	freed := false
	if f != nil && f.kind == k {
		delete(s.pending, id)
		if f.counted && !f.expired {
			s.inflight--
			freed = true
		}
	}
	s.mu.Unlock()
	if freed {
		select {
		case s.slot <- struct{}{}:
		default:
		}
	}
	if f == nil || f.kind != k {
		s.m.lg.Debug("agent result for unknown request", "agent_id", s.agentID, "kind", k.String(), "request_id", id)
		return
	}
	s.m.met.roundTrip[k].Observe(time.Since(f.sentAt).Seconds())
	if n != wholeRequest && n != f.items {
		err := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL,
			"agent %q answered %s request %d with %d items for %d", s.agentID, k, id, n, f.items)
		s.m.lg.Error("agent result malformed", "agent_id", s.agentID, "kind", k.String(), "request_id", id, "got", n, "want", f.items)
		for _, c := range f.calls {
			c.deliver(outcome{err: err})
		}
		return
	}
	var late []*masterv1.AllocationRef
	off := 0
	for _, c := range f.calls {
		cn := c.items()
		o := split(c, off, cn)
		if !c.deliver(o) && k == kindReserve {
			// The caller gave up (timeout or cancel) while the agent
			// reserved: free what it reserved instead of waiting for the
			// agent's reserved grace.
			for i, r := range o.reserve {
				if codes.Code(r.GetStatus().GetCode()) == codes.OK {
					late = append(late, &masterv1.AllocationRef{SegmentId: c.reserve[i].GetSegmentId(), AllocationId: r.GetAllocationId()})
				}
			}
		}
		off += cn
	}
	if len(late) > 0 {
		s.m.lg.Info("releasing late reservations", "agent_id", s.agentID, "count", len(late))
		select {
		case s.submit <- &call{kind: kindRelease, release: late, done: make(chan outcome, 1)}:
		default:
			s.m.lg.Warn("late reservations left to the agent's reserved grace", "agent_id", s.agentID, "count", len(late))
		}
	}
}

// failPending fails every request in flight (the session ended).
func (s *session) failPending(err error) {
	s.mu.Lock()
	p := s.pending
	s.pending = map[uint64]*flight{}
	s.inflight = 0
	s.mu.Unlock()
	for _, f := range p {
		for _, c := range f.calls {
			c.deliver(outcome{err: err})
		}
	}
}

// expire frees the in-flight slots of requests older than their timeout
// (their callers have given up) and forgets requests far older still, whose
// results will never be used.
func (s *session) expire(now time.Time) (freed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, f := range s.pending {
		age := now.Sub(f.sentAt)
		if !f.expired && age >= f.timeout {
			f.expired = true
			if f.counted {
				s.inflight--
				freed = true
			}
		}
		if age >= forgetAfter*f.timeout {
			delete(s.pending, id)
		}
	}
	return freed
}

// forgetAfter (times the request timeout) is how long an unanswered request
// is remembered so a late reserve result can still be released.
const forgetAfter = 4

// checkMountCap refuses a SegmentsUpdate that would take the agent past
// MaxSegmentsPerAgent current segments.
func (s *session) checkMountCap(mounted []*masterv1.SegmentInfo) error {
	max := s.m.cfg.MaxSegmentsPerAgent
	if len(mounted) > max {
		return errTooManySegments(len(mounted), max)
	}
	if len(mounted) == 0 {
		return nil
	}
	a, _ := s.m.reg.Agent(s.agentID)
	n := len(a.SegmentIDs)
	for _, info := range mounted {
		if _, held := slices.BinarySearch(a.SegmentIDs, info.GetSegmentId()); !held {
			n++
		}
	}
	if n > max {
		return errTooManySegments(n, max)
	}
	return nil
}
