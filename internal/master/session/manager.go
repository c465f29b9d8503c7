// Package session is the master's end of SegmentService.Connect: one session
// per agent (a second Connect for the same agent_id replaces the first), the
// registration handshake (Register in, Reconcile, Settings out), heartbeats,
// the liveness monitor, graceful unmount, and the batched command channel
// (Reserve, Seal, Release, Copy) the metadata uses through cluster.Agents.
//
// Per session exactly one goroutine (sendLoop) calls Send; the handshake and
// the batcher enqueue on a bounded channel. Another goroutine (recvLoop) only
// receives and hands messages to the handler goroutine, which owns the
// session's protocol state. Concurrent calls for one agent are coalesced by
// a per-session batcher into shared messages, several in flight, correlated
// by request id; every call has its own timeout, so a slow or dead agent
// never blocks another agent's traffic.
package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Deps are the Manager's collaborators.
type Deps struct {
	// Identity is this master's id, epoch and token key (sent in Settings
	// and stamped on every command).
	Identity cluster.Identity
	// Registry is the segment registry the sessions drive. Liveness uses the
	// registry's clock.
	Registry *registry.Registry
	// Metadata is reconciled on every registration and told to drop the
	// replicas of unmounting segments. It may be nil at New and set with
	// SetMetadata before serving, because the metadata needs the Manager
	// (as cluster.Agents) to be built.
	Metadata cluster.Metadata
	// Metrics receives the session metrics; nil skips them.
	Metrics prometheus.Registerer
}

// Causes that end a session; the handler returns them as its status.
var (
	errClosing  error = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_SHUTTING_DOWN, "master is shutting down")
	errReplaced error = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SESSION_REPLACED, "session replaced by a newer Connect for the same agent_id")
	errLost     error = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent unmounted: no heartbeat within unmount_after or graceful deadline passed")
	errEnded          = errors.New("session ended")
	errNotReady error = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING, "master is starting: metadata not ready")
)

// Manager owns every agent session and implements
// masterv1.SegmentServiceServer and cluster.Agents.
type Manager struct {
	masterv1.UnimplementedSegmentServiceServer

	cfg  Config
	id   cluster.Identity
	reg  *registry.Registry
	meta atomic.Pointer[metaRef]
	lg   *slog.Logger
	met  *metrics
	// events, if set, hears of agents registering and departing (SetEvents).
	events atomic.Pointer[Events]

	// base is cancelled by Close; every session and Run derive from it.
	base       context.Context
	cancelBase context.CancelCauseFunc
	closeOnce  sync.Once
	// wg counts Connect handlers and every goroutine a session starts.
	wg sync.WaitGroup

	// mu guards sessions and closed. Lock order: segment registry → mu →
	// session.mu; the registry is never called with mu held.
	mu       sync.Mutex
	sessions map[string]*session
	closed   bool

	// registering counts Connect handlers that have not finished
	// registering (from the stream's start to Settings queued and the
	// segments activated, or the handler's end).
	registering atomic.Int64

	// epoch is stamped on commands and Settings (Identity.Epoch at New,
	// the term's once a standby is elected: SetEpoch).
	epoch atomic.Uint64
	// fmu guards standby and images (follow.go); fwg counts Follow
	// handlers.
	fmu     sync.Mutex
	standby bool
	images  map[string]*image
	fwg     sync.WaitGroup
	// followCtx ends every Follow handler when the standby is elected
	// (endFollow, from EndFollowing); set by SetStandby.
	followCtx context.Context
	endFollow context.CancelCauseFunc
}

// Registering reports how many agent streams are still registering: waiting
// for their Register, receiving their allocation table or reconciling it.
// A restarted master's recovery lasts while any is (see app.recovery).
func (m *Manager) Registering() int { return int(m.registering.Load()) }

var (
	_ masterv1.SegmentServiceServer = (*Manager)(nil)
	_ cluster.Agents                = (*Manager)(nil)
)

// New builds the manager. It does no I/O and starts nothing.
func New(cfg Config, deps Deps, lg *slog.Logger) (*Manager, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("session config: %w", err)
	}
	if deps.Registry == nil {
		return nil, errors.New("session: Registry is required")
	}
	if deps.Identity.Keys == nil {
		return nil, errors.New("session: Identity.Keys is required")
	}
	met, err := newMetrics(deps.Metrics)
	if err != nil {
		return nil, err
	}
	base, cancel := context.WithCancelCause(context.Background())
	m := &Manager{
		cfg: cfg, id: deps.Identity, reg: deps.Registry, lg: lg, met: met,
		base: base, cancelBase: cancel, sessions: map[string]*session{}, images: map[string]*image{},
	}
	m.epoch.Store(deps.Identity.Epoch)
	if deps.Metadata != nil {
		m.SetMetadata(deps.Metadata)
	}
	return m, nil
}

type metaRef struct{ cluster.Metadata }

// SetMetadata installs the metadata when it could not be given to New (it
// needs this Manager as its cluster.Agents). Call it before serving
// Connect and before Run; until then Connect answers UNAVAILABLE and
// liveness passes are skipped.
func (m *Manager) SetMetadata(md cluster.Metadata) {
	if md != nil {
		m.meta.Store(&metaRef{md})
	}
}

func (m *Manager) metadata() cluster.Metadata {
	if r := m.meta.Load(); r != nil {
		return r.Metadata
	}
	return nil
}

// Events hear of agents arriving and departing. A master that leads under
// HA keeps the list of its agents with them (issue 15): a new leader's
// recovery waits for exactly the agents that list holds.
type Events struct {
	// Arrive is called on the session's goroutine once a registering
	// agent's Register is valid, before its table is taken in and before it
	// is acknowledged (so before any put can be placed on it); an error
	// refuses the registration (the agent retries). It may block until ctx
	// ends.
	Arrive func(ctx context.Context, agentID string) error
	// Depart is called when an agent departed: lost (no heartbeat within
	// UnmountAfter) or stopped gracefully. It must not block.
	Depart func(agentID string)
}

// SetEvents installs e (before Run and the first Connect).
func (m *Manager) SetEvents(e Events) { m.events.Store(&e) }

func (m *Manager) arrive(ctx context.Context, agentID string) error {
	if e := m.events.Load(); e != nil && e.Arrive != nil {
		return e.Arrive(ctx, agentID)
	}
	return nil
}

func (m *Manager) depart(agentID string) {
	if e := m.events.Load(); e != nil && e.Depart != nil {
		e.Depart(agentID)
	}
}

// Config returns the effective configuration (defaults applied).
func (m *Manager) Config() Config { return m.cfg }

// Run runs the liveness monitor and the token key rotation until ctx ends
// or Close is called. It returns nil on a clean stop.
func (m *Manager) Run(ctx context.Context) error {
	t := time.NewTicker(m.cfg.SweepInterval)
	defer t.Stop()
	var rotate <-chan time.Time // nil: never
	if m.cfg.TokenKeyRotation > 0 {
		rt := time.NewTicker(m.cfg.TokenKeyRotation)
		defer rt.Stop()
		rotate = rt.C
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-m.base.Done():
			return nil
		case <-t.C:
			m.sweep()
		case <-rotate:
			m.RotateTokenKey()
		}
	}
}

// RotateTokenKey rotates the token keys and has every session re-send
// Settings with the new key list. The new key signs only after the ring's
// activation delay, by when the agents hold it. It returns the new key's id.
func (m *Manager) RotateTokenKey() uint32 {
	id := m.id.Keys.Rotate()
	m.mu.Lock()
	for _, s := range m.sessions {
		s.kickSettings()
	}
	n := len(m.sessions)
	m.mu.Unlock()
	m.met.keyRotations.Inc()
	m.lg.Info("token key rotated", "key_id", id, "agents", n)
	return id
}

// sweep is one liveness pass: suspect, unmount (dropping replicas through
// the metadata) and close the sessions of lost agents.
func (m *Manager) sweep() {
	if m.metadata() == nil {
		return
	}
	x := m.reg.Expire(m.cfg.SuspectAfter, m.cfg.UnmountAfter)
	for _, aid := range x.Lost {
		m.lg.Warn("agent lost", "agent_id", aid, "unmount_after", m.cfg.UnmountAfter)
		m.closeSession(aid, errLost)
		m.depart(aid)
	}
	if len(x.Unmounting) > 0 {
		m.unmount(x.Unmounting)
	}
}

// unmount drops the replicas of segments that just became UNMOUNTING, then
// marks them UNMOUNTED. No lock of ours is held.
func (m *Manager) unmount(ids []string) {
	m.lg.Info("unmounting segments", "segment_ids", ids)
	m.forgetImages(ids)
	m.metadata().DropSegments(m.base, ids)
	m.reg.MarkUnmounted(ids)
}

// Close ends every session and waits for their goroutines. It is idempotent.
func (m *Manager) Close() error {
	m.closeOnce.Do(func() {
		m.mu.Lock()
		m.closed = true
		m.mu.Unlock()
		m.cancelBase(errClosing)
		m.wg.Wait()
	})
	return nil
}

// enter counts a new handler unless the manager is closed.
func (m *Manager) enter() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	m.wg.Add(1)
	return true
}

func (m *Manager) session(agentID string) *session {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sessions[agentID]
}

// install makes s the agent's session, ending the one it replaces. It fails
// when a newer registration already won.
func (m *Manager) install(s *session) bool {
	m.mu.Lock()
	old := m.sessions[s.agentID]
	if old != nil && old.gen > s.gen {
		m.mu.Unlock()
		return false
	}
	m.sessions[s.agentID] = s
	n := len(m.sessions)
	m.mu.Unlock()
	if old != nil {
		m.lg.Info("agent session replaced", "agent_id", s.agentID, "old_gen", old.gen, "new_gen", s.gen)
		old.cancel(errReplaced)
	}
	m.met.sessions.Set(float64(n))
	return true
}

// uninstall removes s if it is still the agent's session.
func (m *Manager) uninstall(s *session) {
	m.mu.Lock()
	if m.sessions[s.agentID] == s {
		delete(m.sessions, s.agentID)
	}
	n := len(m.sessions)
	m.mu.Unlock()
	m.met.sessions.Set(float64(n))
}

// closeSession ends the agent's session, and on a standby its follow
// stream: the agent registers again, with its whole table.
func (m *Manager) closeSession(agentID string, cause error) {
	if s := m.session(agentID); s != nil {
		s.cancel(cause)
	}
	m.endFollowOf(agentID, cause)
}

// Connected reports whether the agent has a live session.
func (m *Manager) Connected(agentID string) bool { return m.session(agentID) != nil }

// Connect serves one agent stream (SegmentService.Connect).
func (m *Manager) Connect(stream masterv1.SegmentService_ConnectServer) error {
	if !m.enter() {
		return errClosing
	}
	defer m.wg.Done()
	if m.metadata() == nil {
		return errNotReady
	}
	ctx, cancel, recvc, recvErr, done := m.openStream(stream)
	defer done()

	m.registering.Add(1)
	registering := true
	doneRegistering := func() {
		if registering {
			registering = false
			m.registering.Add(-1)
		}
	}
	defer doneRegistering()
	started := time.Now()
	first, reg, resumed, err := m.register(ctx, stream, recvc, recvErr)
	if err != nil {
		return err
	}
	if err := m.arrive(ctx, reg.AgentID); err != nil {
		m.met.registrations.WithLabelValues("failed").Inc()
		m.lg.Warn("agent registration failed: its arrival was not recorded", "agent_id", reg.AgentID, "err", err)
		return status.Errorf(codes.Unavailable, "agent %q not recorded by the leader: %v", reg.AgentID, err)
	}
	gen, gone, err := m.reg.Register(reg)
	if err != nil {
		m.met.registrations.WithLabelValues("rejected").Inc()
		m.lg.Warn("agent registration rejected", "agent_id", reg.AgentID, "err", err)
		return rpcerr.Status(err)
	}
	s := newSession(m, reg.AgentID, gen, ctx, cancel, stream)
	installed := m.install(s)
	// The segments this registration dropped are UNMOUNTING now, and no
	// later registration lists them as the agent's: they are unmounted
	// here even when a newer registration of the agent won the race to
	// install (else they would stay UNMOUNTING, their replicas kept).
	if len(gone) > 0 {
		m.unmount(gone)
	}
	if !installed {
		return errReplaced
	}
	defer m.end(s)
	m.wg.Add(2)
	go s.sendLoop()
	go s.batchLoop()
	segs := m.registeredSegments(reg)
	r := first.GetRegister()
	var release []*masterv1.AllocationRef
	if resumed {
		// The table is the one this master followed: nothing to reconcile;
		// what its reconciles would have released is owed.
		ids := make([]string, len(segs))
		for i, sg := range segs {
			ids[i] = sg.ID
		}
		release = m.followingMetadata().TakeOwed(reg.AgentID, ids)
	} else {
		rec := m.reconciler(ctx, reg.AgentID, segs, r.GetAllocationCount())
		release = rec.Apply(ctx, r.GetAllocations())
		if r.GetChunked() {
			more, err := m.receiveTable(ctx, s.agentID, s.gen, r, rec, recvc, recvErr)
			if err != nil {
				m.met.registrations.WithLabelValues("failed").Inc()
				m.lg.Warn("agent registration failed", "agent_id", reg.AgentID, "allocations", r.GetAllocationCount(),
					"elapsed", time.Since(started), "err", err)
				return rpcerr.Status(err)
			}
			release = append(release, more...)
		}
		release = append(release, rec.Finish(ctx)...)
	}
	settings := m.settings(release)
	settings.Resumed = resumed
	select {
	case s.sendq <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: settings}}:
	case <-ctx.Done():
		return causeStatus(ctx)
	}
	if over, err := m.awaitApplied(ctx, s, recvc, recvErr); over {
		return err
	}
	if _, ok := m.reg.Activate(reg.AgentID, gen); !ok {
		return errReplaced
	}
	close(s.ready)
	n := uint64(len(r.GetAllocations())) + r.GetAllocationCount()
	took := time.Since(started)
	m.met.registrations.WithLabelValues("accepted").Inc()
	m.met.registerSeconds.WithLabelValues(reg.AgentID).Set(took.Seconds())
	m.met.registerAllocs.WithLabelValues(reg.AgentID).Set(float64(n))
	doneRegistering()
	m.lg.Info("agent registered", "agent_id", reg.AgentID, "host_id", reg.HostID, "data_endpoint", reg.DataEndpoint,
		"gen", gen, "segments", len(reg.Segments), "allocations", n, "chunked", r.GetChunked(), "resumed", resumed,
		"released", len(release), "graceful", reg.Graceful, "took", took)

	_, err = m.serve(ctx, s, recvc, recvErr, nil, nil)
	return err
}

// serve handles the agent's messages until the stream ends (over, with
// Connect's return err), until done reports true for a message it
// handled, or until timeout fires (both optional).
func (m *Manager) serve(ctx context.Context, s *session, recvc <-chan *masterv1.ConnectRequest, recvErr <-chan error,
	timeout <-chan time.Time, done func(*masterv1.ConnectRequest) bool) (over bool, err error) {
	for {
		select {
		case msg := <-recvc:
			if err := s.handle(msg); err != nil {
				m.lg.Warn("agent protocol error", "agent_id", s.agentID, "err", err)
				return true, rpcerr.Status(err)
			}
			if done != nil && done(msg) {
				return false, nil
			}
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				m.lg.Info("agent stream closed", "agent_id", s.agentID)
			} else {
				m.lg.Info("agent stream ended", "agent_id", s.agentID, "err", err)
			}
			return true, nil
		case <-timeout:
			return false, nil
		case <-ctx.Done():
			return true, causeStatus(ctx)
		}
	}
}

// awaitApplied waits for the agent's answer to its registration's Settings
// (SettingsApplied or, from an agent that predates that message, its first
// Heartbeat, which it sends only after applying Settings), handling what
// else it sends meanwhile. Until the answer the agent's segments stay as
// Register left them (SUSPECTED, reconciling), so no lookup hands out a
// token the agent cannot verify yet: a restarted or newly elected
// master's key is new to every agent, and a Get read in that window used
// to fail with INVALID_TOKEN "signed by an unknown key". An agent that
// answers neither within RegisterTimeout is activated anyway, as before
// the answer existed, with a warning. over is true when the stream ended
// meanwhile (Connect returns err).
func (m *Manager) awaitApplied(ctx context.Context, s *session, recvc <-chan *masterv1.ConnectRequest, recvErr <-chan error) (over bool, err error) {
	t := time.NewTimer(m.cfg.RegisterTimeout)
	defer t.Stop()
	answered := false
	over, err = m.serve(ctx, s, recvc, recvErr, t.C, func(msg *masterv1.ConnectRequest) bool {
		answered = msg.GetSettingsApplied() != nil || msg.GetHeartbeat() != nil
		return answered
	})
	if !over && !answered {
		m.lg.Warn("agent did not acknowledge its Settings; making its segments readable anyway (reads may fail INVALID_TOKEN until it applies them)",
			"agent_id", s.agentID, "waited", m.cfg.RegisterTimeout)
	}
	return over, err
}

// register takes a Connect's Register: validated, bound to the caller's
// identity, and when it offers to resume, either accepted (resumed: this
// master followed the agent's table to exactly its position) or answered
// with TableRequest, after which the agent registers again in full on
// the same stream. Nothing else sends on the stream yet.
func (m *Manager) register(ctx context.Context, stream masterv1.SegmentService_ConnectServer,
	recvc <-chan *masterv1.ConnectRequest, recvErr <-chan error) (*masterv1.ConnectRequest, registry.Registration, bool, error) {
	m.fmu.Lock()
	standby := m.standby
	m.fmu.Unlock()
	if standby {
		return nil, registry.Registration{}, false, rpcerr.Status(rpcerr.NotLeader(""))
	}
	for again := false; ; again = true {
		first, err := m.awaitRegister(ctx, recvc, recvErr)
		if err != nil {
			return nil, registry.Registration{}, false, err
		}
		r := first.GetRegister()
		reg, err := validateRegister(r, m.epoch.Load(), m.cfg.MaxSegmentsPerAgent)
		if err == nil {
			err = bindHost(stream.Context(), &reg)
		}
		if err == nil && r.GetResume() && (again || r.GetTablePosition() == nil || !r.GetChunked() ||
			r.GetAllocationCount() != 0 || len(r.GetAllocations()) != 0) {
			err = invalid("register: resume needs a table_position and no table, once per stream")
		}
		if err != nil {
			m.met.registrations.WithLabelValues("rejected").Inc()
			m.lg.Warn("agent registration rejected", "agent_id", r.GetAgentId(), "err", err)
			return nil, registry.Registration{}, false, rpcerr.Status(err)
		}
		if !r.GetResume() {
			return first, reg, false, nil
		}
		why := "this master keeps no followed tables"
		if m.followingMetadata() != nil {
			why = m.resumeRefusal(reg.AgentID, r.GetTablePosition(), r.GetSegments())
		}
		if why == "" {
			m.met.resumes.WithLabelValues("resumed").Inc()
			return first, reg, true, nil
		}
		m.met.resumes.WithLabelValues("refused").Inc()
		m.lg.Info("agent's table asked for: its resume was refused", "agent_id", reg.AgentID, "reason", why)
		if err := stream.Send(&masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_TableRequest{
			TableRequest: &masterv1.TableRequest{Reason: why}}}); err != nil {
			return nil, registry.Registration{}, false, err
		}
	}
}

// registeredSegments is the registry's view of the segments reg lists.
func (m *Manager) registeredSegments(reg registry.Registration) []cluster.Segment {
	segs := make([]cluster.Segment, 0, len(reg.Segments))
	for _, info := range reg.Segments {
		if sg, ok := m.reg.Segment(info.GetSegmentId()); ok {
			segs = append(segs, sg)
		}
	}
	return segs
}

// agentSegments is the registry's view of the agent's current segments
// (not UNMOUNTED).
func (m *Manager) agentSegments(agentID string) []cluster.Segment {
	a, _ := m.reg.Agent(agentID)
	segs := make([]cluster.Segment, 0, len(a.SegmentIDs))
	for _, id := range a.SegmentIDs {
		if sg, ok := m.reg.Segment(id); ok && sg.AgentID == agentID &&
			sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
			segs = append(segs, sg)
		}
	}
	return segs
}

// openStream starts serving an agent stream (Connect or Follow): its
// context, ended by the stream, by Close (errClosing) and by done
// (errEnded, when the handler returns), and its receiver, which hands
// messages to recvc and the stream's end to recvErr.
func (m *Manager) openStream(stream masterv1.SegmentService_ConnectServer) (ctx context.Context, cancel context.CancelCauseFunc,
	recvc <-chan *masterv1.ConnectRequest, recvErr <-chan error, done func()) {
	ctx, cancel = context.WithCancelCause(stream.Context())
	stop := context.AfterFunc(m.base, func() { cancel(errClosing) })
	msgs := make(chan *masterv1.ConnectRequest) // unbuffered: recvLoop reuses what a message held
	errc := make(chan error, 1)
	m.wg.Go(func() { recvLoop(ctx, stream, msgs, errc) })
	return ctx, cancel, msgs, errc, func() {
		stop()
		cancel(errEnded)
	}
}

// awaitRegister waits for the stream's first message (RegisterTimeout).
func (m *Manager) awaitRegister(ctx context.Context, recvc <-chan *masterv1.ConnectRequest, recvErr <-chan error) (*masterv1.ConnectRequest, error) {
	t := time.NewTimer(m.cfg.RegisterTimeout)
	defer t.Stop()
	select {
	case msg := <-recvc:
		if msg.GetRegister() == nil {
			m.met.registrations.WithLabelValues("rejected").Inc()
			return nil, rpcerr.Status(invalid("first message must be Register, got %s", msgName(msg)))
		}
		return msg, nil
	case err := <-recvErr:
		if errors.Is(err, io.EOF) {
			return nil, invalid("stream closed before Register")
		}
		return nil, err
	case <-t.C:
		m.met.registrations.WithLabelValues("rejected").Inc()
		return nil, rpcerr.Status(invalid("first message must be Register; none within %v", m.cfg.RegisterTimeout))
	case <-ctx.Done():
		return nil, causeStatus(ctx)
	}
}

// end tears a session down after its handler decided to return: stops the
// sender and batcher, fails requests in flight, and records the disconnect
// (unmounting a gracefully stopping agent's segments at once).
func (m *Manager) end(s *session) {
	s.cancel(errEnded)
	s.stopSend()
	s.failPending(unavailable("session to agent %q ended", s.agentID))
	m.uninstall(s)
	if ids := m.reg.Disconnect(s.agentID, s.gen); len(ids) > 0 {
		m.unmount(ids)
		m.depart(s.agentID) // it stopped gracefully
	}
}

// settings builds a Settings message. Its token keys are filled in by the
// session's sendLoop just before Send, so a rotation between building and
// sending is never lost.
func (m *Manager) settings(release []*masterv1.AllocationRef) *masterv1.Settings {
	return &masterv1.Settings{
		Epoch:              m.epoch.Load(),
		HeartbeatInterval:  durationpb.New(m.cfg.HeartbeatInterval),
		SuspectAfter:       durationpb.New(m.cfg.SuspectAfter),
		UnmountAfter:       durationpb.New(m.cfg.UnmountAfter),
		ReservedGrace:      durationpb.New(m.cfg.ReservedGrace),
		MasterId:           m.id.MasterID,
		ReleaseAllocations: release,
	}
}

// tokenKeys is the ring's current key list for Settings, newest first.
func (m *Manager) tokenKeys() []*masterv1.TokenKey {
	keys := m.id.Keys.Keys()
	out := make([]*masterv1.TokenKey, len(keys))
	for i, k := range keys {
		out[i] = &masterv1.TokenKey{Id: k.ID, Key: slices.Clone(k.Secret)}
	}
	return out
}

func recvLoop(ctx context.Context, stream masterv1.SegmentService_ConnectServer, out chan<- *masterv1.ConnectRequest, errc chan<- error) {
	// A chunk's Allocations are decoded into bufs[cur] (chunkcodec.go),
	// which is used again two chunks later: out is unbuffered and the
	// handler applies a chunk before it takes the next message, so once
	// chunk k+1 is taken, chunk k is done with. Handlers keep no
	// Allocation of a chunk once it is applied (cluster.Reconciler). The
	// buffers go after the table's last chunk.
	var bufs [2]allocBufs
	cur := 0
	for {
		msg := &connectRequest{bufs: &bufs[cur]}
		if err := stream.RecvMsg(msg); err != nil {
			errc <- err
			return
		}
		if msg.used {
			if msg.GetRegisterChunk().GetLast() {
				bufs = [2]allocBufs{}
			}
			cur ^= 1
		}
		select {
		case out <- &msg.ConnectRequest:
		case <-ctx.Done():
			return
		}
	}
}

// causeStatus is the status a handler returns when its context ended.
func causeStatus(ctx context.Context) error {
	cause := context.Cause(ctx)
	if _, ok := status.FromError(cause); ok {
		return cause
	}
	return status.FromContextError(ctx.Err()).Err()
}

func invalid(format string, args ...any) *rpcerr.Error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...)
}

func unavailable(format string, args ...any) *rpcerr.Error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, format, args...)
}

// msgName names the oneof case a ConnectRequest carries ("heartbeat").
func msgName(msg *masterv1.ConnectRequest) string {
	pr := msg.ProtoReflect()
	if fd := pr.WhichOneof(pr.Descriptor().Oneofs().ByName("msg")); fd != nil {
		return string(fd.Name())
	}
	if len(pr.GetUnknown()) > 0 {
		return "a message unknown to this master"
	}
	return "an empty message"
}
