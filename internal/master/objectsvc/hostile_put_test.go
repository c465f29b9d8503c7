package objectsvc

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// tcpHarness is a master's ObjectService on a loopback TCP port, over a
// store with its metrics registered and its background loop (eviction,
// put expiry) running on a test clock, backed by fake agents.
type tcpHarness struct {
	harness
	prom *prometheus.Registry
}

func startTCP(t *testing.T, hosts, segs int, capacity uint64, cfg meta.Config) *tcpHarness {
	t.Helper()
	c := metatest.NewCluster(hosts, segs, capacity)
	clk := newClock()
	c.Agents.NowMs = func() int64 { return clk.Now().UnixMilli() }
	prom := prometheus.NewRegistry()
	cfg.Shards = 16
	if cfg.BlankPool == 0 {
		// The fake agents take no writes, so a put placed on a blank
		// reservation could not be sealed; and a background refill would
		// add Reserve calls the tests count.
		cfg.BlankPool = -1
	}
	store, err := meta.New(cfg, meta.Deps{
		Registry: c.Reg, Agents: c.Agents, Now: clk.Now, Metrics: prom,
		Identity: cluster.Identity{MasterID: "m", Epoch: 9, Keys: token.NewRingWithKey(tokenKey)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	New(Config{MaxBatch: 256}, store).Register(gs)
	served := make(chan struct{})
	go func() { defer close(served); _ = gs.Serve(lis) }()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = store.Run(ctx) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		gs.Stop()
		<-served
		cancel()
		<-ran
	})
	return &tcpHarness{harness: harness{cli: masterv1.NewObjectServiceClient(cc), store: store, c: c, clk: clk}, prom: prom}
}

// metric returns the value of a counter or gauge without labels.
func (h *tcpHarness) metric(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := h.prom.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if c := m.GetCounter(); c != nil {
			return c.GetValue()
		}
		return m.GetGauge().GetValue()
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

// wantStatus checks err's gRPC code and ErrorInfo reason.
func wantStatus(t *testing.T, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("code: got %v (err %v), want %v", got, err, code)
	}
	wantErr(t, err, reason)
}

// TestHostileObjectSizes sends sizes no segment can hold, up to 2^64-1, to a
// master on loopback: each fails with INVALID_ARGUMENT / OBJECT_TOO_LARGE
// (0 with INVALID_PARAMS) before placement, nothing is evicted or reserved,
// an upsert of an existing key keeps the old version, a batch's other items
// proceed, and the master serves puts and gets afterwards.
func TestHostileObjectSizes(t *testing.T) {
	const capacity = 1 << 20
	h := startTCP(t, 2, 1, capacity, meta.Config{})
	ctx := t.Context()
	// Fill the segments to 80 %: the old PutStart of 2^62 evicted all this.
	for i := range 8 {
		h.put(t, "", fmt.Sprintf("k%d", i), 100<<10, &masterv1.ReplicateConfig{ReplicaNum: 2})
	}
	objects := h.metric(t, "crescent_master_objects")
	reserves, _, _ := h.c.Agents.Calls()

	for _, size := range []uint64{capacity + 1, 1 << 40, 1 << 62, 1 << 63, 1<<64 - 1} {
		for _, cfg := range []*masterv1.ReplicateConfig{nil, {ReplicaNum: meta.MaxReplicaNum}} {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "huge", Size: size, Config: cfg, ClientId: "w"})
			wantStatus(t, err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
		}
		_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "k0", Size: size, ClientId: "w", Upsert: true})
		wantStatus(t, err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
	}
	_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "zero", Size: 0, ClientId: "w"})
	wantStatus(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	// The largest segment is the limit: exactly its size passes the check
	// (and then finds no room for 16 replicas on 2 segments, evicting nothing).
	_, err = h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "cap", Size: capacity, ClientId: "w", Config: &masterv1.ReplicateConfig{ReplicaNum: meta.MaxReplicaNum}})
	wantStatus(t, err, codes.ResourceExhausted, "NO_AVAILABLE_HANDLE")

	br, err := h.cli.BatchPutStart(ctx, &masterv1.BatchPutStartRequest{Items: []*masterv1.PutStartRequest{
		{Key: "b1", Size: 1 << 63, ClientId: "w"},
		{Key: "b2", Size: 4096, ClientId: "w"},
		{Key: "b3", Size: 1<<64 - 1, ClientId: "w"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	wantItem(t, br.GetResults()[0].GetStatus(), "OBJECT_TOO_LARGE")
	wantItem(t, br.GetResults()[1].GetStatus(), "")
	wantItem(t, br.GetResults()[2].GetStatus(), "OBJECT_TOO_LARGE")
	if c := codes.Code(br.GetResults()[0].GetStatus().GetCode()); c != codes.InvalidArgument {
		t.Fatalf("batch item code: got %v, want InvalidArgument", c)
	}

	if got := h.metric(t, "crescent_master_evicted_objects_total"); got != 0 {
		t.Fatalf("evicted %v objects, want 0", got)
	}
	if r, _, _ := h.c.Agents.Calls(); r != reserves+1 {
		t.Fatalf("agents saw %d Reserve calls, want only the batch's good item's", r-reserves)
	}
	if got := h.metric(t, "crescent_master_objects"); got != objects+1 {
		t.Fatalf("objects: got %v, want %v", got, objects+1)
	}
	for i := range 8 {
		if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: fmt.Sprintf("k%d", i)}); err != nil {
			t.Fatalf("GetReplicaList k%d after the hostile sizes: %v", i, err)
		}
	}
	h.put(t, "", "after", 4096, nil)
	if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: "after"}); err != nil {
		t.Fatalf("GetReplicaList after: %v", err)
	}
}

// TestHostileObjectSizeFlag: an operator's lower limit is enforced the same
// way.
func TestHostileObjectSizeFlag(t *testing.T) {
	h := startTCP(t, 1, 1, 1<<20, meta.Config{MaxObjectSize: 64 << 10})
	_, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 64<<10 + 1, ClientId: "w"})
	wantStatus(t, err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
	h.put(t, "", "k", 64<<10, nil)
}

// TestAbandonedPutExpires: a PutStart never ended holds its placed bytes
// and quota until the put timeout passes; then the master expires it on its
// own — the agent told to release the reservation, the quota refunded, the
// room back for a new put without evicting anything, nothing published —
// and PutEnd answers NOT_FOUND / PUT_EXPIRED.
func TestAbandonedPutExpires(t *testing.T) {
	const capacity = 1 << 20
	h := startTCP(t, 1, 1, capacity, meta.Config{PutPreemptAfter: 2 * time.Second, PutSweepInterval: 5 * time.Millisecond})
	ctx := t.Context()
	if _, err := h.store.SetTenantQuota(ctx, "t", capacity, 100); err != nil {
		t.Fatal(err)
	}
	// Hard-pinned, so that nothing here can be made room for by evicting.
	h.put(t, "", "kept", 100<<10, &masterv1.ReplicateConfig{HardPin: true})
	if _, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: "t", Key: "abandoned", Size: 700 << 10, ClientId: "w"}); err != nil {
		t.Fatal(err)
	}
	_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: "t", Key: "new", Size: 800 << 10, ClientId: "w"})
	wantStatus(t, err, codes.ResourceExhausted, "NO_AVAILABLE_HANDLE")
	if q, _ := h.store.TenantQuota(ctx, "t"); q.GetUsedBytes() != 700<<10 {
		t.Fatalf("quota while the put is open: %d bytes, want %d", q.GetUsedBytes(), 700<<10)
	}
	records := h.changes(t)
	_, _, releases := h.c.Agents.Calls()

	h.clk.Advance(2 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	wait, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for h.metric(t, "crescent_master_expired_puts_total") < 1 {
		select {
		case <-wait.Done():
			t.Fatal("the abandoned put did not expire")
		case <-tick.C:
		}
	}
	if got := h.metric(t, "crescent_master_expired_puts_total"); got != 1 {
		t.Fatalf("expired puts: got %v, want 1", got)
	}
	if q, _ := h.store.TenantQuota(ctx, "t"); q.GetUsedBytes() != 0 || q.GetUsedObjects() != 0 {
		t.Fatalf("quota after expiry: %d bytes %d objects, want 0", q.GetUsedBytes(), q.GetUsedObjects())
	}
	if _, _, r := h.c.Agents.Calls(); r != releases+1 {
		t.Fatalf("agent Release calls: got %d, want 1", r-releases)
	}
	for _, a := range h.c.Agents.Live() {
		if a.Key == "abandoned" {
			t.Fatalf("allocation %v of the abandoned put still live at the agent", a.Ref)
		}
	}
	if p := h.c.Agents.Problems(); len(p) > 0 {
		t.Fatalf("agent saw misuse: %v", p)
	}
	if got := h.changes(t); fmt.Sprint(got) != fmt.Sprint(records) {
		t.Fatalf("expiry published change records: %v, before %v", got, records)
	}
	_, err = h.cli.PutEnd(ctx, &masterv1.PutEndRequest{Tenant: "t", Key: "abandoned", ClientId: "w", Checksum: 1})
	wantStatus(t, err, codes.NotFound, "PUT_EXPIRED")
	_, err = h.cli.PutRevoke(ctx, &masterv1.PutRevokeRequest{Tenant: "t", Key: "abandoned", ClientId: "w"})
	wantStatus(t, err, codes.NotFound, "PUT_EXPIRED")

	// The room is back: a put that needs it succeeds without evicting.
	h.put(t, "t", "new", 800<<10, nil)
	if got := h.metric(t, "crescent_master_evicted_objects_total"); got != 0 {
		t.Fatalf("evicted %v objects, want 0", got)
	}
	if got := h.metric(t, "crescent_master_objects"); got != 2 {
		t.Fatalf("objects: got %v, want 2 (kept, new)", got)
	}
	for _, k := range []struct{ tenant, key string }{{"", "kept"}, {"t", "new"}} {
		if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: k.tenant, Key: k.key}); err != nil {
			t.Fatalf("GetReplicaList %s/%s: %v", k.tenant, k.key, err)
		}
	}
}
