package objectsvc

import (
	"fmt"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// startLimits serves an ObjectService on 127.0.0.1:0 with the production
// server's codec and message limit (256 MiB, so a 20 MiB string reaches
// the service), backed by a fake cluster of one host with segs memory
// segments of capacity bytes and a store configured by cfg.
func startLimits(t testing.TB, cfg meta.Config, segs int, capacity uint64) *harness {
	t.Helper()
	c := metatest.NewCluster(1, segs, capacity)
	clk := newClock()
	c.Agents.NowMs = func() int64 { return clk.Now().UnixMilli() }
	if cfg.Shards == 0 {
		cfg.Shards = 16
	}
	store, err := meta.New(cfg, meta.Deps{
		Registry: c.Reg, Agents: c.Agents, Now: clk.Now,
		Identity: cluster.Identity{MasterID: "m", Epoch: 9, Keys: token.NewRingWithKey(tokenKey)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(rpccodec.ServerOption(), grpc.MaxRecvMsgSize(server.MaxMessageBytes))
	New(Config{MaxBatch: 256}, store).Register(gs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	cc, err := grpc.NewClient(lis.Addr().String(), rpccodec.DialOption(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(server.MaxMessageBytes)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		gs.Stop()
		<-done
	})
	return &harness{cli: masterv1.NewObjectServiceClient(cc), store: store, c: c, clk: clk}
}

// heapInUse is the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

func wantCode(t testing.TB, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("code: got %v, want %v (%v)", got, code, err)
	}
	wantErr(t, err, reason)
}

// TestOversizedStrings sends every string field of the object API over its
// limit (issue 11, item 4): each is refused with INVALID_ARGUMENT /
// INVALID_PARAMS, the master keeps none of it (five 20 MiB client ids used
// to grow it by 150 MB for good), and a normal put and get work afterwards.
func TestOversizedStrings(t *testing.T) {
	h := startLimits(t, meta.Config{}, 1, 1<<20)
	ctx := t.Context()
	big := func(n int) string { return strings.Repeat("x", n) }
	huge := big(20 << 20)
	calls := []struct {
		name string
		call func() error
	}{
		{"PutStart client_id 20 MiB", func() error {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: "t", Key: "k", Size: 10, ClientId: huge})
			return err
		}},
		{"PutStart key", func() error {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: big(meta.MaxKeyLen + 1), Size: 10})
			return err
		}},
		{"PutStart tenant", func() error {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: big(meta.MaxTenantLen + 1), Key: "k", Size: 10})
			return err
		}},
		{"PutStart group_id", func() error {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "k", Size: 10, Config: &masterv1.ReplicateConfig{GroupId: big(meta.MaxGroupLen + 1)}})
			return err
		}},
		{"PutStart prefer_local_host", func() error {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "k", Size: 10, Config: &masterv1.ReplicateConfig{PreferLocalHost: big(meta.MaxHostLen + 1)}})
			return err
		}},
		{"PutStart preferred segment", func() error {
			_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "k", Size: 10, Config: &masterv1.ReplicateConfig{PreferredSegments: []string{big(meta.MaxHostLen + 1)}}})
			return err
		}},
		{"PutEnd client_id", func() error {
			_, err := h.cli.PutEnd(ctx, &masterv1.PutEndRequest{Key: "k", ClientId: big(meta.MaxClientIDLen + 1)})
			return err
		}},
		{"PutRevoke client_id", func() error {
			_, err := h.cli.PutRevoke(ctx, &masterv1.PutRevokeRequest{Key: "k", ClientId: big(meta.MaxClientIDLen + 1)})
			return err
		}},
		{"GetReplicaList client_host", func() error {
			_, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: "k", ClientHost: big(meta.MaxHostLen + 1)})
			return err
		}},
		{"GetReplicaList key", func() error {
			_, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: big(meta.MaxKeyLen + 1)})
			return err
		}},
		{"ListObjects prefix", func() error {
			_, err := h.cli.ListObjects(ctx, &masterv1.ListObjectsRequest{Prefix: big(meta.MaxKeyLen + 1)})
			return err
		}},
		{"RemoveByPrefix prefix", func() error {
			_, err := h.cli.RemoveByPrefix(ctx, &masterv1.RemoveByPrefixRequest{Prefix: big(meta.MaxKeyLen + 1)})
			return err
		}},
		{"RemoveByRegex regex", func() error {
			_, err := h.cli.RemoveByRegex(ctx, &masterv1.RemoveByRegexRequest{Regex: big(meta.MaxRegexLen + 1)})
			return err
		}},
		{"RemoveAll tenant", func() error {
			_, err := h.cli.RemoveAll(ctx, &masterv1.RemoveAllRequest{Tenant: big(meta.MaxTenantLen + 1)})
			return err
		}},
	}
	before := heapInUse()
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			wantCode(t, c.call(), codes.InvalidArgument, "INVALID_PARAMS")
		})
	}
	for range 4 { // five 20 MiB client ids in all, as in the report
		_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: "t", Key: "k", Size: 10, ClientId: huge})
		wantCode(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	}
	if after := heapInUse(); after > before+8<<20 {
		t.Fatalf("heap after hostile strings: %d MiB, before %d MiB: the master kept them", after>>20, before>>20)
	}
	if got := len(h.store.ListTenants(ctx)); got != 0 {
		t.Fatalf("tenants after refused puts: got %d, want 0", got)
	}
	h.put(t, "t", "k", 10, nil)
	if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "t", Key: "k"}); err != nil {
		t.Fatalf("get after hostile strings: %v", err)
	}
}

// TestFailedPutsLeaveNoTenant: 2000 puts under distinct tenants that fail
// after their tenant was resolved (no room: the only segment is full of a
// hard-pinned object) leave no tenant behind; a tenant whose objects are
// all removed disappears unless it has a quota, and goes once the quota is
// cleared.
func TestFailedPutsLeaveNoTenant(t *testing.T) {
	h := startLimits(t, meta.Config{}, 1, 1000)
	ctx := t.Context()
	h.put(t, "keep", "pinned", 1000, &masterv1.ReplicateConfig{HardPin: true})
	before := heapInUse()
	for i := range 2000 {
		_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: fmt.Sprintf("junk-%04d", i), Key: "k", Size: 500, ClientId: "c"})
		wantCode(t, err, codes.ResourceExhausted, "NO_AVAILABLE_HANDLE")
	}
	tenants := func() []string {
		var out []string
		for _, q := range h.store.ListTenants(ctx) {
			out = append(out, q.GetTenant())
		}
		return out
	}
	if got := tenants(); len(got) != 1 || got[0] != "keep" {
		t.Fatalf("tenants after 2000 failed puts: got %d (%v…), want [keep]", len(got), got[:min(len(got), 3)])
	}
	if after := heapInUse(); after > before+4<<20 {
		t.Fatalf("heap after 2000 failed puts: %d KiB, before %d KiB", after>>10, before>>10)
	}

	if _, err := h.cli.Remove(ctx, &masterv1.RemoveRequest{Tenant: "keep", Key: "pinned", Force: true}); err != nil {
		t.Fatal(err)
	}
	if got := tenants(); len(got) != 0 {
		t.Fatalf("tenants after the last object was removed: got %v, want none", got)
	}
	// A quota keeps an empty tenant; clearing it drops the tenant.
	if _, err := h.store.SetTenantQuota(ctx, "quota", 0, 10); err != nil {
		t.Fatal(err)
	}
	h.put(t, "quota", "a", 100, nil)
	if _, err := h.cli.Remove(ctx, &masterv1.RemoveRequest{Tenant: "quota", Key: "a"}); err != nil {
		t.Fatal(err)
	}
	if got := tenants(); len(got) != 1 || got[0] != "quota" {
		t.Fatalf("tenants with a quota and no objects: got %v, want [quota]", got)
	}
	if _, err := h.store.SetTenantQuota(ctx, "quota", 0, 0); err != nil {
		t.Fatal(err)
	}
	if got := tenants(); len(got) != 0 {
		t.Fatalf("tenants after the quota was cleared: got %v, want none", got)
	}
	// The tenant comes back with its next object, and serves.
	h.put(t, "quota", "b", 100, nil)
	if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "quota", Key: "b"}); err != nil {
		t.Fatalf("get after the tenant came back: %v", err)
	}
}

// TestTenantCap: beyond MaxTenants live tenants a put fails with
// RESOURCE_EXHAUSTED / LIMIT_EXCEEDED; freeing one makes room.
func TestTenantCap(t *testing.T) {
	h := startLimits(t, meta.Config{MaxTenants: 3}, 1, 1<<20)
	ctx := t.Context()
	for i := range 3 {
		h.put(t, fmt.Sprintf("t%d", i), "k", 10, nil)
	}
	_, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: "t3", Key: "k", Size: 10})
	wantCode(t, err, codes.ResourceExhausted, "LIMIT_EXCEEDED")
	h.put(t, "t0", "k2", 10, nil) // known tenants still take puts
	if _, err := h.cli.RemoveAll(ctx, &masterv1.RemoveAllRequest{Tenant: "t1"}); err != nil {
		t.Fatal(err)
	}
	h.put(t, "t3", "k", 10, nil)
}

// TestRemoveByRegexLimits: patterns past the length or program-size limit
// are refused at once; RE2's own limits answer INVALID_PARAMS too.
func TestRemoveByRegexLimits(t *testing.T) {
	h := startLimits(t, meta.Config{}, 1, 1<<20)
	h.put(t, "t", "a1", 10, nil)
	for _, re := range []string{
		strings.Repeat("a", meta.MaxRegexLen+1),
		"a{1000}b{1000}c{1000}d{1000}e{1000}", // 5002 instructions
		"(x{1000}){1000}",                     // RE2: invalid repeat count
		"a(",
	} {
		start := time.Now()
		_, err := h.cli.RemoveByRegex(t.Context(), &masterv1.RemoveByRegexRequest{Tenant: "t", Regex: re, Force: true})
		wantCode(t, err, codes.InvalidArgument, "INVALID_PARAMS")
		if d := time.Since(start); d > time.Second {
			t.Fatalf("refusing %.20q… took %v", re, d)
		}
	}
	r, err := h.cli.RemoveByRegex(t.Context(), &masterv1.RemoveByRegexRequest{Tenant: "t", Regex: "^a[0-9]$"})
	if err != nil || r.GetRemoved() != 1 {
		t.Fatalf("a normal regex afterwards: got %v, %v; want 1 removed", r, err)
	}
}

// TestRemoveByRegexMatchesOutsideLocks runs a costly regex (2002
// instructions, milliseconds per key; far more under the race detector)
// over a tenant while another client reads and writes keys of the same
// tenant: since matching holds no shard lock, their calls complete in a
// small fraction of the scan's time, and the scan is split into pages by
// its budget (ScanBudget keys here; matchBudget bounds the regex work of a
// page the same way, TestScanMatchBudget in meta).
func TestRemoveByRegexMatchesOutsideLocks(t *testing.T) {
	h := startLimits(t, meta.Config{Shards: 4, ScanBudget: 2}, 1, 1<<30)
	ctx := t.Context()
	const n = 8
	key := func(i int) string { return fmt.Sprintf("%04d-%s", i, strings.Repeat("a", 2000)) }
	for i := range n {
		h.put(t, "t", key(i), 10, nil)
	}
	const re = "[a-z]{1000}[0-9]{1000}" // matches nothing here, slowly
	var (
		scan    time.Duration
		pages   int
		scanErr error
		removed uint64
		done    = make(chan struct{})
	)
	go func() {
		defer close(done)
		start := time.Now()
		tok := ""
		for {
			r, err := h.cli.RemoveByRegex(ctx, &masterv1.RemoveByRegexRequest{Tenant: "t", Regex: re, PageToken: tok})
			if err != nil {
				scanErr = err
				return
			}
			pages++
			removed += r.GetRemoved()
			if tok = r.GetNextPageToken(); tok == "" {
				break
			}
		}
		scan = time.Since(start)
	}()
	var worst time.Duration
	calls := 0
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
			start := time.Now()
			if _, err := h.cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "t", Key: key(calls % n)}); err != nil {
				t.Fatalf("get during the scan: %v", err)
			}
			h.put(t, "t", "new", 10, nil)
			if _, err := h.cli.Remove(ctx, &masterv1.RemoveRequest{Tenant: "t", Key: "new", Force: true}); err != nil {
				t.Fatalf("remove during the scan: %v", err)
			}
			worst = max(worst, time.Since(start))
			calls++
		}
	}
	if scanErr != nil {
		t.Fatal(scanErr)
	}
	t.Logf("scan: %v in %d pages; %d get+put+remove rounds alongside, slowest %v", scan, pages, calls, worst)
	if removed != 0 {
		t.Fatalf("scan removed %d objects, want 0", removed)
	}
	if pages < n/2 {
		t.Fatalf("pages: got %d, want at least %d (ScanBudget 2 of %d keys)", pages, n/2, n)
	}
	if calls == 0 || worst > scan/4 {
		t.Fatalf("other clients: %d rounds, slowest %v, during a %v scan: they waited for it", calls, worst, scan)
	}
}

// TestRemoveByPrefixPages: one call examines at most ScanBudget keys and
// answers a page token; following the tokens removes every match and
// nothing else. A forged token is refused.
func TestRemoveByPrefixPages(t *testing.T) {
	h := startLimits(t, meta.Config{Shards: 8, ScanBudget: 50}, 1, 1<<30)
	ctx := t.Context()
	const n = 600
	for i := range n {
		h.put(t, "t", fmt.Sprintf("p/%03d", i), 1, nil)
		if i%3 == 0 {
			h.put(t, "t", fmt.Sprintf("q/%03d", i), 1, nil)
		}
	}
	var removed uint64
	pages := 0
	tok := ""
	for {
		r, err := h.cli.RemoveByPrefix(ctx, &masterv1.RemoveByPrefixRequest{Tenant: "t", Prefix: "p/", PageToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		if r.GetRemoved() > 50 {
			t.Fatalf("page %d removed %d, over the scan budget of 50", pages, r.GetRemoved())
		}
		removed += r.GetRemoved()
		if tok = r.GetNextPageToken(); tok == "" {
			break
		}
	}
	if removed != n || pages < n/50 {
		t.Fatalf("removed %d in %d pages, want %d in at least %d", removed, pages, n, n/50)
	}
	objs, _, err := h.store.ListObjects(ctx, "t", "", 10000, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != n/3 {
		t.Fatalf("objects left: got %d, want the %d q/ keys", len(objs), n/3)
	}
	for _, tok := range []string{"s99", "x", "s1.!!", "s-1", "s01"} {
		_, err := h.cli.RemoveByPrefix(ctx, &masterv1.RemoveByPrefixRequest{Tenant: "t", Prefix: "q/", PageToken: tok})
		wantCode(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	}
}
