package objectsvc

import (
	"context"
	"net"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var tokenKey = token.SigningKey{ID: 1, Secret: []byte("0123456789abcdef0123456789abcdef")}

// newClock is a fake clock reading the wall time, to the millisecond, until
// advanced.
func newClock() *testutil.Clock { return testutil.NewClock(time.UnixMilli(time.Now().UnixMilli())) }

type harness struct {
	cli   masterv1.ObjectServiceClient
	store *meta.Store
	c     *metatest.Cluster
	clk   *testutil.Clock
	svc   *Service // nil from startTCP
}

// start serves an ObjectService over bufconn backed by a fake cluster of
// hosts × segs memory segments of capacity bytes.
func start(t testing.TB, hosts, segs int, capacity uint64) *harness {
	t.Helper()
	return startWith(t, hosts, segs, capacity, Config{MaxBatch: 256})
}

// startWith is start with the service's configuration.
func startWith(t testing.TB, hosts, segs int, capacity uint64, cfg Config) *harness {
	t.Helper()
	c := metatest.NewCluster(hosts, segs, capacity)
	clk := newClock()
	c.Agents.NowMs = func() int64 { return clk.Now().UnixMilli() }
	store, err := meta.New(meta.Config{Shards: 16}, meta.Deps{
		Registry: c.Reg, Agents: c.Agents, Now: clk.Now,
		Identity: cluster.Identity{MasterID: "m", Epoch: 9, Keys: token.NewRingWithKey(tokenKey)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	svc := New(cfg, store)
	svc.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	cc, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		gs.Stop()
	})
	return &harness{cli: masterv1.NewObjectServiceClient(cc), store: store, c: c, clk: clk, svc: svc}
}

// put runs PutStart + PutEnd and fails the test on error.
func (h *harness) put(t testing.TB, tenant, key string, size uint64, cfg *masterv1.ReplicateConfig) {
	t.Helper()
	ctx := t.Context()
	if _, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Tenant: tenant, Key: key, Size: size, Config: cfg, ClientId: "w"}); err != nil {
		t.Fatalf("PutStart %s/%s: %v", tenant, key, err)
	}
	if _, err := h.cli.PutEnd(ctx, &masterv1.PutEndRequest{Tenant: tenant, Key: key, ClientId: "w", Checksum: size * 31}); err != nil {
		t.Fatalf("PutEnd %s/%s: %v", tenant, key, err)
	}
}

// changes returns every change record so far as "type:tenant/key" strings.
func (h *harness) changes(t testing.TB) []string {
	t.Helper()
	recs, _, _, err := h.store.Log().Read(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range recs {
		typ := map[changelog.Type]string{changelog.Stored: "stored", changelog.Removed: "removed", changelog.Cleared: "cleared"}[r.Type]
		out = append(out, typ+":"+r.Tenant+"/"+r.Key)
	}
	return out
}

// wantErr checks err's gRPC code and ErrorInfo reason ("" reason = OK).
func wantErr(t testing.TB, err error, reason string) {
	t.Helper()
	if got := rpcerr.Reason(err); got != reason {
		t.Fatalf("reason: got %q (err %v), want %q", got, err, reason)
	}
	if reason != "" {
		if _, ok := status.FromError(err); !ok {
			t.Fatalf("error %v is not a gRPC status", err)
		}
	}
}

func wantItem(t testing.TB, st *masterv1.ItemStatus, reason string) {
	t.Helper()
	if got := st.GetReason(); got != reason {
		t.Fatalf("item reason: got %q (%s), want %q", got, st.GetMessage(), reason)
	}
	if (reason == "") != (st.GetCode() == 0) {
		t.Fatalf("item code %d does not match reason %q", st.GetCode(), reason)
	}
}
