package testcluster_test

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// restartObjects is BenchmarkMasterRestart's object count (make
// bench-restart sets it; issue 15's target is at least 4M).
var (
	restartObjects = flag.Int("restart-objects", 4_000_000, "objects BenchmarkMasterRestart fills the two agents with")
	restartVerify  = flag.Bool("restart-verify", true, "BenchmarkMasterRestart reads every object back after each restart")
	restartLog     = flag.Bool("restart-log", false, "BenchmarkMasterRestart writes every component's log (Info and up) to stderr")
	restartProfile = flag.String("restart-cpuprofile", "", "BenchmarkMasterRestart writes a CPU profile of the restarts alone (not the fill) to this file")
)

const restartObjectSize = 64

// restartKey is object i's key; restartValue its 64 bytes.
func restartKey(i int) string { return fmt.Sprintf("r/%08d", i) }

func restartValue(i int) []byte {
	b := make([]byte, restartObjectSize)
	for o := 0; o < len(b); o += 8 {
		binary.LittleEndian.PutUint64(b[o:], uint64(i)*0x9e3779b97f4a7c15+uint64(o))
	}
	return b
}

// fillAgents writes objects [0, n) straight into the agents' first memory
// segments (object i on agent i%2), reserved, written and sealed as a put
// leaves them, without the master: a restarted master learns them from the
// registrations alone, as after a crash. Filling through the master would
// take minutes for millions of objects on this machine; what a restart
// reads is the same table.
func fillAgents(tb testing.TB, c *testcluster.Cluster, n int) {
	tb.Helper()
	agents := c.Agents()
	now := time.Now()
	for a := range agents {
		seg := c.Agent(a).Segments().All()[0]
		var seal []segment.SealArg
		flush := func() {
			for i, err := range seg.Seal(seal, now) {
				if err != nil {
					tb.Fatalf("seal %d at agent %d: %v", seal[i].ID, a, err)
				}
			}
			seal = seal[:0]
		}
		for i := a; i < n; i += agents {
			al, err := seg.Reserve(&masterv1.ReserveItem{SegmentId: seg.ID(), Size: restartObjectSize, Tenant: "default", Key: restartKey(i), ReplicaId: 1}, now)
			if err != nil {
				tb.Fatalf("reserve object %d at agent %d: %v", i, a, err)
			}
			h, err := seg.OpenWrite(al.GetAllocationId())
			if err != nil {
				tb.Fatal(err)
			}
			v := restartValue(i)
			if err := h.WriteAt(v, 0); err != nil {
				tb.Fatal(err)
			}
			h.Close()
			seal = append(seal, segment.SealArg{ID: al.GetAllocationId(), Checksum: checksum.Sum(v)})
			if len(seal) == 4096 {
				flush()
			}
		}
		flush()
	}
}

// objectCount is the master's object count.
func objectCount(c *testcluster.Cluster) uint64 {
	n, _, _ := c.Master().Store.Stats()
	return n
}

// readRestartObjects reads objects [0, n) back and checks their bytes.
func readRestartObjects(ctx context.Context, tb testing.TB, cl *client.Client, n int) {
	tb.Helper()
	const batch = 4096
	keys := make([]string, 0, batch)
	for lo := 0; lo < n; lo += batch {
		keys = keys[:0]
		for i := lo; i < min(lo+batch, n); i++ {
			keys = append(keys, restartKey(i))
		}
		vals, errs := cl.BatchGet(ctx, keys)
		for j, err := range errs {
			if err != nil {
				tb.Fatalf("object %d after the restart: %v", lo+j, err)
			}
			if want := restartValue(lo + j); string(vals[j]) != string(want) {
				tb.Fatalf("object %d after the restart: got %x, want %x", lo+j, vals[j], want)
			}
		}
	}
}

// restartCluster is a cluster whose master waits, after a restart, for the
// agents' registrations before it serves the gateway (the default recovery
// grace is off in testcluster).
func restartCluster(tb testing.TB, perAgent uint64, gateway bool) *testcluster.Cluster {
	var lg *slog.Logger
	if *restartLog {
		lg = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	}
	return testcluster.Start(tb, testcluster.Options{
		Logger:      lg,
		Gateway:     gateway,
		AgentMemory: perAgent,
		Master: func(cfg *masterapp.Config) {
			cfg.RecoveryGrace = 2 * time.Second
			cfg.AgentTimeout = 30 * time.Second
		},
	})
}

// TestMasterRestartRebuildsWithoutChurn: a master restarted under a few
// hundred thousand objects rebuilds every one of them from the agents'
// chunked registrations, and the gateway, which resyncs against the new
// master only once the rebuild is complete, publishes nothing: no `removed`
// for objects about to come back, no `stored` for objects it already
// announced.
func TestMasterRestartRebuildsWithoutChurn(t *testing.T) {
	n := 300_000
	if testing.Short() || raceEnabled {
		n = 50_000 // the race detector slows the fill and the reads tenfold
	}
	c := restartCluster(t, 64<<20, true)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	var removed, stored atomic.Int64
	sub, err := kvevent.Subscribe(ctx, c.Gateway().PubEndpoint(), kvevent.Options{
		ReplayEndpoint: c.Gateway().ReplayEndpoint(), Logger: testutil.Logger(),
		OnBatch: func(b kvevent.Batch) {
			for _, ev := range b.Events {
				switch ev.Type {
				case kvevent.Removed:
					removed.Add(1)
				case kvevent.Stored:
					stored.Add(1)
				}
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	fillAgents(t, c, n)
	// The first restart learns the objects (the gateway announces them).
	c.RestartMaster()
	// The subscriber applies a batch to its index before OnBatch sees it,
	// so wait on the count OnBatch keeps: the last batch must be counted
	// before the measured restart, or it looks like an event across it.
	testutil.Eventually(t, time.Minute, func() bool { return stored.Load() == int64(n) && sub.Index().Len() == n },
		"the gateway to announce the %d objects", n)
	if got := removed.Load(); got != 0 {
		t.Fatalf("removed events before the measured restart: got %d, want 0", got)
	}

	before := c.Gateway().Status()
	storedBefore := stored.Load()
	start := time.Now()
	c.RestartMaster()
	testutil.Eventually(t, time.Minute, func() bool { return objectCount(c) == uint64(n) }, "the new master to hold %d objects", n)
	rebuilt := time.Since(start)
	testutil.Eventually(t, time.Minute, func() bool { return c.Gateway().Status().Resyncs > before.Resyncs },
		"the gateway to resync with the new master")
	took, ok := c.Master().Recovered()
	if !ok {
		t.Fatal("the gateway resynced while the master was recovering")
	}
	readRestartObjects(ctx, t, c.Client(t), n)
	t.Logf("%d objects: rebuilt in %v after the restart began, master recovered in %v, every object read back in %v",
		n, rebuilt.Round(time.Millisecond), took.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))

	after := c.Gateway().Status()
	if d := after.PublishedEvents - before.PublishedEvents; d != 0 {
		t.Fatalf("the gateway published %d events across the restart, want 0 (the resync difference of an unchanged set is empty)", d)
	}
	if got := removed.Load(); got != 0 {
		t.Fatalf("removed events across the restart: got %d, want 0", got)
	}
	if got := stored.Load() - storedBefore; got != 0 {
		t.Fatalf("stored events across the restart: got %d, want 0", got)
	}
	if got := sub.Index().Len(); got != n {
		t.Fatalf("subscriber index after the restart: got %d entries, want %d", got, n)
	}
}

// BenchmarkMasterRestart (make bench-restart): two agents hold
// -restart-objects objects of 64 B (filled at the agents, as a crashed
// master leaves them); the master is stopped hard and started again on the
// same address. It reports ready-s, the time from the stop until every
// object is readable again (the new master holds all of them on HEALTHY
// segments: every registration applied and activated), issue 15's number
// (target 5 s at 4M objects or more); recovery-s, the new master's
// recovery (at least its 2 s grace, then until every registration is
// done), after which a gateway resyncs; thp-MiB, the process's memory in
// transparent huge pages when ready; and verify-s, the time the client
// then takes to read every object back and check its bytes (not part of
// ready-s: it is the proof, at about 150k objects/s on this machine).
func BenchmarkMasterRestart(b *testing.B) {
	n := *restartObjects
	perAgent := uint64(n/2+1)*64 + 16<<20
	c := restartCluster(b, perAgent, false)
	fill := time.Now()
	fillAgents(b, c, n)
	b.Logf("filled %d objects into 2 agents in %v", n, time.Since(fill).Round(time.Millisecond))
	cl := c.Client(b)
	if *restartProfile != "" {
		defer testutil.StartCPUProfile(b, *restartProfile)()
	}
	b.ResetTimer()
	var ready, recovery, verify, cpu time.Duration
	var thp float64
	for range b.N {
		start, cpu0 := time.Now(), testutil.ProcessCPU()
		c.RestartMaster()
		for !readable(c, n) {
			time.Sleep(2 * time.Millisecond)
		}
		ready += time.Since(start)
		cpu += testutil.ProcessCPU() - cpu0
		thp = anonHugeMiB()
		for {
			if took, ok := c.Master().Recovered(); ok {
				recovery += took
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		if *restartVerify {
			v := time.Now()
			readRestartObjects(b.Context(), b, cl, n)
			verify += time.Since(v)
		}
	}
	b.StopTimer()
	per := func(d time.Duration) float64 { return d.Seconds() / float64(b.N) }
	b.ReportMetric(per(ready), "ready-s")
	b.ReportMetric(per(recovery), "recovery-s")
	b.ReportMetric(per(verify), "verify-s")
	b.ReportMetric(per(cpu), "cpu-s")
	b.ReportMetric(float64(n), "objects")
	b.ReportMetric(thp, "thp-MiB")
}

// anonHugeMiB is the process's anonymous memory in transparent huge pages
// (AnonHugePages of /proc/self/smaps_rollup), in MiB; 0 when unknown. The
// rebuild asks for them (meta/slab.go); this shows whether it got them.
func anonHugeMiB() float64 {
	b, err := os.ReadFile("/proc/self/smaps_rollup")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "AnonHugePages:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// readable reports whether the master holds all n objects and every
// segment is HEALTHY (the registrations were applied and activated).
func readable(c *testcluster.Cluster, n int) bool {
	if objectCount(c) != uint64(n) || c.Master().Sessions.Registering() != 0 {
		return false
	}
	for _, s := range c.Master().Registry.Segments() {
		if s.Health != masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY {
			return false
		}
	}
	return true
}
