package link

import (
	"cmp"
	"slices"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Chunk bounds of a registration's allocation table: the master refuses a
// chunk of more than 16384 allocations (session.MaxRegisterChunk); a chunk
// also stays near maxChunkBytes, so one with long keys is not a message of
// tens of MiB that the master holds while it applies it.
const (
	maxChunkAllocs = 16384
	maxChunkBytes  = 1 << 20
)

// registration is the stream's opening: a chunked Register and its table in
// RegisterChunk messages, in the order the master checks (segments in the
// Register's order, allocation ids increasing within each).
type registration struct {
	register *masterv1.Register
	table    []*masterv1.Allocation
}

// newRegistration orders the table by the segment list. Allocations of a
// segment not in the list (mounted between the two snapshots) are left
// out: the segment's SegmentsUpdate follows, and its table with the next
// registration.
//
// A table comes grouped by segment (Set.Table), each group mostly in id
// order (the ring's ids are; the long-lived old ones are not), so the
// segment is looked up once per group and each group is sorted by id alone:
// at 2M allocations a sort of the whole table comparing segment positions
// through a map cost about a second of the agent's CPU on every
// registration, the time a restarted master waits. A table that is not
// grouped so is sorted whole.
func newRegistration(r *masterv1.Register, table []*masterv1.Allocation) *registration {
	pos := make(map[string]int, len(r.GetSegments()))
	for i, s := range r.GetSegments() {
		pos[s.GetSegmentId()] = i
	}
	type run struct{ pos, lo, hi int }
	var runs []run
	kept := table[:0] // compacted in place: never ahead of the reading index
	grouped := true
	seen := make(map[int]bool, len(pos))
	for i := 0; i < len(table); {
		seg := table[i].GetSegmentId()
		j := i + 1
		for j < len(table) && table[j].GetSegmentId() == seg {
			j++
		}
		if p, ok := pos[seg]; ok {
			grouped = grouped && !seen[p]
			seen[p] = true
			lo := len(kept)
			kept = append(kept, table[i:j]...)
			runs = append(runs, run{p, lo, len(kept)})
		}
		i = j
	}
	byID := func(a, b *masterv1.Allocation) int { return cmp.Compare(a.GetAllocationId(), b.GetAllocationId()) }
	switch {
	case !grouped:
		slices.SortFunc(kept, func(a, b *masterv1.Allocation) int {
			return cmp.Or(cmp.Compare(pos[a.GetSegmentId()], pos[b.GetSegmentId()]), byID(a, b))
		})
	default:
		for _, rn := range runs {
			if part := kept[rn.lo:rn.hi]; !slices.IsSortedFunc(part, byID) {
				slices.SortFunc(part, byID)
			}
		}
		if !slices.IsSortedFunc(runs, func(a, b run) int { return cmp.Compare(a.pos, b.pos) }) {
			slices.SortFunc(runs, func(a, b run) int { return cmp.Compare(a.pos, b.pos) })
			ordered := make([]*masterv1.Allocation, 0, len(kept))
			for _, rn := range runs {
				ordered = append(ordered, kept[rn.lo:rn.hi]...)
			}
			kept = ordered
		}
	}
	r.Chunked, r.AllocationCount, r.Allocations = true, uint64(len(kept)), nil
	return &registration{register: r, table: kept}
}

// resumeRegistration is a Connect's offer to resume (Register.resume): a
// chunked Register of no allocations with the table's position, and no
// chunk after it.
func resumeRegistration(r *masterv1.Register, pos *masterv1.TablePosition) *registration {
	r.Chunked, r.AllocationCount, r.Allocations = true, 0, nil
	r.TablePosition, r.Resume = pos, true
	return &registration{register: r}
}

// messages calls send with the Register, then each chunk (allocations of
// one segment, named once by the chunk); the last chunk (empty when the
// table is) carries last. It stops when send fails. It clears the table's
// segment ids as it goes.
func (g *registration) messages(send func(*masterv1.ConnectRequest) bool) bool {
	if !send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: g.register}}) {
		return false
	}
	if g.register.GetResume() {
		return true
	}
	rest := g.table
	for {
		n, size, seg := 0, 0, ""
		if len(rest) > 0 {
			seg = rest[0].GetSegmentId()
		}
		for n < len(rest) && n < maxChunkAllocs && (n == 0 || size < maxChunkBytes) && rest[n].GetSegmentId() == seg {
			a := rest[n]
			a.SegmentId = "" // the chunk names it once
			// About its encoded size (the numbers take 30-60 bytes): the
			// codec computes every size again when it marshals the chunk.
			size += len(a.GetKey()) + len(a.GetTenant()) + len(a.GetGroupId()) + 48
			n++
		}
		ch := &masterv1.RegisterChunk{SegmentId: seg, Allocations: rest[:n:n], Last: n == len(rest)}
		rest = rest[n:]
		if !send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}}) {
			return false
		}
		if ch.Last {
			return true
		}
	}
}
