package meta

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/token"
)

// BenchmarkHeapPerObject loads 1M single-replica objects (32-byte keys,
// default tenant, no group) through the batch put path and reports the
// master's heap bytes per object, change log (default retention) included.
// Run it with -benchtime=1x.
func BenchmarkHeapPerObject(b *testing.B) {
	b.Run("changelog=default", func(b *testing.B) { benchHeap(b, 0) })
	b.Run("changelog=1k", func(b *testing.B) { benchHeap(b, 1024) })
}

func benchHeap(b *testing.B, retention int) {
	const n = 1 << 20
	for b.Loop() {
		b.StopTimer()
		c := metatest.NewCluster(4, 2, 1<<50)
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("%032x", uint64(i)*0x9e3779b97f4a7c15)
		}
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		b.StartTimer()
		s, err := New(Config{ChangeRetention: retention}, Deps{Registry: c.Reg, Agents: &metatest.NullAgents{},
			Identity: cluster.Identity{Epoch: 1, Keys: token.NewRing(0, nil)}}, nil)
		if err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		const batch = 1024
		specs := make([]PutSpec, batch)
		ends := make([]PutEndSpec, batch)
		for i := 0; i < n; i += batch {
			for j := range batch {
				specs[j] = PutSpec{Key: keys[i+j], Size: 4096, ClientID: "w"}
				ends[j] = PutEndSpec{Key: keys[i+j], ClientID: "w", Checksum: 1}
			}
			for _, r := range s.BatchPutStart(ctx, specs) {
				if r.Err != nil {
					b.Fatal(r.Err)
				}
			}
			for _, err := range s.BatchPutEnd(ctx, ends) {
				if err != nil {
					b.Fatal(err)
				}
			}
		}
		b.StopTimer()
		keys = nil
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		objs, _, rev := s.Stats()
		if objs != n || rev != n {
			b.Fatalf("objects %d revision %d, want %d", objs, rev, n)
		}
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/n, "B/object")
		b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "puts/s")
		runtime.KeepAlive(s)
		b.StartTimer()
	}
}

func benchStore(b *testing.B) *Store {
	b.Helper()
	c := metatest.NewCluster(4, 2, 1<<50)
	s, err := New(Config{}, Deps{Registry: c.Reg, Agents: &metatest.NullAgents{},
		Identity: cluster.Identity{Epoch: 1, Keys: token.NewRing(0, nil)}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// BenchmarkStoreBatchPut128 is BatchPutStart+BatchPutEnd of 128 keys
// straight on the store (no gRPC), agents answering instantly.
func BenchmarkStoreBatchPut128(b *testing.B) {
	s := benchStore(b)
	ctx := context.Background()
	specs := make([]PutSpec, 128)
	ends := make([]PutEndSpec, 128)
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		for j := range specs {
			k := fmt.Sprintf("%032x", n)
			n++
			specs[j] = PutSpec{Key: k, Size: 4096, ClientID: "w"}
			ends[j] = PutEndSpec{Key: k, ClientID: "w"}
		}
		s.BatchPutStart(ctx, specs)
		s.BatchPutEnd(ctx, ends)
	}
	b.ReportMetric(float64(b.N*128)/b.Elapsed().Seconds(), "keys/s")
}

// BenchmarkStoreBatchGet128 is BatchGet of 128 keys straight on the store.
func BenchmarkStoreBatchGet128(b *testing.B) {
	s := benchStore(b)
	ctx := context.Background()
	const n = 1 << 14
	specs := make([]PutSpec, n)
	ends := make([]PutEndSpec, n)
	for i := range specs {
		k := fmt.Sprintf("%032x", i)
		specs[i] = PutSpec{Key: k, Size: 4096, ClientID: "w"}
		ends[i] = PutEndSpec{Key: k, ClientID: "w"}
	}
	s.BatchPutStart(ctx, specs)
	s.BatchPutEnd(ctx, ends)
	gets := make([]GetSpec, 128)
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		for j := range gets {
			gets[j] = GetSpec{Key: specs[i%n].Key}
			i++
		}
		for _, r := range s.BatchGet(ctx, gets) {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
		}
	}
	b.ReportMetric(float64(b.N*128)/b.Elapsed().Seconds(), "keys/s")
}

// BenchmarkListObjectsPage lists one 1000-key page from the middle of a
// 200k-object tenant.
func BenchmarkListObjectsPage(b *testing.B) {
	s := benchStore(b)
	ctx := context.Background()
	const n = 200_000
	for lo := 0; lo < n; lo += 1024 {
		specs := make([]PutSpec, 0, 1024)
		ends := make([]PutEndSpec, 0, 1024)
		for i := lo; i < min(lo+1024, n); i++ {
			k := fmt.Sprintf("%032x", i)
			specs = append(specs, PutSpec{Key: k, Size: 64, ClientID: "w"})
			ends = append(ends, PutEndSpec{Key: k, ClientID: "w"})
		}
		s.BatchPutStart(ctx, specs)
		s.BatchPutEnd(ctx, ends)
	}
	tok := EncodePageToken(fmt.Sprintf("%032x", n/2))
	b.ReportAllocs()
	for b.Loop() {
		infos, _, err := s.ListObjects(ctx, "", "", 1000, tok)
		if err != nil || len(infos) != 1000 {
			b.Fatalf("ListObjects: %d infos, %v", len(infos), err)
		}
	}
}
