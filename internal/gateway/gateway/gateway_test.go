package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
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
func TestEndToEnd(t *testing.T) {
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

// TestGatewayRestart: a subscriber connected to one gateway process
// reconnects to its replacement (same ports), detects the restart, and
// converges on the master's set from the new process's replay ring.
func TestGatewayRestart(t *testing.T) {
	m := fakemaster.New(5)
	addr := startMaster(t, m)
	rng := rand.New(rand.NewPCG(3, 4))
	randomWorkload(t, m, rng, 300, false)
	cfg := testConfig(addr)
	gw1 := startGateway(t, cfg)
	var (
		mu   sync.Mutex
		gaps []kvevent.Gap
	)
	sub, err := kvevent.Subscribe(t.Context(), gw1.g.PubEndpoint(), kvevent.Options{
		ReplayEndpoint: gw1.g.ReplayEndpoint(), FromSeq: 1, Logger: testutil.Logger(),
		OnGap:        func(g kvevent.Gap) { gaps = append(gaps, g) },
		ReconnectMin: time.Millisecond, ReconnectMax: 20 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	randomWorkload(t, m, rng, 300, false)
	settled(t, m, gw1.g, sub)

	// Replace the gateway on the same endpoints while the master changes.
	cfg.Pub, cfg.Replay = gw1.g.PubEndpoint(), gw1.g.ReplayEndpoint()
	gw1.stop()
	randomWorkload(t, m, rng, 200, false)
	gw2 := startGateway(t, cfg)
	testutil.Eventually(t, 30*time.Second, func() bool { return gw2.g.Status().Subscribers == 1 }, "the subscriber to reconnect")
	randomWorkload(t, m, rng, 50, false)
	m.Put("alpha", "after-restart", masterv1.Medium_MEDIUM_MEMORY, "") // at least one live event
	// Sequence numbers restarted, so "same last sequence" proves nothing
	// here: wait for the index to converge on the master's set.
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		if slices.Equal(sub.Index().Keys(), masterKeys(m)) {
			return nil
		}
		return fmt.Errorf("after a gateway restart the index (%d) never matched the master set (%d); subscriber %+v gateway %+v",
			sub.Index().Len(), len(masterKeys(m)), sub.Stats(), gw2.g.Status())
	})
	settled(t, m, gw2.g, sub)
	if ss := sub.Stats(); ss.Resets != 1 || ss.Unrepaired != 0 {
		t.Errorf("subscriber stats %+v, want one reset, nothing unrepaired", ss)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(gaps) != 1 || !gaps[0].Reset {
		t.Errorf("gaps = %+v, want exactly one reset", gaps)
	}
}

func TestStatusEndpoints(t *testing.T) {
	m := fakemaster.New(1)
	cfg := testConfig(startMaster(t, m))
	cfg.EmitObjectKey = false
	gw := startGateway(t, cfg)
	testutil.Eventually(t, 30*time.Second, func() bool { return gw.g.Status().Watching }, "the initial snapshot")
	m.Put("t", "a", masterv1.Medium_MEDIUM_MEMORY, "")
	m.Put("t", "b", masterv1.Medium_MEDIUM_DISK, "")
	m.RemoveAll("t")
	testutil.Eventually(t, 30*time.Second, func() bool { return gw.g.Status().PublishedEvents == 1 }, "the cleared event")

	resp, err := http.Get("http://" + gw.g.AdminAddr() + "/kv_events/status")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var doc map[string]any
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatalf("status is not JSON: %v\n%s", err, body)
	}
	want := map[string]any{"enabled": true, "published_batches": 1.0, "published_events": 1.0, "dropped_events": 0.0, "skipped_keyless_events": 2.0}
	for k, v := range want {
		if doc[k] != v {
			t.Errorf("status %s = %v, want %v", k, doc[k], v)
		}
	}
	// Mooncake's five fields come first.
	order := []string{`"enabled"`, `"published_batches"`, `"published_events"`, `"dropped_events"`, `"skipped_keyless_events"`, `"enqueued_events"`}
	for i := 1; i < len(order); i++ {
		if strings.Index(string(body), order[i-1]) > strings.Index(string(body), order[i]) {
			t.Errorf("status field %s after %s", order[i-1], order[i])
		}
	}

	resp, err = http.Get("http://" + gw.g.AdminAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, line := range []string{
		"crescent_gateway_kv_events_enabled 1",
		"crescent_gateway_kv_events_published_events_total 1",
		"crescent_gateway_kv_events_skipped_keyless_events_total 2",
		"crescent_gateway_kv_events_dropped_events_total 0",
		"crescent_gateway_kv_events_peers_refused_total 0",
		"crescent_gateway_kv_events_peers_dropped_total 0",
	} {
		if !strings.Contains(string(metrics), line+"\n") {
			t.Errorf("metrics lack %q", line)
		}
	}

	cc, err := grpc.NewClient(gw.g.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	gs, err := gatewayv1.NewGatewayServiceClient(cc).GetStatus(t.Context(), &gatewayv1.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !gs.GetEnabled() || gs.GetPublishedEvents() != 1 || gs.GetSkippedKeylessEvents() != 2 || gs.GetMasterEpoch() != 1 || gs.GetMasterRevision() != m.Head() || gs.GetLastSequence() != 1 {
		t.Errorf("GetStatus = %v", gs)
	}

	resp, err = http.Get("http://" + gw.g.AdminAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz = %d, want 200 once synced", resp.StatusCode)
	}
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
