package gateway

// Helpers of state_bench_test.go: the 1M-object gateway, the snapshot
// fetcher process, the raw loopback baseline, percentiles.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

const (
	// stateBenchObjectsEnv overrides the announced set's size (1M) for a
	// quick trial of the benchmarks.
	stateBenchObjectsEnv = "GATEWAY_STATE_BENCH_OBJECTS"
	// stateBenchFetchEnv set: this process is a snapshot fetcher (see
	// TestStateBenchFetcher), fetching from the endpoint it names.
	stateBenchFetchEnv = "GATEWAY_STATE_BENCH_FETCH"
	// snapshotClientMax is the consumers' reply limit: a 1M-object reply
	// is about 317 MB, over kvevent's default MaxReplyBytes (256 MiB), so
	// a consumer of a set this large must raise it; 1 GiB is the
	// gateway's --snapshot-max-bytes default.
	snapshotClientMax = 1 << 30
)

func stateBenchObjects(b *testing.B) int {
	s := os.Getenv(stateBenchObjectsEnv)
	if s == "" {
		return 1_000_000
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive count", stateBenchObjectsEnv, s)
	}
	return n
}

const benchKeyLen = len("bench/61f148/00000000")

// benchKey is the i'th key of the benchmarks' set, as BenchmarkPipeline
// names them (crescentctl bench --mode put).
func benchKey(i int) string {
	var k [benchKeyLen]byte
	copy(k[:], "bench/61f148/")
	for d, v := benchKeyLen-1, i; d >= benchKeyLen-8; d, v = d-1, v/10 {
		k[d] = byte('0' + v%10)
	}
	return string(k[:])
}

// stateBenchConfig is testConfig with the master's response size of the
// other benchmarks, quiet logs, and loopback endpoints (snapshot included).
func stateBenchConfig(master string) Config {
	c := testConfig(master)
	c.Snapshot = "tcp://127.0.0.1:0"
	return c
}

// newStateBenchMaster is a fake master with the real master's snapshot
// page (changesvc's default SnapshotPageSize, 1000) and the benchmarks'
// 1024 changes per Watch response.
func newStateBenchMaster(b *testing.B) (*fakemaster.Master, string) {
	// Scripted: the benchmark times the gateway; Append grows the gateway's set without growing the fake's own (see fillByWatch).
	m := fakemaster.New(1)
	m.MaxPerResponse = 1024
	m.PageSize = 1000
	return m, startMaster(b, m)
}

// fillByWatch makes a watching gateway publish n stored events of
// benchKey(0..n-1), tenant "default", memory: the fake master appends them
// to its log (not its readable set, which stays small, so the fake's own
// heap does not weigh on the measurement) in chunks the size of the
// gateway's queue, each once the previous one was published, so that
// nothing is dropped (the live path drops the oldest on overflow).
func fillByWatch(b *testing.B, m *fakemaster.Master, g *Gateway, n int) {
	b.Helper()
	const chunk = 1 << 16
	base := g.Status().PublishedEvents
	for start := 0; start < n; start += chunk {
		c := min(chunk, n-start)
		changes := make([]masterv1.Change, c)
		ptrs := make([]*masterv1.Change, c)
		for j := range changes {
			changes[j] = masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_STORED,
				Tenant: "default", Key: benchKey(start + j), Medium: masterv1.Medium_MEDIUM_MEMORY}
			ptrs[j] = &changes[j]
		}
		for j := 0; j < c; j += benchBatch {
			m.Append(ptrs[j:min(j+benchBatch, c)]...)
		}
		want := base + uint64(start+c)
		testutil.Eventually(b, 60*time.Second, func() bool { return g.Status().PublishedEvents >= want }, "chunk at %d published", start)
		m.Compact(0)
	}
	settleRecorder(b, g)
	if st := g.Status(); st.DroppedEvents != 0 || st.AnnouncedEntries < n {
		b.Fatalf("filling: %d events dropped, %d announced, want 0 and %d", st.DroppedEvents, st.AnnouncedEntries, n)
	}
}

// fillMaster makes benchKey(0..n-1) readable at the master (the set a
// resync lists) and compacts its log.
func fillMaster(m *fakemaster.Master, n int) {
	for i := range n {
		m.Put("default", benchKey(i), masterv1.Medium_MEDIUM_MEMORY, "")
	}
	m.Compact(0)
}

// settleRecorder waits until the gateway published everything it queued
// and the recorder folded every batch published.
func settleRecorder(b *testing.B, g *Gateway) {
	b.Helper()
	testutil.EventuallyNoError(b, 60*time.Second, func() error {
		st := g.Status()
		if st.EnqueuedEvents == st.PublishedEvents+st.DroppedEvents && st.QueueDepth == 0 &&
			st.LastSequence > 0 && st.RecorderCut == int64(st.LastSequence) {
			return nil
		}
		return fmt.Errorf("not settled: enqueued %d published %d dropped %d queue %d last seq %d recorder cut %d",
			st.EnqueuedEvents, st.PublishedEvents, st.DroppedEvents, st.QueueDepth, st.LastSequence, st.RecorderCut)
	})
}

// fetchProc is the snapshot fetcher process (TestStateBenchFetcher).
type fetchProc struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	done bool
}

// fetchStats is what a fetcher process reports when stopped.
type fetchStats struct {
	fetches, errors, events int
	p50, max                time.Duration
}

// consumerModel is where BenchmarkGatewayStateLive's snapshot consumers
// spend their CPU and memory.
type consumerModel int

const (
	// remoteConsumers stand for consumers on other hosts: the gateway's
	// host pays for sending the bytes and for nothing else. The fetcher
	// process reads each reply off the socket into one reused buffer
	// (ZMTP framing only, no decoding, no allocation) and runs under
	// SCHED_IDLE (chrt --idle 0), so it takes only CPU time no other
	// thread wants. (nice 19 did not do that: EEVDF lets a running task
	// keep its slice, and the gateway's p99 with decoding fetchers at
	// nice 19 was no better than at nice 0.) Without chrt it falls back to
	// nice 19.
	remoteConsumers consumerModel = iota + 1
	// localConsumers decode every reply with kvevent.FetchSnapshot at nice
	// 0: consumers sharing the gateway's 2 cores, the worst case.
	localConsumers
)

// startFetchers runs `workers` snapshot-fetching loops against ep in a
// child process (this test binary again), as consumers run: in a process
// of their own, so that their work and garbage are not the gateway's. It
// returns once the first request is on its way.
func startFetchers(b *testing.B, ep string, workers int, model consumerModel) *fetchProc {
	b.Helper()
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	args := []string{"-test.run=^TestStateBenchFetcher$", "-test.bench=^$"}
	cmd := exec.Command(self, args...)
	if model == remoteConsumers {
		if chrt, err := exec.LookPath("chrt"); err == nil {
			cmd = exec.Command(chrt, append([]string{"--idle", "0", self}, args...)...)
		} else if nice, err := exec.LookPath("nice"); err == nil {
			cmd = exec.Command(nice, append([]string{"-n", "19", self}, args...)...)
		} else {
			b.Skipf("neither chrt(1) nor nice(1) found")
		}
	}
	cmd.Env = append(os.Environ(), stateBenchFetchEnv+"="+ep, "GATEWAY_STATE_BENCH_WORKERS="+strconv.Itoa(workers),
		"GATEWAY_STATE_BENCH_DISCARD="+strconv.FormatBool(model == remoteConsumers))
	cmd.Stderr = os.Stderr
	p := &fetchProc{cmd: cmd}
	if p.in, err = cmd.StdinPipe(); err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	p.out = bufio.NewScanner(out)
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if !p.done {
			p.in.Close()
			_ = cmd.Wait()
		}
	})
	if line := p.line(b); line != "ready" {
		b.Fatalf("fetcher process: %q, want ready", line)
	}
	return p
}

// line is the next line of the fetcher's protocol (others are the test
// framework's).
func (p *fetchProc) line(b *testing.B) string {
	for p.out.Scan() {
		if s, ok := strings.CutPrefix(p.out.Text(), "FETCH "); ok {
			return s
		}
	}
	b.Fatalf("fetcher process ended: %v", p.out.Err())
	return ""
}

// stop ends the loops (a fetch in flight is abandoned) and returns the
// fetcher's counts.
func (p *fetchProc) stop(b *testing.B) fetchStats {
	b.Helper()
	p.in.Close()
	line := p.line(b)
	var st fetchStats
	var p50, mx int64
	if _, err := fmt.Sscanf(line, "done %d %d %d %d %d", &st.fetches, &st.errors, &st.events, &p50, &mx); err != nil {
		b.Fatalf("fetcher process: %q: %v", line, err)
	}
	st.p50, st.max = time.Duration(p50), time.Duration(mx)
	for p.out.Scan() { // the framework's PASS
	}
	if err := p.cmd.Wait(); err != nil {
		b.Fatalf("fetcher process: %v", err)
	}
	p.done = true
	return st
}

// TestStateBenchFetcher is not a test: it is the snapshot fetcher process
// of BenchmarkGatewayStateLive (startFetchers), skipped otherwise. Its
// workers call kvevent.FetchSnapshot in a loop until stdin closes; the
// protocol on stdout is "FETCH ready", then "FETCH done fetches errors
// events p50-ns max-ns".
func TestStateBenchFetcher(t *testing.T) {
	ep := os.Getenv(stateBenchFetchEnv)
	if ep == "" {
		t.Skip("the snapshot fetcher process of BenchmarkGatewayStateLive; runs only when it starts this binary")
	}
	workers, _ := strconv.Atoi(os.Getenv("GATEWAY_STATE_BENCH_WORKERS"))
	workers = max(workers, 1)
	discard, _ := strconv.ParseBool(os.Getenv("GATEWAY_STATE_BENCH_DISCARD"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	var (
		mu      sync.Mutex
		durs    []time.Duration
		errs    atomic.Int64
		events  atomic.Int64
		started sync.WaitGroup
		wg      sync.WaitGroup
	)
	started.Add(workers)
	for range workers {
		wg.Go(func() {
			br := bufio.NewReaderSize(nil, 1<<20)
			first := true
			for ctx.Err() == nil {
				t0 := time.Now()
				if first {
					first = false
					started.Done()
				}
				var n int
				var err error
				if discard {
					err = discardSnapshot(ctx, ep, br)
				} else {
					var snap *kvevent.Snapshot
					if snap, err = kvevent.FetchSnapshot(ctx, ep, kvevent.SnapshotOptions{Timeout: 2 * time.Minute, MaxReplyBytes: snapshotClientMax}); err == nil {
						n = snap.Events()
					}
				}
				switch {
				case ctx.Err() != nil:
				case err != nil:
					errs.Add(1)
					fmt.Fprintln(os.Stderr, "fetcher:", err)
					time.Sleep(10 * time.Millisecond)
				default:
					events.Add(int64(n))
					mu.Lock()
					durs = append(durs, time.Since(t0))
					mu.Unlock()
				}
			}
		})
	}
	started.Wait()
	fmt.Println("FETCH ready")
	wg.Wait()
	slices.Sort(durs)
	var p50, mx time.Duration
	if len(durs) > 0 {
		p50, mx = durs[len(durs)/2], durs[len(durs)-1]
	}
	fmt.Printf("FETCH done %d %d %d %d %d\n", len(durs), errs.Load(), events.Load(), p50, mx)
}

// discardSnapshot asks the snapshot ROUTER at ep for a snapshot and reads
// the reply off the connection through br, discarding it: a REQ
// handshake, the request, then ZMTP frames (flags, 1- or 8-byte size,
// body) until the last one. No frame is kept, so nothing is allocated per
// reply (see remoteConsumers).
func discardSnapshot(ctx context.Context, ep string, br *bufio.Reader) error {
	_, addr, err := zmtp.SplitEndpoint(ep)
	if err != nil {
		return err
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer nc.Close()
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	defer stop()
	c, err := zmtp.Handshake(nc, zmq4.Req, false, time.Minute, zmtp.Limits{})
	if err != nil {
		return err
	}
	if err := c.Write(zmtp.AppendMessage(nil, nil, []byte("snapshot")), time.Minute); err != nil {
		return err
	}
	// The reply is all the server sends after the handshake, and nothing
	// of it was read yet: the handshake reads only its own commands.
	br.Reset(nc)
	var size [8]byte
	for {
		flags, err := br.ReadByte()
		if err != nil {
			return err
		}
		n := 0
		if flags&zmtpLong != 0 {
			if _, err := io.ReadFull(br, size[:]); err != nil {
				return err
			}
			v := binary.BigEndian.Uint64(size[:])
			if v > snapshotClientMax {
				return fmt.Errorf("snapshot frame of %d bytes", v)
			}
			n = int(v)
		} else {
			b, err := br.ReadByte()
			if err != nil {
				return err
			}
			n = int(b)
		}
		if _, err := br.Discard(n); err != nil {
			return err
		}
		if flags&(zmtpMore|zmtpCommand) == 0 {
			return nil
		}
	}
}

// ZMTP 3 frame flags (RFC 23).
const (
	zmtpMore    = 1
	zmtpLong    = 2
	zmtpCommand = 4
)

// rawLoopback is the baseline of a snapshot fetch: the time to dial a
// loopback TCP connection and move n bytes over it, written and read in
// 1 MiB calls (no framing, no decoding, no allocation).
func rawLoopback(b *testing.B, n int) time.Duration {
	b.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	werr := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			werr <- err
			return
		}
		defer c.Close()
		buf := make([]byte, 1<<20)
		for left := n; left > 0; {
			w, err := c.Write(buf[:min(len(buf), left)])
			if err != nil {
				werr <- err
				return
			}
			left -= w
		}
		werr <- nil
	}()
	buf := make([]byte, 1<<20)
	t0 := time.Now()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	got := 0
	for {
		r, err := c.Read(buf)
		got += r
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	d := time.Since(t0)
	if err := <-werr; err != nil || got != n {
		b.Fatalf("raw loopback: read %d of %d bytes, writer: %v", got, n, err)
	}
	return d
}

// copyDir copies the regular files of src into a new dst (a process
// killed at this moment leaves exactly these bytes: the page cache has
// every write(2)).
func copyDir(b *testing.B, src, dst string) {
	b.Helper()
	if err := os.MkdirAll(dst, 0o750); err != nil {
		b.Fatal(err)
	}
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == src {
			return err
		}
		if d.IsDir() {
			return fs.SkipDir
		}
		in, err := os.Open(path)
		if err != nil {
			return err
		}
		defer in.Close()
		out, err := os.Create(filepath.Join(dst, d.Name()))
		if err != nil {
			return err
		}
		if _, err := io.Copy(out, in); err != nil {
			out.Close()
			return err
		}
		return out.Close()
	})
	if err != nil {
		b.Fatal(err)
	}
}

// dirBytes is the size of the regular files directly in dir.
func dirBytes(dir string) int64 {
	var n int64
	es, _ := os.ReadDir(dir)
	for _, e := range es {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
	}
	return n
}

// pct is the q-quantile of sorted durations, in ms.
func pct(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(sorted[min(len(sorted)-1, int(q*float64(len(sorted))))].Microseconds()) / 1000
}

// rtSample is what the Go runtime and the kernel say about this process
// at one moment (runtime/metrics, getrusage): where a phase's time went.
type rtSample struct {
	sched, gcPause *metrics.Float64Histogram
	gcCycles       uint64
	gcCPU, cpu     float64
	osWait         float64 // seconds the process's threads waited for a CPU (schedstat)
	faults         float64 // page faults (getrusage minflt+majflt; prefaulted pages count too)
}

var rtNames = []string{"/sched/latencies:seconds", "/sched/pauses/total/gc:seconds", "/gc/cycles/total:gc-cycles", "/cpu/classes/gc/total:cpu-seconds"}

func readRT() rtSample {
	ss := make([]metrics.Sample, len(rtNames))
	for i, n := range rtNames {
		ss[i].Name = n
	}
	metrics.Read(ss)
	s := rtSample{cpu: cpuTime().Seconds(), osWait: runDelay(), faults: pageFaults()}
	for _, m := range ss {
		switch m.Name {
		case rtNames[0]:
			s.sched = m.Value.Float64Histogram()
		case rtNames[1]:
			s.gcPause = m.Value.Float64Histogram()
		case rtNames[2]:
			s.gcCycles = m.Value.Uint64()
		case rtNames[3]:
			s.gcCPU = m.Value.Float64()
		}
	}
	return s
}

// rtDelta accumulates the differences between samples.
type rtDelta struct {
	sched, gcPause []uint64 // bucket counts
	buckets        []float64
	pauseBuckets   []float64
	gcCycles       uint64
	gcCPU, cpu     float64
	osWait         float64
	faults         float64
}

func (d *rtDelta) add(a, b rtSample) {
	if d.sched == nil {
		d.sched, d.buckets = make([]uint64, len(b.sched.Counts)), b.sched.Buckets
		d.gcPause, d.pauseBuckets = make([]uint64, len(b.gcPause.Counts)), b.gcPause.Buckets
	}
	for i := range b.sched.Counts {
		d.sched[i] += b.sched.Counts[i] - a.sched.Counts[i]
	}
	for i := range b.gcPause.Counts {
		d.gcPause[i] += b.gcPause.Counts[i] - a.gcPause.Counts[i]
	}
	d.gcCycles += b.gcCycles - a.gcCycles
	d.gcCPU += b.gcCPU - a.gcCPU
	d.cpu += b.cpu - a.cpu
	d.osWait += b.osWait - a.osWait
	d.faults += b.faults - a.faults
}

// pageFaults is this process's page faults so far. On the VM of
// BENCHMARKS.md a first-touch fault costs about 10 µs and stalls the other
// vCPU too, so they explain much of a phase's latency there.
func pageFaults() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Minflt + ru.Majflt)
}

// runDelay is the time this process's threads spent runnable but waiting
// for a CPU (the second field of /proc/self/task/*/schedstat; threads that
// exited are not counted).
func runDelay() float64 {
	ts, _ := filepath.Glob("/proc/self/task/*/schedstat")
	var ns int64
	for _, t := range ts {
		b, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		if f := strings.Fields(string(b)); len(f) >= 2 {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			ns += v
		}
	}
	return float64(ns) / 1e9
}

// histQ is the q-quantile of a histogram's counts, in ms (the upper bound
// of the bucket it falls in; the lower bound for the last, open bucket).
func histQ(counts []uint64, buckets []float64, q float64) float64 {
	var total uint64
	for _, c := range counts {
		total += c
	}
	if total == 0 {
		return 0
	}
	want := uint64(q * float64(total))
	var seen uint64
	for i, c := range counts {
		seen += c
		if seen > want || (q == 1 && seen == total) {
			ub := buckets[i+1]
			if math.IsInf(ub, 1) {
				ub = buckets[i]
			}
			return ub * 1000
		}
	}
	return buckets[len(buckets)-2] * 1000
}

// load1 is the 1-minute load average (the machine is shared).
func load1() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
