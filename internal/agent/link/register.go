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
func newRegistration(r *masterv1.Register, table []*masterv1.Allocation) *registration {
	pos := make(map[string]int, len(r.GetSegments()))
	for i, s := range r.GetSegments() {
		pos[s.GetSegmentId()] = i
	}
	kept := table[:0]
	for _, a := range table {
		if _, ok := pos[a.GetSegmentId()]; ok {
			kept = append(kept, a)
		}
	}
	slices.SortFunc(kept, func(a, b *masterv1.Allocation) int {
		if c := cmp.Compare(pos[a.GetSegmentId()], pos[b.GetSegmentId()]); c != 0 {
			return c
		}
		return cmp.Compare(a.GetAllocationId(), b.GetAllocationId())
	})
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
			rest[n].SegmentId = "" // the chunk names it once
			size += rest[n].SizeVT() + 4
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
