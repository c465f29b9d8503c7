// Package registry is the master's segment registry: every segment agents
// have mounted, with its lifecycle (OK, DRAINING, DRAINED,
// GRACEFULLY_UNMOUNTING, UNMOUNTING, UNMOUNTED) and its health overlay
// (HEALTHY, SUSPECTED), and the agents that own them.
//
// The registry is in-memory and never blocks on I/O. It implements
// cluster.Registry for the metadata; the agent session (internal/session)
// drives registration, heartbeats, deregistration and liveness through the
// other methods, and performs the side effects (dropping replicas through
// cluster.Metadata) the registry asks for in its return values. Callers ask
// the predicates on cluster.Segment (CanAllocate, CanServeRead,
// CanContinueCleanup) instead of switching on the lifecycle/health pair.
package registry

import (
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/services/master/internal/cluster"
	"github.com/prometheus/client_golang/prometheus"
)

// Config tunes the registry.
type Config struct {
	// Retention is how long UNMOUNTED segments and disconnected agents with
	// no live segment stay listed (for AdminService) before they are
	// forgotten. Default 10 minutes.
	Retention time.Duration
	// DefaultGrace is the graceful-unmount deadline used when an agent
	// announces a clean stop without a grace (or registers with
	// graceful_unmount set). Default 30 s.
	DefaultGrace time.Duration
}

func (c Config) withDefaults() Config {
	if c.Retention <= 0 {
		c.Retention = 10 * time.Minute
	}
	if c.DefaultGrace <= 0 {
		c.DefaultGrace = 30 * time.Second
	}
	return c
}

// Deps are the registry's collaborators.
type Deps struct {
	// Clock returns the current time; nil means time.Now. Tests inject a
	// fake so liveness runs without sleeping.
	Clock func() time.Time
	// Metrics receives the segments-by-lifecycle/health gauge; nil skips it.
	Metrics prometheus.Registerer
}

// Agent is a point-in-time copy of one agent's registry record.
type Agent struct {
	ID           string
	HostID       string
	DataEndpoint string
	// TransferEndpoint is the agent's bulk transfer listener; empty if none.
	TransferEndpoint string
	Version          string
	Connected        bool
	LastHeartbeat    time.Time
	// SegmentIDs are the segments of the agent's latest registration (plus
	// any mounted since), sorted.
	SegmentIDs []string
	// GraceDeadline is set once the agent announced a clean stop.
	GraceDeadline time.Time
}

// Detail is a segment's registry entry with the fields cluster.Segment does
// not carry.
type Detail struct {
	cluster.Segment
	Alignment uint64
}

// Registration is one agent's Register message, already validated.
type Registration struct {
	AgentID          string
	HostID           string
	DataEndpoint     string
	TransferEndpoint string
	Version          string
	Segments         []*masterv1.SegmentInfo
	// Graceful is Register.graceful_unmount: the agent is stopping.
	Graceful bool
}

// Expiry is what one liveness pass decided. The caller drops the replicas of
// Unmounting through the metadata, then calls MarkUnmounted, and closes the
// sessions of Lost agents.
type Expiry struct {
	// Suspected are segments that just became SUSPECTED.
	Suspected []string
	// Unmounting are segments that just became UNMOUNTING.
	Unmounting []string
	// Lost are agents whose heartbeats stopped for unmount_after (or whose
	// grace deadline passed); their sessions must end.
	Lost []string
}

type entry struct {
	seg       cluster.Segment
	alignment uint64
	// graceDeadline is when a GRACEFULLY_UNMOUNTING segment becomes
	// UNMOUNTING. It survives reconnects: the RFC's "graceful unmounting
	// never silently returns to OK".
	graceDeadline time.Time
	// unmountedAt is when the segment became UNMOUNTED (zero before).
	unmountedAt time.Time
}

type agentEntry struct {
	id, host, endpoint, xfer, version string
	connected                         bool
	// gen is the session generation of the latest registration; calls that
	// carry an older gen come from a replaced session and are ignored.
	gen uint64
	// reconciling is set from Register until Activate: the segments stay
	// SUSPECTED (not allocatable, not readable) and liveness leaves the agent
	// alone while the metadata reconciles its table.
	reconciling  bool
	lastBeat     time.Time
	disconnectAt time.Time
	// graceDeadline is set while the agent announced a clean stop
	// (Deregister, or Register with graceful_unmount); informational, the
	// segments carry their own deadlines.
	graceDeadline time.Time
	segments      map[string]bool
}

// Registry is the segment registry. It is safe for concurrent use.
type Registry struct {
	cfg Config
	now func() time.Time
	lg  *slog.Logger

	// mu guards segs, agents and nextGen. Lock order (ARCHITECTURE.md §3):
	// metadata shard → mu → agent session locks. Nothing is called out to
	// while mu is held.
	mu      sync.RWMutex
	segs    map[string]*entry
	agents  map[string]*agentEntry
	nextGen uint64
}

var _ cluster.Registry = (*Registry)(nil)

// New builds an empty registry. It does no I/O and starts nothing.
func New(cfg Config, deps Deps, lg *slog.Logger) (*Registry, error) {
	if deps.Clock == nil {
		deps.Clock = time.Now
	}
	r := &Registry{
		cfg:    cfg.withDefaults(),
		now:    deps.Clock,
		lg:     lg,
		segs:   map[string]*entry{},
		agents: map[string]*agentEntry{},
	}
	if deps.Metrics != nil {
		if err := deps.Metrics.Register(collector{r}); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func notFound(id string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q", id)
}

// Segments returns every segment that is not UNMOUNTED, sorted by id.
func (r *Registry) Segments() []cluster.Segment {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]cluster.Segment, 0, len(r.segs))
	for _, id := range slices.Sorted(maps.Keys(r.segs)) {
		if e := r.segs[id]; e.seg.Lifecycle != lcUnmounted {
			out = append(out, e.seg)
		}
	}
	return out
}

// Segment returns one segment, UNMOUNTED ones too while remembered.
func (r *Registry) Segment(id string) (cluster.Segment, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	e, ok := r.segs[id]
	if !ok {
		return cluster.Segment{}, false
	}
	return e.seg, true
}

// Details returns every remembered segment (UNMOUNTED included), sorted by id.
func (r *Registry) Details() []Detail {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]Detail, 0, len(r.segs))
	for _, id := range slices.Sorted(maps.Keys(r.segs)) {
		e := r.segs[id]
		out = append(out, Detail{Segment: e.seg, Alignment: e.alignment})
	}
	return out
}

// Detail returns one remembered segment.
func (r *Registry) Detail(id string) (Detail, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	e, ok := r.segs[id]
	if !ok {
		return Detail{}, false
	}
	return Detail{Segment: e.seg, Alignment: e.alignment}, true
}

// Agents returns every remembered agent, sorted by id.
func (r *Registry) Agents() []Agent {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]Agent, 0, len(r.agents))
	for _, id := range slices.Sorted(maps.Keys(r.agents)) {
		out = append(out, r.agents[id].view())
	}
	return out
}

// Agent returns one remembered agent.
func (r *Registry) Agent(id string) (Agent, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	a, ok := r.agents[id]
	if !ok {
		return Agent{}, false
	}
	return a.view(), true
}

func (a *agentEntry) view() Agent {
	return Agent{
		ID: a.id, HostID: a.host, DataEndpoint: a.endpoint, TransferEndpoint: a.xfer, Version: a.version,
		Connected: a.connected, LastHeartbeat: a.lastBeat,
		SegmentIDs: slices.Sorted(maps.Keys(a.segments)), GraceDeadline: a.graceDeadline,
	}
}

// SetLifecycle moves a segment between OK, DRAINING and DRAINED (the
// operator's drain). The unmount states are driven by the agent session and
// refused here, as are transitions the table forbids.
func (r *Registry) SetLifecycle(id string, lc masterv1.SegmentLifecycle) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.segs[id]
	if !ok {
		return notFound(id)
	}
	from := e.seg.Lifecycle
	if from == lc {
		return nil
	}
	if !operatorLifecycle[lc] {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"segment %q: lifecycle %s is driven by the agent session, not set directly", id, lc)
	}
	if !CanTransition(from, lc) {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
			"segment %q: illegal lifecycle transition %s → %s", id, from, lc)
	}
	e.seg.Lifecycle = lc
	r.lg.Info("segment lifecycle changed", "segment_id", id, "from", LifecycleLabel(from), "to", LifecycleLabel(lc))
	return nil
}

// setLifecycleLocked applies an agent-driven transition if the table allows
// it and reports whether it changed anything.
func (r *Registry) setLifecycleLocked(e *entry, lc masterv1.SegmentLifecycle) bool {
	from := e.seg.Lifecycle
	if from == lc || !CanTransition(from, lc) {
		return false
	}
	e.seg.Lifecycle = lc
	if lc == lcUnmounted {
		e.unmountedAt = r.now()
	}
	r.lg.Info("segment lifecycle changed", "segment_id", e.seg.ID, "agent_id", e.seg.AgentID,
		"from", LifecycleLabel(from), "to", LifecycleLabel(lc))
	return true
}

func (r *Registry) setHealthLocked(e *entry, h masterv1.SegmentHealth) bool {
	if e.seg.Health == h {
		return false
	}
	from := e.seg.Health
	e.seg.Health = h
	r.lg.Info("segment health changed", "segment_id", e.seg.ID, "agent_id", e.seg.AgentID,
		"from", HealthLabel(from), "to", HealthLabel(h))
	return true
}

func applyInfo(e *entry, info *masterv1.SegmentInfo) {
	e.seg.Capacity = info.GetCapacity()
	e.seg.Used = info.GetUsed()
	e.seg.LargestFreeExtent = info.GetLargestFreeExtent()
	if info.GetName() != "" {
		e.seg.Name = info.GetName()
	}
	if info.GetMedium() != masterv1.Medium_MEDIUM_UNSPECIFIED {
		e.seg.Medium = info.GetMedium()
	}
	if info.GetAlignment() != 0 {
		e.alignment = info.GetAlignment()
	}
}

// Register records an agent's registration and returns the new session
// generation, and the segments the agent had before but no longer lists
// (they are UNMOUNTING now; the caller drops them and calls MarkUnmounted).
//
// Listed segments are created or updated with health SUSPECTED until
// Activate: placement and reads stay off them while the metadata reconciles
// the agent's table. Their lifecycle is kept (a DRAINED segment stays
// DRAINED, a GRACEFULLY_UNMOUNTING one never returns to OK); new ones start
// OK, or GRACEFULLY_UNMOUNTING when reg.Graceful is set. A segment that is
// UNMOUNTED is mounted afresh (a disk segment re-registering with its data).
//
// Register fails, changing nothing, when a listed segment is UNMOUNTING
// (UNAVAILABLE: the agent retries after the unmount finished) or belongs to
// another agent that is connected (FAILED_PRECONDITION).
func (r *Registry) Register(reg Registration) (gen uint64, gone []string, err error) {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, info := range reg.Segments {
		e, ok := r.segs[info.GetSegmentId()]
		if !ok {
			continue
		}
		if e.seg.Lifecycle == lcUnmounting {
			return 0, nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
				"segment %q is being unmounted; retry once it is unmounted", e.seg.ID)
		}
		if e.seg.AgentID != reg.AgentID && e.seg.Lifecycle != lcUnmounted {
			if other := r.agents[e.seg.AgentID]; other != nil && other.connected {
				return 0, nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE,
					"segment %q is mounted by connected agent %q", e.seg.ID, e.seg.AgentID)
			}
		}
	}

	a := r.agents[reg.AgentID]
	if a == nil {
		a = &agentEntry{id: reg.AgentID}
		r.agents[reg.AgentID] = a
	}
	r.nextGen++
	a.gen = r.nextGen
	a.host, a.endpoint, a.xfer, a.version = reg.HostID, reg.DataEndpoint, reg.TransferEndpoint, reg.Version
	a.connected, a.reconciling = true, true
	a.lastBeat, a.disconnectAt = now, time.Time{}
	switch {
	case reg.Graceful && (a.graceDeadline.IsZero() || !now.Before(a.graceDeadline)):
		// A stopping agent reconnecting keeps its announced deadline
		// while it lies ahead; otherwise it gets the default grace.
		a.graceDeadline = now.Add(r.cfg.DefaultGrace)
	case !reg.Graceful:
		// The agent is not stopping (any more). Segments already
		// GRACEFULLY_UNMOUNTING keep their own deadline.
		a.graceDeadline = time.Time{}
	}

	listed := make(map[string]bool, len(reg.Segments))
	for _, info := range reg.Segments {
		id := info.GetSegmentId()
		listed[id] = true
		e, ok := r.segs[id]
		if !ok || e.seg.Lifecycle == lcUnmounted {
			if ok {
				r.lg.Info("segment mounted again", "segment_id", id, "agent_id", reg.AgentID)
			}
			e = &entry{seg: cluster.Segment{ID: id, Lifecycle: lcOK, Health: suspected}}
			r.segs[id] = e
		}
		if prev := e.seg.AgentID; prev != "" && prev != reg.AgentID {
			if pa := r.agents[prev]; pa != nil {
				delete(pa.segments, id)
			}
			r.lg.Warn("segment moved to another agent", "segment_id", id, "from_agent_id", prev, "to_agent_id", reg.AgentID)
		}
		e.seg.AgentID, e.seg.HostID, e.seg.DataEndpoint, e.seg.TransferEndpoint = reg.AgentID, reg.HostID, reg.DataEndpoint, reg.TransferEndpoint
		e.seg.LastHeartbeatMs = now.UnixMilli()
		applyInfo(e, info)
		r.setHealthLocked(e, suspected)
		if reg.Graceful {
			r.startGraceLocked(e, a.graceDeadline)
		}
	}
	for id := range a.segments {
		if listed[id] {
			continue
		}
		if e := r.segs[id]; e != nil && e.seg.AgentID == reg.AgentID && r.setLifecycleLocked(e, lcUnmounting) {
			gone = append(gone, id)
		}
	}
	a.segments = listed
	slices.Sort(gone)
	return a.gen, gone, nil
}

// Activate ends the reconciliation Register started: the agent's segments
// that are not being unmounted become HEALTHY. It returns false (and does
// nothing) when gen is no longer the agent's current session.
func (r *Registry) Activate(agentID string, gen uint64) ([]cluster.Segment, bool) {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.agents[agentID]
	if a == nil || a.gen != gen || !a.connected {
		return nil, false
	}
	a.reconciling = false
	a.lastBeat = now
	var out []cluster.Segment
	for _, id := range slices.Sorted(maps.Keys(a.segments)) {
		e := r.segs[id]
		if e == nil || e.seg.Lifecycle == lcUnmounting || e.seg.Lifecycle == lcUnmounted {
			continue
		}
		r.setHealthLocked(e, healthy)
		e.seg.LastHeartbeatMs = now.UnixMilli()
		out = append(out, e.seg)
	}
	return out, true
}

// Heartbeat refreshes an agent's liveness and its segments' usage, and
// returns SUSPECTED segments to HEALTHY. Segments it does not own are
// ignored. It reports false when gen is stale.
func (r *Registry) Heartbeat(agentID string, gen uint64, infos []*masterv1.SegmentInfo) bool {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.agents[agentID]
	if a == nil || a.gen != gen || !a.connected {
		return false
	}
	a.lastBeat = now
	for _, info := range infos {
		if e := r.segs[info.GetSegmentId()]; e != nil && e.seg.AgentID == agentID && a.segments[e.seg.ID] {
			applyInfo(e, info)
		}
	}
	for id := range a.segments {
		e := r.segs[id]
		if e == nil || e.seg.Lifecycle == lcUnmounting || e.seg.Lifecycle == lcUnmounted {
			continue
		}
		e.seg.LastHeartbeatMs = now.UnixMilli()
		if !a.reconciling {
			r.setHealthLocked(e, healthy)
		}
	}
	return true
}

// Deregister records a clean-stop announcement: the agent's segments become
// GRACEFULLY_UNMOUNTING (readable, not allocatable) until now+grace (or the
// configured default when grace <= 0), or until the stream closes.
func (r *Registry) Deregister(agentID string, gen uint64, grace time.Duration) bool {
	if grace <= 0 {
		grace = r.cfg.DefaultGrace
	}
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.agents[agentID]
	if a == nil || a.gen != gen || !a.connected {
		return false
	}
	a.graceDeadline = now.Add(grace)
	for id := range a.segments {
		if e := r.segs[id]; e != nil {
			r.startGraceLocked(e, a.graceDeadline)
		}
	}
	return true
}

// startGraceLocked moves a segment to GRACEFULLY_UNMOUNTING with a deadline;
// a segment already there keeps the earlier of the two deadlines.
func (r *Registry) startGraceLocked(e *entry, deadline time.Time) {
	if e.seg.Lifecycle == lcGraceful {
		if e.graceDeadline.IsZero() || deadline.Before(e.graceDeadline) {
			e.graceDeadline = deadline
		}
		return
	}
	if r.setLifecycleLocked(e, lcGraceful) {
		e.graceDeadline = deadline
	}
}

// Disconnect records that the agent's session ended. Its segments become
// SUSPECTED at once (nothing can be sent to the agent, and the master can no
// longer vouch for its reads); liveness unmounts them unmount_after after the
// last heartbeat unless the agent comes back. When the agent had announced a
// clean stop, its GRACEFULLY_UNMOUNTING segments become UNMOUNTING now and
// are returned for the caller to drop. A stale gen does nothing.
func (r *Registry) Disconnect(agentID string, gen uint64) (unmounting []string) {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.agents[agentID]
	if a == nil || a.gen != gen || !a.connected {
		return nil
	}
	a.connected, a.reconciling, a.disconnectAt = false, false, now
	for _, id := range slices.Sorted(maps.Keys(a.segments)) {
		e := r.segs[id]
		if e == nil || e.seg.Lifecycle == lcUnmounted {
			continue
		}
		r.setHealthLocked(e, suspected)
		if e.seg.Lifecycle == lcGraceful && r.setLifecycleLocked(e, lcUnmounting) {
			unmounting = append(unmounting, id)
		}
	}
	// A stream closing after a clean-stop announcement completes the stop.
	a.graceDeadline = time.Time{}
	return unmounting
}

// Mount adds segments an agent mounted at run time (SegmentsUpdate). They
// start OK (GRACEFULLY_UNMOUNTING if the agent is stopping) and HEALTHY.
// Ids that are UNMOUNTING or held by another agent are skipped and returned.
func (r *Registry) Mount(agentID string, gen uint64, infos []*masterv1.SegmentInfo) (skipped []string) {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.agents[agentID]
	if a == nil || a.gen != gen || !a.connected {
		for _, info := range infos {
			skipped = append(skipped, info.GetSegmentId())
		}
		return skipped
	}
	for _, info := range infos {
		id := info.GetSegmentId()
		e, ok := r.segs[id]
		if ok && e.seg.Lifecycle != lcUnmounted && e.seg.AgentID != agentID {
			skipped = append(skipped, id)
			continue
		}
		if ok && e.seg.Lifecycle == lcUnmounting {
			skipped = append(skipped, id)
			continue
		}
		if !ok || e.seg.Lifecycle == lcUnmounted {
			e = &entry{seg: cluster.Segment{ID: id, Lifecycle: lcOK, Health: healthy}}
			r.segs[id] = e
			if a.reconciling {
				e.seg.Health = suspected
			}
		}
		e.seg.AgentID, e.seg.HostID, e.seg.DataEndpoint, e.seg.TransferEndpoint = agentID, a.host, a.endpoint, a.xfer
		e.seg.LastHeartbeatMs = now.UnixMilli()
		applyInfo(e, info)
		if !a.graceDeadline.IsZero() {
			r.startGraceLocked(e, a.graceDeadline)
		}
		a.segments[id] = true
	}
	return skipped
}

// Unmount moves segments the agent unmounted at run time (SegmentsUpdate) to
// UNMOUNTING and returns those that moved; the caller drops them and calls
// MarkUnmounted.
func (r *Registry) Unmount(agentID string, gen uint64, ids []string) (unmounting []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.agents[agentID]
	if a == nil || a.gen != gen || !a.connected {
		return nil
	}
	for _, id := range ids {
		if e := r.segs[id]; e != nil && e.seg.AgentID == agentID && r.setLifecycleLocked(e, lcUnmounting) {
			unmounting = append(unmounting, id)
		}
	}
	return unmounting
}

// MarkUnmounted moves UNMOUNTING segments to UNMOUNTED once their replicas
// were dropped. It also removes them from their agent's current segments.
func (r *Registry) MarkUnmounted(ids []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		e := r.segs[id]
		if e == nil {
			continue
		}
		r.setLifecycleLocked(e, lcUnmounted)
		if a := r.agents[e.seg.AgentID]; a != nil {
			delete(a.segments, id)
		}
	}
}

// Expire is one liveness pass at the clock's current time:
//   - an agent with no heartbeat for suspectAfter has its HEALTHY segments
//     SUSPECTED;
//   - one with none for unmountAfter (or whose grace deadline passed) has its
//     segments UNMOUNTING and is reported Lost;
//   - UNMOUNTED segments and disconnected agents without segments older
//     than the retention are forgotten.
//
// Agents still reconciling a registration are skipped.
func (r *Registry) Expire(suspectAfter, unmountAfter time.Duration) Expiry {
	now := r.now()
	var x Expiry
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, aid := range slices.Sorted(maps.Keys(r.agents)) {
		a := r.agents[aid]
		if a.reconciling {
			continue
		}
		since := now.Sub(a.lastBeat)
		lost := since >= unmountAfter
		live, graceEnded := 0, 0
		for _, id := range slices.Sorted(maps.Keys(a.segments)) {
			e := r.segs[id]
			if e == nil || e.seg.Lifecycle == lcUnmounting || e.seg.Lifecycle == lcUnmounted {
				continue
			}
			graceOver := e.seg.Lifecycle == lcGraceful && !e.graceDeadline.IsZero() && !now.Before(e.graceDeadline)
			if lost || graceOver {
				if r.setLifecycleLocked(e, lcUnmounting) {
					x.Unmounting = append(x.Unmounting, id)
				}
				if graceOver {
					graceEnded++
				}
				continue
			}
			live++
			if since >= suspectAfter && r.setHealthLocked(e, suspected) {
				x.Suspected = append(x.Suspected, id)
			}
		}
		// A connected agent is lost when its heartbeats stopped, or when
		// this pass ended the grace of its last segments.
		if a.connected && (lost || (graceEnded > 0 && live == 0)) {
			x.Lost = append(x.Lost, aid)
		}
		if !a.connected && len(a.segments) == 0 && now.Sub(a.disconnectAt) >= r.cfg.Retention {
			delete(r.agents, aid)
		}
	}
	for id, e := range r.segs {
		if e.seg.Lifecycle == lcUnmounted && now.Sub(e.unmountedAt) >= r.cfg.Retention {
			delete(r.segs, id)
		}
	}
	return x
}

// Counts returns the number of remembered segments per (lifecycle, health).
func (r *Registry) Counts() map[[2]string]int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := map[[2]string]int{}
	for _, e := range r.segs {
		out[[2]string{LifecycleLabel(e.seg.Lifecycle), HealthLabel(e.seg.Health)}]++
	}
	return out
}

var segmentsDesc = prometheus.NewDesc("crescent_master_segments",
	"Segments known to the master, by lifecycle and health.", []string{"lifecycle", "health"}, nil)

// collector exports the registry's counts at scrape time, so the gauge can
// never drift from the registry.
type collector struct{ r *Registry }

func (c collector) Describe(ch chan<- *prometheus.Desc) { ch <- segmentsDesc }

func (c collector) Collect(ch chan<- prometheus.Metric) {
	for k, n := range c.r.Counts() {
		ch <- prometheus.MustNewConstMetric(segmentsDesc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
}
