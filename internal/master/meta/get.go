package meta

import (
	"container/heap"
	"context"
	"encoding/base64"
	"slices"
	"strings"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/protobuf/types/known/durationpb"
)

// GetSpec is one GetReplicaList.
type GetSpec struct {
	Tenant, Key string
	// ClientHost lists replicas on that host first.
	ClientHost string
}

// GetResult is one BatchGetReplicaList outcome.
type GetResult struct {
	Resp *masterv1.GetReplicaListResponse
	Err  error
}

func errNotReady(tenant, key, why string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY,
		"object %q/%q is not readable yet: %s", tenant, key, why)
}

// segCache memoises registry reads for one request. The first few
// segments live inline so a single-object read allocates nothing here.
type segCache struct {
	s    *Store
	n    int
	idx  [4]uint32
	ok   [4]bool
	sv   []cluster.Segment
	arr  [4]cluster.Segment
	more map[uint32]int
	oks  []bool
}

// slot returns the cache slot of seg and whether the registry knows it.
func (c *segCache) slot(seg uint32) (int, bool) {
	for i := 0; i < c.n && i < len(c.idx); i++ {
		if c.idx[i] == seg {
			return i, c.ok[i]
		}
	}
	if i, hit := c.more[seg]; hit {
		return i, c.oks[i-len(c.idx)]
	}
	sv, ok := c.s.reg.Segment(c.s.segs.get(seg).id)
	if c.sv == nil {
		c.sv = c.arr[:0]
	}
	i := c.n
	c.n++
	c.sv = append(c.sv, sv)
	if i < len(c.idx) {
		c.idx[i], c.ok[i] = seg, ok
	} else {
		if c.more == nil {
			c.more = map[uint32]int{}
		}
		c.more[seg] = i
		c.oks = append(c.oks, ok)
	}
	return i, ok
}

func (c *segCache) get(seg uint32) (cluster.Segment, bool) {
	i, ok := c.slot(seg)
	return c.sv[i], ok
}

// readRep is a readable replica and its segment's cache slot.
type readRep struct {
	r    replica
	slot int
}

// readView is what a get copies out of the shard.
type readView struct {
	// tenant and key name the object (its read tokens bind them).
	tenant, key    string
	size, checksum uint64
	group          string
	reps           []readRep
}

// readLocked resolves the readable replicas of o (COMPLETE, on a segment
// that can serve reads) into v, or returns why there are none.
func (s *Store) readLocked(sh *shard, o *object, c *segCache, tenant, key string, v *readView) error {
	return s.readIntoLocked(sh, o, c, tenant, key, v, &v.reps)
}

// readIntoLocked is readLocked appending the replicas to *arena (shared by
// a batch) and pointing v.reps at them.
func (s *Store) readIntoLocked(sh *shard, o *object, c *segCache, tenant, key string, v *readView, arena *[]readRep) error {
	v.tenant, v.key = tenant, key
	start := len(*arena)
	if arena == &v.reps {
		start, *arena = 0, (*arena)[:0]
	}
	processing := false
	for i := range o.replicas {
		r := &o.replicas[i]
		if r.status != stComplete {
			processing = processing || r.status == stProcessing
			continue
		}
		slot, ok := c.slot(r.seg)
		if !ok || !c.sv[slot].CanServeRead() {
			continue
		}
		*arena = append(*arena, readRep{r: *r, slot: slot})
	}
	v.reps = (*arena)[start:len(*arena):len(*arena)]
	if len(v.reps) == 0 {
		if o.hasComplete() {
			return errNotReady(tenant, key, "no replica is on a segment that can serve reads")
		}
		if processing {
			return errNotReady(tenant, key, "only PROCESSING replicas exist")
		}
		return errNotFound(tenant, key)
	}
	v.size, v.checksum, v.group = o.size, o.checksum, sh.groupOf(o)
	return nil
}

// Get is GetReplicaList for one object; see BatchGet.
func (s *Store) Get(ctx context.Context, sp GetSpec) (*masterv1.GetReplicaListResponse, error) {
	if len(sp.ClientHost) > MaxHostLen {
		return nil, errClientHost(len(sp.ClientHost))
	}
	t, shard, err := s.locate(&sp.Tenant, sp.Key)
	if err != nil {
		return nil, err
	}
	c := segCache{s: s}
	var v readView
	shd := &s.shards[shard]
	shd.mu.Lock()
	o := shd.getLocked(t, sp.Key)
	if o == nil {
		err = errNotFound(sp.Tenant, sp.Key)
	} else if err = s.readLocked(shd, o, &c, sp.Tenant, sp.Key, &v); err == nil {
		s.grantLeaseLocked(shd, o)
	}
	shd.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if s.promo.sk != nil && !hasMemory(v.reps) {
		s.countRead(t, sp.Tenant, sp.Key) // promote.go
	}
	return s.readResponse(&v, &c, sp.ClientHost), nil
}

func errClientHost(n int) error {
	return errInvalid("client_host must be at most %d bytes, got %d", MaxHostLen, n)
}

func (s *Store) grantLeaseLocked(sh *shard, o *object) {
	sh.touchLocked(o, s.nowMs())
	o.flags |= flagLeased
}

// BatchGet is GetReplicaList for many objects: one lock per shard, one
// registry read per segment, tokens signed outside the locks.
func (s *Store) BatchGet(ctx context.Context, specs []GetSpec) []GetResult {
	res := make([]GetResult, len(specs))
	views := make([]readView, len(specs))
	items := s.locateAll(len(specs),
		func(i int) (*string, string) { return &specs[i].Tenant, specs[i].Key },
		func(i int, err error) { res[i].Err = err })
	items = slices.DeleteFunc(items, func(it located) bool {
		if n := len(specs[it.i].ClientHost); n > MaxHostLen {
			res[it.i].Err = errClientHost(n)
			return true
		}
		return false
	})
	c := segCache{s: s}
	arena := make([]readRep, 0, len(items))
	// One clock read per call, not per shard: time.Now was 4 % of the
	// master's CPU on batch gets. A lease starts at most the shard-lock
	// waits of this call early.
	now := s.nowMs()
	forShards(items, located.shardOf, func(sh int, group []located) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		for _, it := range group {
			sp := &specs[it.i]
			o := shd.getLocked(it.tenant, sp.Key)
			if o == nil {
				res[it.i].Err = errNotFound(sp.Tenant, sp.Key)
				continue
			}
			if err := s.readIntoLocked(shd, o, &c, sp.Tenant, sp.Key, &views[it.i], &arena); err != nil {
				res[it.i].Err = err
				continue
			}
			shd.touchLocked(o, now)
			o.flags |= flagLeased
		}
		shd.mu.Unlock()
	})
	// One allocation each for the responses and descriptors of the batch.
	// Reads of objects with no memory replica are counted for promotion
	// here, outside the shard locks (promote.go).
	total, ok := 0, 0
	counting := s.promo.sk != nil
	for _, it := range items {
		if res[it.i].Err == nil {
			total += len(views[it.i].reps)
			ok++
			if counting && !hasMemory(views[it.i].reps) {
				s.countRead(it.tenant, specs[it.i].Tenant, specs[it.i].Key)
			}
		}
	}
	resps := make([]masterv1.GetReplicaListResponse, ok)
	descs := make([]masterv1.ReplicaDescriptor, total)
	ttl := s.leaseTTL
	at := s.now()
	exp, signer := at.Add(s.cfg.LeaseTTL), s.keys.Signer(at)
	for _, it := range items {
		if res[it.i].Err != nil {
			continue
		}
		v := &views[it.i]
		resp := &resps[0]
		resps = resps[1:]
		s.fillResponse(resp, v, &c, specs[it.i].ClientHost, descs[:len(v.reps)], ttl, exp, signer)
		descs = descs[len(v.reps):]
		res[it.i].Resp = resp
	}
	return res
}

// readResponse builds a GetReplicaList answer with read tokens valid for
// the lease, replicas on clientHost first.
func (s *Store) readResponse(v *readView, c *segCache, clientHost string) *masterv1.GetReplicaListResponse {
	resp := &masterv1.GetReplicaListResponse{}
	now := s.now()
	s.fillResponse(resp, v, c, clientHost, make([]masterv1.ReplicaDescriptor, len(v.reps)), s.leaseTTL, now.Add(s.cfg.LeaseTTL), s.keys.Signer(now))
	return resp
}

// fillResponse writes v into resp using descs (len(v.reps) long) for the
// descriptors; ttl may be shared between responses (it is only read). The
// read tokens expire at exp and are signed by signer.
func (s *Store) fillResponse(resp *masterv1.GetReplicaListResponse, v *readView, c *segCache, clientHost string,
	descs []masterv1.ReplicaDescriptor, ttl *durationpb.Duration, exp time.Time, signer *token.Signer) {
	expMs := exp.UnixMilli()
	reps := make([]*masterv1.ReplicaDescriptor, 0, len(v.reps))
	for pass := 0; pass < 2; pass++ {
		for i := range v.reps {
			sv := &c.sv[v.reps[i].slot]
			local := clientHost != "" && sv.HostID == clientHost
			if (pass == 0) != local {
				continue
			}
			r := &v.reps[i].r
			d := &descs[len(reps)]
			d.ReplicaId = r.id
			d.SegmentId = sv.ID
			d.AgentId = sv.AgentID
			d.HostId = sv.HostID
			d.DataEndpoint = sv.DataEndpoint
			d.TransferEndpoint = sv.TransferEndpoint
			d.AllocationId = r.allocID
			d.Offset = r.offset
			d.Size = v.size
			d.Medium = masterv1.Medium(r.medium)
			d.Status = masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE
			d.Token = signer.Sign(token.Claims{Mode: token.Read, Tenant: v.tenant, Key: v.key, SegmentID: sv.ID, AllocationID: r.allocID, Expiry: exp})
			d.TokenExpiryUnixMs = expMs
			reps = append(reps, d)
		}
	}
	resp.Size = v.size
	resp.Checksum = v.checksum
	resp.Replicas = reps
	resp.LeaseTtl = ttl
	resp.GroupId = v.group
}

// Exist reports whether an object is readable, granting the read lease when
// it is.
func (s *Store) Exist(ctx context.Context, tenant, key string) (bool, error) {
	r, err := s.BatchExist(ctx, []ObjectRef{{Tenant: tenant, Key: key}})
	if err != nil {
		return false, err
	}
	return r[0], nil
}

// ObjectRef names an object.
type ObjectRef struct{ Tenant, Key string }

// BatchExist answers Exist for many objects. Invalid keys fail the call.
func (s *Store) BatchExist(ctx context.Context, refs []ObjectRef) ([]bool, error) {
	out := make([]bool, len(refs))
	type item struct {
		i, shard int
		tenant   uint32
	}
	items := make([]item, 0, len(refs))
	for i := range refs {
		refs[i].Tenant = NormalizeTenant(refs[i].Tenant)
		if err := ValidateKey(refs[i].Tenant, refs[i].Key); err != nil {
			return nil, err
		}
		t, ok := s.tenants.lookup(refs[i].Tenant)
		if !ok {
			continue
		}
		items = append(items, item{i: i, tenant: t, shard: s.shardIndex(t, refs[i].Key)})
	}
	c := segCache{s: s}
	var v readView
	forShards(items, func(it item) int { return it.shard }, func(sh int, group []item) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		for _, it := range group {
			o := shd.getLocked(it.tenant, refs[it.i].Key)
			if o != nil && s.readLocked(shd, o, &c, "", "", &v) == nil {
				s.grantLeaseLocked(shd, o)
				out[it.i] = true
			}
		}
		shd.mu.Unlock()
	})
	return out, nil
}

// GetSize returns the size of a readable object, without a lease.
func (s *Store) GetSize(ctx context.Context, tenant, key string) (uint64, error) {
	tenant = NormalizeTenant(tenant)
	var size uint64
	err := s.withObject(tenant, key, func(shd *shard, o *object) error {
		c := segCache{s: s}
		var v readView
		if err := s.readLocked(shd, o, &c, tenant, key, &v); err != nil {
			return err
		}
		size = o.size
		return nil
	})
	return size, err
}

// QueryRoute returns every replica of an object, any status, without
// tokens or lease.
func (s *Store) QueryRoute(ctx context.Context, tenant, key string) (*masterv1.QueryRouteResponse, error) {
	tenant = NormalizeTenant(tenant)
	var resp *masterv1.QueryRouteResponse
	err := s.withObject(tenant, key, func(shd *shard, o *object) error {
		c := segCache{s: s}
		resp = &masterv1.QueryRouteResponse{Size: o.size, Checksum: o.checksum, GroupId: shd.groupOf(o)}
		for _, r := range o.replicas {
			e := s.segs.get(r.seg)
			sv, _ := c.get(r.seg)
			resp.Replicas = append(resp.Replicas, &masterv1.ReplicaDescriptor{
				ReplicaId: r.id, SegmentId: e.id, AgentId: sv.AgentID, HostId: sv.HostID,
				DataEndpoint: sv.DataEndpoint, TransferEndpoint: sv.TransferEndpoint, AllocationId: r.allocID, Offset: r.offset, Size: o.size,
				Medium: masterv1.Medium(r.medium), Status: masterv1.ReplicaStatus(r.status),
			})
		}
		return nil
	})
	return resp, err
}

// withObject runs f on one object under its shard lock. tenant must be
// normalized.
func (s *Store) withObject(tenant, key string, f func(*shard, *object) error) error {
	t, shard, err := s.locate(&tenant, key)
	if err != nil {
		return err
	}
	shd := &s.shards[shard]
	shd.mu.Lock()
	defer shd.mu.Unlock()
	o := shd.getLocked(t, key)
	if o == nil {
		return errNotFound(tenant, key)
	}
	return f(shd, o)
}

// ListObjects pages through a tenant's objects in key order. The page token
// is the last key of the previous page, base64url-encoded.
func (s *Store) ListObjects(ctx context.Context, tenant, prefix string, pageSize int, pageToken string) ([]*masterv1.ObjectInfo, string, error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen || len(prefix) > MaxKeyLen {
		return nil, "", errInvalid("tenant must be at most %d bytes and prefix at most %d, got %d and %d", MaxTenantLen, MaxKeyLen, len(tenant), len(prefix))
	}
	if pageSize <= 0 {
		pageSize = 1000
	}
	pageSize = min(pageSize, 10000)
	after, err := DecodePageToken(pageToken)
	if err != nil {
		return nil, "", err
	}
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return nil, "", nil
	}
	now := s.nowMs()
	// Keep only the pageSize+1 smallest keys past the token (a max-heap on
	// key), building an ObjectInfo only for a key that enters it: a page
	// costs one scan of the tenant and O(pageSize) memory, not an
	// ObjectInfo and a sort of every object after the token.
	top := &keyHeap{}
	limit := pageSize + 1
	for i := range s.shards {
		shd := &s.shards[i]
		shd.mu.Lock()
		for key, o := range shd.tenants[t].all() {
			if !strings.HasPrefix(key, prefix) || (pageToken != "" && key <= after) {
				continue
			}
			if top.Len() == limit && key >= (*top)[0].Key {
				continue
			}
			info := &masterv1.ObjectInfo{
				Key: key, Size: o.size, Replicas: uint32(len(o.replicas)), GroupId: shd.groupOf(o),
				SoftPinned: shd.softPinnedLocked(o, now), HardPinned: o.flags&flagHardPin != 0,
				Processing: o.put != nil, Checksum: o.checksum,
			}
			if o.leased(now, s.cfg.LeaseTTL) {
				info.LeaseExpiryUnixMs = o.accessMs + s.cfg.LeaseTTL.Milliseconds()
			}
			var media uint8
			for _, r := range o.replicas {
				if r.status == stComplete && media&(1<<r.medium) == 0 {
					media |= 1 << r.medium
					info.Media = append(info.Media, masterv1.Medium(r.medium))
				}
			}
			if top.Len() == limit {
				(*top)[0] = info
				heap.Fix(top, 0)
			} else {
				heap.Push(top, info)
			}
		}
		shd.mu.Unlock()
	}
	infos := []*masterv1.ObjectInfo(*top)
	slices.SortFunc(infos, func(a, b *masterv1.ObjectInfo) int { return strings.Compare(a.Key, b.Key) })
	next := ""
	if len(infos) > pageSize {
		infos = infos[:pageSize]
		next = EncodePageToken(infos[pageSize-1].Key)
	}
	return infos, next, nil
}

// keyHeap is a max-heap of ObjectInfos by key (container/heap).
type keyHeap []*masterv1.ObjectInfo

func (h keyHeap) Len() int           { return len(h) }
func (h keyHeap) Less(i, j int) bool { return h[i].Key > h[j].Key }
func (h keyHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *keyHeap) Push(x any)        { *h = append(*h, x.(*masterv1.ObjectInfo)) }
func (h *keyHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// EncodePageToken makes a ListObjects page token from the last key listed.
func EncodePageToken(lastKey string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(lastKey))
}

// DecodePageToken parses a ListObjects page token ("" is the first page).
func DecodePageToken(tok string) (string, error) {
	if tok == "" {
		return "", nil
	}
	if len(tok) > base64.RawURLEncoding.EncodedLen(MaxKeyLen) {
		return "", errInvalid("page_token too long")
	}
	b, err := base64.RawURLEncoding.Strict().DecodeString(tok)
	if err != nil || len(b) == 0 || EncodePageToken(string(b)) != tok {
		return "", errInvalid("malformed page_token")
	}
	return string(b), nil
}
