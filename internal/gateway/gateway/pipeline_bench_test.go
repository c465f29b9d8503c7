package gateway

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// BenchmarkPipeline measures the gateway's cost per event, in its own
// process as in production: the fake master runs in a child process (this
// test binary again, see benchMaster) and serves Watch over gRPC on
// loopback with the master's codec, in responses of up to resp changes as
// changesvc batches its log; the gateway follows it (source → queue →
// publisher → PUB socket) with no subscriber or one raw SUB connection
// that only reads the frames (in the benchmark process: about an eighth of
// its CPU in live50k/subs=1, the same before and after a gateway change).
// Workload: batch puts of 128 new 4 KiB-object keys of one tenant
// (crescentctl bench --mode put), so every change is a stored event and
// the announced set grows by b.N.
//
// The master builds its log in chunks of 64Ki changes while the timer is
// stopped. In the resp variants it holds a chunk back from the stream
// (fakemaster.Hold) and then releases it at once: the gateway catches up
// with responses of resp changes back to back. In the live variants it
// commits the chunk 128 changes at a time at a fixed rate (50k events/s,
// about what the cluster benchmark puts on a 2-core machine) and responses
// carry what accumulated, so each commit costs the gateway its wake-ups
// (gRPC reader, source, publisher, subscriber writer); only cpu-ns/event
// means anything there. cpu-ns/event is this process's CPU time per event.
// Use a fixed -benchtime (the set size, and with it the map cost, depends
// on b.N):
//
//	go test -run '^$' -bench 'Pipeline/resp' -benchtime 2000000x -count 3 ./internal/gateway/
//	go test -run '^$' -bench 'Pipeline/live' -benchtime 500000x -count 3 ./internal/gateway/
func BenchmarkPipeline(b *testing.B) {
	for _, resp := range []int{1024, 128} {
		for _, subs := range []int{0, 1} {
			b.Run(fmt.Sprintf("resp=%d/subs=%d", resp, subs), func(b *testing.B) { benchPipeline(b, resp, 0, subs == 1) })
		}
	}
	for _, subs := range []int{0, 1} {
		b.Run(fmt.Sprintf("live50k/subs=%d", subs), func(b *testing.B) { benchPipeline(b, 1024, 50_000, subs == 1) })
	}
}

// benchPipeline: rate 0 releases each chunk of the master's log at once;
// a positive rate commits it in batches at rate events/s.
func benchPipeline(b *testing.B, resp int, rate float64, subscribe bool) {
	m := startBenchMaster(b, resp)
	gw := startGateway(b, testConfig(m.addr))
	testutil.Eventually(b, 30*time.Second, func() bool { return gw.g.Status().Watching }, "the initial snapshot")
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
		testutil.Eventually(b, 30*time.Second, func() bool { return gw.g.Status().Subscribers == 1 }, "the subscriber")
	}

	var cpu time.Duration
	var published uint64
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; {
		b.StopTimer()
		n := min(benchChunk, b.N-i)
		m.do(b, "prep %d %d %g", i, n, rate)
		i += n
		published += uint64(n)
		c0 := cpuTime()
		b.StartTimer()
		m.do(b, "go")
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

const (
	benchMasterEnv = "GATEWAY_BENCH_MASTER" // set: this process is benchMaster, serving resp changes per response
	benchChunk     = 1 << 16
	benchBatch     = 128
)

// benchMasterProc is the child process serving the fake master.
type benchMasterProc struct {
	addr string
	in   io.Writer
	out  *bufio.Scanner
}

func startBenchMaster(b *testing.B, resp int) *benchMasterProc {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), benchMasterEnv+"="+strconv.Itoa(resp))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		in.Close() // benchMaster returns at the end of its input
		if err := cmd.Wait(); err != nil {
			b.Errorf("bench master: %v", err)
		}
	})
	p := &benchMasterProc{in: in, out: bufio.NewScanner(out)}
	if !p.out.Scan() {
		b.Fatalf("bench master did not start: %v", p.out.Err())
	}
	p.addr = p.out.Text()
	return p
}

// do sends a command and waits for its "ok".
func (p *benchMasterProc) do(b *testing.B, format string, args ...any) {
	if _, err := fmt.Fprintf(p.in, format+"\n", args...); err != nil {
		b.Fatal(err)
	}
	if !p.out.Scan() || p.out.Text() != "ok" {
		b.Fatalf("bench master answered %q to %q (%v)", p.out.Text(), fmt.Sprintf(format, args...), p.out.Err())
	}
}

// benchMaster serves a fake master for BenchmarkPipeline: it prints its
// address, then answers each command with "ok":
//
//	prep start n rate  build the changes storing keys start..start+n-1
//	                   (rate 0: appended, but held back from the stream)
//	go                 rate 0: release them; else commit them, benchBatch
//	                   at a time, at rate changes/s
//
// The changes and their keys are reused from chunk to chunk (the gateway
// has applied a chunk before the next prep), so the master makes no
// garbage of its own.
func benchMaster(resp int) error {
	// Scripted: Hold/Append build a backlog and a log that grows no set, which a real master cannot do.
	m := fakemaster.New(1)
	m.MaxPerResponse = resp
	addr, stop, err := fakemaster.Serve(m)
	if err != nil {
		return err
	}
	defer stop()
	fmt.Println(addr)
	changes := make([]masterv1.Change, benchChunk)
	ptrs := make([]*masterv1.Change, benchChunk)
	for j := range changes {
		ptrs[j] = &changes[j]
	}
	const keyLen = len("bench/61f148/00000000")
	keys := make([]byte, benchChunk*keyLen)
	var n int
	var rate float64
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var start int
		switch cmd := in.Text(); {
		case cmd == "go" && rate == 0:
			m.Release()
		case cmd == "go":
			t0 := time.Now()
			for j := 0; j < n; j += benchBatch {
				if d := time.Until(t0.Add(time.Duration(float64(j) / rate * 1e9))); d > 0 {
					time.Sleep(d)
				}
				m.Append(ptrs[j:min(j+benchBatch, n)]...)
			}
		default:
			if _, err := fmt.Sscanf(cmd, "prep %d %d %g", &start, &n, &rate); err != nil {
				return fmt.Errorf("command %q: %w", cmd, err)
			}
			m.Compact(0) // the gateway applied everything: the changes may be reused
			for j := range n {
				kb := keys[j*keyLen : (j+1)*keyLen]
				copy(kb, "bench/61f148/")
				for d, v := keyLen-1, start+j; d >= keyLen-8; d, v = d-1, v/10 {
					kb[d] = byte('0' + v%10)
				}
				changes[j] = masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_STORED,
					Tenant: "default", Key: unsafe.String(&kb[0], len(kb)), Medium: masterv1.Medium_MEDIUM_MEMORY}
			}
			if rate == 0 {
				m.Hold()
				for j := 0; j < n; j += benchBatch {
					m.Append(ptrs[j:min(j+benchBatch, n)]...)
				}
			}
		}
		fmt.Println("ok")
	}
	return in.Err()
}
