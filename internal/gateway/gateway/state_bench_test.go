package gateway

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/gateway/status"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// The issue 13 benchmarks (BENCHMARKS.md, "Gateway restarts and
// snapshots"): a gateway that has announced 1M objects (benchKey, one
// tenant, as BenchmarkPipeline's) serves a late joiner's snapshot, keeps
// publishing live while snapshots are served, and restarts from its state
// directory. Each reports its own same-sitting baseline and the ratio.
// Run them with a fixed count (each iteration rebuilds the 1M set):
//
//	go test -run '^$' -bench GatewayState -benchtime 1x -count 3 ./internal/gateway/gateway/
//
// (make bench-gateway-state). GATEWAY_STATE_BENCH_OBJECTS=100000 and
// GATEWAY_STATE_BENCH_PHASE=2s make a quick trial.

// BenchmarkGatewayStateBootstrap: a late joiner's whole bootstrap through
// the snapshot endpoint: kvevent.FetchSnapshot (the request, the
// recorder's build of the reply from its set, the transfer, the decoding)
// plus applying every chunk to a kvevent.Index. Target: ≤ 3 s for 1M
// objects. Baseline: the same number of bytes over a raw loopback TCP
// connection (rawLoopback); x-raw is bootstrap ÷ raw.
//
// The consumer raises its reply limit: 1M objects take about 317 MB, over
// kvevent.SnapshotOptions' default MaxReplyBytes of 256 MiB (the gateway's
// --snapshot-max-bytes default is 1 GiB).
func BenchmarkGatewayStateBootstrap(b *testing.B) {
	n := stateBenchObjects(b)
	m, addr := newStateBenchMaster(b)
	cfg := stateBenchConfig(addr)
	cfg.StreamFormat = "snapshot" // the dialect of snapshot consumers
	gw := startGateway(b, cfg)
	testutil.Eventually(b, 30*time.Second, func() bool { return gw.g.Status().Watching }, "the initial snapshot")
	fillByWatch(b, m, gw.g, n)
	want := gw.g.Status().LastSequence

	var boot, fetch, apply, build, raw time.Duration
	var replyBytes int
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		snap, err := kvevent.FetchSnapshot(b.Context(), gw.g.SnapshotEndpoint(),
			kvevent.SnapshotOptions{Timeout: 2 * time.Minute, MaxReplyBytes: snapshotClientMax})
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		idx := kvevent.NewIndex()
		for _, bt := range snap.Batches {
			idx.ApplyBatch(bt)
		}
		t2 := time.Now()
		b.StopTimer()
		boot += t2.Sub(t0)
		fetch += t1.Sub(t0)
		apply += t2.Sub(t1)
		if idx.Len() != n || snap.Cut != int64(want) {
			b.Fatalf("bootstrapped %d entries at cut %d, want %d at %d", idx.Len(), snap.Cut, n, want)
		}
		rs := gw.g.rec.Stats()
		build += rs.LastBuildDuration
		replyBytes = rs.LastReplyBytes
		snap, idx = nil, nil
		raw += rawLoopback(b, replyBytes)
		b.StartTimer()
	}
	b.StopTimer()
	per := func(d time.Duration) float64 { return d.Seconds() / float64(b.N) }
	b.ReportMetric(per(boot), "boot-s")
	b.ReportMetric(per(fetch), "fetch-s")
	b.ReportMetric(per(build), "build-s")
	b.ReportMetric(per(apply), "apply-s")
	b.ReportMetric(per(raw), "raw-s")
	b.ReportMetric(float64(boot)/float64(raw), "x-raw")
	b.ReportMetric(float64(replyBytes)/1e6, "reply-MB")
	b.ReportMetric(float64(n), "objects")
}

// BenchmarkGatewayStateLive: live publish latency at 50k events/s while
// snapshots of the 1M set are served. Per iteration, three phases of
// stateLivePhase each, on one gateway: no snapshot requests (the
// baseline), then 2 concurrent snapshot loops of remote consumers (a
// fetcher process that only reads the bytes, under SCHED_IDLE: see
// remoteConsumers), then the same loops as local consumers decoding every
// reply at nice 0 (sharing the 2 cores). Latency is from just before the
// fake master's Put/Remove (the change's Append to the log) to the
// subscriber's OnBatch (a kvevent subscriber in this process, as in
// BenchmarkLatency50k): per event, p50/p99/max. Target: p99 ≤ 5 ms while
// snapshots are served (the remote phase: the consumers' decoding is not
// the gateway's).
func BenchmarkGatewayStateLive(b *testing.B) {
	const rate = 50_000
	n := stateBenchObjects(b)
	phase := stateLivePhase
	if d, err := time.ParseDuration(os.Getenv("GATEWAY_STATE_BENCH_PHASE")); err == nil {
		phase = d // a quick trial
	}
	m, addr := newStateBenchMaster(b)
	cfg := stateBenchConfig(addr)
	cfg.StreamFormat = "snapshot"
	gw := startGateway(b, cfg)
	testutil.Eventually(b, 30*time.Second, func() bool { return gw.g.Status().Watching }, "the initial snapshot")
	fillByWatch(b, m, gw.g, n)

	perPhase := int(phase.Seconds() * rate)
	phases := []struct {
		name   string
		model  consumerModel // 0: no snapshot requests
		lat    []time.Duration
		served uint64
		fs     fetchStats
		rt     rtDelta
		load   float64
	}{{name: "base"}, {name: "snap-remote", model: remoteConsumers}, {name: "snap-local", model: localConsumers}}
	total := b.N * len(phases) * perPhase
	sent := make([]int64, total) // op → UnixNano before the change
	lat := make([]int64, total)  // op → ns to the subscriber
	var received atomic.Int64
	sub, err := kvevent.Subscribe(b.Context(), gw.g.PubEndpoint(), kvevent.Options{
		Logger: testutil.Logger(), DisableIndex: true,
		OnBatch: func(bt kvevent.Batch) {
			now := time.Now().UnixNano()
			for _, e := range bt.Events {
				k, ok := strings.CutPrefix(e.Key, "live/")
				if !ok {
					continue
				}
				i, err := strconv.Atoi(k)
				if err != nil {
					continue
				}
				op := 2 * i
				if e.Type == kvevent.Removed {
					op++
				}
				if op < total {
					atomic.StoreInt64(&lat[op], now-atomic.LoadInt64(&sent[op]))
				}
			}
			received.Add(int64(len(bt.Events)))
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	testutil.Eventually(b, 30*time.Second, func() bool { return gw.g.Status().Subscribers == 1 }, "the subscriber")

	// op i: stored (even) or removed (odd) of live/<i/2>, tenant "live":
	// the set stays 1M (+1).
	op := 0
	var sending time.Duration
	run := func(count int) {
		start, from := time.Now(), op
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for op < from+count {
			<-tick.C
			due := from + min(count, int(time.Since(start).Seconds()*rate))
			for ; op < due; op++ {
				k := "live/" + strconv.Itoa(op/2)
				atomic.StoreInt64(&sent[op], time.Now().UnixNano())
				if op%2 == 0 {
					m.Put("live", k, masterv1.Medium_MEDIUM_MEMORY, "")
				} else {
					m.Remove("live", k, masterv1.Medium_MEDIUM_MEMORY)
				}
				if op%65536 == 0 {
					m.Compact(1 << 17)
				}
			}
		}
		sending += time.Since(start)
		testutil.Eventually(b, 60*time.Second, func() bool { return received.Load() >= int64(op) }, "every live event")
	}
	b.ResetTimer()
	for range b.N {
		for i := range phases {
			ph := &phases[i]
			var fp *fetchProc
			st0 := gw.g.Status()
			if ph.model != 0 {
				fp = startFetchers(b, gw.g.SnapshotEndpoint(), 2, ph.model)
			}
			from := op
			ph.load += load1() / float64(b.N)
			rt0 := readRT()
			run(perPhase)
			ph.rt.add(rt0, readRT())
			if fp != nil {
				fs := fp.stop(b)
				ph.fs.fetches += fs.fetches
				ph.fs.errors += fs.errors
				ph.fs.p50 = max(ph.fs.p50, fs.p50)
				ph.fs.max = max(ph.fs.max, fs.max)
			}
			ph.served += gw.g.Status().SnapshotsServed - st0.SnapshotsServed
			for j := from; j < op; j++ {
				ph.lat = append(ph.lat, time.Duration(atomic.LoadInt64(&lat[j])))
			}
		}
	}
	b.StopTimer()
	for i := range phases {
		ph := &phases[i]
		slices.Sort(ph.lat)
		b.ReportMetric(pct(ph.lat, 0.50), ph.name+"-p50-ms")
		b.ReportMetric(pct(ph.lat, 0.99), ph.name+"-p99-ms")
		b.ReportMetric(pct(ph.lat, 1), ph.name+"-max-ms")
		// Where the time went: how long this process's goroutines waited
		// for a thread (runtime/metrics /sched/latencies), GC cycles and
		// their longest stop-the-world pause, the process's CPU per
		// second and the GC's share of it, how long per second its
		// threads waited for a CPU the kernel gave to others (schedstat),
		// the machine's load average, its page faults per second.
		secs := phase.Seconds() * float64(b.N)
		b.ReportMetric(histQ(ph.rt.sched, ph.rt.buckets, 0.99), ph.name+"-sched-p99-ms")
		b.ReportMetric(histQ(ph.rt.sched, ph.rt.buckets, 1), ph.name+"-sched-max-ms")
		b.ReportMetric(float64(ph.rt.gcCycles)/secs, ph.name+"-gc/s")
		b.ReportMetric(histQ(ph.rt.gcPause, ph.rt.pauseBuckets, 1), ph.name+"-gc-pause-max-ms")
		b.ReportMetric(ph.rt.cpu/secs, ph.name+"-cpu-cores")
		b.ReportMetric(ph.rt.gcCPU/secs, ph.name+"-gc-cores")
		b.ReportMetric(ph.rt.osWait/secs, ph.name+"-os-wait-cores")
		b.ReportMetric(ph.load, ph.name+"-load1")
		b.ReportMetric(ph.rt.faults/secs, ph.name+"-faults/s")
		if ph.model != 0 {
			b.ReportMetric(pct(ph.lat, 0.99)/pct(phases[0].lat, 0.99), ph.name+"-x-base-p99")
			b.ReportMetric(float64(ph.served), ph.name+"-served")
			b.ReportMetric(float64(ph.fs.fetches), ph.name+"-fetched")
			b.ReportMetric(ph.fs.max.Seconds(), ph.name+"-fetch-max-s")
			if ph.fs.errors != 0 {
				b.Errorf("%s: %d snapshot fetches failed", ph.name, ph.fs.errors)
			}
		}
	}
	st, ss := gw.g.Status(), sub.Stats()
	if st.DroppedEvents != 0 || st.SubscriberDroppedBatches != 0 || ss.MissingSeqs != 0 || st.RecorderFailed {
		b.Errorf("dropped %d events, %d subscriber batches; subscriber missed %d sequences; recorder failed %v",
			st.DroppedEvents, st.SubscriberDroppedBatches, ss.MissingSeqs, st.RecorderFailed)
	}
	b.ReportMetric(float64(op)/sending.Seconds(), "events/s")
}

// stateLivePhase is the length of each phase of BenchmarkGatewayStateLive.
const stateLivePhase = 10 * time.Second

// BenchmarkGatewayStateRestart: a gateway with --state-dir announced 1M
// objects (a fresh start: its resync published them) and stopped; a new
// gateway.New on the same directory resumes. Timed from the call to New
// to the moment the new gateway has published a change made just after
// New returned (and everything queued before it): resume-s. new-s is New
// alone (reading the state). Cases:
//
//   - clean: the first gateway stopped (SIGTERM's path: final checkpoint,
//     journal fsynced).
//   - crash: a copy of the state directory taken while the first gateway
//     was still running, idle after publishing the 1M, before any periodic
//     checkpoint (its CheckpointInterval is 0): what a kill -9 at that
//     moment leaves, the empty checkpoint of its first start and a journal
//     of every batch. The restart replays the whole journal.
//   - resync (the baseline): the same restart without a state directory,
//     a full resync of the 1M from the master.
//
// --resume-hold is 0 for the restored gateways: the hold waits for
// subscribers that were attached before the restart and would count their
// reconnect (libzmq retries every 100 ms), not the gateway; with none
// attached the checkpoint recorded 0 subscribers and the default would
// hold the full 2 s. Target: resume ≤ 2 s.
func BenchmarkGatewayStateRestart(b *testing.B) {
	n := stateBenchObjects(b)
	m, addr := newStateBenchMaster(b)
	fillMaster(m, n)
	var res [3]struct {
		name             string
		newD, resumeD    time.Duration
		published, bytes int64
	}
	res[0].name, res[1].name, res[2].name = "clean", "crash", "resync"
	b.ResetTimer()
	for it := range b.N {
		b.StopTimer()
		dir := b.TempDir()
		stateDir, crashDir := filepath.Join(dir, "state"), filepath.Join(dir, "crash")
		cfg := stateBenchConfig(addr)
		cfg.StateDir, cfg.CheckpointInterval = stateDir, 0
		first := startGateway(b, cfg)
		testutil.EventuallyNoError(b, 2*time.Minute, func() error {
			if st := first.g.Status(); st.MasterRevision != m.Head() || st.PublishedEvents < uint64(n) {
				return fmt.Errorf("first gateway: published %d of %d, at revision %d of %d", st.PublishedEvents, n, st.MasterRevision, m.Head())
			}
			return nil
		})
		settleRecorder(b, first.g)
		copyDir(b, stateDir, crashDir)
		res[1].bytes += dirBytes(crashDir)
		first.stop()
		res[0].bytes += dirBytes(stateDir)
		b.StartTimer()

		restored := stateBenchConfig(addr)
		restored.ResumeHold = 0
		for i, c := range []struct {
			dir      string
			mode     string
			resynced bool
		}{{stateDir, stateRestored, false}, {crashDir, stateRestored, false}, {"", stateOff, true}} {
			cfg := restored
			cfg.StateDir = c.dir
			marker := "marker/" + strconv.Itoa(it) + "/" + res[i].name
			newD, resumeD, st := timedRestart(b, m, cfg, marker)
			if st.State != c.mode || (st.Resyncs != 0) != c.resynced {
				b.Fatalf("%s: state %q (%s), %d resyncs; want %q", res[i].name, st.State, st.StateError, st.Resyncs, c.mode)
			}
			res[i].newD += newD
			res[i].resumeD += resumeD
			res[i].published += int64(st.PublishedEvents)
		}
	}
	b.StopTimer()
	for _, r := range res {
		b.ReportMetric(r.newD.Seconds()/float64(b.N), r.name+"-new-s")
		b.ReportMetric(r.resumeD.Seconds()/float64(b.N), r.name+"-resume-s")
		b.ReportMetric(float64(r.published)/float64(b.N), r.name+"-events")
		if r.bytes > 0 {
			b.ReportMetric(float64(r.bytes)/float64(b.N)/1e6, r.name+"-dir-MB")
		}
	}
	b.ReportMetric(res[0].resumeD.Seconds()/res[2].resumeD.Seconds(), "clean-x-resync")
	b.ReportMetric(res[1].resumeD.Seconds()/res[2].resumeD.Seconds(), "crash-x-resync")
}

// timedRestart starts a gateway with cfg, makes a change (marker) at the
// master as soon as New returns, and returns New's duration, the time from
// New's call until the gateway published up to the master's head with
// nothing left queued, and its status then. The gateway is stopped.
func timedRestart(b *testing.B, m *fakemaster.Master, cfg Config, marker string) (newD, resumeD time.Duration, st status.Status) {
	b.Helper()
	t0 := time.Now()
	g, err := New(cfg, Deps{}, testutil.Logger())
	if err != nil {
		b.Fatal(err)
	}
	newD = time.Since(t0)
	m.Put("default", marker, masterv1.Medium_MEDIUM_MEMORY, "")
	head := m.Head()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		st = g.Status()
		if st.MasterRevision == head && st.PublishedEvents > 0 && st.EnqueuedEvents == st.PublishedEvents+st.DroppedEvents && !st.ResumeHolding {
			resumeD = time.Since(t0)
			break
		}
		if time.Now().After(deadline) {
			cancel()
			<-done
			b.Fatalf("no resume within 2 minutes: %+v", st)
		}
		time.Sleep(200 * time.Microsecond)
	}
	cancel()
	if err := <-done; err != nil {
		b.Fatalf("gateway Run: %v", err)
	}
	if st.DroppedEvents != 0 {
		b.Fatalf("restart dropped %d events", st.DroppedEvents)
	}
	return newD, resumeD, st
}
