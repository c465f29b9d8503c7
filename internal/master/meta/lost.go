package meta

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
)

// Lost removes the replicas that point at allocations agentID dropped
// while serving (AllocationsLost: bytes that no longer match their sealed
// checksum, or cannot be read), whose segments are segments (see
// cluster.Metadata). It returns the number of replicas removed, counted
// in crescent_master_replicas_lost_total.
func (s *Store) Lost(_ context.Context, agentID string, segments []cluster.Segment, allocs []*masterv1.Allocation) int {
	segSet := make(map[uint32]cluster.Segment, len(segments))
	for _, sg := range segments {
		// A segment not interned never held a replica here.
		if idx, ok := s.segs.lookup(sg.ID); ok {
			segSet[idx] = sg
		}
	}
	if len(segSet) == 0 {
		return 0
	}
	n := s.dropAllocs(segSet, allocs)
	s.lost.Add(float64(n))
	return n
}

// dropAllocs removes the non-pending replicas that point at allocs, which
// their agent no longer holds (a standby's followed agent released them,
// or the leader's agent dropped them as lost), through the mutation path:
// `removed` is recorded where a medium stops being readable, the tenant is
// refunded, and an object left without replicas is erased (a put in
// progress on it too: its PutEnd answers PUT_EXPIRED). Nothing is sent to
// the agent, and a release still owed for one of them is forgotten: the
// agent has already let it go. Allocations on segments not in segs, and
// allocations no replica points at (an upsert replaced the object
// meanwhile, a removal came first), change nothing. It returns the number
// of replicas removed.
func (s *Store) dropAllocs(segs map[uint32]cluster.Segment, allocs []*masterv1.Allocation) int {
	type item struct {
		a      *masterv1.Allocation
		seg    uint32
		tenant uint32
		shard  int
	}
	items := make([]item, 0, len(allocs))
	for _, a := range allocs {
		idx, ok := s.segs.lookup(a.GetSegmentId())
		if _, mine := segs[idx]; !ok || !mine {
			continue
		}
		s.takeOwed(allocKey{idx, a.GetAllocationId()})
		t, ok := s.tenants.lookup(NormalizeTenant(a.GetTenant()))
		if !ok {
			continue
		}
		items = append(items, item{a: a, seg: idx, tenant: t, shard: s.shardIndex(t, a.GetKey())})
	}
	removed := 0
	forShards(items, func(it item) int { return it.shard }, func(sh int, its []item) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, nil)
		for _, it := range its {
			o := shd.getLocked(it.tenant, it.a.GetKey())
			if o == nil {
				continue
			}
			i := o.allocIndex(it.seg, it.a.GetAllocationId())
			if i < 0 {
				continue
			}
			m.remove(o, i, false)
			removed++
			m.dropGone(o)
		}
		m.commit()
		shd.mu.Unlock()
	})
	return removed
}
