package segment

import (
	"strconv"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

// BenchmarkSetCycle is the segment side of a put of 128 × 4 KiB objects, as
// the link and the transfer listener drive it, without the network: Set.Reserve
// of the batch, a write handle opened and closed per object, Set.Seal (the
// hash verification), and Set.Release of the batch put benchWindow cycles
// earlier. The segment holds fill sealed objects first, as an agent serving
// a cluster does, and records its changes in a Feed, as the segments of an
// agent that follows standbys do (2 allocations per object: the seal's and
// the release's change). ns/obj and allocs/obj are per object.
func BenchmarkSetCycle(b *testing.B) {
	const (
		batch  = 128
		size   = 4 << 10
		window = 32
		fill   = 48 << 10
	)
	mem, err := NewMemory("bench", (fill+(window+2)*batch)*size)
	if err != nil {
		b.Fatal(err)
	}
	defer mem.Close()
	set := NewSet(mem)
	set.SetFeed(NewFeed(0))
	now := time.Now()
	reserve := make([]*masterv1.ReserveItem, batch)
	for i := range reserve {
		reserve[i] = &masterv1.ReserveItem{SegmentId: mem.ID(), Size: size, Tenant: "bench", Key: "bench/object-" + strconv.Itoa(i), ReplicaId: 1}
	}
	zero := checksum.Sum(make([]byte, size))
	seal := make([]*masterv1.SealItem, batch)
	release := make([]*masterv1.AllocationRef, batch)
	for i := range seal {
		seal[i] = &masterv1.SealItem{SegmentId: mem.ID(), Checksum: zero}
		release[i] = &masterv1.AllocationRef{SegmentId: mem.ID()}
	}
	cycle := func(live *[][]uint64, write bool) {
		ids := make([]uint64, batch)
		for i, r := range set.Reserve(reserve, now) {
			if r.GetStatus().GetCode() != 0 {
				b.Fatalf("reserve: %v", r.GetStatus())
			}
			ids[i] = r.GetAllocationId()
		}
		if write {
			for _, id := range ids {
				h, err := mem.OpenWrite(id)
				if err != nil {
					b.Fatal(err)
				}
				h.Close()
			}
		}
		for i, id := range ids {
			seal[i].AllocationId = id
		}
		for _, st := range set.Seal(seal, now) {
			if st.GetCode() != 0 {
				b.Fatalf("seal: %v", st)
			}
		}
		if live == nil {
			return
		}
		*live = append(*live, ids)
		if len(*live) > window {
			for i, id := range (*live)[0] {
				release[i].AllocationId = id
			}
			*live = (*live)[1:]
			for _, st := range set.Release(release) {
				if st.GetCode() != 0 {
					b.Fatalf("release: %v", st)
				}
			}
		}
	}
	for range fill / batch {
		cycle(nil, false)
	}
	var live [][]uint64
	for range window + 1 {
		cycle(&live, true)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		cycle(&live, true)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/obj")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkSharedBacking compares a memfd-backed segment (NewSharedMemory,
// made only with --shm-socket) with an anonymous one (NewMemory), paired in
// each iteration: prefault of a fresh 64 MiB segment (the agent's start),
// then 1 MiB writes and seal hashes over it (steady state). Ratios are
// memfd time / anonymous time.
//
//	go test ./internal/agent/segment -run '^$' -bench SharedBacking -count 3
func BenchmarkSharedBacking(b *testing.B) {
	const size, obj = 64 << 20, 1 << 20
	var pre, steady [2]time.Duration
	src := make([]byte, obj)
	for b.Loop() {
		for k, mk := range []func(string, uint64) (*Segment, error){NewMemory, NewSharedMemory} {
			s, err := mk("bench", size)
			if err != nil {
				b.Fatal(err)
			}
			t0 := time.Now()
			if err := s.Prefault(b.Context()); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			m := s.store.(*memory)
			for off := uint64(0); off+obj <= size; off += obj {
				_ = m.writeAt(src, off)
				if _, err := m.hash(off, obj); err != nil {
					b.Fatal(err)
				}
			}
			t2 := time.Now()
			pre[k] += t1.Sub(t0)
			steady[k] += t2.Sub(t1)
			_ = s.Close()
		}
	}
	b.ReportMetric(float64(pre[1])/float64(pre[0]), "prefault-memfd/anon")
	b.ReportMetric(float64(steady[1])/float64(steady[0]), "write+hash-memfd/anon")
	b.ReportMetric(float64(pre[0])/float64(b.N)/1e6, "ms/prefault-anon")
	b.ReportMetric(float64(pre[1])/float64(b.N)/1e6, "ms/prefault-memfd")
}
