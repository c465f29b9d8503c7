package segment

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"
)

// readAll reads every change of f after from.
func readAll(t *testing.T, f *Feed, from uint64) []Change {
	t.Helper()
	out, err := f.Read(nil, from, f.Size())
	if err != nil {
		t.Fatalf("Read(%d): %v", from, err)
	}
	return out
}

// TestFeedRecordsSealsAndReleases: a seal is a change carrying the complete
// allocation, a release of a sealed allocation is a change carrying its
// segment, id, tenant and key; a reservation, a failed seal, a release or
// expiry of a RESERVED allocation and a repeated seal are not changes.
func TestFeedRecordsSealsAndReleases(t *testing.T) {
	for _, medium := range []string{"memory", "disk"} {
		t.Run(medium, func(t *testing.T) {
			var s *Segment
			if medium == "memory" {
				s = newMem(t, 1<<20)
			} else {
				var err error
				if s, _, err = OpenDisk(t.TempDir(), 1<<20); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = s.Close() })
			}
			f := NewFeed(0)
			NewSet(s).SetFeed(f)
			if inst, v := f.Position(); len(inst) != 32 || v != 0 {
				t.Fatalf("Position() = %q, %d; want 32 hex digits and 0", inst, v)
			}

			data := []byte("sealed object")
			a := reserve(t, s, "a", uint64(len(data)))
			b := reserve(t, s, "b", 4)
			c := reserve(t, s, "c", 4)
			reserve(t, s, "expires", 4)
			write(t, s, a.GetAllocationId(), data)
			if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
				t.Fatal(err)
			}
			sealed, _ := s.Lookup(a.GetAllocationId())
			// A retry of the seal changes nothing.
			if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
				t.Fatal(err)
			}
			if err := seal(s, b.GetAllocationId(), 42); err == nil {
				t.Fatal("seal with a wrong checksum succeeded")
			}
			if err := s.Release(c.GetAllocationId()); err != nil {
				t.Fatal(err)
			}
			if n := len(s.ExpireReserved(t0.Add(time.Hour))); n != 2 {
				t.Fatalf("ExpireReserved released %d, want 2 (b and expires)", n)
			}
			if _, v := f.Position(); v != 1 {
				t.Fatalf("version after one seal = %d, want 1", v)
			}
			if err := s.Release(a.GetAllocationId()); err != nil {
				t.Fatal(err)
			}
			if err := s.Release(a.GetAllocationId()); err != nil { // unknown now: a no-op
				t.Fatal(err)
			}

			got := readAll(t, f, 0)
			if len(got) != 2 || got[0].Released() || !got[1].Released() {
				t.Fatalf("changes = %v, want a seal then a release", got)
			}
			if sealed.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED || sealed.GetChecksum() != checksum.Sum(data) {
				t.Fatalf("table row after the seal = %v", sealed)
			}
			if g := got[0].Allocation(); !proto.Equal(g, sealed) {
				t.Errorf("sealed change = %v, want %v", g, sealed)
			}
			rel := &masterv1.Allocation{SegmentId: s.ID(), AllocationId: a.GetAllocationId(), Tenant: "t", Key: "a"}
			if g := got[1].Allocation(); !proto.Equal(g, rel) {
				t.Errorf("released change = %v, want %v", g, rel)
			}
		})
	}
}

// TestFeedRecordsCorruptDrops: a sealed allocation VerifySealed drops is a
// release in the feed (when one is attached: at start-up none is yet).
func TestFeedRecordsCorruptDrops(t *testing.T) {
	dir := t.TempDir()
	objs := fillDisk(t, dir, 1<<20, 100, 200)
	testutil.FlipByte(t, filepath.Join(dir, dataName), objs[1].alloc.GetOffset()+7)
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	f := NewFeed(0)
	s.SetFeed(f)
	if _, err := s.VerifySealed(t.Context(), VerifyConfig{}); err != nil {
		t.Fatal(err)
	}
	got := readAll(t, f, 0)
	if len(got) != 1 || !got[0].Released() || got[0].Allocation().GetAllocationId() != objs[1].alloc.GetAllocationId() {
		t.Fatalf("changes = %v, want the release of allocation %d", got, objs[1].alloc.GetAllocationId())
	}
}

// TestFeedRing: positions, bounded reads, ErrBehind once a version has left
// the ring, and the wake-up channel.
func TestFeedRing(t *testing.T) {
	s := newMem(t, 1<<20)
	f := NewFeed(3) // rounded up to 4
	if f.Size() != 4 {
		t.Fatalf("Size() = %d, want 4", f.Size())
	}
	s.SetFeed(f)
	ch := f.Changed(0)
	select {
	case <-ch:
		t.Fatal("Changed(0) closed before any change")
	default:
	}
	var ids []uint64
	for i := range 6 {
		a := reserve(t, s, fmt.Sprint("k", i), 1)
		if err := seal(s, a.GetAllocationId(), checksum.Sum(make([]byte, 1))); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, a.GetAllocationId())
	}
	select {
	case <-ch:
	default:
		t.Fatal("Changed(0) not closed after a change")
	}
	select {
	case <-f.Changed(5):
	default:
		t.Fatal("Changed(5) not closed at version 6")
	}
	select {
	case <-f.Changed(6):
		t.Fatal("Changed(6) closed at version 6")
	default:
	}

	for _, tc := range []struct {
		from    uint64
		limit   int
		want    []uint64 // allocation ids, in order
		wantErr error
	}{
		{from: 6, limit: 10, want: nil},
		{from: 2, limit: 10, want: ids[2:6]},
		{from: 2, limit: 3, want: ids[2:5]},
		{from: 4, limit: 1, want: ids[4:5]},
		{from: 3, limit: 0, want: nil},
		{from: 1, limit: 10, wantErr: ErrBehind},
		{from: 0, limit: 1, wantErr: ErrBehind},
		{from: 7, limit: 1, wantErr: errAny},
	} {
		t.Run(fmt.Sprintf("from=%d,limit=%d", tc.from, tc.limit), func(t *testing.T) {
			got, err := f.Read(nil, tc.from, tc.limit)
			switch {
			case tc.wantErr == errAny && err == nil, tc.wantErr != errAny && !errors.Is(err, tc.wantErr):
				t.Fatalf("Read error = %v, want %v", err, tc.wantErr)
			case tc.wantErr != nil:
				return
			}
			var gotIDs []uint64
			for _, c := range got {
				gotIDs = append(gotIDs, c.Allocation().GetAllocationId())
			}
			if fmt.Sprint(gotIDs) != fmt.Sprint(tc.want) {
				t.Fatalf("Read = %v, want %v", gotIDs, tc.want)
			}
		})
	}
}

var errAny = errors.New("any error")

// TestFeedRingModel: any sequence of changes and reads answers what a list
// of every change would, within the ring, and ErrBehind outside it.
func TestFeedRingModel(t *testing.T) {
	s := newMem(t, 1<<20)
	rapid.Check(t, func(rt *rapid.T) {
		f := NewFeed(1 << rapid.IntRange(0, 4).Draw(rt, "sizeShift"))
		var all []*entry
		for range rapid.IntRange(0, 60).Draw(rt, "steps") {
			if rapid.Bool().Draw(rt, "change") {
				e := &entry{id: uint64(len(all) + 1)}
				all = append(all, e)
				if rapid.Bool().Draw(rt, "released") {
					f.released(s, e)
				} else {
					f.sealed(s, e)
				}
				continue
			}
			v := uint64(len(all))
			from := rapid.Uint64Range(0, v).Draw(rt, "from")
			limit := rapid.IntRange(0, 20).Draw(rt, "limit")
			got, err := f.Read(nil, from, limit)
			if v-from > uint64(f.Size()) {
				if !errors.Is(err, ErrBehind) {
					rt.Fatalf("Read(%d) at version %d with a ring of %d: err %v, want ErrBehind", from, v, f.Size(), err)
				}
				continue
			}
			if err != nil {
				rt.Fatalf("Read(%d) at version %d: %v", from, v, err)
			}
			want := all[from:min(v, from+uint64(limit))]
			if len(got) != len(want) {
				rt.Fatalf("Read(%d, %d) at version %d: %d changes, want %d", from, limit, v, len(got), len(want))
			}
			for i := range got {
				if id := got[i].Allocation().GetAllocationId(); id != want[i].id {
					rt.Fatalf("change %d: allocation %d, want %d", from+uint64(i)+1, id, want[i].id)
				}
			}
		}
	})
}

// TestFeedSnapshotInvariant: while seals and releases run on two segments,
// a table taken after reading the feed's position, with the changes after
// that position applied in order, is exactly the final table's sealed
// allocations.
func TestFeedSnapshotInvariant(t *testing.T) {
	segs := []*Segment{newMem(t, 4<<20), newMem(t, 4<<20)}
	set := NewSet(segs...)
	f := NewFeed(1 << 16)
	set.SetFeed(f)
	sum := checksum.Sum(make([]byte, 64)) // the pages are zero; nothing writes

	type key struct {
		seg string
		id  uint64
	}
	sealedOf := func(table []*masterv1.Allocation) map[key]*masterv1.Allocation {
		out := map[key]*masterv1.Allocation{}
		for _, a := range table {
			if a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
				out[key{a.GetSegmentId(), a.GetAllocationId()}] = a
			}
		}
		return out
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 7))
			sg := segs[w%2]
			var live []uint64
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if _, v := f.Position(); v >= 1<<15 {
					// Half the ring: enough changes to snapshot across,
					// and the first snapshot's position stays in the ring
					// however fast the writers run (without the race
					// detector they outran it on a fast VM).
					<-stop
					return
				}
				items := make([]*masterv1.ReserveItem, 1+r.IntN(8))
				for k := range items {
					items[k] = &masterv1.ReserveItem{SegmentId: sg.ID(), Size: 64, Tenant: "t", Key: fmt.Sprintf("w%d/%d/%d", w, i, k), ReplicaId: 1}
				}
				var seals []*masterv1.SealItem
				for _, res := range set.Reserve(items, t0) {
					if res.GetStatus().GetCode() != 0 {
						continue
					}
					if r.IntN(4) == 0 { // some stay RESERVED, some are released so
						if r.IntN(2) == 0 {
							set.Release([]*masterv1.AllocationRef{{SegmentId: sg.ID(), AllocationId: res.GetAllocationId()}})
						}
						continue
					}
					seals = append(seals, &masterv1.SealItem{SegmentId: sg.ID(), AllocationId: res.GetAllocationId(), Checksum: sum})
				}
				set.Seal(seals, t0)
				for _, it := range seals {
					live = append(live, it.GetAllocationId())
				}
				for len(live) > 64 || (len(live) > 0 && r.IntN(3) == 0) {
					k := r.IntN(len(live))
					set.Release([]*masterv1.AllocationRef{{SegmentId: sg.ID(), AllocationId: live[k]}})
					live = append(live[:k], live[k+1:]...)
				}
				set.ExpireReserved(t0.Add(time.Hour), 0)
			}
		})
	}

	type snap struct {
		version uint64
		sealed  map[key]*masterv1.Allocation
	}
	var snaps []snap
	for range 20 {
		_, v := f.Position()
		snaps = append(snaps, snap{v, sealedOf(set.Table())})
		time.Sleep(2 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	inst, final := f.Position()
	if inst != f.Instance() || final == snaps[0].version {
		t.Fatalf("no change recorded while snapshotting (version %d)", final)
	}
	want := sealedOf(set.Table())
	for i, sn := range snaps {
		for _, c := range readAll(t, f, sn.version) {
			a := c.Allocation()
			k := key{a.GetSegmentId(), a.GetAllocationId()}
			if c.Released() {
				delete(sn.sealed, k)
			} else {
				sn.sealed[k] = a
			}
		}
		if len(sn.sealed) != len(want) {
			t.Fatalf("snapshot %d (version %d of %d) with its changes: %d sealed allocations, want %d", i, sn.version, final, len(sn.sealed), len(want))
		}
		for k, a := range want {
			if !proto.Equal(sn.sealed[k], a) {
				t.Fatalf("snapshot %d (version %d of %d): allocation %v is %v, want %v", i, sn.version, final, k, sn.sealed[k], a)
			}
		}
	}
}
