package session

import (
	"context"
	"errors"
	"io"
	"math"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Warm standbys (issue 15). A standby master's Manager serves
// SegmentService.Follow: every agent registers its table there as on
// Connect and then streams the changes of its table (TableDelta), so the
// standby's metadata holds the object map the agents' tables imply. The
// standby sends the agents nothing but Settings (standby set). Once the
// master is elected, EndFollowing stops the follow streams, and each
// agent's Connect offers to resume at its table position: when the
// standby followed that agent's instance to exactly that position, the
// registration needs no table (Settings with resumed set), so a new
// leader serves within milliseconds of its election instead of after a
// rebuild of millions of allocations.

// MaxDeltaChanges bounds the changes one TableDelta may carry (the agents
// send at most 4096).
const MaxDeltaChanges = 16384

// errFollowEnded ends the follow streams of a standby that was elected.
var errFollowEnded error = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_IS_LEADER,
	"this master was elected: it leads now and follows no agent; Connect to it")

// errFollowStale ends a follow stream whose agent's segments were unmounted
// since it registered.
var errFollowStale error = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
	"follow: the agent's segments were unmounted since it registered; follow again with the whole table")

func errIsLeader() error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_IS_LEADER,
		"this master leads (or runs without election): only a standby is followed")
}

// image is what a standby knows of one agent's followed table.
type image struct {
	instance string
	segs     map[string]bool
	// version is the feed position the metadata reflects; valid once ready.
	version uint64
	ready   bool
	// live: its Follow stream is running (so version may still move).
	live bool
	// bad: the metadata no longer reflects the table (its segments were
	// unmounted meanwhile).
	bad    bool
	cancel context.CancelCauseFunc
}

// SetStandby makes the Manager a standby's: Follow is served, Connect is
// refused with NOT_LEADER. Call it before serving; EndFollowing ends it.
func (m *Manager) SetStandby() {
	m.fmu.Lock()
	m.standby = true
	m.followCtx, m.endFollow = context.WithCancelCause(m.base)
	m.fmu.Unlock()
}

// EndFollowing ends standby mode once the master is elected: new Follow
// streams are refused with MASTER_IS_LEADER, running ones are ended, and
// it returns when their handlers have (so nothing changes the metadata
// behind the new leader's back). What each stream had applied stays as
// that agent's image, for its resumed registration.
func (m *Manager) EndFollowing() {
	m.fmu.Lock()
	m.standby = false
	if m.endFollow != nil {
		// Every handler counted in fwg, registered or still waiting for
		// its Register, watches followCtx.
		m.endFollow(errFollowEnded)
	}
	m.fmu.Unlock()
	m.fwg.Wait()
}

// SetEpoch sets the epoch the Manager stamps on commands and Settings (an
// elected standby's term).
func (m *Manager) SetEpoch(e uint64) { m.epoch.Store(e) }

func (m *Manager) followingMetadata() cluster.FollowingMetadata {
	fm, _ := m.metadata().(cluster.FollowingMetadata)
	return fm
}

// Follow serves one agent's Follow stream on a standby.
func (m *Manager) Follow(stream masterv1.SegmentService_FollowServer) error {
	if !m.enter() {
		return errClosing
	}
	defer m.wg.Done()
	m.fmu.Lock()
	if !m.standby {
		m.fmu.Unlock()
		return rpcerr.Status(errIsLeader())
	}
	m.fwg.Add(1)
	fctx := m.followCtx
	m.fmu.Unlock()
	defer m.fwg.Done()
	fm := m.followingMetadata()
	if fm == nil {
		return errNotReady
	}
	ctx, cancel, recvc, recvErr, done := m.openStream(stream)
	defer done()
	ended := context.AfterFunc(fctx, func() { cancel(context.Cause(fctx)) })
	defer ended()

	started := time.Now()
	first, err := m.awaitRegister(ctx, recvc, recvErr)
	if err != nil {
		return err
	}
	r := first.GetRegister()
	// A standby has no epoch of its own yet: any agent may follow it.
	reg, err := validateRegister(r, math.MaxUint64, m.cfg.MaxSegmentsPerAgent)
	if err == nil {
		err = bindHost(stream.Context(), &reg)
	}
	if err == nil && (r.GetTablePosition() == nil || !r.GetChunked() || r.GetResume()) {
		err = invalid("follow: the Register must be chunked, carry its table_position and not resume")
	}
	if err != nil {
		m.met.follows.WithLabelValues("rejected").Inc()
		m.lg.Warn("agent follow rejected", "agent_id", r.GetAgentId(), "err", err)
		return rpcerr.Status(err)
	}
	pos := r.GetTablePosition()
	gen, gone, err := m.reg.Register(reg)
	if err != nil {
		m.met.follows.WithLabelValues("rejected").Inc()
		return rpcerr.Status(err)
	}
	img := &image{instance: pos.GetInstance(), segs: make(map[string]bool, len(reg.Segments)), live: true, cancel: cancel}
	for _, info := range reg.Segments {
		img.segs[info.GetSegmentId()] = true
	}
	m.fmu.Lock()
	if old := m.images[reg.AgentID]; old != nil && old.live {
		old.cancel(errReplaced)
	}
	m.images[reg.AgentID] = img
	m.fmu.Unlock()
	defer func() {
		m.fmu.Lock()
		img.live = false
		m.fmu.Unlock()
		if ids := m.reg.Disconnect(reg.AgentID, gen); len(ids) > 0 {
			m.unmount(ids)
		}
	}()
	if len(gone) > 0 {
		m.unmount(gone)
	}
	segs := m.registeredSegments(reg)
	rec := m.reconciler(ctx, reg.AgentID, segs, r.GetAllocationCount())
	fm.Owe(rec.Apply(ctx, r.GetAllocations()))
	more, err := m.receiveTable(ctx, reg.AgentID, gen, r, rec, recvc, recvErr)
	if err != nil {
		m.met.follows.WithLabelValues("failed").Inc()
		m.lg.Warn("agent follow failed while taking its table", "agent_id", reg.AgentID, "err", err)
		return rpcerr.Status(err)
	}
	fm.Owe(more)
	fm.Owe(rec.Finish(ctx))
	st := m.settings(nil)
	st.Standby, st.Epoch = true, 0
	st.TokenKeys = nil // a standby signs nothing
	if err := stream.Send(&masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: st}}); err != nil {
		return err
	}
	m.reg.Activate(reg.AgentID, gen)
	m.fmu.Lock()
	img.version, img.ready = pos.GetVersion(), true
	m.fmu.Unlock()
	m.met.follows.WithLabelValues("accepted").Inc()
	m.lg.Info("agent followed", "agent_id", reg.AgentID, "segments", len(reg.Segments),
		"allocations", r.GetAllocationCount(), "position", pos.GetVersion(), "took", time.Since(started))

	for {
		select {
		case msg := <-recvc:
			if err := m.followMessage(ctx, fm, img, reg.AgentID, gen, segs, msg); err != nil {
				if err == errFollowStale {
					m.lg.Info("agent follow ended: its segments were unmounted", "agent_id", reg.AgentID)
				} else {
					m.lg.Warn("agent follow protocol error", "agent_id", reg.AgentID, "err", err)
				}
				return rpcerr.Status(err)
			}
		case err := <-recvErr:
			if !errors.Is(err, io.EOF) {
				m.lg.Info("agent follow stream ended", "agent_id", reg.AgentID, "err", err)
			}
			return nil
		case <-ctx.Done():
			return causeStatus(ctx)
		}
	}
}

// followMessage handles one message after a follow registration.
func (m *Manager) followMessage(ctx context.Context, fm cluster.FollowingMetadata, img *image, agentID string, gen uint64,
	segs []cluster.Segment, msg *masterv1.ConnectRequest) error {
	switch v := msg.GetMsg().(type) {
	case *masterv1.ConnectRequest_TableDelta:
		d := v.TableDelta
		m.fmu.Lock()
		at, bad := img.version, img.bad
		m.fmu.Unlock()
		if bad {
			// Some of its segments were unmounted since the registration
			// (their replicas dropped): the stream ends, and the agent
			// follows again with its whole table.
			return errFollowStale
		}
		if err := validateDelta(d, at, img.segs); err != nil {
			return err
		}
		fm.FollowDelta(ctx, agentID, segs, d.GetSealed(), d.GetReleased())
		m.fmu.Lock()
		img.version = d.GetVersion()
		m.fmu.Unlock()
		m.met.followChanges.Add(float64(len(d.GetSealed()) + len(d.GetReleased())))
	case *masterv1.ConnectRequest_Heartbeat:
		infos := v.Heartbeat.GetSegments()
		if err := validateInfos(infos, false); err != nil {
			infos = nil // liveness still counts
		}
		m.reg.Heartbeat(agentID, gen, infos)
	case *masterv1.ConnectRequest_Deregister:
		grace := max(v.Deregister.GetGrace().AsDuration(), 0)
		m.reg.Deregister(agentID, gen, grace)
	case *masterv1.ConnectRequest_Register, *masterv1.ConnectRequest_RegisterChunk:
		return invalid("follow: %s only opens a stream", msgName(msg))
	case *masterv1.ConnectRequest_AllocationsLost:
		// Connect only: the agent journaled the release of the allocations
		// it lost, so its feed brings them here as a TableDelta's released.
	default:
		// Results belong to Connect; a newer agent's messages are ignored.
		m.lg.Debug("agent follow message ignored", "agent_id", agentID, "msg", msgName(msg))
	}
	return nil
}

// validateDelta checks a TableDelta against the position the standby is
// at: it must continue it exactly, count one change per allocation, and
// name only the agent's segments and SEALED allocations.
func validateDelta(d *masterv1.TableDelta, at uint64, segs map[string]bool) error {
	n := uint64(len(d.GetSealed())) + uint64(len(d.GetReleased()))
	switch {
	case d.GetFromVersion() != at:
		return invalid("table delta from %d, but the table is at %d", d.GetFromVersion(), at)
	case n > MaxDeltaChanges:
		return invalid("table delta of %d changes, max %d", n, MaxDeltaChanges)
	case d.GetVersion() < d.GetFromVersion() || d.GetVersion()-d.GetFromVersion() != n:
		return invalid("table delta from %d to %d carries %d changes", d.GetFromVersion(), d.GetVersion(), n)
	}
	for _, a := range d.GetSealed() {
		switch {
		case !segs[a.GetSegmentId()]:
			return invalid("table delta: allocation %d of segment %q the agent did not register", a.GetAllocationId(), a.GetSegmentId())
		case a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED:
			return invalid("table delta: sealed allocation %d has state %v", a.GetAllocationId(), a.GetState())
		case a.GetKey() == "":
			return invalid("table delta: allocation %d has no key", a.GetAllocationId())
		}
	}
	for _, a := range d.GetReleased() {
		if !segs[a.GetSegmentId()] || a.GetKey() == "" {
			return invalid("table delta: released allocation %d of segment %q: want a registered segment and the key", a.GetAllocationId(), a.GetSegmentId())
		}
	}
	return nil
}

// resumeRefusal reports why a Connect's resume Register cannot skip its
// table ("" when it can, and then the image is used up): this master must
// have followed the same agent instance over the same segments to exactly
// the position the agent names, and its metadata must still reflect it.
func (m *Manager) resumeRefusal(agentID string, pos *masterv1.TablePosition, segments []*masterv1.SegmentInfo) string {
	m.fmu.Lock()
	defer m.fmu.Unlock()
	img := m.images[agentID]
	switch {
	case m.standby:
		return "this master stands by"
	case img == nil:
		return "this master did not follow the agent"
	case img.instance != pos.GetInstance():
		return "this master followed another instance of the agent"
	case !img.ready:
		return "this master had not taken the agent's table when it was elected"
	case img.live:
		return "the agent's follow stream is still running"
	case img.bad:
		return "the agent's segments were unmounted since"
	case img.version != pos.GetVersion():
		return "this master followed the table to another position"
	case len(segments) != len(img.segs):
		return "the agent registers other segments than it followed with"
	}
	for _, s := range segments {
		if !img.segs[s.GetSegmentId()] {
			return "the agent registers other segments than it followed with"
		}
	}
	delete(m.images, agentID)
	return ""
}

// endFollowOf ends agentID's follow stream, if one runs. A standby's sweep
// ends the stream of an agent it found lost, as a leader's ends its
// session: the sweep unmounted the agent's segments and dropped their
// replicas, and a stream that went on (the agent only stalled) would apply
// its next deltas to segments no longer mounted — replicas no registration
// would drop again, listed after an election but never readable (the
// soak's "listed by the leader but unreadable", seed 41838869).
func (m *Manager) endFollowOf(agentID string, cause error) {
	m.fmu.Lock()
	defer m.fmu.Unlock()
	if img := m.images[agentID]; img != nil && img.live {
		img.cancel(cause)
	}
}

// forgetImages marks the images of agents whose segments were unmounted:
// the metadata dropped their replicas.
func (m *Manager) forgetImages(ids []string) {
	m.fmu.Lock()
	defer m.fmu.Unlock()
	for _, img := range m.images {
		for _, id := range ids {
			if img.segs[id] {
				img.bad = true
				break
			}
		}
	}
}
