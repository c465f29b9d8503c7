package session

import (
	"context"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// maxIDLen bounds agent, host and segment ids, endpoints and the agent's
// version string (bytes); maxNameLen bounds a segment's name (a disk
// segment's is its file path). The registry keeps all of them.
const (
	maxIDLen   = 256
	maxNameLen = 4096
)

// maxTenantLen and maxKeyLen bound an allocation's tenant and key
// (bytes) where the agent side checks them.
const (
	maxTenantLen = cluster.MaxTenantLen
	maxKeyLen    = cluster.MaxKeyLen
)

// MaxLostAllocations is the most allocations one AllocationsLost may
// carry; maxLostReason bounds the part of its reason the master logs.
const (
	MaxLostAllocations = 16384
	maxLostReason      = 1024
)

// maxSegmentCapacity bounds a segment's claimed capacity (1 PiB, far past
// any host's memory or disk): the master sums capacities and free bytes
// as int64, which a claim near 2^64 would turn negative.
const maxSegmentCapacity = 1 << 50

// DefaultMaxSegmentsPerAgent is Config.MaxSegmentsPerAgent's default.
const DefaultMaxSegmentsPerAgent = 256

func errTooManySegments(n, max int) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
		"agent claims %d segments, max %d per agent (--max-segments-per-agent)", n, max)
}

// validateRegister checks an agent's Register against the proto contract,
// this master's epoch and the cap of maxSegs segments per agent
// (LIMIT_EXCEEDED, checked before anything is built from the list), and
// returns the registry's view of it. It never panics, whatever the bytes
// decoded to.
func validateRegister(r *masterv1.Register, epoch uint64, maxSegs int) (registry.Registration, error) {
	if r == nil {
		return registry.Registration{}, invalid("first message must be Register")
	}
	switch {
	case r.GetAgentId() == "":
		return registry.Registration{}, invalid("register: agent_id is required")
	case len(r.GetAgentId()) > maxIDLen:
		return registry.Registration{}, invalid("register: agent_id longer than %d bytes", maxIDLen)
	case len(r.GetHostId()) > maxIDLen:
		return registry.Registration{}, invalid("register: host_id longer than %d bytes", maxIDLen)
	case r.GetDataEndpoint() == "":
		return registry.Registration{}, invalid("register: data_endpoint is required")
	case len(r.GetDataEndpoint()) > maxIDLen || len(r.GetTransferEndpoint()) > maxIDLen:
		return registry.Registration{}, invalid("register: endpoints are limited to %d bytes", maxIDLen)
	case len(r.GetVersion()) > maxIDLen:
		return registry.Registration{}, invalid("register: version longer than %d bytes", maxIDLen)
	case len(r.GetTablePosition().GetInstance()) > maxIDLen:
		return registry.Registration{}, invalid("register: table_position.instance longer than %d bytes", maxIDLen)
	}
	if r.GetKnownEpoch() > epoch {
		return registry.Registration{}, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_STALE_EPOCH,
			"register: agent already accepted epoch %d; this master's epoch %d is older", r.GetKnownEpoch(), epoch)
	}
	switch {
	case r.GetChunked() && len(r.GetAllocations()) > 0:
		return registry.Registration{}, invalid("register: a chunked Register carries its allocations in RegisterChunk messages, not inline (%d)", len(r.GetAllocations()))
	case !r.GetChunked() && r.GetAllocationCount() != 0:
		return registry.Registration{}, invalid("register: allocation_count %d without chunked", r.GetAllocationCount())
	case r.GetAllocationCount() > maxRegisterAllocations:
		return registry.Registration{}, invalid("register: allocation_count %d exceeds %d", r.GetAllocationCount(), uint64(maxRegisterAllocations))
	}
	if n := len(r.GetSegments()); n > maxSegs {
		return registry.Registration{}, errTooManySegments(n, maxSegs)
	}
	if err := validateInfos(r.GetSegments(), true); err != nil {
		return registry.Registration{}, err
	}
	listed := make(map[string]bool, len(r.GetSegments()))
	for _, s := range r.GetSegments() {
		listed[s.GetSegmentId()] = true
	}
	type allocKey struct {
		seg string
		id  uint64
	}
	seen := make(map[allocKey]bool, len(r.GetAllocations()))
	for i, a := range r.GetAllocations() {
		k := allocKey{a.GetSegmentId(), a.GetAllocationId()}
		switch {
		case a == nil:
			return registry.Registration{}, invalid("register: allocation %d is empty", i)
		case !listed[a.GetSegmentId()]:
			return registry.Registration{}, invalid("register: allocation %d names segment %q the agent did not list", i, a.GetSegmentId())
		case seen[k]:
			return registry.Registration{}, invalid("register: allocation %d of segment %q listed twice", a.GetAllocationId(), a.GetSegmentId())
		case a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED && a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED:
			return registry.Registration{}, invalid("register: allocation %d of segment %q has state %v", a.GetAllocationId(), a.GetSegmentId(), a.GetState())
		case a.GetKey() == "" && !blankReserved(a):
			return registry.Registration{}, invalid("register: allocation %d of segment %q has no key", a.GetAllocationId(), a.GetSegmentId())
		case a.GetBlank() && !blankReserved(a):
			return registry.Registration{}, invalid("register: allocation %d of segment %q is blank with an object or not RESERVED", a.GetAllocationId(), a.GetSegmentId())
		}
		seen[k] = true
	}
	host := r.GetHostId()
	if host == "" {
		host = r.GetAgentId()
	}
	return registry.Registration{
		AgentID: r.GetAgentId(), HostID: host, DataEndpoint: r.GetDataEndpoint(), TransferEndpoint: r.GetTransferEndpoint(), Version: r.GetVersion(),
		Segments: r.GetSegments(), Graceful: r.GetGracefulUnmount(),
	}, nil
}

// validateInfos checks segment descriptions. Heartbeats may omit the medium
// (they only refresh usage); mounts must give it.
func validateInfos(infos []*masterv1.SegmentInfo, mount bool) error {
	seen := make(map[string]bool, len(infos))
	for i, s := range infos {
		id := s.GetSegmentId()
		switch {
		case s == nil || id == "":
			return invalid("segment %d: segment_id is required", i)
		case len(id) > maxIDLen:
			return invalid("segment %d: segment_id longer than %d bytes", i, maxIDLen)
		case len(s.GetName()) > maxNameLen:
			return invalid("segment %q: name longer than %d bytes", id, maxNameLen)
		case seen[id]:
			return invalid("segment %q listed twice", id)
		case s.GetCapacity() > maxSegmentCapacity:
			return invalid("segment %q: capacity %d exceeds %d", id, s.GetCapacity(), uint64(maxSegmentCapacity))
		case s.GetUsed() > s.GetCapacity():
			return invalid("segment %q: used %d exceeds capacity %d", id, s.GetUsed(), s.GetCapacity())
		}
		if mount {
			switch s.GetMedium() {
			case masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK:
			default:
				return invalid("segment %q: medium %v is not memory or disk", id, s.GetMedium())
			}
		}
		seen[id] = true
	}
	return nil
}

// bindHost ties a registration to the caller's certificate. An agent
// principal (spiffe://…/agent/<host-id>, checked by the server's
// authorization table before Connect runs) may register only its own host:
// the Register's host_id (or agent_id when host_id is empty) must equal the
// certificate's name, and the registry then refuses an agent_id or segment
// another host holds (Registration.HostBound). Without a principal, or with
// the plaintext mode's stand-in, nothing is bound: that is the
// unauthenticated cluster of `make run`.
func bindHost(ctx context.Context, reg *registry.Registration) error {
	p, ok := auth.FromContext(ctx)
	if !ok || p.Role != auth.RoleAgent {
		return nil
	}
	if reg.HostID != p.Name {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT,
			"register: host_id %q is not this certificate's host %q", reg.HostID, p.Name)
	}
	reg.HostBound = true
	return nil
}

// blankReserved reports a well-formed blank reservation in a registration:
// flagged blank, RESERVED, with no object (meta reconciles it as one).
func blankReserved(a *masterv1.Allocation) bool {
	return a.GetBlank() && a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_RESERVED &&
		a.GetTenant() == "" && a.GetKey() == ""
}

// validateLost checks an AllocationsLost against the proto contract: at
// most MaxLostAllocations, each naming its segment, allocation and object
// within the limits the master keeps. The reason is not checked (it is
// clipped for the log: clipReason). It never panics, whatever the bytes
// decoded to.
func validateLost(l *masterv1.AllocationsLost) error {
	allocs := l.GetAllocations()
	if len(allocs) > MaxLostAllocations {
		return invalid("allocations lost: %d allocations, max %d per message", len(allocs), MaxLostAllocations)
	}
	for i, a := range allocs {
		switch {
		case a == nil:
			return invalid("allocations lost: allocation %d is empty", i)
		case a.GetSegmentId() == "" || len(a.GetSegmentId()) > maxIDLen:
			return invalid("allocations lost: allocation %d: segment_id must be 1..%d bytes, got %d", i, maxIDLen, len(a.GetSegmentId()))
		case a.GetKey() == "" || len(a.GetKey()) > maxKeyLen:
			return invalid("allocations lost: allocation %d of segment %q: key must be 1..%d bytes, got %d", a.GetAllocationId(), a.GetSegmentId(), maxKeyLen, len(a.GetKey()))
		case len(a.GetTenant()) > maxTenantLen:
			return invalid("allocations lost: allocation %d of segment %q: tenant longer than %d bytes", a.GetAllocationId(), a.GetSegmentId(), maxTenantLen)
		}
	}
	return nil
}

// clipReason cuts an AllocationsLost reason to maxLostReason bytes for
// the log, at a rune boundary.
func clipReason(r string) string {
	if len(r) <= maxLostReason {
		return r
	}
	return strings.ToValidUTF8(r[:maxLostReason], "")
}
