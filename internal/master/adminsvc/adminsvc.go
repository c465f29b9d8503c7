// Package adminsvc is the gRPC adapter of crescent.master.v1.AdminService:
// it validates requests, asks the segment registry (segments, agents) or the
// metadata (drain, tenant quotas, totals), and maps errors to statuses
// through internal/rpcerr. It holds no state of its own.
package adminsvc

import (
	"context"
	"errors"
	"log/slog"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Meta is what AdminService needs from the object metadata.
type Meta interface {
	// DrainSegmentCounts marks the segment DRAINING, moves its replicas elsewhere
	// (evicting other objects for room unless noEvict) and marks it DRAINED
	// when none is left. It returns what it did; with an error, the counts
	// so far (nil when it did not start).
	DrainSegmentCounts(ctx context.Context, segmentID string, noEvict bool) (*masterv1.DrainCounts, error)
	// DrainProgress is the running or last drain of each segment drained
	// since the master started, by segment id.
	DrainProgress() map[string]*masterv1.DrainProgress
	// UndrainSegment returns a DRAINING or DRAINED segment to OK, stopping
	// a drain in progress at its next chunk; a no-op on an OK one.
	UndrainSegment(ctx context.Context, segmentID string) error
	// SetTenantQuota sets a tenant's limits (0 = unlimited).
	SetTenantQuota(ctx context.Context, tenant string, maxBytes, maxObjects uint64) (*masterv1.TenantQuota, error)
	// TenantQuota returns a tenant's limits and usage.
	TenantQuota(ctx context.Context, tenant string) (*masterv1.TenantQuota, error)
	// ListTenants lists every tenant's limits and usage.
	ListTenants(ctx context.Context) []*masterv1.TenantQuota
	// Stats returns objects and bytes held and the change log head.
	Stats() (objects, bytes, revision uint64)
	// SegmentReplicaCounts returns replicas (any status) per segment id.
	SegmentReplicaCounts() map[string]uint64
	// MigrateObjects copies (or with move, moves) named objects of one
	// tenant to a target: an error for the whole request, else one result
	// per key, in order.
	MigrateObjects(ctx context.Context, tenant string, keys []string, target *masterv1.MigrationTarget, move bool, fromSegment string) ([]*masterv1.MigrationResult, error)
}

// Registry is what AdminService needs from the segment registry
// (*registry.Registry implements it).
type Registry interface {
	Details() []registry.Detail
	Detail(id string) (registry.Detail, bool)
	Agents() []registry.Agent
}

// Deps are the service's collaborators.
type Deps struct {
	Identity cluster.Identity
	Registry Registry
	Meta     Meta
	// Leader reports whether this master leads and, when not, the leader's
	// address. Nil means a single master that always leads.
	Leader func() (leader bool, hint string)
	// Epoch, if set, is the current epoch (an elected standby's changes
	// at its election); nil means Identity.Epoch.
	Epoch func() uint64
}

// Service implements masterv1.AdminServiceServer.
type Service struct {
	masterv1.UnimplementedAdminServiceServer
	deps Deps
	lg   *slog.Logger
}

var _ masterv1.AdminServiceServer = (*Service)(nil)

// maxIDLen bounds ids and tenant names accepted from operators (bytes).
const maxIDLen = 4096

// New builds the service. It does no I/O.
func New(deps Deps, lg *slog.Logger) (*Service, error) {
	if deps.Registry == nil || deps.Meta == nil {
		return nil, errors.New("adminsvc: Registry and Meta are required")
	}
	if deps.Leader == nil {
		deps.Leader = func() (bool, string) { return true, "" }
	}
	return &Service{deps: deps, lg: lg}, nil
}

func invalid(format string, args ...any) error {
	return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...))
}

func notFound(id string) error {
	return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q", id))
}

func checkSegmentID(id string) error {
	switch {
	case id == "":
		return invalid("segment_id is required")
	case len(id) > maxIDLen:
		return invalid("segment_id longer than %d bytes", maxIDLen)
	}
	return nil
}

func checkTenant(tenant string) error {
	if len(tenant) > maxIDLen {
		return invalid("tenant longer than %d bytes", maxIDLen)
	}
	return nil
}

// segmentPB is the wire view of one registry entry and its drain (nil
// when none).
func segmentPB(d registry.Detail, replicas uint64, drain *masterv1.DrainProgress) *masterv1.Segment {
	s := d.Segment
	return &masterv1.Segment{
		Drain: drain,
		Info: &masterv1.SegmentInfo{
			SegmentId: s.ID, Medium: s.Medium, Capacity: s.Capacity, Used: s.Used,
			LargestFreeExtent: s.LargestFreeExtent, Alignment: d.Alignment, Name: s.Name,
		},
		AgentId: s.AgentID, HostId: s.HostID, DataEndpoint: s.DataEndpoint, TransferEndpoint: s.TransferEndpoint,
		Lifecycle: s.Lifecycle, Health: s.Health, Replicas: replicas,
		LastHeartbeatUnixMs: s.LastHeartbeatMs,
		CanAllocate:         s.CanAllocate(), CanServeRead: s.CanServeRead(),
	}
}

// ListSegments lists every remembered segment, UNMOUNTED ones included.
func (s *Service) ListSegments(ctx context.Context, _ *masterv1.ListSegmentsRequest) (*masterv1.ListSegmentsResponse, error) {
	counts := s.deps.Meta.SegmentReplicaCounts()
	drains := s.deps.Meta.DrainProgress()
	details := s.deps.Registry.Details()
	out := make([]*masterv1.Segment, 0, len(details))
	for _, d := range details {
		out = append(out, segmentPB(d, counts[d.ID], drains[d.ID]))
	}
	return &masterv1.ListSegmentsResponse{Segments: out}, nil
}

// GetSegment describes one segment.
func (s *Service) GetSegment(ctx context.Context, req *masterv1.GetSegmentRequest) (*masterv1.GetSegmentResponse, error) {
	id := req.GetSegmentId()
	if err := checkSegmentID(id); err != nil {
		return nil, err
	}
	d, ok := s.deps.Registry.Detail(id)
	if !ok {
		return nil, notFound(id)
	}
	return &masterv1.GetSegmentResponse{Segment: s.segmentPB(d)}, nil
}

// ListAgents lists agents, connected or recently lost.
func (s *Service) ListAgents(ctx context.Context, _ *masterv1.ListAgentsRequest) (*masterv1.ListAgentsResponse, error) {
	agents := s.deps.Registry.Agents()
	out := make([]*masterv1.Agent, 0, len(agents))
	for _, a := range agents {
		var beat int64
		if !a.LastHeartbeat.IsZero() {
			beat = a.LastHeartbeat.UnixMilli()
		}
		out = append(out, &masterv1.Agent{
			AgentId: a.ID, HostId: a.HostID, DataEndpoint: a.DataEndpoint, TransferEndpoint: a.TransferEndpoint, Connected: a.Connected,
			LastHeartbeatUnixMs: beat, SegmentIds: a.SegmentIDs, Version: a.Version,
		})
	}
	return &masterv1.ListAgentsResponse{Agents: out}, nil
}

// segmentPB is the wire view of one segment, with its replica count and
// drain.
func (s *Service) segmentPB(d registry.Detail) *masterv1.Segment {
	return segmentPB(d, s.deps.Meta.SegmentReplicaCounts()[d.ID], s.deps.Meta.DrainProgress()[d.ID])
}

// DrainSegment drains a segment through the metadata and returns its state
// and the drain's counts afterwards. A drain stopped early is an error
// whose ErrorInfo metadata carries the counts so far (the metadata sets
// them).
func (s *Service) DrainSegment(ctx context.Context, req *masterv1.DrainSegmentRequest) (*masterv1.DrainSegmentResponse, error) {
	id := req.GetSegmentId()
	if err := checkSegmentID(id); err != nil {
		return nil, err
	}
	if _, ok := s.deps.Registry.Detail(id); !ok {
		return nil, notFound(id)
	}
	counts, err := s.deps.Meta.DrainSegmentCounts(ctx, id, req.GetNoEvict())
	if err != nil {
		s.lg.Warn("segment drain failed", "segment_id", id, "no_evict", req.GetNoEvict(), "err", err)
		return nil, rpcerr.Status(err)
	}
	d, ok := s.deps.Registry.Detail(id)
	if !ok {
		return nil, notFound(id)
	}
	s.lg.Info("segment drain answered", "segment_id", id, "lifecycle", registry.LifecycleLabel(d.Lifecycle),
		"moved", counts.GetMoved(), "evicted", counts.GetEvicted(), "offloaded", counts.GetOffloaded(), "dropped", counts.GetDropped(), "left", counts.GetLeft())
	return &masterv1.DrainSegmentResponse{Segment: s.segmentPB(d), Counts: counts}, nil
}

// UndrainSegment returns a drained or draining segment to service and
// returns its state afterwards.
func (s *Service) UndrainSegment(ctx context.Context, req *masterv1.UndrainSegmentRequest) (*masterv1.UndrainSegmentResponse, error) {
	id := req.GetSegmentId()
	if err := checkSegmentID(id); err != nil {
		return nil, err
	}
	if err := s.deps.Meta.UndrainSegment(ctx, id); err != nil {
		return nil, rpcerr.Status(err)
	}
	d, ok := s.deps.Registry.Detail(id)
	if !ok {
		return nil, notFound(id)
	}
	s.lg.Info("segment undrained", "segment_id", id, "lifecycle", registry.LifecycleLabel(d.Lifecycle))
	return &masterv1.UndrainSegmentResponse{Segment: s.segmentPB(d)}, nil
}

// CopyObjects copies named objects of any tenant (ObjectService.Copy for
// operators).
func (s *Service) CopyObjects(ctx context.Context, req *masterv1.CopyObjectsRequest) (*masterv1.CopyObjectsResponse, error) {
	res, err := s.deps.Meta.MigrateObjects(ctx, req.GetTenant(), req.GetKeys(), req.GetTarget(), false, "")
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.CopyObjectsResponse{Results: res}, nil
}

// MoveObjects moves named objects of any tenant (ObjectService.Move for
// operators).
func (s *Service) MoveObjects(ctx context.Context, req *masterv1.MoveObjectsRequest) (*masterv1.MoveObjectsResponse, error) {
	res, err := s.deps.Meta.MigrateObjects(ctx, req.GetTenant(), req.GetKeys(), req.GetTarget(), true, req.GetFromSegmentId())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.MoveObjectsResponse{Results: res}, nil
}

// SetTenantQuota sets a tenant's limits.
func (s *Service) SetTenantQuota(ctx context.Context, req *masterv1.SetTenantQuotaRequest) (*masterv1.SetTenantQuotaResponse, error) {
	if err := checkTenant(req.GetTenant()); err != nil {
		return nil, err
	}
	q, err := s.deps.Meta.SetTenantQuota(ctx, req.GetTenant(), req.GetMaxBytes(), req.GetMaxObjects())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	s.lg.Info("tenant quota set", "tenant", q.GetTenant(), "max_bytes", q.GetMaxBytes(), "max_objects", q.GetMaxObjects())
	return &masterv1.SetTenantQuotaResponse{Quota: q}, nil
}

// GetTenantQuota returns a tenant's limits and usage.
func (s *Service) GetTenantQuota(ctx context.Context, req *masterv1.GetTenantQuotaRequest) (*masterv1.GetTenantQuotaResponse, error) {
	if err := checkTenant(req.GetTenant()); err != nil {
		return nil, err
	}
	q, err := s.deps.Meta.TenantQuota(ctx, req.GetTenant())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.GetTenantQuotaResponse{Quota: q}, nil
}

// ListTenants lists tenants with limits and usage.
func (s *Service) ListTenants(ctx context.Context, _ *masterv1.ListTenantsRequest) (*masterv1.ListTenantsResponse, error) {
	return &masterv1.ListTenantsResponse{Tenants: s.deps.Meta.ListTenants(ctx)}, nil
}

// GetClusterStatus summarises the master. Capacity and use count segments
// that hold data that can be served: HEALTHY and not unmounting.
func (s *Service) GetClusterStatus(ctx context.Context, _ *masterv1.GetClusterStatusRequest) (*masterv1.GetClusterStatusResponse, error) {
	objects, bytes, revision := s.deps.Meta.Stats()
	leader, hint := s.deps.Leader()
	epoch := s.deps.Identity.Epoch
	if s.deps.Epoch != nil {
		epoch = s.deps.Epoch()
	}
	resp := &masterv1.GetClusterStatusResponse{
		MasterId: s.deps.Identity.MasterID, Epoch: epoch, Leader: leader, LeaderHint: hint,
		Objects: objects, Bytes: bytes, Revision: revision,
	}
	for _, a := range s.deps.Registry.Agents() {
		if a.Connected {
			resp.AgentsConnected++
		}
	}
	media := map[masterv1.Medium]*masterv1.MediumUsage{}
	for _, d := range s.deps.Registry.Details() {
		if d.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
			continue
		}
		resp.Segments++
		if !d.CanServeRead() {
			continue
		}
		resp.CapacityBytes += d.Capacity
		resp.UsedBytes += d.Used
		mu := media[d.Medium]
		if mu == nil {
			mu = &masterv1.MediumUsage{Medium: d.Medium}
			media[d.Medium] = mu
		}
		mu.CapacityBytes += d.Capacity
		mu.UsedBytes += d.Used
	}
	for _, m := range []masterv1.Medium{masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK} {
		if mu := media[m]; mu != nil {
			resp.Media = append(resp.Media, mu)
		}
	}
	return resp, nil
}
