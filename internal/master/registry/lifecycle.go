package registry

import (
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Short names for the lifecycle and health enums, used throughout the package.
const (
	lcOK         = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK
	lcDraining   = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING
	lcDrained    = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED
	lcGraceful   = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_GRACEFULLY_UNMOUNTING
	lcUnmounting = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING
	lcUnmounted  = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED

	healthy   = masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY
	suspected = masterv1.SegmentHealth_SEGMENT_HEALTH_SUSPECTED
)

// transitions is the legal lifecycle transitions table (the RFC's review
// version: DRAINED stays a state, SUSPECTED is a health overlay, not a
// lifecycle). Same-state "transitions" are no-ops and always allowed.
//
//	OK                    → DRAINING (operator drain)
//	                      → GRACEFULLY_UNMOUNTING (agent announced a clean stop)
//	                      → UNMOUNTING (agent lost, or agent unmounted the segment)
//	DRAINING              → DRAINED (every replica moved or removed)
//	                      → OK (drain abandoned)
//	                      → GRACEFULLY_UNMOUNTING, UNMOUNTING (as from OK)
//	DRAINED               → OK (put back in service), DRAINING (drain again)
//	                      → GRACEFULLY_UNMOUNTING, UNMOUNTING (as from OK)
//	GRACEFULLY_UNMOUNTING → UNMOUNTING (grace deadline, or the stream closed);
//	                        never back to OK (the RFC: no silent return)
//	UNMOUNTING            → UNMOUNTED (its replicas were dropped)
//	UNMOUNTED             → none through SetLifecycle. A disk segment that
//	                        re-registers after it was unmounted is mounted
//	                        afresh by Register (its sealed allocations are
//	                        adopted by the metadata's Reconcile).
var transitions = map[masterv1.SegmentLifecycle][]masterv1.SegmentLifecycle{
	lcOK:         {lcDraining, lcGraceful, lcUnmounting},
	lcDraining:   {lcDrained, lcOK, lcGraceful, lcUnmounting},
	lcDrained:    {lcOK, lcDraining, lcGraceful, lcUnmounting},
	lcGraceful:   {lcUnmounting},
	lcUnmounting: {lcUnmounted},
	lcUnmounted:  nil,
}

// CanTransition reports whether a segment may move from one lifecycle state
// to another.
func CanTransition(from, to masterv1.SegmentLifecycle) bool {
	if _, ok := transitions[from]; !ok {
		return false
	}
	if from == to {
		return true
	}
	for _, t := range transitions[from] {
		if t == to {
			return true
		}
	}
	return false
}

// operatorLifecycle lists the states SetLifecycle (the metadata's and the
// operator's lever) may move a segment into. The unmount states belong to the
// agent session: they are driven by Deregister, liveness and SegmentsUpdate,
// because entering them obliges the caller to drop the segment's replicas.
var operatorLifecycle = map[masterv1.SegmentLifecycle]bool{
	lcOK:       true,
	lcDraining: true,
	lcDrained:  true,
}

// LifecycleLabel is the metric label for a lifecycle ("ok", "draining", …).
func LifecycleLabel(lc masterv1.SegmentLifecycle) string {
	return strings.ToLower(strings.TrimPrefix(lc.String(), "SEGMENT_LIFECYCLE_"))
}

// HealthLabel is the metric label for a health value ("healthy", "suspected").
func HealthLabel(h masterv1.SegmentHealth) string {
	return strings.ToLower(strings.TrimPrefix(h.String(), "SEGMENT_HEALTH_"))
}
