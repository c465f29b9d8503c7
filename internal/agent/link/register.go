package link

import (
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
)

// Chunk bounds of a registration's allocation table: the master refuses a
// chunk of more than 16384 allocations (session.MaxRegisterChunk); a chunk
// also stays near maxChunkBytes, so one with long keys is not a message of
// tens of MiB that the master holds while it applies it.
const (
	maxChunkAllocs = 16384
	maxChunkBytes  = 1 << 20
)

// fillBatch is how many allocations a chunk takes from its segment per
// hold of the segment's lock (tablePart.Fill).
const fillBatch = 256

// tablePart is one segment's part of a registration's table, in id order
// (segment.TableView).
type tablePart interface {
	SegmentID() string
	Len() int
	// Fill sets each dst[i], cleared first, to allocation from+i, its
	// segment id empty.
	Fill(dst []*masterv1.Allocation, from int)
}

// registration is the stream's opening: a chunked Register and its table in
// RegisterChunk messages, in the order the master checks (segments in the
// Register's order, allocation ids increasing within each).
type registration struct {
	register *masterv1.Register
	parts    []tablePart
	count    int // allocations in parts
}

// newRegistration makes r a chunked Register of the table parts, one per
// segment, in the Register's segment order.
func newRegistration(r *masterv1.Register, parts []tablePart) *registration {
	g := &registration{register: r, parts: parts}
	for _, p := range parts {
		g.count += p.Len()
	}
	r.Chunked, r.AllocationCount, r.Allocations = true, uint64(g.count), nil
	return g
}

// tableParts views the table of each of r's segments, in r's order; a
// segment no longer mounted (unmounted between the two snapshots) is left
// out: its SegmentsUpdate follows.
func tableParts(set *segment.Set, r *masterv1.Register) []tablePart {
	parts := make([]tablePart, 0, len(r.GetSegments()))
	for _, info := range r.GetSegments() {
		if sg, ok := set.Get(info.GetSegmentId()); ok {
			parts = append(parts, sg.View())
		}
	}
	return parts
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
// table is) carries last. It stops when send fails. Every chunk is built in
// the same Allocations, filled from the table as it goes: send must be done
// with a message when it returns (gRPC's Send marshals it before it
// returns).
func (g *registration) messages(send func(*masterv1.ConnectRequest) bool) bool {
	if !send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: g.register}}) {
		return false
	}
	if g.register.GetResume() {
		return true
	}
	n := min(g.count, maxChunkAllocs)
	block := make([]masterv1.Allocation, n)
	allocs := make([]*masterv1.Allocation, n)
	for i := range block {
		allocs[i] = &block[i]
	}
	sent := 0
	for _, p := range g.parts {
		for from := 0; from < p.Len(); {
			k, size := 0, 0
			for k < maxChunkAllocs && from+k < p.Len() && (k == 0 || size < maxChunkBytes) {
				b := min(fillBatch, maxChunkAllocs-k, p.Len()-from-k)
				p.Fill(allocs[k:k+b], from+k)
				for _, a := range allocs[k : k+b] {
					if k > 0 && size >= maxChunkBytes {
						break
					}
					// About its encoded size (the numbers take 30-60
					// bytes): the codec computes it when it marshals.
					size += len(a.GetKey()) + len(a.GetTenant()) + len(a.GetGroupId()) + 48
					k++
				}
			}
			from += k
			sent += k
			ch := &masterv1.RegisterChunk{SegmentId: p.SegmentID(), Allocations: allocs[:k:k], Last: sent == g.count}
			if !send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}}) {
				return false
			}
		}
	}
	if g.count == 0 {
		return send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: &masterv1.RegisterChunk{Last: true}}})
	}
	return true
}
