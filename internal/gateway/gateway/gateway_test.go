package gateway

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if resp := os.Getenv(benchMasterEnv); resp != "" {
		n, _ := strconv.Atoi(resp)
		if err := benchMaster(n); err != nil {
			fmt.Fprintln(os.Stderr, "bench master:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func testConfig(master string) Config {
	c := DefaultConfig()
	c.Master = master
	c.Pub = "tcp://127.0.0.1:0"
	c.Replay = "tcp://127.0.0.1:0"
	c.Snapshot = "tcp://127.0.0.1:0"
	c.AdminAddr = "127.0.0.1:0"
	c.GRPCAddr = "127.0.0.1:0"
	c.BackendID = "e2e"
	c.ReconnectMin = time.Millisecond
	c.ReconnectMax = 20 * time.Millisecond
	c.ShutdownTimeout = time.Second
	return c
}

// startMaster serves a fake master until the test ends.
func startMaster(t testing.TB, m *fakemaster.Master) string {
	t.Helper()
	addr, stop, err := fakemaster.Serve(m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return addr
}

type running struct {
	g    *Gateway
	stop func()
}

// startGateway runs a gateway; stop ends it (also at cleanup).
func startGateway(t testing.TB, cfg Config) *running {
	t.Helper()
	g, err := New(cfg, Deps{}, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	stopped := false
	r := &running{g: g, stop: func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("gateway Run: %v", err)
		}
	}}
	t.Cleanup(r.stop)
	return r
}

func wireMedium(m masterv1.Medium) kvevent.Medium {
	if m == masterv1.Medium_MEDIUM_DISK {
		return kvevent.MediumDisk
	}
	return kvevent.MediumCPU
}

func masterKeys(m *fakemaster.Master) []kvevent.Key {
	var out []kvevent.Key
	for k := range m.Readable() {
		out = append(out, kvevent.Key{Tenant: k.Tenant, Key: k.Key, Medium: wireMedium(k.Medium)})
	}
	slices.SortFunc(out, func(a, b kvevent.Key) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Medium, b.Medium))
	})
	return out
}

// settled waits until the gateway applied the master's head, published
// everything, and the subscriber received the last sequence.
func settled(t testing.TB, m *fakemaster.Master, g *Gateway, sub *kvevent.Subscriber) {
	t.Helper()
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		st := g.Status()
		if st.MasterEpoch == m.Epoch() && st.MasterRevision == m.Head() &&
			st.EnqueuedEvents == st.PublishedEvents+st.DroppedEvents &&
			st.LastSequence > 0 && sub.Stats().LastSeq == st.LastSequence {
			return nil
		}
		return fmt.Errorf("pipeline did not settle: gateway %+v subscriber %+v master epoch %d head %d", st, sub.Stats(), m.Epoch(), m.Head())
	})
}

// randomWorkload mutates the master like a cache under load: puts on both
// media, upserts (removed then stored), removes, RemoveAll of tenants
// (some empty), with stream drops, compactions and a failover mixed in.
func randomWorkload(t *testing.T, m *fakemaster.Master, rng *rand.Rand, ops int, chaos bool) {
	tenants := []string{"alpha", "beta", "gamma"}
	media := []masterv1.Medium{masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK}
	for i := range ops {
		tn := tenants[rng.IntN(len(tenants))]
		key := fmt.Sprintf("model/layer-%d/block-%03d", rng.IntN(4), rng.IntN(60))
		med := media[rng.IntN(2)]
		switch r := rng.IntN(100); {
		case r < 55:
			m.Put(tn, key, med, fmt.Sprintf("g%d", rng.IntN(3)))
		case r < 90:
			m.Remove(tn, key, med)
		case r < 93:
			m.RemoveAll(tn)
		case chaos && r < 96:
			m.DropStreams()
		case chaos && r < 98:
			m.Compact(rng.IntN(20))
		default:
		}
		if chaos && i == ops/2 {
			m.Restart(m.Epoch() + 1) // failover: new epoch, log restarts at 1
		}
	}
}

// TestEndToEnd: fake master → gateway → kvevent subscriber. After a random
// workload with stream drops, compactions and a failover, the subscriber's
// index equals the master's readable set and its sequence had no gaps.
// (gateway_cluster_test.go covers puts, removes, an agent leaving and a
// master restart against the real master.)
func TestEndToEnd(t *testing.T) {
	// Scripted: a real master never drops a Watch stream in its epoch or compacts under a following gateway on demand.
	m := fakemaster.New(100)
	m.MaxPerResponse = 16
	m.Put("alpha", "preexisting", masterv1.Medium_MEDIUM_MEMORY, "g")
	gw := startGateway(t, testConfig(startMaster(t, m)))
	sub, err := kvevent.Subscribe(t.Context(), gw.g.PubEndpoint(), kvevent.Options{
		ReplayEndpoint: gw.g.ReplayEndpoint(), FromSeq: 1, Logger: testutil.Logger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	testutil.Eventually(t, 30*time.Second, func() bool { return gw.g.Status().Subscribers == 1 }, "subscriber")

	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 3 {
		randomWorkload(t, m, rng, 400, round > 0)
		settled(t, m, gw.g, sub)
		if got, want := sub.Index().Keys(), masterKeys(m); !slices.Equal(got, want) {
			t.Fatalf("round %d: subscriber index (%d) != master readable set (%d)\n got %v\nwant %v", round, len(got), len(want), got, want)
		}
	}
	st, ss := gw.g.Status(), sub.Stats()
	if ss.MissingSeqs != 0 || ss.Resets != 0 || ss.Malformed != 0 || st.DroppedEvents != 0 {
		t.Errorf("subscriber stats %+v, gateway dropped %d: want no gaps, resets, malformed or drops", ss, st.DroppedEvents)
	}
	if st.Resyncs < 2 {
		t.Errorf("resyncs = %d, want the initial one plus at least one after failover/compaction", st.Resyncs)
	}
	t.Logf("gateway: %d batches, %d events, %d resyncs; master epoch %d head %d; %d readable",
		st.PublishedBatches, st.PublishedEvents, st.Resyncs, m.Epoch(), m.Head(), len(masterKeys(m)))
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Config)
	}{
		{"no backend id", func(c *Config) { c.BackendID = "" }},
		{"no master", func(c *Config) { c.Master = "" }},
		{"block size over u32", func(c *Config) { c.BlockSize = 1 << 33 }},
		{"max batch 0", func(c *Config) { c.MaxBatch = 0 }},
		{"bad pub", func(c *Config) { c.Pub = "tcp:/x" }},
		{"reconnect inverted", func(c *Config) { c.ReconnectMax = 0 }},
		{"replay conns per peer 0", func(c *Config) { c.ReplayMaxConnsPerPeer = 0 }},
		{"replay idle timeout 0", func(c *Config) { c.ReplayIdleTimeout = 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := testConfig("m:1")
			tt.mod(&c)
			if err := c.Validate(); err == nil {
				t.Error("Validate() = nil, want an error")
			}
			if _, err := New(c, Deps{}, testutil.Logger()); err == nil {
				t.Error("New accepted an invalid config")
			}
		})
	}
	c := testConfig("m:1")
	if err := c.Validate(); err != nil {
		t.Errorf("Validate(test config) = %v", err)
	}
	fs := flag.NewFlagSet("gw", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"--replay-max-conns-per-peer=7", "--replay-idle-timeout=3s"}); err != nil {
		t.Fatal(err)
	}
	if p := c.publisherConfig(); p.ReplayMaxConnsPerPeer != 7 || p.ReplayIdleTimeout != 3*time.Second {
		t.Errorf("publisher config from flags: %d per peer, idle %v; want 7, 3s", p.ReplayMaxConnsPerPeer, p.ReplayIdleTimeout)
	}
}
