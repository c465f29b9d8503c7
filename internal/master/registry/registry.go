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
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
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
	// HostBound says HostID was proven by the agent's certificate (mTLS,
	// spiffe://…/agent/<host-id>). Register then refuses an agent_id or a
	// segment that another host holds: a certificate for one host must not
	// take over another host's agent or its replicas.
	HostBound bool
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
