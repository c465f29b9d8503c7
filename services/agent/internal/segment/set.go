package segment

import (
	"errors"
	"os"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/rpcerr"
	"google.golang.org/grpc/codes"
)

// Set is the agent's mounted segments, looked up by id. It applies the
// master's batched commands, each item to its own segment.
type Set struct {
	segs []*Segment
	byID map[string]*Segment
}

// NewSet groups segments; ids must be unique.
func NewSet(segs ...*Segment) *Set {
	s := &Set{segs: segs, byID: make(map[string]*Segment, len(segs))}
	for _, sg := range segs {
		s.byID[sg.ID()] = sg
	}
	return s
}

// Get returns the segment with id.
func (s *Set) Get(id string) (*Segment, bool) {
	sg, ok := s.byID[id]
	return sg, ok
}

// All returns the segments in mount order.
func (s *Set) All() []*Segment { return s.segs }

// Infos describes every segment with its current usage.
func (s *Set) Infos() []*masterv1.SegmentInfo {
	out := make([]*masterv1.SegmentInfo, len(s.segs))
	for i, sg := range s.segs {
		out[i] = sg.Info()
	}
	return out
}

// Table returns the full allocation table of every segment.
func (s *Set) Table() []*masterv1.Allocation {
	var out []*masterv1.Allocation
	for _, sg := range s.segs {
		out = append(out, sg.Table()...)
	}
	return out
}

func errNoSegment(id string) error {
	return rpcerr.New(codes.NotFound, masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", id)
}

// Reserve applies a batch of reservations; results are in items order.
func (s *Set) Reserve(items []*masterv1.ReserveItem, now time.Time) []*masterv1.ReserveItemResult {
	out := make([]*masterv1.ReserveItemResult, len(items))
	for i, it := range items {
		sg, ok := s.Get(it.GetSegmentId())
		if !ok {
			out[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(errNoSegment(it.GetSegmentId()))}
			continue
		}
		a, err := sg.Reserve(it, now)
		if err != nil {
			out[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(err)}
			continue
		}
		out[i] = &masterv1.ReserveItemResult{Status: rpcerr.Item(nil), AllocationId: a.GetAllocationId(), Offset: a.GetOffset()}
	}
	return out
}

// Release applies a batch of releases (unknown ids and unknown segments are
// no-ops) and makes journaled releases durable once per segment.
func (s *Set) Release(refs []*masterv1.AllocationRef) []*masterv1.ItemStatus {
	out := make([]*masterv1.ItemStatus, len(refs))
	touched := map[*Segment][]int{}
	for i, r := range refs {
		sg, ok := s.Get(r.GetSegmentId())
		if !ok {
			out[i] = rpcerr.Item(nil)
			continue
		}
		out[i] = rpcerr.Item(sg.Release(r.GetAllocationId()))
		touched[sg] = append(touched[sg], i)
	}
	for sg, idx := range touched {
		if err := sg.SyncJournal(); err != nil && !errors.Is(err, os.ErrClosed) {
			st := rpcerr.Item(rpcerr.New(codes.Internal, masterv1.ErrorReason_ERROR_REASON_INTERNAL, "sync journal of %s: %v", sg.ID(), err))
			for _, i := range idx {
				if out[i].GetCode() == 0 {
					out[i] = st
				}
			}
		}
	}
	return out
}

// Seal applies a batch of seals, grouped per segment so each disk segment
// syncs once; results are in items order.
func (s *Set) Seal(items []*masterv1.SealItem, now time.Time) []*masterv1.ItemStatus {
	out := make([]*masterv1.ItemStatus, len(items))
	type group struct {
		idx  []int
		args []SealArg
	}
	groups := map[*Segment]*group{}
	var order []*Segment
	for i, it := range items {
		sg, ok := s.Get(it.GetSegmentId())
		if !ok {
			out[i] = rpcerr.Item(errNoSegment(it.GetSegmentId()))
			continue
		}
		g := groups[sg]
		if g == nil {
			g = &group{}
			groups[sg] = g
			order = append(order, sg)
		}
		g.idx = append(g.idx, i)
		g.args = append(g.args, SealArg{ID: it.GetAllocationId(), Checksum: it.GetChecksum(), SoftPinUntilMs: it.GetSoftPinUntilUnixMs()})
	}
	for _, sg := range order {
		g := groups[sg]
		for k, err := range sg.Seal(g.args, now) {
			out[g.idx[k]] = rpcerr.Item(err)
		}
	}
	return out
}

// ReleaseRefs releases allocations named by the master (Settings); errors
// are ignored because a release of an unknown id is a no-op.
func (s *Set) ReleaseRefs(refs []*masterv1.AllocationRef) {
	_ = s.Release(refs)
}

// ExpireReserved releases RESERVED allocations older than grace in every
// segment and returns how many it released.
func (s *Set) ExpireReserved(now time.Time, grace time.Duration) int {
	n := 0
	for _, sg := range s.segs {
		n += len(sg.ExpireReserved(now.Add(-grace)))
	}
	return n
}

// Close unmounts every segment.
func (s *Set) Close() error {
	var errs []error
	for _, sg := range s.segs {
		errs = append(errs, sg.Close())
	}
	return errors.Join(errs...)
}
