package testutil

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"
)

// FakeConfig configures a Fake.
type FakeConfig struct {
	// Agents is the number of agents, one memory segment each. Default 2.
	Agents int
	// Transfer makes every agent serve the bulk transfer protocol
	// (internal/xfer) beside DataService and advertise it in descriptors.
	Transfer bool
	// PageSize is how many keys one ListObjects, RemoveByPrefix or
	// RemoveByRegex call scans before it answers with a page token, as the
	// master's scan budget does. Default 100.
	PageSize int
	// LeaseTTL is the read lease GetReplicaList and Exist grant. Default 10 s.
	LeaseTTL time.Duration
	// SegmentCapacity is each segment's size in bytes. Default 1 GiB.
	SegmentCapacity uint64
	// Now is the fake's clock (leases). Default time.Now.
	Now func() time.Time
}

func (c *FakeConfig) defaults() {
	if c.Agents <= 0 {
		c.Agents = 2
	}
	if c.PageSize <= 0 {
		c.PageSize = 100
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 10 * time.Second
	}
	if c.SegmentCapacity == 0 {
		c.SegmentCapacity = 1 << 30
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Fake is an in-memory Crescent cluster on loopback ports: a master serving
// ObjectService and AdminService, and agents serving DataService (and,
// with FakeConfig.Transfer, the bulk transfer protocol). It keeps the
// contracts the SDK relies on — PutStart → writes → PutEnd with checksum
// verification, PutRevoke, read leases that make Remove refuse without
// force, busy and hard-pinned objects, paged scans, quotas, segment
// drain — with none of the real master's placement, eviction or
// recovery. Hooks inject failures. Safe for concurrent use.
//
// The real services live under services/*/internal, out of reach of
// pkg/ and cli/; e2e tests run them as processes.
type Fake struct {
	cfg    FakeConfig
	master *grpc.Server
	lis    net.Listener
	done   chan struct{}
	agents []*FakeAgent

	// mu guards every field below and the agents' stores.
	mu        sync.Mutex
	objects   map[objKey]*object
	quotas    map[string]*masterv1.TenantQuota
	segs      []*fakeSegment
	nextAlloc uint64
	revision  uint64
	calls     map[string]int
	hook      func(method string) error
	agentHook func(agent int, method string) error
	closed    bool
}

type objKey struct{ tenant, key string }

type object struct {
	size      uint64
	checksum  uint64
	cfg       *masterv1.ReplicateConfig
	client    string
	complete  bool
	leaseTill time.Time
	replicas  []*alloc
}

// alloc is one replica's allocation on an agent's segment.
type alloc struct {
	agent  int
	id     uint64
	token  []byte
	data   []byte
	sealed bool
}

type fakeSegment struct {
	id        string
	agent     int
	lifecycle masterv1.SegmentLifecycle
}

// NewFake starts a Fake for t and stops it when t ends.
func NewFake(t testing.TB, cfg FakeConfig) *Fake {
	t.Helper()
	f, err := StartFake(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

// StartFake starts a Fake; Close stops it. For examples, which have no
// testing.TB; tests use NewFake.
func StartFake(cfg FakeConfig) (*Fake, error) {
	cfg.defaults()
	f := &Fake{
		cfg: cfg, done: make(chan struct{}),
		objects: map[objKey]*object{}, quotas: map[string]*masterv1.TenantQuota{}, calls: map[string]int{},
	}
	for i := range cfg.Agents {
		a, err := startAgent(f, i)
		if err != nil {
			f.Close()
			return nil, err
		}
		f.agents = append(f.agents, a)
		f.segs = append(f.segs, &fakeSegment{id: fmt.Sprintf("seg-%d", i), agent: i, lifecycle: masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK})
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Close()
		return nil, err
	}
	f.lis = lis
	f.master = grpc.NewServer(rpccodec.ServerOption(), grpc.UnaryInterceptor(f.intercept))
	masterv1.RegisterObjectServiceServer(f.master, objectService{f: f})
	masterv1.RegisterAdminServiceServer(f.master, adminService{f: f})
	go func() {
		defer close(f.done)
		_ = f.master.Serve(lis)
	}()
	return f, nil
}

// Addr is the master's host:port.
func (f *Fake) Addr() string { return f.lis.Addr().String() }

// Agent returns agent i.
func (f *Fake) Agent(i int) *FakeAgent { return f.agents[i] }

// Close stops the master and every agent. Idempotent.
func (f *Fake) Close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	f.mu.Unlock()
	if f.master != nil {
		f.master.Stop()
		<-f.done
	}
	for _, a := range f.agents {
		a.Stop()
	}
}

// SetHook makes every master call first ask hook, by method name
// ("PutStart"); a non-nil error is the call's answer (through
// rpcerr.Status). nil removes the hook.
func (f *Fake) SetHook(hook func(method string) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hook = hook
}

// SetAgentHook makes every agent call ask hook, by agent index and method
// ("Write", "Read", "BatchWrite", "BatchRead", "TransferWrite",
// "TransferRead"); a non-nil error fails the call (gRPC) or each of its
// items (BatchWrite, BatchRead and transfers). nil removes the hook.
func (f *Fake) SetAgentHook(hook func(agent int, method string) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.agentHook = hook
}

// Calls reports how many times a master or agent method was called.
func (f *Fake) Calls(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[method]
}

// Keys returns the tenant's readable keys, sorted.
func (f *Fake) Keys(tenant string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for k, o := range f.objects {
		if k.tenant == tenant && o.complete {
			out = append(out, k.key)
		}
	}
	slices.Sort(out)
	return out
}

// Object returns a readable object's bytes (from its first replica).
func (f *Fake) Object(tenant, key string) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	o, ok := f.objects[objKey{tenant, key}]
	if !ok || !o.complete {
		return nil, false
	}
	return slices.Clone(o.replicas[0].data), true
}

// Corrupt flips the first byte of replica i of a stored object, so a
// reader finds its checksum wrong.
func (f *Fake) Corrupt(tenant, key string, replica int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if o, ok := f.objects[objKey{tenant, key}]; ok && replica < len(o.replicas) && len(o.replicas[replica].data) > 0 {
		o.replicas[replica].data[0] ^= 0xff
	}
}

// Segments returns the segment ids, in agent order.
func (f *Fake) Segments() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, s := range f.segs {
		out = append(out, s.id)
	}
	return out
}

// SetLifecycle moves a segment to lc (a segment not OK takes no new
// replicas).
func (f *Fake) SetLifecycle(segment string, lc masterv1.SegmentLifecycle) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.segs {
		if s.id == segment {
			s.lifecycle = lc
		}
	}
}

func (f *Fake) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	method := info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]
	f.mu.Lock()
	f.calls[method]++
	hook := f.hook
	f.mu.Unlock()
	if hook != nil {
		if err := hook(method); err != nil {
			return nil, rpcerr.Status(err)
		}
	}
	resp, err := h(ctx, req)
	return resp, rpcerr.Status(err)
}

func errorf(r masterv1.ErrorReason, format string, args ...any) error {
	return rpcerr.Errorf(r, format, args...)
}

func (f *Fake) quotaLocked(tenant string) *masterv1.TenantQuota {
	q, ok := f.quotas[tenant]
	if !ok {
		q = &masterv1.TenantQuota{Tenant: tenant}
		f.quotas[tenant] = q
	}
	return q
}

// dropLocked erases an object, refunding its quota.
func (f *Fake) dropLocked(k objKey) {
	o, ok := f.objects[k]
	if !ok {
		return
	}
	delete(f.objects, k)
	q := f.quotaLocked(k.tenant)
	q.UsedBytes -= o.size
	q.UsedObjects--
	f.revision++
}

// removableLocked is why o cannot be removed without force, or nil.
func (f *Fake) removableLocked(k objKey, o *object, force bool) error {
	switch {
	case !o.complete:
		return errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY, "object %q is being written", k.key)
	case force:
		return nil
	case o.cfg.GetHardPin():
		return errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY, "object %q is hard-pinned", k.key)
	case f.cfg.Now().Before(o.leaseTill):
		return errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE, "object %q has a read lease", k.key)
	}
	return nil
}

func (f *Fake) putStart(r *masterv1.PutStartRequest) ([]*masterv1.ReplicaDescriptor, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.GetKey() == "" || r.GetClientId() == "" {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "key and client id are required")
	}
	k := objKey{r.GetTenant(), r.GetKey()}
	if old, ok := f.objects[k]; ok {
		switch {
		case !old.complete:
			return nil, errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY, "object %q is being written", k.key)
		case !r.GetUpsert():
			return nil, errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_ALREADY_EXISTS, "object %q exists", k.key)
		}
		f.dropLocked(k)
	}
	q := f.quotaLocked(k.tenant)
	if (q.MaxBytes > 0 && q.UsedBytes+r.GetSize() > q.MaxBytes) || (q.MaxObjects > 0 && q.UsedObjects+1 > q.MaxObjects) {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED, "tenant %q is over its quota", k.tenant)
	}
	n := max(1, int(r.GetConfig().GetReplicaNum()))
	var segs []*fakeSegment
	for _, s := range f.segs {
		if s.lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK && len(segs) < n {
			segs = append(segs, s)
		}
	}
	if len(segs) < n {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, "%d replicas asked, %d segments can allocate", n, len(segs))
	}
	o := &object{size: r.GetSize(), cfg: r.GetConfig(), client: r.GetClientId()}
	if o.cfg == nil {
		o.cfg = &masterv1.ReplicateConfig{}
	}
	for _, s := range segs {
		f.nextAlloc++
		tok := make([]byte, 16)
		_, _ = rand.Read(tok)
		o.replicas = append(o.replicas, &alloc{agent: s.agent, id: f.nextAlloc, token: tok, data: make([]byte, r.GetSize())})
	}
	f.objects[k] = o
	q.UsedBytes += o.size
	q.UsedObjects++
	return f.descriptorsLocked(o), nil
}

func (f *Fake) descriptorsLocked(o *object) []*masterv1.ReplicaDescriptor {
	out := make([]*masterv1.ReplicaDescriptor, len(o.replicas))
	for i, a := range o.replicas {
		ag, s := f.agents[a.agent], f.segs[a.agent]
		st := masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING
		if o.complete {
			st = masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE
		}
		medium := o.cfg.GetMedium()
		if medium == masterv1.Medium_MEDIUM_UNSPECIFIED {
			medium = masterv1.Medium_MEDIUM_MEMORY
		}
		out[i] = &masterv1.ReplicaDescriptor{
			ReplicaId: uint32(i + 1), SegmentId: s.id, AgentId: ag.ID(), HostId: ag.HostID(), DataEndpoint: ag.Addr(),
			AllocationId: a.id, Size: o.size, Medium: medium, Status: st, Token: a.token, TransferEndpoint: ag.TransferAddr(),
		}
	}
	return out
}

func (f *Fake) putEnd(r *masterv1.PutEndRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := objKey{r.GetTenant(), r.GetKey()}
	o, ok := f.objects[k]
	switch {
	case !ok || o.complete:
		return errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "no put of %q in progress", k.key)
	case o.client != r.GetClientId():
		return errorf(masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT, "put of %q belongs to another client", k.key)
	}
	for _, a := range o.replicas {
		if xxhash.Sum64(a.data) != r.GetChecksum() {
			return errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "replica of %q does not match the checksum", k.key)
		}
	}
	for _, a := range o.replicas {
		a.sealed = true
	}
	o.complete, o.checksum = true, r.GetChecksum()
	f.revision++
	return nil
}

func (f *Fake) putRevoke(r *masterv1.PutRevokeRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := objKey{r.GetTenant(), r.GetKey()}
	o, ok := f.objects[k]
	switch {
	case !ok || o.complete:
		return errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "no put of %q in progress", k.key)
	case o.client != r.GetClientId():
		return errorf(masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT, "put of %q belongs to another client", k.key)
	}
	f.dropLocked(k)
	return nil
}

// readableLocked returns a complete object or OBJECT_NOT_FOUND.
func (f *Fake) readableLocked(tenant, key string) (*object, error) {
	o, ok := f.objects[objKey{tenant, key}]
	if !ok || !o.complete {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "object %q not found", key)
	}
	return o, nil
}

func (f *Fake) replicaList(r *masterv1.GetReplicaListRequest) (*masterv1.GetReplicaListResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	o, err := f.readableLocked(r.GetTenant(), r.GetKey())
	if err != nil {
		return nil, err
	}
	o.leaseTill = f.cfg.Now().Add(f.cfg.LeaseTTL)
	return &masterv1.GetReplicaListResponse{
		Size: o.size, Checksum: o.checksum, Replicas: f.descriptorsLocked(o), LeaseTtl: durationpb.New(f.cfg.LeaseTTL), GroupId: o.cfg.GetGroupId(),
	}, nil
}

func (f *Fake) exist(r *masterv1.ExistRequest) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	o, err := f.readableLocked(r.GetTenant(), r.GetKey())
	if err != nil {
		return false
	}
	o.leaseTill = f.cfg.Now().Add(f.cfg.LeaseTTL)
	return true
}

func (f *Fake) remove(r *masterv1.RemoveRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := objKey{r.GetTenant(), r.GetKey()}
	o, ok := f.objects[k]
	if !ok {
		return errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "object %q not found", k.key)
	}
	if err := f.removableLocked(k, o, r.GetForce()); err != nil {
		return err
	}
	f.dropLocked(k)
	return nil
}

// scan removes (or, with remove nil, lists) the tenant's keys that match,
// in key order after token, at most PageSize of them per call.
func (f *Fake) scan(tenant, token string, match func(string) bool, force bool) (removed, skipped uint64, next string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var keys []string
	for k := range f.objects {
		if k.tenant == tenant && k.key > token && match(k.key) {
			keys = append(keys, k.key)
		}
	}
	slices.Sort(keys)
	if len(keys) > f.cfg.PageSize {
		keys = keys[:f.cfg.PageSize]
		next = keys[len(keys)-1]
	}
	for _, key := range keys {
		k := objKey{tenant, key}
		if f.removableLocked(k, f.objects[k], force) != nil {
			skipped++
			continue
		}
		f.dropLocked(k)
		removed++
	}
	return removed, skipped, next
}

// objectService adapts the Fake to ObjectService.
type objectService struct {
	masterv1.UnimplementedObjectServiceServer
	f *Fake
}

func (s objectService) PutStart(_ context.Context, r *masterv1.PutStartRequest) (*masterv1.PutStartResponse, error) {
	reps, err := s.f.putStart(r)
	if err != nil {
		return nil, err
	}
	return &masterv1.PutStartResponse{Replicas: reps}, nil
}

func (s objectService) PutEnd(_ context.Context, r *masterv1.PutEndRequest) (*masterv1.PutEndResponse, error) {
	return &masterv1.PutEndResponse{}, s.f.putEnd(r)
}

func (s objectService) PutRevoke(_ context.Context, r *masterv1.PutRevokeRequest) (*masterv1.PutRevokeResponse, error) {
	return &masterv1.PutRevokeResponse{}, s.f.putRevoke(r)
}

func (s objectService) BatchPutStart(_ context.Context, r *masterv1.BatchPutStartRequest) (*masterv1.BatchPutStartResponse, error) {
	out := &masterv1.BatchPutStartResponse{}
	for _, it := range r.GetItems() {
		reps, err := s.f.putStart(it)
		out.Results = append(out.Results, &masterv1.PutStartResult{Status: rpcerr.Item(err), Replicas: reps})
	}
	return out, nil
}

func (s objectService) BatchPutEnd(_ context.Context, r *masterv1.BatchPutEndRequest) (*masterv1.BatchPutEndResponse, error) {
	out := &masterv1.BatchPutEndResponse{}
	for _, it := range r.GetItems() {
		out.Results = append(out.Results, rpcerr.Item(s.f.putEnd(it)))
	}
	return out, nil
}

func (s objectService) BatchPutRevoke(_ context.Context, r *masterv1.BatchPutRevokeRequest) (*masterv1.BatchPutRevokeResponse, error) {
	out := &masterv1.BatchPutRevokeResponse{}
	for _, it := range r.GetItems() {
		out.Results = append(out.Results, rpcerr.Item(s.f.putRevoke(it)))
	}
	return out, nil
}

func (s objectService) GetReplicaList(_ context.Context, r *masterv1.GetReplicaListRequest) (*masterv1.GetReplicaListResponse, error) {
	return s.f.replicaList(r)
}

func (s objectService) BatchGetReplicaList(_ context.Context, r *masterv1.BatchGetReplicaListRequest) (*masterv1.BatchGetReplicaListResponse, error) {
	out := &masterv1.BatchGetReplicaListResponse{}
	for _, it := range r.GetItems() {
		rl, err := s.f.replicaList(it)
		out.Results = append(out.Results, &masterv1.GetReplicaListResult{Status: rpcerr.Item(err), ReplicaList: rl})
	}
	return out, nil
}

func (s objectService) Exist(_ context.Context, r *masterv1.ExistRequest) (*masterv1.ExistResponse, error) {
	return &masterv1.ExistResponse{Exists: s.f.exist(r)}, nil
}

func (s objectService) BatchExist(_ context.Context, r *masterv1.BatchExistRequest) (*masterv1.BatchExistResponse, error) {
	out := &masterv1.BatchExistResponse{}
	for _, it := range r.GetItems() {
		out.Exists = append(out.Exists, s.f.exist(it))
	}
	return out, nil
}

func (s objectService) GetSize(_ context.Context, r *masterv1.GetSizeRequest) (*masterv1.GetSizeResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	o, err := s.f.readableLocked(r.GetTenant(), r.GetKey())
	if err != nil {
		return nil, err
	}
	return &masterv1.GetSizeResponse{Size: o.size}, nil
}

func (s objectService) QueryRoute(_ context.Context, r *masterv1.QueryRouteRequest) (*masterv1.QueryRouteResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	o, err := s.f.readableLocked(r.GetTenant(), r.GetKey())
	if err != nil {
		return nil, err
	}
	return &masterv1.QueryRouteResponse{Size: o.size, Checksum: o.checksum, Replicas: s.f.descriptorsLocked(o), GroupId: o.cfg.GetGroupId()}, nil
}

func (s objectService) ListObjects(_ context.Context, r *masterv1.ListObjectsRequest) (*masterv1.ListObjectsResponse, error) {
	f := s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	var keys []string
	for k := range f.objects {
		if k.tenant == r.GetTenant() && k.key > r.GetPageToken() && strings.HasPrefix(k.key, r.GetPrefix()) {
			keys = append(keys, k.key)
		}
	}
	slices.Sort(keys)
	out := &masterv1.ListObjectsResponse{}
	if len(keys) > f.cfg.PageSize {
		keys = keys[:f.cfg.PageSize]
		out.NextPageToken = keys[len(keys)-1]
	}
	for _, key := range keys {
		o := f.objects[objKey{r.GetTenant(), key}]
		info := &masterv1.ObjectInfo{
			Key: key, Size: o.size, Replicas: uint32(len(o.replicas)), GroupId: o.cfg.GetGroupId(), SoftPinned: o.cfg.GetSoftPin(),
			HardPinned: o.cfg.GetHardPin(), LeaseExpiryUnixMs: o.leaseTill.UnixMilli(), Processing: !o.complete, Checksum: o.checksum,
		}
		if o.complete {
			info.Media = []masterv1.Medium{f.descriptorsLocked(o)[0].GetMedium()}
		}
		out.Objects = append(out.Objects, info)
	}
	return out, nil
}

func (s objectService) Remove(_ context.Context, r *masterv1.RemoveRequest) (*masterv1.RemoveResponse, error) {
	return &masterv1.RemoveResponse{}, s.f.remove(r)
}

func (s objectService) BatchRemove(_ context.Context, r *masterv1.BatchRemoveRequest) (*masterv1.BatchRemoveResponse, error) {
	out := &masterv1.BatchRemoveResponse{}
	for _, it := range r.GetItems() {
		out.Results = append(out.Results, rpcerr.Item(s.f.remove(it)))
	}
	return out, nil
}

func (s objectService) RemoveAll(_ context.Context, r *masterv1.RemoveAllRequest) (*masterv1.RemoveAllResponse, error) {
	out := &masterv1.RemoveAllResponse{}
	for token := ""; ; {
		rm, sk, next := s.f.scan(r.GetTenant(), token, func(string) bool { return true }, r.GetForce())
		out.Removed, out.Skipped = out.Removed+rm, out.Skipped+sk
		if token = next; token == "" {
			return out, nil
		}
	}
}

func (s objectService) RemoveByPrefix(_ context.Context, r *masterv1.RemoveByPrefixRequest) (*masterv1.RemoveByPrefixResponse, error) {
	rm, sk, next := s.f.scan(r.GetTenant(), r.GetPageToken(), func(k string) bool { return strings.HasPrefix(k, r.GetPrefix()) }, r.GetForce())
	return &masterv1.RemoveByPrefixResponse{Removed: rm, Skipped: sk, NextPageToken: next}, nil
}

func (s objectService) RemoveByRegex(_ context.Context, r *masterv1.RemoveByRegexRequest) (*masterv1.RemoveByRegexResponse, error) {
	re, err := regexp.Compile(r.GetRegex())
	if err != nil {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "regex: %v", err)
	}
	rm, sk, next := s.f.scan(r.GetTenant(), r.GetPageToken(), re.MatchString, r.GetForce())
	return &masterv1.RemoveByRegexResponse{Removed: rm, Skipped: sk, NextPageToken: next}, nil
}

// adminService adapts the Fake to AdminService.
type adminService struct {
	masterv1.UnimplementedAdminServiceServer
	f *Fake
}

func (s adminService) segmentLocked(seg *fakeSegment) *masterv1.Segment {
	f := s.f
	a := f.agents[seg.agent]
	var used, replicas uint64
	for _, o := range f.objects {
		for _, r := range o.replicas {
			if r.agent == seg.agent {
				used += uint64(len(r.data))
				replicas++
			}
		}
	}
	ok := seg.lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK
	return &masterv1.Segment{
		Info:    &masterv1.SegmentInfo{SegmentId: seg.id, Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: f.cfg.SegmentCapacity, Used: used},
		AgentId: a.ID(), HostId: a.HostID(), DataEndpoint: a.Addr(), TransferEndpoint: a.TransferAddr(),
		Lifecycle: seg.lifecycle, Health: masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY, Replicas: replicas,
		CanAllocate: ok, CanServeRead: ok || seg.lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED,
	}
}

func (s adminService) findLocked(id string) (*fakeSegment, error) {
	for _, seg := range s.f.segs {
		if seg.id == id {
			return seg, nil
		}
	}
	return nil, errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", id)
}

func (s adminService) ListSegments(context.Context, *masterv1.ListSegmentsRequest) (*masterv1.ListSegmentsResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	out := &masterv1.ListSegmentsResponse{}
	for _, seg := range s.f.segs {
		out.Segments = append(out.Segments, s.segmentLocked(seg))
	}
	return out, nil
}

func (s adminService) GetSegment(_ context.Context, r *masterv1.GetSegmentRequest) (*masterv1.GetSegmentResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	seg, err := s.findLocked(r.GetSegmentId())
	if err != nil {
		return nil, err
	}
	return &masterv1.GetSegmentResponse{Segment: s.segmentLocked(seg)}, nil
}

func (s adminService) ListAgents(context.Context, *masterv1.ListAgentsRequest) (*masterv1.ListAgentsResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	out := &masterv1.ListAgentsResponse{}
	for i, a := range s.f.agents {
		out.Agents = append(out.Agents, &masterv1.Agent{
			AgentId: a.ID(), HostId: a.HostID(), DataEndpoint: a.Addr(), TransferEndpoint: a.TransferAddr(), Connected: true,
			LastHeartbeatUnixMs: s.f.cfg.Now().UnixMilli(), SegmentIds: []string{s.f.segs[i].id}, Version: "fake",
		})
	}
	return out, nil
}

// DrainSegment marks the segment DRAINED at once (the fake moves nothing).
func (s adminService) DrainSegment(_ context.Context, r *masterv1.DrainSegmentRequest) (*masterv1.DrainSegmentResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	seg, err := s.findLocked(r.GetSegmentId())
	if err != nil {
		return nil, err
	}
	if seg.lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK && seg.lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "segment %q is %s", seg.id, seg.lifecycle)
	}
	seg.lifecycle = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED
	return &masterv1.DrainSegmentResponse{Segment: s.segmentLocked(seg)}, nil
}

func (s adminService) UndrainSegment(_ context.Context, r *masterv1.UndrainSegmentRequest) (*masterv1.UndrainSegmentResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	seg, err := s.findLocked(r.GetSegmentId())
	if err != nil {
		return nil, err
	}
	switch seg.lifecycle {
	case masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED:
	default:
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "segment %q is %s", seg.id, seg.lifecycle)
	}
	seg.lifecycle = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK
	return &masterv1.UndrainSegmentResponse{Segment: s.segmentLocked(seg)}, nil
}

func (s adminService) SetTenantQuota(_ context.Context, r *masterv1.SetTenantQuotaRequest) (*masterv1.SetTenantQuotaResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	q := s.f.quotaLocked(r.GetTenant())
	q.MaxBytes, q.MaxObjects = r.GetMaxBytes(), r.GetMaxObjects()
	return &masterv1.SetTenantQuotaResponse{Quota: cloneQuota(q)}, nil
}

func (s adminService) GetTenantQuota(_ context.Context, r *masterv1.GetTenantQuotaRequest) (*masterv1.GetTenantQuotaResponse, error) {
	s.f.mu.Lock()
	defer s.f.mu.Unlock()
	return &masterv1.GetTenantQuotaResponse{Quota: cloneQuota(s.f.quotaLocked(r.GetTenant()))}, nil
}

func cloneQuota(q *masterv1.TenantQuota) *masterv1.TenantQuota {
	return &masterv1.TenantQuota{Tenant: q.GetTenant(), MaxBytes: q.GetMaxBytes(), MaxObjects: q.GetMaxObjects(), UsedBytes: q.GetUsedBytes(), UsedObjects: q.GetUsedObjects()}
}

func (s adminService) GetClusterStatus(context.Context, *masterv1.GetClusterStatusRequest) (*masterv1.GetClusterStatusResponse, error) {
	f := s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &masterv1.GetClusterStatusResponse{
		MasterId: "fake-master", Epoch: 1, Leader: true, Revision: f.revision,
		AgentsConnected: uint32(len(f.agents)), Segments: uint32(len(f.segs)), CapacityBytes: uint64(len(f.segs)) * f.cfg.SegmentCapacity,
	}
	for _, o := range f.objects {
		if o.complete {
			out.Objects++
			out.Bytes += o.size
		}
		out.UsedBytes += o.size * uint64(len(o.replicas))
	}
	return out, nil
}

// errClosed answers calls to a stopped agent's transfer listener.
var errClosed = errors.New("testutil: fake agent stopped")
