package dataplane

import (
	"strconv"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/token"
)

// BenchmarkShmRead reads one sealed object through the shared-memory
// client, paired in every iteration with a plain copy of the same size
// (ratio memcpy/shm: 1 would be the copy's speed); no checksum, no master.
// The agent is in the same process, on the same two cores.
//
//	go test ./internal/agent/dataplane -run '^$' -bench ShmRead -count 3
func BenchmarkShmRead(b *testing.B) {
	for _, size := range []int{4 << 10, 1 << 20} {
		b.Run(strconv.Itoa(size), func(b *testing.B) {
			e := startShm(b, ShmConfig{})
			data := randBytes(size)
			id := e.reserve(b, e.shared, uint64(size))
			if errs, err := e.client.Write(b.Context(), []*agentv1.TransferItem{e.item(e.shared, id, token.Write)}, [][]byte{data}); err != nil || errs[0] != nil {
				b.Fatal(errs, err)
			}
			if err := e.shared.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(data)}}, now)[0]; err != nil {
				b.Fatal(err)
			}
			dst := make([]byte, size)
			items := []*agentv1.TransferItem{e.item(e.shared, id, token.Read)}
			var tc, ts time.Duration
			for b.Loop() {
				t0 := time.Now()
				copy(dst, data)
				t1 := time.Now()
				res, err := e.client.Read(b.Context(), items, [][]byte{dst})
				ts += time.Since(t1)
				tc += t1.Sub(t0)
				if err != nil || res[0].Err != nil {
					b.Fatal(res, err)
				}
			}
			b.ReportMetric(float64(tc)/float64(ts), "memcpy/shm")
			b.ReportMetric(float64(ts)/float64(b.N)/1e3, "µs/shm-read")
			b.ReportMetric(float64(tc)/float64(b.N)/1e3, "µs/memcpy")
		})
	}
}
