package segment

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

// TestExpireReservedModel: reservations (blank ones too), seals, releases,
// open writers (which bind a blank, restarting its grace) and sweeps at
// random times; ExpireReserved (which looks only at its queue of
// reservations) expires exactly the RESERVED allocations older than the
// cutoff that nobody is writing, Stats' counts (kept, not counted) match a
// walk of the allocations, and Table and View hold them all, exactly the
// unbound blanks flagged blank (with no object).
func TestExpireReservedModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		s, err := NewMemory("mem-0", 1<<20)
		if err != nil {
			rt.Fatal(err)
		}
		defer func() { _ = s.Close() }()
		now := t0
		zeros := checksum.Sum(make([]byte, 64))
		var ids []uint64
		blanks := map[uint64]bool{}
		open := map[uint64]*Handle{}
		defer func() {
			for _, h := range open {
				h.Close()
			}
		}()
		for step := range rapid.IntRange(1, 60).Draw(rt, "steps") {
			switch op := rapid.IntRange(0, 6).Draw(rt, "op"); op {
			case 0, 1, 6:
				blank := op == 6
				a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: 64, Tenant: "t", Key: fmt.Sprint("k", step), ReplicaId: 1, Blank: blank}, now)
				if err == nil {
					ids = append(ids, a.GetAllocationId())
					blanks[a.GetAllocationId()] = blank
				}
			case 2:
				if len(ids) > 0 {
					id := rapid.SampledFrom(ids).Draw(rt, "seal")
					_ = s.Seal([]SealArg{{ID: id, Checksum: zeros}}, now)
				}
			case 3:
				if len(ids) > 0 {
					_ = s.Release(rapid.SampledFrom(ids).Draw(rt, "release"))
				}
			case 4:
				if len(ids) > 0 {
					id := rapid.SampledFrom(ids).Draw(rt, "write")
					if h, ok := open[id]; ok {
						h.Close()
						delete(open, id)
					} else if blanks[id] {
						h := new(Handle)
						if s.OpenWriteAs(h, id, Identity{Tenant: []byte("t"), Key: []byte(fmt.Sprint("b", id))}, now) == nil {
							open[id] = h
						}
					} else if h, err := s.OpenWrite(id); err == nil {
						open[id] = h
					}
				}
			case 5:
				cutoff := now.Add(-time.Duration(rapid.IntRange(0, 5).Draw(rt, "age")) * time.Millisecond)
				var want []uint64
				for _, a := range lookupAll(s, ids) {
					if a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_RESERVED && open[a.GetAllocationId()] == nil &&
						a.GetCreatedUnixMs() < cutoff.UnixMilli() {
						want = append(want, a.GetAllocationId())
					}
				}
				got := s.ExpireReserved(cutoff)
				slices.Sort(got)
				slices.Sort(want)
				if !slices.Equal(got, want) {
					rt.Fatalf("ExpireReserved(%v): got %v, want %v", cutoff.Sub(t0), got, want)
				}
			}
			now = now.Add(time.Duration(rapid.IntRange(0, 2).Draw(rt, "tick")) * time.Millisecond)
			var reserved, sealed, unbound int
			for _, a := range lookupAll(s, ids) {
				if a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
					sealed++
				} else {
					reserved++
				}
				if a.GetKey() == "" {
					unbound++ // an unbound blank
				}
			}
			if _, r, sl := s.Stats(); r != reserved || sl != sealed {
				rt.Fatalf("Stats: %d reserved, %d sealed; the table holds %d and %d", r, sl, reserved, sealed)
			}
			tbl := s.Table()
			if all := reserved + sealed; len(tbl) != all || s.View().Len() != all {
				rt.Fatalf("Table has %d rows and View %d; the segment holds %d allocations", len(tbl), s.View().Len(), all)
			}
			flagged := 0
			for _, a := range tbl {
				if a.GetBlank() != (a.GetKey() == "") {
					rt.Fatalf("Table row %v: flagged blank %v with key %q", a, a.GetBlank(), a.GetKey())
				}
				if a.GetBlank() {
					flagged++
				}
			}
			if flagged != unbound {
				rt.Fatalf("Table flags %d blanks; %d are unbound", flagged, unbound)
			}
		}
	})
}

// lookupAll returns the allocations of ids still in s's table.
func lookupAll(s *Segment, ids []uint64) []*masterv1.Allocation {
	var out []*masterv1.Allocation
	for _, id := range ids {
		if a, ok := s.Lookup(id); ok {
			out = append(out, a)
		}
	}
	return out
}
