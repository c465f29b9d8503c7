package registry

import (
	"maps"
	"slices"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

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
// another agent that is connected (FAILED_PRECONDITION). With reg.HostBound
// it also fails (ILLEGAL_CLIENT, PERMISSION_DENIED) when the agent_id was last
// registered from another host, or a listed segment that is not UNMOUNTED
// belongs to another host, connected or not.
func (r *Registry) Register(reg Registration) (gen uint64, gone []string, err error) {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if a := r.agents[reg.AgentID]; reg.HostBound && a != nil && a.host != reg.HostID {
		return 0, nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT,
			"agent_id %q is registered from host %q; a certificate for host %q cannot take it over", reg.AgentID, a.host, reg.HostID)
	}
	for _, info := range reg.Segments {
		e, ok := r.segs[info.GetSegmentId()]
		if !ok {
			continue
		}
		if reg.HostBound && e.seg.HostID != reg.HostID && e.seg.Lifecycle != lcUnmounted {
			return 0, nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT,
				"segment %q belongs to host %q; a certificate for host %q cannot take it over", e.seg.ID, e.seg.HostID, reg.HostID)
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
	a := r.sessionLocked(agentID, gen)
	if a == nil {
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
	a := r.sessionLocked(agentID, gen)
	if a == nil {
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

// Progress records that a registering agent's stream is making progress
// (a chunk of its allocation table arrived): it counts as a heartbeat, so
// a long registration that then fails leaves the agent its full
// unmount_after to come back. It reports false when gen is stale.
func (r *Registry) Progress(agentID string, gen uint64) bool {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.sessionLocked(agentID, gen)
	if a == nil {
		return false
	}
	a.lastBeat = now
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
	a := r.sessionLocked(agentID, gen)
	if a == nil {
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

// Disconnect records that the agent's session ended. Its segments not
// already UNMOUNTING become SUSPECTED at once (nothing can be sent to the agent, and the master can no
// longer vouch for its reads); liveness unmounts them unmount_after after the
// last heartbeat unless the agent comes back. When the agent had announced a
// clean stop, its GRACEFULLY_UNMOUNTING segments become UNMOUNTING now and
// are returned for the caller to drop. A stale gen does nothing.
func (r *Registry) Disconnect(agentID string, gen uint64) (unmounting []string) {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.sessionLocked(agentID, gen)
	if a == nil {
		return nil
	}
	a.connected, a.reconciling, a.disconnectAt = false, false, now
	for _, id := range slices.Sorted(maps.Keys(a.segments)) {
		e := r.segs[id]
		// An UNMOUNTING segment is already being dropped by whoever moved
		// it there, and reads of it are refused by its lifecycle; its
		// health stays as that unmount found it, so the outcome does not
		// depend on whether the stream ended before or after the drop.
		if e == nil || e.seg.Lifecycle == lcUnmounted || e.seg.Lifecycle == lcUnmounting {
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
	a := r.sessionLocked(agentID, gen)
	if a == nil {
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
	a := r.sessionLocked(agentID, gen)
	if a == nil {
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

// sessionLocked is the agent's entry when gen is its current, connected
// session; nil for a stale generation or a disconnected agent, whose calls
// are ignored. r.mu is held.
func (r *Registry) sessionLocked(agentID string, gen uint64) *agentEntry {
	if a := r.agents[agentID]; a != nil && a.gen == gen && a.connected {
		return a
	}
	return nil
}
