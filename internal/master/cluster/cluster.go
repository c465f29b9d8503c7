// Package cluster is the seam between the master's two halves:
//
//   - the object metadata (internal/meta and friends): objects, replicas,
//     placement, quotas, eviction, the change log — it owns decisions;
//   - the agent side (internal/registry, internal/session): the segment
//     registry, one session per agent on SegmentService.Connect, liveness,
//     and the batched command channel to agents.
//
// Each half depends only on the interfaces here, so either can be tested
// with a hand-written fake of the other, and the metadata code does not know
// whether it talks to a real agent or a test double.
//
// Lock order (ARCHITECTURE.md §3): metadata shard → segment registry → agent
// session. The metadata may call Registry and Agents while holding a shard
// lock only for the in-memory Registry reads (never Agents: that is I/O). The
// agent side never holds its own locks while calling Metadata.
package cluster

import (
	"context"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/token"
)

// The object identity's limits, which every part of the master enforces
// (the metadata on requests, the agent side on what agents report).
const (
	MaxKeyLen    = 4096
	MaxTenantLen = 256
)

// Identity is this master's identity for the current leader term.
type Identity struct {
	// MasterID names the process (host:port or a flag).
	MasterID string
	// Epoch is unique per master lifetime / leader term and grows across
	// terms; commands carry it and agents reject older ones; the change log
	// restarts its revisions at 1 in every epoch.
	Epoch uint64
	// Keys sign DataService tokens (internal/token); agents receive the
	// current and previous keys in Settings. The session manager rotates them.
	Keys *token.Ring
}

// Segment is a point-in-time copy of one segment's registry entry.
type Segment struct {
	ID           string
	AgentID      string
	HostID       string
	DataEndpoint string
	// TransferEndpoint is the agent's bulk transfer listener; empty if none.
	TransferEndpoint string
	Name             string
	Medium           masterv1.Medium
	// Capacity and Used are as last reported by the agent (Used includes
	// alignment). The metadata keeps its own per-segment accounting of what
	// it has placed; this is the agent's.
	Capacity          uint64
	Used              uint64
	LargestFreeExtent uint64
	Lifecycle         masterv1.SegmentLifecycle
	Health            masterv1.SegmentHealth
	LastHeartbeatMs   int64
}

// CanAllocate reports whether new replicas may be placed on the segment.
func (s Segment) CanAllocate() bool {
	return s.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK &&
		s.Health == masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY
}

// CanServeRead reports whether COMPLETE replicas on the segment may be handed
// to readers.
func (s Segment) CanServeRead() bool {
	if s.Health != masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY {
		return false
	}
	switch s.Lifecycle {
	case masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK,
		masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING,
		masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED,
		masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_GRACEFULLY_UNMOUNTING:
		return true
	}
	return false
}

// CanContinueCleanup reports whether release/seal traffic to the segment may
// still be sent (the agent is reachable and the segment not yet unmounted).
func (s Segment) CanContinueCleanup() bool {
	return s.Health == masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY &&
		s.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED
}

// Registry is the segment registry, implemented by the agent side. All
// methods are in-memory and cheap; none blocks on I/O.
type Registry interface {
	// Segments returns every segment that is not UNMOUNTED.
	Segments() []Segment
	// Segment returns one segment (UNMOUNTED ones too while remembered).
	Segment(id string) (Segment, bool)
	// SetLifecycle moves a segment along its lifecycle (DrainSegment uses
	// DRAINING then DRAINED). Illegal transitions return an error.
	SetLifecycle(id string, lc masterv1.SegmentLifecycle) error
}

// Agents sends commands to agents over their Connect sessions. The
// implementation coalesces concurrent calls for one agent into shared
// batched messages (several in flight, correlated by request id), applies a
// per-request timeout, and never lets a slow agent block another agent's
// traffic. Results are in item order. An error for the whole call (agent not
// connected, timeout, session lost) is an *rpcerr.Error with reason
// AGENT_UNAVAILABLE.
type Agents interface {
	Reserve(ctx context.Context, agentID string, items []*masterv1.ReserveItem) ([]*masterv1.ReserveItemResult, error)
	Seal(ctx context.Context, agentID string, items []*masterv1.SealItem) ([]*masterv1.ItemStatus, error)
	// Release frees allocations; unknown ids are no-ops at the agent. When
	// the agent is not connected the call returns an error and the agent's
	// own reconcile on reconnect (or its unmount) frees the space. When the
	// agent answered but could not release some (a disk segment whose
	// journal cannot be written), the error is a *ReleaseFailed naming
	// them; the others were released.
	Release(ctx context.Context, agentID string, items []*masterv1.AllocationRef) error
	// Copy asks the agent to copy sealed allocations of its own into
	// allocations reserved at other agents (items[i].Source into
	// items[i].Target, over the target's bulk transfer endpoint when the
	// item names one); statuses are in item order. A failed item wrote
	// nothing the master may rely on: its target is still RESERVED.
	Copy(ctx context.Context, agentID string, items []*masterv1.CopyItem) ([]*masterv1.ItemStatus, error)
}

// Reconciler applies one registration's allocation table in parts, as a
// chunked Register delivers it: Apply adopts and claims the allocations of
// one chunk (the rules of Metadata.Reconcile) and returns those the agent
// should release; Finish removes the replicas on the agent's segments that
// no chunk claimed and returns the remaining releases. Apply and Finish are
// called from one goroutine, Finish once; a Reconciler whose registration
// failed is dropped without Finish (what it adopted stays, on SUSPECTED
// segments, for the agent's next registration to reconcile).
type Reconciler interface {
	// Apply takes the next chunk of the table. It keeps nothing of allocs
	// once it returns: the receiver decodes later chunks into the same
	// Allocations.
	Apply(ctx context.Context, allocs []*masterv1.Allocation) []*masterv1.AllocationRef
	Finish(ctx context.Context) []*masterv1.AllocationRef
}

// ChunkedMetadata is metadata that reconciles a registration chunk by chunk.
// Metadata without it is given the whole table at the end.
type ChunkedMetadata interface {
	// BeginReconcile starts one; expected is the table's announced size
	// (0 when unknown).
	BeginReconcile(ctx context.Context, agentID string, segments []Segment, expected uint64) Reconciler
}

// Metadata is what the agent side needs from the object metadata,
// implemented by internal/meta. The agent side calls it without holding any
// of its own locks.
type Metadata interface {
	// Reconcile is called when an agent registers — first connect, reconnect
	// within the unmount window, or any connect after a master restart —
	// with its authoritative allocation table. The agent's table wins for
	// what exists on segments:
	//   - replicas the master has on those segments that the agent lacks are
	//     removed through the normal mutation path (recording `removed`
	//     where a medium stops being readable);
	//   - SEALED allocations the master lacks are adopted as COMPLETE
	//     replicas (creating objects, recording `stored`), with their pins;
	//   - RESERVED allocations matching a PROCESSING replica are kept;
	//     unmatched RESERVED ones are left to the agent's reserved grace.
	// It returns SEALED allocations the master will not adopt (for example
	// a replica of an object that was replaced meanwhile, or a checksum that
	// disagrees with the object's other replicas); the agent releases them.
	Reconcile(ctx context.Context, agentID string, segments []Segment, allocs []*masterv1.Allocation) []*masterv1.AllocationRef
	// DropSegments removes every replica on the segments through the normal
	// mutation path (recording `removed` where a medium stops being
	// readable, refunding quota), without sending Release to the agent.
	// Called when segments become UNMOUNTING; the caller marks them
	// UNMOUNTED after it returns.
	DropSegments(ctx context.Context, segmentIDs []string)
	// Lost is called when an agent reports SEALED allocations it dropped
	// while serving (AllocationsLost: bytes that no longer match their
	// sealed checksum, or cannot be read); segments are the agent's
	// current segments. It removes the replicas that point at those
	// allocations through the normal mutation path (recording `removed`
	// where a medium stops being readable, refunding quota, erasing an
	// object left without replicas) and sends no Release: the agent
	// already released them. Allocations on segments not among segments,
	// and allocations no replica points at (an upsert replaced the object
	// meanwhile, a removal came first), are ignored. It returns the
	// number of replicas removed. It keeps nothing of allocs once it
	// returns.
	Lost(ctx context.Context, agentID string, segments []Segment, allocs []*masterv1.Allocation) int
	// SegmentReplicaCounts returns the number of replicas (any status) per
	// segment id, for AdminService.
	SegmentReplicaCounts() map[string]uint64
}

// FollowingMetadata is metadata a warm standby keeps from its agents'
// Follow streams (issue 15). A registration's table is reconciled as on
// Connect (ChunkedMetadata); what it would return for release is owed
// instead (a standby commands no agent), and handed to the agent in the
// Settings of its resumed registration once the master leads.
type FollowingMetadata interface {
	ChunkedMetadata
	// FollowDelta applies one TableDelta of agentID, whose segments are
	// segments: sealed allocations adopted (one already held is left as
	// it is), the replicas of released ones removed.
	FollowDelta(ctx context.Context, agentID string, segments []Segment, sealed, released []*masterv1.Allocation)
	// Owe remembers allocations to release later.
	Owe(refs []*masterv1.AllocationRef)
	// TakeOwed returns and forgets the releases owed on the segments, all
	// of agentID's (a resumed registration).
	TakeOwed(agentID string, segmentIDs []string) []*masterv1.AllocationRef
}

// ReleaseFailed is Agents.Release's error when the agent answered and
// could not release Refs (the others of the call were released); Err is
// the first item's error.
type ReleaseFailed struct {
	Refs []*masterv1.AllocationRef
	Err  error
}

func (e *ReleaseFailed) Error() string {
	return fmt.Sprintf("%d allocations not released: %v", len(e.Refs), e.Err)
}

func (e *ReleaseFailed) Unwrap() error { return e.Err }
