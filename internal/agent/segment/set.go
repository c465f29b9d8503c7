package segment

import (
	"errors"
	"fmt"
	"os"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
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

// SetFeed makes every segment record its changes in f (Segment.SetFeed).
func (s *Set) SetFeed(f *Feed) {
	for _, sg := range s.segs {
		sg.SetFeed(f)
	}
}

// Get returns the segment with id.
func (s *Set) Get(id string) (*Segment, bool) {
	sg, ok := s.byID[id]
	return sg, ok
}

// SegmentID returns the id of the mounted segment whose id is b, without
// allocating: decoders take it instead of copying the id of every item.
func (s *Set) SegmentID(b []byte) (string, bool) {
	if sg, ok := s.byID[string(b)]; ok {
		return sg.id, true
	}
	return "", false
}

// getNear is Get for the items of a batch, which nearly always name one
// segment: last, the previous item's segment, is tried first.
func (s *Set) getNear(id string, last *Segment) (*Segment, bool) {
	if last != nil && last.id == id {
		return last, true
	}
	return s.Get(id)
}

// statuses returns n OK item statuses for a batch answer: every one points
// to the same empty ItemStatus (OK on the wire, as rpcerr.Item(nil)), which
// nothing may modify; a failed item gets a status of its own (setStatus).
// The answer is only marshalled, and one allocation per item was a tenth of
// the agent's allocated bytes on a put of 4 KiB objects.
func statuses(n int) []*masterv1.ItemStatus {
	out := make([]*masterv1.ItemStatus, n)
	ok := &masterv1.ItemStatus{}
	for i := range out {
		out[i] = ok
	}
	return out
}

// setStatus sets *st to err's status (rpcerr.Item) when err is not nil.
func setStatus(st **masterv1.ItemStatus, err error) {
	if err != nil {
		*st = rpcerr.Item(err)
	}
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

// Table returns a copy of every segment's allocation table, for tests and
// diagnostics: a registration reads the tables through Segment.View.
func (s *Set) Table() []*masterv1.Allocation {
	var out []*masterv1.Allocation
	for _, sg := range s.segs {
		out = append(out, sg.Table()...)
	}
	return out
}

func errNoSegment(id string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", id)
}

// Reserve applies a batch of reservations; results are in items order.
// The results are allocated as one array for the batch, OK statuses shared
// (statuses).
func (s *Set) Reserve(items []*masterv1.ReserveItem, now time.Time) []*masterv1.ReserveItemResult {
	return s.ReserveUnder(items, now, 0)
}

// ReserveUnder is Reserve of a Reserve command from master epoch epoch,
// which the allocations remember for their seal receipts.
func (s *Set) ReserveUnder(items []*masterv1.ReserveItem, now time.Time, epoch uint64) []*masterv1.ReserveItemResult {
	out := make([]*masterv1.ReserveItemResult, len(items))
	res := make([]masterv1.ReserveItemResult, len(items))
	sts := statuses(len(items))
	nowMs := now.UnixMilli()
	var sg *Segment
	for i, it := range items {
		r := &res[i]
		r.Status, out[i] = sts[i], r
		var ok bool
		if sg, ok = s.getNear(it.GetSegmentId(), sg); !ok {
			setStatus(&r.Status, errNoSegment(it.GetSegmentId()))
			continue
		}
		sg.mu.Lock()
		e, err := sg.reserveLocked(it, nowMs, epoch)
		if err == nil {
			r.AllocationId, r.Offset = e.id, e.offset
		}
		sg.mu.Unlock()
		setStatus(&r.Status, err)
	}
	return out
}

// Release applies a batch of releases (unknown ids and unknown segments are
// no-ops) and makes journaled releases durable once per segment.
func (s *Set) Release(refs []*masterv1.AllocationRef) []*masterv1.ItemStatus {
	out := statuses(len(refs))
	touched := map[*Segment][]int{}
	var sg *Segment
	for i, r := range refs {
		var ok bool
		if sg, ok = s.getNear(r.GetSegmentId(), sg); !ok {
			continue
		}
		setStatus(&out[i], sg.Release(r.GetAllocationId()))
		if sg.jrn != nil {
			touched[sg] = append(touched[sg], i)
		}
	}
	for sg, idx := range touched {
		if err := sg.SyncJournal(); err != nil && !errors.Is(err, os.ErrClosed) {
			st := rpcerr.Item(fmt.Errorf("sync journal of %s: %w", sg.ID(), err))
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
	out := statuses(len(items))
	type group struct {
		idx  []int
		args []SealArg
	}
	groups := map[*Segment]*group{}
	var order []*Segment
	var sg *Segment
	for i, it := range items {
		var ok bool
		if sg, ok = s.getNear(it.GetSegmentId(), sg); !ok {
			setStatus(&out[i], errNoSegment(it.GetSegmentId()))
			continue
		}
		g := groups[sg]
		if g == nil {
			g = &group{idx: make([]int, 0, len(items)), args: make([]SealArg, 0, len(items))}
			groups[sg] = g
			order = append(order, sg)
		}
		g.idx = append(g.idx, i)
		g.args = append(g.args, SealArg{ID: it.GetAllocationId(), Checksum: it.GetChecksum(), SoftPinUntilMs: it.GetSoftPinUntilUnixMs()})
	}
	for _, sg := range order {
		g := groups[sg]
		for k, err := range sg.Seal(g.args, now) {
			setStatus(&out[g.idx[k]], err)
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
