// Package objectsvc adapts crescent.master.v1.ObjectService to the object
// metadata (internal/meta): it checks the request envelope, converts
// messages to domain specs, calls the store, and maps errors to a gRPC
// status with an ErrorInfo reason (internal/rpcerr) — nothing else.
package objectsvc

import (
	"context"
	"sync/atomic"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
)

// DefaultMaxBatch bounds the items of one batch RPC.
const DefaultMaxBatch = 10000

// Config tunes the adapter.
type Config struct {
	// MaxBatch bounds the items of one batch RPC (default 10000).
	MaxBatch int
	// Unary is the server's chain of unary interceptors
	// (server.Server.Unary), which every call carried on CallStream runs
	// through as its unary call would. Nil runs them bare (tests of the
	// service alone).
	Unary grpc.UnaryServerInterceptor
}

// Service implements masterv1.ObjectServiceServer over a *meta.Store.
type Service struct {
	masterv1.UnimplementedObjectServiceServer
	store    *meta.Store
	maxBatch int
	unary    grpc.UnaryServerInterceptor
	carried  map[string]carriedCall // CallStream's calls (callstream.go)
	stopping context.Context        // ended by Close
	// lookupAddr is what CallStream names as the lookup listener; nil
	// when there is none.
	lookupAddr atomic.Pointer[string]
	stop       context.CancelFunc
}

// New returns the adapter. It does no I/O.
func New(cfg Config, store *meta.Store) *Service {
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = DefaultMaxBatch
	}
	if cfg.Unary == nil {
		cfg.Unary = func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			return h(ctx, req)
		}
	}
	s := &Service{store: store, maxBatch: cfg.MaxBatch, unary: cfg.Unary}
	s.carried = s.carriedCalls()
	s.stopping, s.stop = context.WithCancel(context.Background())
	return s
}

// Close ends every CallStream with UNAVAILABLE / MASTER_SHUTTING_DOWN and
// refuses new ones (the SDK makes their calls again, unary, at the next
// leader); unary calls are not affected. Call it before stopping the gRPC
// server, whose graceful stop would otherwise wait for the streams.
func (s *Service) Close() { s.stop() }

func errShuttingDown() error {
	return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_SHUTTING_DOWN, "master is shutting down"))
}

// Register registers the service on a gRPC server.
func (s *Service) Register(r grpc.ServiceRegistrar) { masterv1.RegisterObjectServiceServer(r, s) }

func invalid(format string, args ...any) error {
	return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...))
}

func (s *Service) checkBatch(n int) error {
	if n == 0 {
		return invalid("batch has no items")
	}
	if n > s.maxBatch {
		return invalid("batch has %d items, max %d", n, s.maxBatch)
	}
	return nil
}

// putSpec converts a PutStartRequest; shape errors are INVALID_PARAMS.
func putSpec(r *masterv1.PutStartRequest) (meta.PutSpec, error) {
	c := r.GetConfig()
	sp := meta.PutSpec{
		Tenant: r.GetTenant(), Key: r.GetKey(), Size: r.GetSize(),
		ReplicaNum: int(c.GetReplicaNum()), Medium: c.GetMedium(),
		Preferred: c.GetPreferredSegments(), PreferLocalHost: c.GetPreferLocalHost(),
		SoftPin: c.GetSoftPin(), HardPin: c.GetHardPin(), Group: c.GetGroupId(),
		ClientID: r.GetClientId(), Upsert: r.GetUpsert(),
	}
	if c.GetReplicaNum() > meta.MaxReplicaNum {
		return sp, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"replica_num must be at most %d, got %d", meta.MaxReplicaNum, c.GetReplicaNum())
	}
	if len(c.GetPreferredSegments()) > meta.MaxReplicaNum*4 {
		return sp, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"too many preferred_segments (%d)", len(c.GetPreferredSegments()))
	}
	if d := c.GetSoftPinTtl(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() < 0 {
			return sp, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "soft_pin_ttl is not a valid non-negative duration")
		}
		sp.SoftPinTTL = d.AsDuration()
	}
	return sp, nil
}

// PutStart implements ObjectService.PutStart.
func (s *Service) PutStart(ctx context.Context, r *masterv1.PutStartRequest) (*masterv1.PutStartResponse, error) {
	sp, err := putSpec(r)
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	reps, err := s.store.PutStart(ctx, sp)
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.PutStartResponse{Replicas: reps, Spares: s.leaseSpares(r.GetClientId(), r.GetTenant(), r.GetSize(), r.GetSpares())}, nil
}

// leaseSpares answers a request's spares (meta.LeaseSpares); nil when it
// asked for none.
func (s *Service) leaseSpares(client, tenant string, size uint64, n uint32) []*masterv1.ReplicaDescriptor {
	if n == 0 {
		return nil
	}
	return s.store.LeaseSpares(client, tenant, size, int(min(n, 16)))
}

// putEndSpec converts a PutEndRequest; a spare's put parameters are
// checked as PutStart's.
func putEndSpec(r *masterv1.PutEndRequest) (meta.PutEndSpec, error) {
	sp := meta.PutEndSpec{Tenant: r.GetTenant(), Key: r.GetKey(), ClientID: r.GetClientId(), Checksum: r.GetChecksum(), Receipts: r.GetSealReceipts()}
	if c := r.GetSpare(); c != nil {
		ps, err := putSpec(&masterv1.PutStartRequest{Tenant: r.GetTenant(), Key: r.GetKey(), Size: c.GetSize(), Config: c.GetConfig(), ClientId: r.GetClientId(), Upsert: c.GetUpsert()})
		if err != nil {
			return sp, err
		}
		sp.Spare = &meta.SpareSpec{SegmentID: c.GetSegmentId(), AllocationID: c.GetAllocationId(), Put: ps}
	}
	return sp, nil
}

// endSpares answers a spare's commit with the spares it asked for: a
// put's PutEnd names its size only when it commits a spare.
func (s *Service) endSpares(r *masterv1.PutEndRequest) []*masterv1.ReplicaDescriptor {
	if r.GetSpare() == nil {
		return nil
	}
	return s.leaseSpares(r.GetClientId(), r.GetTenant(), r.GetSpare().GetSize(), r.GetSpares())
}

// PutEnd implements ObjectService.PutEnd.
func (s *Service) PutEnd(ctx context.Context, r *masterv1.PutEndRequest) (*masterv1.PutEndResponse, error) {
	sp, err := putEndSpec(r)
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	if err := s.store.PutEnd(ctx, sp); err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.PutEndResponse{Spares: s.endSpares(r)}, nil
}

// PutRevoke implements ObjectService.PutRevoke.
func (s *Service) PutRevoke(ctx context.Context, r *masterv1.PutRevokeRequest) (*masterv1.PutRevokeResponse, error) {
	if err := s.store.PutRevoke(ctx, meta.PutRevokeSpec{Tenant: r.GetTenant(), Key: r.GetKey(), ClientID: r.GetClientId()}); err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.PutRevokeResponse{}, nil
}

// BatchPutStart implements ObjectService.BatchPutStart.
func (s *Service) BatchPutStart(ctx context.Context, r *masterv1.BatchPutStartRequest) (*masterv1.BatchPutStartResponse, error) {
	if err := s.checkBatch(len(r.GetItems())); err != nil {
		return nil, err
	}
	out := make([]*masterv1.PutStartResult, len(r.GetItems()))
	specs := make([]meta.PutSpec, 0, len(r.GetItems()))
	idx := make([]int, 0, len(r.GetItems()))
	for i, it := range r.GetItems() {
		sp, err := putSpec(it)
		if err != nil {
			out[i] = &masterv1.PutStartResult{Status: rpcerr.Item(err)}
			continue
		}
		specs = append(specs, sp)
		idx = append(idx, i)
	}
	results := make([]masterv1.PutStartResult, len(specs))
	for j, res := range s.store.BatchPutStart(ctx, specs) {
		o := &results[j]
		o.Status, o.Replicas = item(res.Err), res.Replicas
		if req := r.GetItems()[idx[j]]; res.Err == nil {
			o.Spares = s.leaseSpares(req.GetClientId(), req.GetTenant(), req.GetSize(), req.GetSpares())
		}
		out[idx[j]] = o
	}
	return &masterv1.BatchPutStartResponse{Results: out}, nil
}

// BatchPutEnd implements ObjectService.BatchPutEnd.
func (s *Service) BatchPutEnd(ctx context.Context, r *masterv1.BatchPutEndRequest) (*masterv1.BatchPutEndResponse, error) {
	if err := s.checkBatch(len(r.GetItems())); err != nil {
		return nil, err
	}
	specs := make([]meta.PutEndSpec, 0, len(r.GetItems()))
	idx := make([]int, 0, len(r.GetItems()))
	errs := make([]error, len(r.GetItems()))
	for i, it := range r.GetItems() {
		sp, err := putEndSpec(it)
		if err != nil {
			errs[i] = err
			continue
		}
		specs = append(specs, sp)
		idx = append(idx, i)
	}
	for j, err := range s.store.BatchPutEnd(ctx, specs) {
		errs[idx[j]] = err
	}
	resp := &masterv1.BatchPutEndResponse{Results: items(errs)}
	for i, it := range r.GetItems() {
		if errs[i] != nil || it.GetSpare() == nil || it.GetSpares() == 0 {
			continue
		}
		if resp.Answers == nil {
			resp.Answers = make([]*masterv1.PutEndResponse, len(errs))
			for k := range resp.Answers {
				resp.Answers[k] = &masterv1.PutEndResponse{}
			}
		}
		resp.Answers[i].Spares = s.endSpares(it)
	}
	return resp, nil
}

// BatchPutRevoke implements ObjectService.BatchPutRevoke.
func (s *Service) BatchPutRevoke(ctx context.Context, r *masterv1.BatchPutRevokeRequest) (*masterv1.BatchPutRevokeResponse, error) {
	if err := s.checkBatch(len(r.GetItems())); err != nil {
		return nil, err
	}
	specs := make([]meta.PutRevokeSpec, len(r.GetItems()))
	for i, it := range r.GetItems() {
		specs[i] = meta.PutRevokeSpec{Tenant: it.GetTenant(), Key: it.GetKey(), ClientID: it.GetClientId()}
	}
	return &masterv1.BatchPutRevokeResponse{Results: items(s.store.BatchPutRevoke(ctx, specs))}, nil
}

// GetReplicaList implements ObjectService.GetReplicaList.
func (s *Service) GetReplicaList(ctx context.Context, r *masterv1.GetReplicaListRequest) (*masterv1.GetReplicaListResponse, error) {
	resp, err := s.store.Get(ctx, meta.GetSpec{Tenant: r.GetTenant(), Key: r.GetKey(), ClientHost: r.GetClientHost()})
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return resp, nil
}

// BatchGetReplicaList implements ObjectService.BatchGetReplicaList.
func (s *Service) BatchGetReplicaList(ctx context.Context, r *masterv1.BatchGetReplicaListRequest) (*masterv1.BatchGetReplicaListResponse, error) {
	if err := s.checkBatch(len(r.GetItems())); err != nil {
		return nil, err
	}
	specs := make([]meta.GetSpec, len(r.GetItems()))
	for i, it := range r.GetItems() {
		specs[i] = meta.GetSpec{Tenant: it.GetTenant(), Key: it.GetKey(), ClientHost: it.GetClientHost()}
	}
	res := s.store.BatchGet(ctx, specs)
	out := make([]*masterv1.GetReplicaListResult, len(res))
	results := make([]masterv1.GetReplicaListResult, len(res))
	for i, r := range res {
		out[i] = &results[i]
		out[i].Status, out[i].ReplicaList = item(r.Err), r.Resp
	}
	return &masterv1.BatchGetReplicaListResponse{Results: out}, nil
}

// Exist implements ObjectService.Exist.
func (s *Service) Exist(ctx context.Context, r *masterv1.ExistRequest) (*masterv1.ExistResponse, error) {
	ok, err := s.store.Exist(ctx, r.GetTenant(), r.GetKey())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.ExistResponse{Exists: ok}, nil
}

// BatchExist implements ObjectService.BatchExist.
func (s *Service) BatchExist(ctx context.Context, r *masterv1.BatchExistRequest) (*masterv1.BatchExistResponse, error) {
	if err := s.checkBatch(len(r.GetItems())); err != nil {
		return nil, err
	}
	refs := make([]meta.ObjectRef, len(r.GetItems()))
	for i, it := range r.GetItems() {
		refs[i] = meta.ObjectRef{Tenant: it.GetTenant(), Key: it.GetKey()}
	}
	ex, err := s.store.BatchExist(ctx, refs)
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.BatchExistResponse{Exists: ex}, nil
}

// GetSize implements ObjectService.GetSize.
func (s *Service) GetSize(ctx context.Context, r *masterv1.GetSizeRequest) (*masterv1.GetSizeResponse, error) {
	n, err := s.store.GetSize(ctx, r.GetTenant(), r.GetKey())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.GetSizeResponse{Size: n}, nil
}

// QueryRoute implements ObjectService.QueryRoute.
func (s *Service) QueryRoute(ctx context.Context, r *masterv1.QueryRouteRequest) (*masterv1.QueryRouteResponse, error) {
	resp, err := s.store.QueryRoute(ctx, r.GetTenant(), r.GetKey())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return resp, nil
}

// ListObjects implements ObjectService.ListObjects.
func (s *Service) ListObjects(ctx context.Context, r *masterv1.ListObjectsRequest) (*masterv1.ListObjectsResponse, error) {
	if len(r.GetPrefix()) > meta.MaxKeyLen || len(r.GetTenant()) > meta.MaxTenantLen {
		return nil, invalid("tenant or prefix too long")
	}
	objs, next, err := s.store.ListObjects(ctx, r.GetTenant(), r.GetPrefix(), int(min(r.GetPageSize(), 10000)), r.GetPageToken())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.ListObjectsResponse{Objects: objs, NextPageToken: next}, nil
}

// Remove implements ObjectService.Remove.
func (s *Service) Remove(ctx context.Context, r *masterv1.RemoveRequest) (*masterv1.RemoveResponse, error) {
	if err := s.store.Remove(ctx, meta.RemoveSpec{Tenant: r.GetTenant(), Key: r.GetKey(), Force: r.GetForce()}); err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.RemoveResponse{}, nil
}

// BatchRemove implements ObjectService.BatchRemove.
func (s *Service) BatchRemove(ctx context.Context, r *masterv1.BatchRemoveRequest) (*masterv1.BatchRemoveResponse, error) {
	if err := s.checkBatch(len(r.GetItems())); err != nil {
		return nil, err
	}
	specs := make([]meta.RemoveSpec, len(r.GetItems()))
	for i, it := range r.GetItems() {
		specs[i] = meta.RemoveSpec{Tenant: it.GetTenant(), Key: it.GetKey(), Force: it.GetForce()}
	}
	return &masterv1.BatchRemoveResponse{Results: items(s.store.BatchRemove(ctx, specs))}, nil
}

// RemoveAll implements ObjectService.RemoveAll.
func (s *Service) RemoveAll(ctx context.Context, r *masterv1.RemoveAllRequest) (*masterv1.RemoveAllResponse, error) {
	n, skipped, err := s.store.RemoveAll(ctx, r.GetTenant(), r.GetForce())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.RemoveAllResponse{Removed: n, Skipped: skipped}, nil
}

// RemoveByPrefix implements ObjectService.RemoveByPrefix.
func (s *Service) RemoveByPrefix(ctx context.Context, r *masterv1.RemoveByPrefixRequest) (*masterv1.RemoveByPrefixResponse, error) {
	if r.GetPrefix() == "" {
		return nil, invalid("prefix must not be empty (use RemoveAll)")
	}
	n, skipped, next, err := s.store.RemoveByPrefix(ctx, r.GetTenant(), r.GetPrefix(), r.GetForce(), r.GetPageToken())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.RemoveByPrefixResponse{Removed: n, Skipped: skipped, NextPageToken: next}, nil
}

// RemoveByRegex implements ObjectService.RemoveByRegex.
func (s *Service) RemoveByRegex(ctx context.Context, r *masterv1.RemoveByRegexRequest) (*masterv1.RemoveByRegexResponse, error) {
	n, skipped, next, err := s.store.RemoveByRegex(ctx, r.GetTenant(), r.GetRegex(), r.GetForce(), r.GetPageToken())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.RemoveByRegexResponse{Removed: n, Skipped: skipped, NextPageToken: next}, nil
}

// okItem is shared by every OK item of every response: marshalling only
// reads it.
var okItem = &masterv1.ItemStatus{}

func item(err error) *masterv1.ItemStatus {
	if err == nil {
		return okItem
	}
	return rpcerr.Item(err)
}

func items(errs []error) []*masterv1.ItemStatus {
	out := make([]*masterv1.ItemStatus, len(errs))
	for i, err := range errs {
		out[i] = item(err)
	}
	return out
}

// Copy implements ObjectService.Copy.
func (s *Service) Copy(ctx context.Context, r *masterv1.ObjectServiceCopyRequest) (*masterv1.ObjectServiceCopyResponse, error) {
	res, err := s.store.MigrateObjects(ctx, r.GetTenant(), r.GetKeys(), r.GetTarget(), false, "")
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.ObjectServiceCopyResponse{Results: res}, nil
}

// Move implements ObjectService.Move.
func (s *Service) Move(ctx context.Context, r *masterv1.ObjectServiceMoveRequest) (*masterv1.ObjectServiceMoveResponse, error) {
	res, err := s.store.MigrateObjects(ctx, r.GetTenant(), r.GetKeys(), r.GetTarget(), true, r.GetFromSegmentId())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.ObjectServiceMoveResponse{Results: res}, nil
}

// Prefetch implements ObjectService.Prefetch.
func (s *Service) Prefetch(ctx context.Context, r *masterv1.PrefetchRequest) (*masterv1.PrefetchResponse, error) {
	res, err := s.store.PrefetchObjects(ctx, r.GetTenant(), r.GetKeys(), r.GetWait())
	if err != nil {
		return nil, rpcerr.Status(err)
	}
	return &masterv1.PrefetchResponse{Results: res}, nil
}
