package link

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"google.golang.org/protobuf/proto"
)

// TestRegistrationChunks: the table goes out after a chunked Register in
// bounded chunks of one segment each (named by the chunk, not repeated per
// allocation), in the Register's segment order with ids increasing, the
// last one marked, and allocation_count equal to what the chunks carry;
// allocations of an unlisted segment are left out.
func TestRegistrationChunks(t *testing.T) {
	mk := func(seg string, id uint64, keyLen int) *masterv1.Allocation {
		return &masterv1.Allocation{SegmentId: seg, AllocationId: id, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED,
			Key: fmt.Sprintf("k%d", id) + strings.Repeat("x", keyLen)}
	}
	for _, tc := range []struct {
		name       string
		n, keyLen  int
		wantChunks int
	}{
		{"empty", 0, 0, 1},
		{"one chunk per segment", 10, 0, 2},
		{"by count", 2*maxChunkAllocs + 5, 0, 4},
		{"by bytes", 1000, 4000, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var table []*masterv1.Allocation
			for i := tc.n; i > 0; i-- { // reversed, alternating segments
				table = append(table, mk([]string{"s0", "s1"}[i%2], uint64(i), tc.keyLen))
			}
			table = append(table, mk("gone", 1, 0))
			r := &masterv1.Register{AgentId: "a", Segments: []*masterv1.SegmentInfo{{SegmentId: "s1"}, {SegmentId: "s0"}}}
			reg := newRegistration(r, partsOf(r, table))
			var msgs []*masterv1.ConnectRequest
			// The chunks' Allocations are reused: each message is kept as a copy.
			if !reg.messages(func(m *masterv1.ConnectRequest) bool { msgs = append(msgs, proto.CloneOf(m)); return true }) {
				t.Fatal("messages stopped")
			}
			r = msgs[0].GetRegister()
			if r == nil || !r.GetChunked() || r.GetAllocationCount() != uint64(tc.n) || len(r.GetAllocations()) != 0 {
				t.Fatalf("first message: got %v, want a chunked Register announcing %d", msgs[0], tc.n)
			}
			if got := len(msgs) - 1; got != tc.wantChunks {
				t.Fatalf("chunks: got %d, want %d", got, tc.wantChunks)
			}
			pos := map[string]int{"s1": 0, "s0": 1}
			prevPos, prevID, total := -1, uint64(0), 0
			for i, m := range msgs[1:] {
				ch := m.GetRegisterChunk()
				if ch == nil || ch.GetLast() != (i == len(msgs)-2) {
					t.Fatalf("chunk %d: got %v, want a RegisterChunk with last=%v", i, m, i == len(msgs)-2)
				}
				if n := len(ch.GetAllocations()); n > maxChunkAllocs || (n > 1 && ch.SizeVT() > maxChunkBytes+8192) {
					t.Fatalf("chunk %d: %d allocations, %d bytes; want at most %d and about %d", i, n, ch.SizeVT(), maxChunkAllocs, maxChunkBytes)
				}
				if len(ch.GetAllocations()) > 0 && ch.GetSegmentId() == "" {
					t.Fatalf("chunk %d: %d allocations and no segment_id", i, len(ch.GetAllocations()))
				}
				for _, a := range ch.GetAllocations() {
					if a.GetSegmentId() != "" {
						t.Fatalf("chunk %d: allocation %d repeats its segment id", i, a.GetAllocationId())
					}
					p := pos[ch.GetSegmentId()]
					if p < prevPos || (p == prevPos && a.GetAllocationId() <= prevID) {
						t.Fatalf("allocation %s/%d after %d/%d: out of order", ch.GetSegmentId(), a.GetAllocationId(), prevPos, prevID)
					}
					prevPos, prevID = p, a.GetAllocationId()
					total++
				}
			}
			if total != tc.n {
				t.Fatalf("chunks carried %d allocations, want %d", total, tc.n)
			}
		})
	}
}

// slicePart is a tablePart of Allocations in id order.
type slicePart struct {
	seg    string
	allocs []*masterv1.Allocation
}

func (p slicePart) SegmentID() string { return p.seg }
func (p slicePart) Len() int          { return len(p.allocs) }
func (p slicePart) Fill(dst []*masterv1.Allocation, from int) {
	for i, a := range p.allocs[from : from+len(dst)] {
		dst[i].Reset()
		proto.Merge(dst[i], a)
		dst[i].SegmentId = ""
	}
}

// partsOf groups table by the Register's segments, in its order, each part
// in id order; allocations of other segments are left out.
func partsOf(r *masterv1.Register, table []*masterv1.Allocation) []tablePart {
	var parts []tablePart
	for _, info := range r.GetSegments() {
		p := slicePart{seg: info.GetSegmentId()}
		for _, a := range table {
			if a.GetSegmentId() == p.seg {
				p.allocs = append(p.allocs, a)
			}
		}
		slices.SortFunc(p.allocs, func(a, b *masterv1.Allocation) int { return cmp.Compare(a.GetAllocationId(), b.GetAllocationId()) })
		parts = append(parts, p)
	}
	return parts
}

// TestTablePartsFromSegments: a registration of real segments sends each
// listed, mounted segment's table in the Register's order, ids increasing
// (old ids first), with every field of each allocation; a listed segment
// no longer mounted is left out; the count announced is what is sent.
func TestTablePartsFromSegments(t *testing.T) {
	now := time.Now()
	zeros := checksum.Sum(make([]byte, 64)) // a new segment's bytes
	var segs []*segment.Segment
	want := map[string][]*masterv1.Allocation{}
	var ids []string
	for _, name := range []string{"m0", "m1"} {
		sg, err := segment.NewMemory(name, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		id := sg.ID()
		ids = append(ids, id)
		t.Cleanup(func() { sg.Close() })
		for i := range 700 {
			a, err := sg.Reserve(&masterv1.ReserveItem{SegmentId: id, Size: 64, Tenant: "t", Key: fmt.Sprint(id, "/", i), ReplicaId: 1, GroupId: "g"}, now)
			if err != nil {
				t.Fatal(err)
			}
			if i%3 == 0 {
				for _, err := range sg.Seal([]segment.SealArg{{ID: a.GetAllocationId(), Checksum: zeros}}, now) {
					if err != nil {
						t.Fatal(err)
					}
				}
			}
		}
		for _, a := range sg.Table() {
			if a.GetAllocationId()%5 == 0 {
				if err := sg.Release(a.GetAllocationId()); err != nil {
					t.Fatal(err)
				}
			}
		}
		tbl := sg.Table()
		slices.SortFunc(tbl, func(a, b *masterv1.Allocation) int { return cmp.Compare(a.GetAllocationId(), b.GetAllocationId()) })
		want[id] = tbl
		segs = append(segs, sg)
	}
	set := segment.NewSet(segs...)
	r := &masterv1.Register{Segments: []*masterv1.SegmentInfo{{SegmentId: ids[1]}, {SegmentId: "gone"}, {SegmentId: ids[0]}}}
	g := newRegistration(r, tableParts(set, r))
	var got []*masterv1.RegisterChunk
	if !g.messages(func(m *masterv1.ConnectRequest) bool {
		if ch := m.GetRegisterChunk(); ch != nil {
			got = append(got, proto.CloneOf(ch)) // the chunk's Allocations are reused
		}
		return true
	}) {
		t.Fatal("messages stopped")
	}
	var sent []*masterv1.Allocation
	for _, ch := range got {
		for _, a := range ch.GetAllocations() {
			a.SegmentId = ch.GetSegmentId()
			sent = append(sent, a)
		}
	}
	all := append(slices.Clone(want[ids[1]]), want[ids[0]]...)
	if r.GetAllocationCount() != uint64(len(all)) || len(sent) != len(all) {
		t.Fatalf("announced %d, sent %d, want %d", r.GetAllocationCount(), len(sent), len(all))
	}
	for i := range all {
		if !proto.Equal(sent[i], all[i]) {
			t.Fatalf("allocation %d: sent %v, want %v", i, sent[i], all[i])
		}
	}
}
