package meta

import (
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// segView is one registry segment with its metadata index.
type segView struct {
	idx uint32
	e   *segEntry
	seg cluster.Segment
}

// free is the room left on the segment: capacity minus the larger of what
// the agent last reported and what the metadata has placed since.
func (v *segView) free() int64 {
	return int64(v.seg.Capacity) - v.e.used(v.seg)
}

// fits says whether need bytes likely fit: enough free bytes and, once the
// agent has reported, a large enough contiguous free extent as of its last
// heartbeat — unless the metadata freed space there since, which can only
// have grown the extents. The agent's Reserve is the final word.
func (v *segView) fits(need int64) bool {
	if v.free() < need {
		return false
	}
	if v.e.freedMs.Load() >= v.seg.LastHeartbeatMs {
		return true
	}
	if v.seg.LargestFreeExtent > 0 || v.seg.Used > 0 {
		return int64(v.seg.LargestFreeExtent) >= need
	}
	return true
}

// placer picks segments for new replicas from one registry snapshot.
type placer struct {
	// alloc lists the segments that can allocate, per medium.
	alloc map[masterv1.Medium][]segView
}

// exclusions are segments and agents that failed during one request and
// are not tried again by its retry.
type exclusions struct {
	segs   map[uint32]bool
	agents map[string]bool
}

func newExclusions() *exclusions {
	return &exclusions{segs: map[uint32]bool{}, agents: map[string]bool{}}
}

// newPlacer snapshots the registry, skipping excluded segments and agents.
func (s *Store) newPlacer(ex *exclusions) *placer {
	return s.newPlacerFrom(s.reg.Segments(), ex)
}

// newPlacerFrom is newPlacer over a registry snapshot the caller took.
func (s *Store) newPlacerFrom(segs []cluster.Segment, ex *exclusions) *placer {
	p := &placer{alloc: make(map[masterv1.Medium][]segView)}
	for _, sg := range segs {
		if !sg.CanAllocate() || ex.agents[sg.AgentID] {
			continue
		}
		idx := s.segs.intern(sg.ID)
		if ex.segs[idx] {
			continue
		}
		p.alloc[sg.Medium] = append(p.alloc[sg.Medium], segView{idx: idx, e: s.segs.get(idx), seg: sg})
	}
	return p
}

// errNoSpace is NO_AVAILABLE_HANDLE; space reports whether eviction could
// help (enough segments large enough exist, they are just full).
func errNoSpace(space bool, format string, args ...any) *placeErr {
	return &placeErr{err: rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, format, args...), space: space}
}

type placeErr struct {
	err   error
	space bool
}

// pick chooses n distinct segments of medium with room for size: the hole
// eviction just made (if any), preferred segments (in order), then
// segments on new hosts before reused hosts, the local host before others,
// most free space first. avoid lists segments that must not be chosen
// (already holding a replica).
func (p *placer) pick(n int, medium masterv1.Medium, size uint64, hole string, preferred []string, localHost string, avoid []uint32) ([]*segView, *placeErr) {
	all := p.alloc[medium]
	eligible, large := len(all), 0
	for i := range all {
		if slices.Contains(avoid, all[i].idx) {
			eligible--
		} else if all[i].seg.Capacity >= size {
			large++
		}
	}
	if eligible < n {
		return nil, errNoSpace(false, "%d replicas requested but only %d %s segments can allocate", n, eligible, medium)
	}
	if large < n {
		// Not even empty segments would hold it: evicting cannot help.
		return nil, errNoSpace(false, "%d replicas of %d bytes requested but only %d %s segments are that large", n, size, large, medium)
	}
	chosen := make([]*segView, 0, n)
	taken := func(v *segView) bool {
		for _, c := range chosen {
			if c.idx == v.idx {
				return true
			}
		}
		for _, a := range avoid {
			if a == v.idx {
				return true
			}
		}
		return false
	}
	hostUsed := func(h string) bool {
		for _, c := range chosen {
			if c.seg.HostID == h {
				return true
			}
		}
		return false
	}
	need := int64(size) // ≤ the largest capacity, checked above
	if hole != "" {
		for i := range all {
			// The metadata just made this hole itself: trust it over the
			// agent's (older) extent report.
			if v := &all[i]; v.seg.ID == hole && !taken(v) && v.free() >= need {
				chosen = append(chosen, v)
				break
			}
		}
	}
	for _, id := range preferred {
		if len(chosen) == n {
			break
		}
		for i := range all {
			v := &all[i]
			if v.seg.ID == id && !taken(v) && v.fits(need) {
				chosen = append(chosen, v)
				break
			}
		}
	}
	for len(chosen) < n {
		var best *segView
		var bestNewHost, bestLocal bool
		var bestFree int64
		for i := range all {
			v := &all[i]
			if taken(v) {
				continue
			}
			if !v.fits(need) {
				continue
			}
			f := v.free()
			newHost := !hostUsed(v.seg.HostID)
			local := localHost != "" && v.seg.HostID == localHost
			better := best == nil ||
				(newHost && !bestNewHost) ||
				(newHost == bestNewHost && local && !bestLocal) ||
				(newHost == bestNewHost && local == bestLocal && f > bestFree)
			if better {
				best, bestNewHost, bestLocal, bestFree = v, newHost, local, f
			}
		}
		if best == nil {
			return nil, errNoSpace(true, "no %s segment has %d free bytes for replica %d of %d", medium, size, len(chosen)+1, n)
		}
		chosen = append(chosen, best)
	}
	return chosen, nil
}
