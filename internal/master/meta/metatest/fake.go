// Package metatest holds hand-written fakes of the agent side
// (cluster.Registry and cluster.Agents) for tests and benchmarks of the
// object metadata. The fake agents keep an allocation table per segment and
// flag leaks and double releases, so tests can check that the metadata
// neither loses nor double-frees space.
package metatest

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Registry is a fake segment registry.
type Registry struct {
	mu    sync.Mutex
	segs  map[string]cluster.Segment
	order []string
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{segs: map[string]cluster.Segment{}} }

// Add registers (or replaces) a segment; zero Lifecycle/Health mean OK and
// HEALTHY, zero Medium means memory.
func (r *Registry) Add(s cluster.Segment) {
	if s.Lifecycle == 0 {
		s.Lifecycle = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK
	}
	if s.Health == 0 {
		s.Health = masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY
	}
	if s.Medium == 0 {
		s.Medium = masterv1.Medium_MEDIUM_MEMORY
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.segs[s.ID]; !ok {
		r.order = append(r.order, s.ID)
	}
	r.segs[s.ID] = s
}

// SetHealth changes a segment's health overlay.
func (r *Registry) SetHealth(id string, h masterv1.SegmentHealth) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.segs[id]
	s.Health = h
	r.segs[id] = s
}

// Segments implements cluster.Registry.
func (r *Registry) Segments() []cluster.Segment {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]cluster.Segment, 0, len(r.order))
	for _, id := range r.order {
		if s := r.segs[id]; s.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
			out = append(out, s)
		}
	}
	return out
}

// Segment implements cluster.Registry.
func (r *Registry) Segment(id string) (cluster.Segment, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.segs[id]
	return s, ok
}

// SetLifecycle implements cluster.Registry (any forward move is legal).
func (r *Registry) SetLifecycle(id string, lc masterv1.SegmentLifecycle) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.segs[id]
	if !ok {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %s", id)
	}
	undrain := lc == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK &&
		(s.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING || s.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED)
	if lc < s.Lifecycle && !undrain { // forward only, but for UndrainSegment's way back
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "segment %s: %v -> %v", id, s.Lifecycle, lc)
	}
	s.Lifecycle = lc
	r.segs[id] = s
	return nil
}

// Ref names an allocation.
type Ref struct {
	Segment string
	ID      uint64
}

// Alloc is one allocation at a fake agent.
type Alloc struct {
	Ref
	Offset     uint64
	Size       uint64
	Sealed     bool
	Checksum   uint64
	Tenant     string
	Key        string
	ReplicaID  uint32
	Group      string
	HardPin    bool
	SoftPinMs  int64
	SealedAtMs int64
	// Blank: reserved with no identity (ReserveItem.blank) and not bound
	// by a write yet (Bind).
	Blank bool
}

// Agents is a fake of every agent at once: it answers Reserve from each
// segment's capacity, seals, releases and copies, and records misuse.
type Agents struct {
	Reg *Registry
	// NowMs stamps seals (default 0).
	NowMs func() int64
	// Extents makes Reserve allocate real offsets first-fit (64-byte
	// aligned), so fragmentation happens as at a real agent. Set before use.
	Extents bool
	// FailCopy, when set, is asked about every Copy item (under the fake's
	// lock, so it must not call the fake); a non-nil error fails the item
	// with it. Set before use.
	FailCopy func(*masterv1.CopyItem) error
	// FailSeal, when set, is asked about every Seal item as FailCopy is;
	// a non-nil error fails the item with it and leaves it unsealed.
	FailSeal func(*masterv1.SealItem) error
	// FailRelease, when set, is asked about every Release item as
	// FailCopy is; a non-nil error keeps the allocation, and Release
	// answers a *cluster.ReleaseFailed naming the items kept.
	FailRelease func(*masterv1.AllocationRef) error
	// BeforeRelease, when set, runs at the start of every Release, before
	// the fake frees anything (outside its lock: it may call Report, as a
	// heartbeat the agent sent before it applied the release). Set before
	// use.
	BeforeRelease func()
	// BeforeCopy, when set, runs at the start of every Copy, outside the
	// fake's lock (it may call Live). Set before use.
	BeforeCopy func()

	mu       sync.Mutex
	next     uint64
	live     map[Ref]*Alloc
	used     map[string]uint64
	released map[Ref]bool
	problems []string
	down     map[string]bool
	badSum   map[string]bool // keys whose seal fails with CHECKSUM_MISMATCH
	reserveN int
	sealN    int
	releaseN int
	copyN    int
	gone     map[string]bool // unmounted segments
	ext      map[string][]span
}

// span is an allocated extent [off, end).
type span struct{ off, end uint64 }

const align = 64

// fitLocked finds the first gap of size bytes on seg (first fit).
func (a *Agents) fitLocked(seg string, capacity, size uint64) (uint64, bool) {
	size = (size + align - 1) / align * align
	var prev uint64
	for _, sp := range a.ext[seg] {
		if sp.off-prev >= size {
			return prev, true
		}
		prev = sp.end
	}
	if capacity-prev >= size {
		return prev, true
	}
	return 0, false
}

func (a *Agents) addSpanLocked(seg string, off, size uint64) {
	size = (size + align - 1) / align * align
	xs := a.ext[seg]
	i, _ := slices.BinarySearchFunc(xs, off, func(x span, o uint64) int { return cmp.Compare(x.off, o) })
	a.ext[seg] = slices.Insert(xs, i, span{off, off + size})
}

func (a *Agents) removeSpanLocked(seg string, off uint64) {
	xs := a.ext[seg]
	if i, ok := slices.BinarySearchFunc(xs, off, func(x span, o uint64) int { return cmp.Compare(x.off, o) }); ok {
		a.ext[seg] = slices.Delete(xs, i, i+1)
	}
}

// Report copies each segment's use and largest free extent into the
// registry, as a heartbeat does.
func (a *Agents) Report() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, sg := range a.Reg.Segments() {
		sg.Used = a.used[sg.ID]
		if a.NowMs != nil {
			sg.LastHeartbeatMs = a.NowMs()
		}
		var largest, prev uint64
		for _, sp := range a.ext[sg.ID] {
			largest = max(largest, sp.off-prev)
			prev = sp.end
		}
		if a.Extents {
			sg.LargestFreeExtent = max(largest, sg.Capacity-prev)
		} else {
			sg.LargestFreeExtent = sg.Capacity - sg.Used
		}
		a.Reg.Add(sg)
	}
}

// NewAgents returns fake agents over reg.
func NewAgents(reg *Registry) *Agents {
	return &Agents{Reg: reg, live: map[Ref]*Alloc{}, used: map[string]uint64{}, released: map[Ref]bool{},
		down: map[string]bool{}, badSum: map[string]bool{}, gone: map[string]bool{}, ext: map[string][]span{}}
}

// SetDown makes every call to agent fail with AGENT_UNAVAILABLE.
func (a *Agents) SetDown(agent string, down bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.down[agent] = down
}

// BadChecksum makes seals of key fail with CHECKSUM_MISMATCH.
func (a *Agents) BadChecksum(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.badSum[key] = true
}

func (a *Agents) check(agent string) error {
	if a.down[agent] {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent %s is down", agent)
	}
	return nil
}

// Reserve implements cluster.Agents.
func (a *Agents) Reserve(ctx context.Context, agent string, items []*masterv1.ReserveItem) ([]*masterv1.ReserveItemResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check(agent); err != nil {
		return nil, err
	}
	a.reserveN++
	out := make([]*masterv1.ReserveItemResult, len(items))
	for i, it := range items {
		seg, ok := a.Reg.Segment(it.GetSegmentId())
		switch {
		case !ok || seg.AgentID != agent || a.gone[seg.ID]:
			out[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %s at %s", it.GetSegmentId(), agent))}
		case a.used[seg.ID]+it.GetSize() > seg.Capacity:
			out[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, "segment %s full", seg.ID))}
		default:
			off := a.next * 64
			if a.Extents {
				o, ok := a.fitLocked(seg.ID, seg.Capacity, it.GetSize())
				if !ok {
					out[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, "segment %s: no free extent of %d bytes", seg.ID, it.GetSize()))}
					continue
				}
				off = o
				a.addSpanLocked(seg.ID, off, it.GetSize())
			}
			a.next++
			r := Ref{seg.ID, a.next}
			if it.GetBlank() {
				a.live[r] = &Alloc{Ref: r, Offset: off, Size: it.GetSize(), Blank: true}
			} else {
				a.live[r] = &Alloc{Ref: r, Offset: off, Size: it.GetSize(), Tenant: it.GetTenant(), Key: it.GetKey(), ReplicaID: it.GetReplicaId(),
					Group: it.GetGroupId(), HardPin: it.GetHardPin(), SoftPinMs: it.GetSoftPinUntilUnixMs()}
			}
			a.used[seg.ID] += it.GetSize()
			out[i] = &masterv1.ReserveItemResult{Status: &masterv1.ItemStatus{}, AllocationId: a.next, Offset: off}
		}
	}
	return out, nil
}

// Seal implements cluster.Agents.
func (a *Agents) Seal(ctx context.Context, agent string, items []*masterv1.SealItem) ([]*masterv1.ItemStatus, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check(agent); err != nil {
		return nil, err
	}
	a.sealN++
	out := make([]*masterv1.ItemStatus, len(items))
	for i, it := range items {
		al := a.live[Ref{it.GetSegmentId(), it.GetAllocationId()}]
		var failed error
		if a.FailSeal != nil {
			failed = a.FailSeal(it)
		}
		switch {
		case failed != nil:
			out[i] = rpcerr.Item(failed)
		case al == nil:
			out[i] = rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND, "no allocation %d", it.GetAllocationId()))
		case al.Blank:
			out[i] = rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE, "allocation %d is a blank reservation no write has bound", it.GetAllocationId()))
		case a.badSum[al.Key]:
			out[i] = rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "checksum mismatch"))
		case al.Sealed && al.Checksum != it.GetChecksum():
			out[i] = rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE, "sealed with another checksum"))
		default:
			al.Sealed, al.Checksum, al.SoftPinMs = true, it.GetChecksum(), it.GetSoftPinUntilUnixMs()
			if a.NowMs != nil {
				al.SealedAtMs = a.NowMs()
			}
			out[i] = &masterv1.ItemStatus{}
		}
	}
	return out, nil
}

// Release implements cluster.Agents. Releasing an allocation twice, or one
// that never existed, is recorded as a problem.
func (a *Agents) Release(ctx context.Context, agent string, items []*masterv1.AllocationRef) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	if a.BeforeRelease != nil {
		a.BeforeRelease()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check(agent); err != nil {
		return err
	}
	a.releaseN++
	var failed *cluster.ReleaseFailed
	defer func() {
		if failed != nil {
			err = failed
		}
	}()
	for _, it := range items {
		if a.FailRelease != nil {
			if ferr := a.FailRelease(it); ferr != nil {
				if failed == nil {
					failed = &cluster.ReleaseFailed{Err: ferr}
				}
				failed.Refs = append(failed.Refs, it)
				continue
			}
		}
		r := Ref{it.GetSegmentId(), it.GetAllocationId()}
		al := a.live[r]
		if al == nil {
			if a.released[r] {
				a.problems = append(a.problems, fmt.Sprintf("double release of %v", r))
			} else if !a.gone[r.Segment] {
				a.problems = append(a.problems, fmt.Sprintf("release of unknown allocation %v", r))
			}
			continue
		}
		delete(a.live, r)
		a.used[r.Segment] -= al.Size
		a.released[r] = true
		if a.Extents {
			a.removeSpanLocked(r.Segment, al.Offset)
		}
	}
	return nil
}

// Copy implements cluster.Agents: each target receives its source's bytes
// (its checksum); an item whose allocations are not a sealed source and a
// reserved target fails with ALLOCATION_STATE, alone. FailCopy, when set,
// fails the items it names with its error.
func (a *Agents) Copy(ctx context.Context, agent string, items []*masterv1.CopyItem) ([]*masterv1.ItemStatus, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if a.BeforeCopy != nil {
		a.BeforeCopy()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check(agent); err != nil {
		return nil, err
	}
	a.copyN++
	out := make([]*masterv1.ItemStatus, len(items))
	for i, it := range items {
		if a.FailCopy != nil {
			if err := a.FailCopy(it); err != nil {
				out[i] = rpcerr.Item(err)
				continue
			}
		}
		src := a.live[Ref{it.GetSource().GetSegmentId(), it.GetSource().GetAllocationId()}]
		dst := a.live[Ref{it.GetTarget().GetSegmentId(), it.GetTarget().GetAllocationId()}]
		if src == nil || dst == nil || !src.Sealed || dst.Sealed {
			out[i] = rpcerr.Item(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE, "copy %v -> %v: bad allocations", it.GetSource(), it.GetTarget()))
			continue
		}
		out[i] = &masterv1.ItemStatus{}
	}
	return out, nil
}

// CopyCalls is the number of Copy calls that reached a connected agent.
func (a *Agents) CopyCalls() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.copyN
}

// Unmount forgets a segment's allocations, as an agent does when the
// segment goes away (no release is expected for them).
func (a *Agents) Unmount(segment string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.gone[segment] = true
	delete(a.ext, segment)
	for r := range a.live {
		if r.Segment == segment {
			delete(a.live, r)
		}
	}
	a.used[segment] = 0
}

// Lose drops an allocation as an agent does when a read finds its bytes
// bad (it journals the release itself, then reports it lost): a Release
// of it afterwards is recorded as a double release. It returns the
// allocation as the agent reports it (AllocationsLost), or nil when it
// holds none by that reference.
func (a *Agents) Lose(r Ref) *masterv1.Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	al := a.live[r]
	if al == nil {
		return nil
	}
	delete(a.live, r)
	a.used[r.Segment] -= al.Size
	a.released[r] = true
	if a.Extents {
		a.removeSpanLocked(r.Segment, al.Offset)
	}
	return &masterv1.Allocation{SegmentId: r.Segment, AllocationId: r.ID, Tenant: al.Tenant, Key: al.Key, ReplicaId: al.ReplicaID}
}

// Bind records an object in a blank reservation, as an agent does from
// the write token when a client's write opens it; binding a bound one to
// another object fails, to the same one is a no-op.
func (a *Agents) Bind(seg string, id uint64, tenant, key string, replica uint32, group string, hardPin bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	al := a.live[Ref{seg, id}]
	switch {
	case al == nil:
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND, "no allocation %d", id)
	case al.Blank:
		al.Blank, al.Tenant, al.Key, al.ReplicaID, al.Group, al.HardPin = false, tenant, key, replica, group, hardPin
	case al.Tenant != tenant || al.Key != key:
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN, "allocation %d holds %q/%q", id, al.Tenant, al.Key)
	}
	return nil
}

// Live returns a copy of every live allocation.
func (a *Agents) Live() map[Ref]Alloc {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[Ref]Alloc, len(a.live))
	for r, al := range a.live {
		out[r] = *al
	}
	return out
}

// Used returns the bytes allocated on a segment.
func (a *Agents) Used(segment string) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.used[segment]
}

// Problems returns the recorded misuse (double or unknown releases).
func (a *Agents) Problems() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.problems)
}

// Calls returns how many Reserve, Seal and Release calls were made.
func (a *Agents) Calls() (reserve, seal, release int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.reserveN, a.sealN, a.releaseN
}

// Table returns agent's allocation table as it would send it in Register.
func (a *Agents) Table(agent string) []*masterv1.Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []*masterv1.Allocation
	for _, al := range a.live {
		seg, ok := a.Reg.Segment(al.Segment)
		if !ok || seg.AgentID != agent {
			continue
		}
		st := masterv1.AllocationState_ALLOCATION_STATE_RESERVED
		if al.Sealed {
			st = masterv1.AllocationState_ALLOCATION_STATE_SEALED
		}
		out = append(out, &masterv1.Allocation{
			SegmentId: al.Segment, AllocationId: al.ID, Offset: al.Offset, Size: al.Size, State: st,
			Tenant: al.Tenant, Key: al.Key, ReplicaId: al.ReplicaID, Checksum: al.Checksum,
			GroupId: al.Group, HardPin: al.HardPin, SoftPinUntilUnixMs: al.SoftPinMs, SealedUnixMs: al.SealedAtMs, Blank: al.Blank,
		})
	}
	slices.SortFunc(out, func(x, y *masterv1.Allocation) int {
		if x.SegmentId != y.SegmentId {
			if x.SegmentId < y.SegmentId {
				return -1
			}
			return 1
		}
		return int(x.AllocationId) - int(y.AllocationId)
	})
	return out
}

// Cluster is a registry plus agents: hosts × segments per host, each
// segment of capacity bytes, all memory.
type Cluster struct {
	Reg    *Registry
	Agents *Agents
}

// NewCluster builds hosts agents ("agent-h", host "host-h") with segs
// memory segments each ("seg-h-s").
func NewCluster(hosts, segs int, capacity uint64) *Cluster {
	reg := NewRegistry()
	for h := range hosts {
		for s := range segs {
			reg.Add(cluster.Segment{
				ID: fmt.Sprintf("seg-%d-%d", h, s), AgentID: fmt.Sprintf("agent-%d", h), HostID: fmt.Sprintf("host-%d", h),
				DataEndpoint: fmt.Sprintf("10.0.0.%d:50052", h+1), Capacity: capacity,
			})
		}
	}
	return &Cluster{Reg: reg, Agents: NewAgents(reg)}
}

// NullAgents answers every command with success and keeps nothing, for
// benchmarks that must measure the metadata's own memory and CPU.
type NullAgents struct {
	mu   sync.Mutex
	next uint64
}

// Reserve implements cluster.Agents.
func (n *NullAgents) Reserve(ctx context.Context, agent string, items []*masterv1.ReserveItem) ([]*masterv1.ReserveItemResult, error) {
	n.mu.Lock()
	first := n.next + 1
	n.next += uint64(len(items))
	n.mu.Unlock()
	out := make([]*masterv1.ReserveItemResult, len(items))
	ok := &masterv1.ItemStatus{}
	for i := range items {
		out[i] = &masterv1.ReserveItemResult{Status: ok, AllocationId: first + uint64(i)}
	}
	return out, nil
}

// Seal implements cluster.Agents.
func (n *NullAgents) Seal(ctx context.Context, agent string, items []*masterv1.SealItem) ([]*masterv1.ItemStatus, error) {
	out := make([]*masterv1.ItemStatus, len(items))
	ok := &masterv1.ItemStatus{}
	for i := range out {
		out[i] = ok
	}
	return out, nil
}

// Release implements cluster.Agents.
func (n *NullAgents) Release(ctx context.Context, agent string, items []*masterv1.AllocationRef) error {
	return nil
}

// Copy implements cluster.Agents: every item succeeds.
func (n *NullAgents) Copy(ctx context.Context, agent string, items []*masterv1.CopyItem) ([]*masterv1.ItemStatus, error) {
	out := make([]*masterv1.ItemStatus, len(items))
	ok := &masterv1.ItemStatus{}
	for i := range out {
		out[i] = ok
	}
	return out, nil
}
