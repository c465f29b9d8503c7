package link

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
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
			reg := newRegistration(&masterv1.Register{AgentId: "a", Segments: []*masterv1.SegmentInfo{{SegmentId: "s1"}, {SegmentId: "s0"}}}, table)
			var msgs []*masterv1.ConnectRequest
			if !reg.messages(func(m *masterv1.ConnectRequest) bool { msgs = append(msgs, m); return true }) {
				t.Fatal("messages stopped")
			}
			r := msgs[0].GetRegister()
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

// TestNewRegistrationOrder: whatever the table's order (grouped by segment
// or not, ids out of order, segments in another order than the Register's,
// allocations of unlisted segments), the registration's table is the
// listed segments' allocations ordered by the Register's segment order,
// then id: what the master's table cursor checks.
func TestNewRegistrationOrder(t *testing.T) {
	segs := []*masterv1.SegmentInfo{{SegmentId: "s0"}, {SegmentId: "s1"}, {SegmentId: "s2"}}
	rng := rand.New(rand.NewPCG(7, 7))
	for trial := range 200 {
		var table []*masterv1.Allocation
		grouped := trial%2 == 0
		for _, seg := range []string{"s2", "x", "s0", "s1"} {
			n := rng.IntN(50)
			for i := range n {
				id := uint64(i + 1)
				if rng.IntN(4) == 0 {
					id = uint64(rng.IntN(1000) + 100) // an old id, out of order
				}
				table = append(table, &masterv1.Allocation{SegmentId: seg, AllocationId: id})
			}
		}
		if !grouped {
			rng.Shuffle(len(table), func(i, j int) { table[i], table[j] = table[j], table[i] })
		}
		want := slices.Clone(table)
		want = slices.DeleteFunc(want, func(a *masterv1.Allocation) bool { return a.GetSegmentId() == "x" })
		order := map[string]int{"s0": 0, "s1": 1, "s2": 2}
		slices.SortStableFunc(want, func(a, b *masterv1.Allocation) int {
			return cmp.Or(cmp.Compare(order[a.GetSegmentId()], order[b.GetSegmentId()]), cmp.Compare(a.GetAllocationId(), b.GetAllocationId()))
		})
		g := newRegistration(&masterv1.Register{Segments: segs}, table)
		if len(g.table) != len(want) || g.register.GetAllocationCount() != uint64(len(want)) {
			t.Fatalf("trial %d: %d allocations (count %d), want %d", trial, len(g.table), g.register.GetAllocationCount(), len(want))
		}
		for i := range want {
			if g.table[i].GetSegmentId() != want[i].GetSegmentId() || g.table[i].GetAllocationId() != want[i].GetAllocationId() {
				t.Fatalf("trial %d (grouped %v): at %d got %s/%d, want %s/%d", trial, grouped, i,
					g.table[i].GetSegmentId(), g.table[i].GetAllocationId(), want[i].GetSegmentId(), want[i].GetAllocationId())
			}
		}
	}
}
