package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// readable is the master's readable (tenant, key, medium) set, from
// ChangeService.Snapshot (an admin's call).
func (c *Cluster) readable(ctx context.Context) (map[kvevent.Key]bool, error) {
	stream, err := c.admin().Changes().Snapshot(ctx, &masterv1.SnapshotRequest{})
	if err != nil {
		return nil, err
	}
	out := map[kvevent.Key]bool{}
	for {
		page, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		for _, e := range page.GetEntries() {
			m := kvevent.MediumCPU
			if e.GetMedium() == masterv1.Medium_MEDIUM_DISK {
				m = kvevent.MediumDisk
			}
			out[kvevent.Key{Tenant: e.GetTenant(), Key: e.GetKey(), Medium: m}] = true
		}
		if page.GetLast() {
			return out, nil
		}
	}
}

// sameSet reports the difference between the subscriber's index and the
// master's readable set ("" when equal).
func sameSet(idx []kvevent.Key, master map[kvevent.Key]bool) string {
	var extra, missing []string
	seen := map[kvevent.Key]bool{}
	for _, k := range idx {
		seen[k] = true
		if !master[k] {
			extra = append(extra, fmt.Sprintf("%s/%s/%v", k.Tenant, k.Key, k.Medium))
		}
	}
	for k := range master {
		if !seen[k] {
			missing = append(missing, fmt.Sprintf("%s/%s/%v", k.Tenant, k.Key, k.Medium))
		}
	}
	if len(extra) == 0 && len(missing) == 0 {
		return ""
	}
	slices.Sort(extra)
	slices.Sort(missing)
	return fmt.Sprintf("subscriber has %d extra %v, lacks %d %v", len(extra), head(extra), len(missing), head(missing))
}

func head(s []string) []string {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}

func subscribe(t *testing.T, c *Cluster, onBatch ...func(kvevent.Batch)) *kvevent.Subscriber {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	sub, err := kvevent.Subscribe(ctx, c.GatewayPub, kvevent.Options{
		ReplayEndpoint: c.GatewayRepl,
		FromSeq:        1,
		OnGap:          func(g kvevent.Gap) { t.Logf("gap: %+v", g) },
		OnBatch: func(b kvevent.Batch) {
			for _, f := range onBatch {
				f(b)
			}
		},
	})
	if err != nil {
		t.Fatalf("Subscribe: %v", err)
	}
	t.Cleanup(func() { sub.Close() })
	return sub
}

// converge waits until the subscriber's index equals the master's readable
// set.
func converge(t *testing.T, c *Cluster, sub *kvevent.Subscriber) {
	t.Helper()
	ctx := ctxT(t, 30*time.Second)
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		m, err := c.readable(ctx)
		if err != nil {
			return err
		}
		if d := sameSet(sub.Index().Keys(), m); d != "" {
			return errors.New(d)
		}
		return nil
	})
}

type gatewayStatus struct {
	Enabled              bool   `json:"enabled"`
	PublishedBatches     uint64 `json:"published_batches"`
	PublishedEvents      uint64 `json:"published_events"`
	DroppedEvents        uint64 `json:"dropped_events"`
	SkippedKeylessEvents uint64 `json:"skipped_keyless_events"`
	// Continuity (docs/gateway-state.md).
	LastSequence   uint64 `json:"last_sequence"`
	PublisherEpoch string `json:"publisher_epoch"`
	State          string `json:"state"`
	StateError     string `json:"state_error"`
}

// gatewayStatus reads /kv_events/status, waiting (10 s) for a gateway that
// is still starting.
func (c *Cluster) gatewayStatus(t testing.TB) gatewayStatus {
	t.Helper()
	var st gatewayStatus
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		resp, err := c.Gateway.get("/kv_events/status")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status: %s", resp.Status)
		}
		return json.NewDecoder(resp.Body).Decode(&st)
	})
	return st
}

// TestEventsMatchMaster runs a random workload — puts on memory and disk,
// upserts, removes, a RemoveAll that empties a tenant and one that skips a
// leased object, evictions, and an agent killed — and checks that a
// subscriber applying the gateway's stream holds exactly the master's
// readable set, with no sequence gap.
func TestEventsMatchMaster(t *testing.T) {
	// A segment is suspected after 1 s without a heartbeat (placement
	// skips it): short enough for the agent kill below, long enough that
	// a loaded CI machine's stalls do not fail the fill's puts.
	c := StartCluster(t, Options{Agents: 3, AgentMemory: "8MiB", Disk: true, Gateway: true,
		SuspectAfter: time.Second, UnmountAfter: 2500 * time.Millisecond,
		MasterFlags: []string{"--lease-ttl", "2s"}})
	sub := subscribe(t, c)
	ctx := ctxT(t, 3*time.Minute)
	rng := rand.New(rand.NewPCG(1, 2))
	tenants := []string{"t1", "t2", "t3"}
	cls := map[string]*client.Client{}
	for _, tn := range tenants {
		cls[tn] = c.Client(tn)
	}
	payload := randBytes(t, 1<<20)
	for step := 0; step < 300; step++ {
		tn := tenants[rng.IntN(len(tenants))]
		cl := cls[tn]
		key := fmt.Sprintf("k%02d", rng.IntN(40))
		size := 1 + rng.IntN(300<<10)
		if rng.IntN(10) == 0 {
			size = 1 << 20 // big ones push memory segments into eviction
		}
		switch op := rng.IntN(10); {
		case op < 4:
			opts := []client.PutOption{client.WithReplicas(1 + rng.IntN(2))}
			if rng.IntN(4) == 0 {
				opts = append(opts, client.WithMedium(masterv1.Medium_MEDIUM_DISK))
			}
			if rng.IntN(6) == 0 {
				opts = append(opts, client.WithGroup("g-"+key))
			}
			_ = cl.Put(ctx, key, payload[:size], opts...) // exists / no space are fine
		case op < 6:
			_ = cl.Put(ctx, key, payload[:size], client.WithUpsert())
		case op < 8:
			_ = cl.Remove(ctx, key, rng.IntN(2) == 0)
		case op < 9:
			_, _ = cl.Get(ctx, key)
		default:
			_, _, _ = cl.RemoveByPrefix(ctx, "k1", true)
		}
	}
	// Fill memory past the high watermark: PutStart evicts the least
	// recently used unpinned objects to make room.
	for i := 0; i < 40; i++ {
		key := fmt.Sprintf("fill/%02d", i)
		// Each put finds room: its eviction makes a hole, and an offload
		// pass moving the segment's objects to disk at the same moment
		// frees their memory under evictMu, so the hole is never promised
		// before the agent freed it (once in about 40 runs under load
		// before: NO_AVAILABLE_HANDLE, "largest free extent" below 1 MiB).
		if err := cls["t3"].Put(ctx, key, payload, client.WithUpsert()); err != nil {
			t.Fatalf("fill %d: %v", i, err)
		}
	}
	converge(t, c, sub)

	// A RemoveAll that skips a leased object, then one that empties the tenant.
	t1 := cls["t1"]
	_ = t1.Put(ctx, "leased", []byte("x"), client.WithUpsert())
	if _, err := t1.Get(ctx, "leased"); err != nil {
		t.Fatal(err)
	}
	if _, skipped, err := t1.RemoveAll(ctx, false); err != nil || skipped == 0 {
		t.Fatalf("RemoveAll without force: skipped %d, %v; want the leased object skipped", skipped, err)
	}
	converge(t, c, sub)
	// With force, RemoveAll is an admin's (issue 14).
	if _, _, err := c.AdminClient("t1").RemoveAll(ctx, true); err != nil {
		t.Fatal(err)
	}
	converge(t, c, sub)

	// Kill an agent: its replicas go, by unmount, with removed events.
	c.Agents[2].Kill()
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		for _, s := range c.Segments() {
			if s.GetHostId() == "host-c" && s.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
				return fmt.Errorf("host-c segment %s still %v", s.GetInfo().GetSegmentId(), s.GetLifecycle())
			}
		}
		return nil
	})
	converge(t, c, sub)

	st := sub.Stats()
	if st.Unrepaired != 0 || st.Resets != 0 || st.Malformed != 0 {
		t.Fatalf("subscriber stats %+v: want no unrepaired gap, reset or malformed message", st)
	}
	if ev := c.metric(t, c.Master, "crescent_master_evicted_objects_total"); ev == 0 {
		t.Fatalf("no eviction happened; the workload must push segments past the high watermark")
	} else {
		t.Logf("evicted objects: %v", ev)
	}
	gs := c.gatewayStatus(t)
	if !gs.Enabled || gs.PublishedEvents == 0 || gs.DroppedEvents != 0 {
		t.Fatalf("gateway status %+v", gs)
	}
	t.Logf("subscriber %+v; gateway %+v; index %d keys", st, gs, len(sub.Index().Keys()))
}

// TestEventsSurviveRestarts: a gateway restart and a master restart each
// leave the subscriber holding the master's readable set.
func TestEventsSurviveRestarts(t *testing.T) {
	c := StartCluster(t, Options{Agents: 2, Gateway: true})
	var mu sync.Mutex
	removed := map[string]int{}
	sub := subscribe(t, c, func(b kvevent.Batch) {
		mu.Lock()
		defer mu.Unlock()
		for _, e := range b.Events {
			if e.Type == kvevent.Removed {
				removed[e.Key]++
			}
		}
	})
	ctx := ctxT(t, 2*time.Minute)
	cl := c.Client("default")
	for i := 0; i < 50; i++ {
		if err := cl.Put(ctx, fmt.Sprintf("r/%d", i), []byte(strings.Repeat("x", 100+i))); err != nil {
			t.Fatal(err)
		}
	}
	converge(t, c, sub)

	// Master restart: the new master rebuilds from agents; the gateway sees
	// a new epoch, resyncs and publishes only the difference.
	c.Master.Kill()
	c.Master.Restart()
	c.WaitSegments(2)
	if err := cl.Remove(ctx, "r/0", true); err != nil {
		t.Fatal(err)
	}
	if err := cl.Put(ctx, "after-master-restart", []byte("y")); err != nil {
		t.Fatal(err)
	}
	converge(t, c, sub)
	// The restarted master rebuilt every object from the agents before its
	// change stream served the gateway: no object flapped removed → stored.
	mu.Lock()
	if len(removed) != 1 || removed["r/0"] != 1 {
		t.Errorf("removed events across the master restart: %v; want only r/0 once", removed)
	}
	mu.Unlock()

	// Gateway restart: with its state directory the sequence continues
	// (docs/gateway-state.md); the subscriber gets the difference live or
	// repairs it from the restored replay ring.
	c.Gateway.Stop()
	if err := cl.Remove(ctx, "r/1", true); err != nil {
		t.Fatal(err)
	}
	c.Gateway.Restart()
	if err := cl.Put(ctx, "after-gateway-restart", []byte("z")); err != nil {
		t.Fatal(err)
	}
	converge(t, c, sub)
}
