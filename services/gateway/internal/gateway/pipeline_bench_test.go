package gateway

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/crescent-kv/crescent/services/gateway/internal/fakemaster"
	"github.com/go-zeromq/zmq4"
)

// BenchmarkPipeline measures the gateway's cost per event: the fake master
// serves Watch over gRPC on loopback (master codec) in responses of up to
// resp changes, as changesvc batches its log; the gateway follows it
// (source → queue → publisher → PUB socket) with no subscriber or one raw
// SUB connection that only reads the frames. Workload: batch puts of 128
// new 4 KiB-object keys of one tenant (crescentctl bench --mode put), so
// every change is a stored event and the announced set grows by b.N.
//
// The master's log is built with the timer stopped (fakemaster.Append, so
// the fake keeps no readable set of its own) and held back from the stream
// (fakemaster.Hold) in chunks of 64Ki changes; the timed part is the
// master sending them and the gateway publishing them. The gateway and
// the fake master share the process, so ns/event, cpu-ns/event (process
// CPU time) and allocs/op include the master's send path, which is the
// same before and after a gateway change. Use a fixed -benchtime (the set
// size, and with it the map cost, depends on b.N):
//
//	go test -run '^$' -bench Pipeline -benchtime 1000000x -count 3 ./internal/gateway/
func BenchmarkPipeline(b *testing.B) {
	for _, resp := range []int{1024, 128} {
		for _, subs := range []int{0, 1} {
			b.Run(fmt.Sprintf("resp=%d/subs=%d", resp, subs), func(b *testing.B) { benchPipeline(b, resp, subs == 1) })
		}
	}
}

func benchPipeline(b *testing.B, resp int, subscribe bool) {
	m := fakemaster.New(1)
	m.MaxPerResponse = resp
	gw := startGateway(b, testConfig(startMaster(b, m)))
	waitFor(b, "the initial snapshot", func() bool { return gw.g.Status().Watching })
	var got atomic.Uint64 // messages the subscriber read
	if subscribe {
		c, err := zmtp.Dial(b.Context(), gw.g.PubEndpoint(), zmq4.Sub, 5*time.Second, zmtp.Limits{MaxFrame: 1 << 20, MaxFrames: 4})
		if err != nil {
			b.Fatal(err)
		}
		if err := c.Write(zmtp.AppendMessage(nil, []byte{1}), 5*time.Second); err != nil {
			b.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				msg, err := c.ReadMessage()
				if err != nil {
					return
				}
				if msg.Command == "" {
					got.Add(1)
				}
			}
		}()
		b.Cleanup(func() { c.Close(); <-done })
		waitFor(b, "the subscriber", func() bool { return gw.g.Status().Subscribers == 1 })
	}

	const chunk, batch = 1 << 16, 128
	// The changes and their keys are reused from chunk to chunk (the master
	// has sent a chunk when the gateway has published it), so building the
	// backlog leaves no garbage for the timed part to collect.
	changes := make([]masterv1.Change, chunk)
	ptrs := make([]*masterv1.Change, chunk)
	for j := range changes {
		ptrs[j] = &changes[j]
	}
	const keyLen = len("bench/61f148/00000000")
	arena := make([]byte, chunk*keyLen)
	var cpu time.Duration
	var published uint64
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; {
		b.StopTimer()
		n := min(chunk, b.N-i)
		m.Hold()
		for j := range n {
			kb := arena[j*keyLen : (j+1)*keyLen]
			copy(kb, "bench/61f148/")
			for d, v := keyLen-1, i+j; d >= keyLen-8; d, v = d-1, v/10 {
				kb[d] = byte('0' + v%10)
			}
			changes[j] = masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_STORED,
				Tenant: "default", Key: unsafe.String(&kb[0], len(kb)), Medium: masterv1.Medium_MEDIUM_MEMORY}
		}
		for j := 0; j < n; j += batch {
			m.Append(ptrs[j:min(j+batch, n)]...)
		}
		i += n
		m.Compact(n) // the gateway applied everything before this chunk
		published += uint64(n)
		c0 := cpuTime()
		b.StartTimer()
		m.Release()
		for {
			st := gw.g.Status()
			if st.PublishedEvents >= published && (!subscribe || got.Load() == st.PublishedBatches) {
				break
			}
			time.Sleep(200 * time.Microsecond)
		}
		b.StopTimer()
		cpu += cpuTime() - c0
		b.StartTimer()
	}
	b.StopTimer()
	st := gw.g.Status()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/event")
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/event")
	b.ReportMetric(float64(st.PublishedEvents)/float64(max(st.PublishedBatches, 1)), "events/batch")
	if st.DroppedEvents != 0 || st.SubscriberDroppedBatches != 0 || st.Resyncs != 1 || st.PublishedEvents != uint64(b.N) || st.AnnouncedEntries != b.N {
		b.Fatalf("dropped %d events, %d subscriber batches, %d resyncs, published %d and announced %d of %d",
			st.DroppedEvents, st.SubscriberDroppedBatches, st.Resyncs, st.PublishedEvents, st.AnnouncedEntries, b.N)
	}
}

// cpuTime is the process's user and system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
