package changesvc

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type harness struct {
	cli   masterv1.ChangeServiceClient
	store *meta.Store
	svc   *Service
}

func start(t *testing.T, retention int) *harness {
	t.Helper()
	c := metatest.NewCluster(2, 2, 1<<30)
	store, err := meta.New(meta.Config{Shards: 8, ChangeRetention: retention}, meta.Deps{
		Registry: c.Reg, Agents: c.Agents,
		Identity: cluster.Identity{Epoch: 77, Keys: token.NewRing(0, nil)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	svc := New(Config{MaxChangesPerResponse: 7, SnapshotPageSize: 5}, store)
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
	return &harness{cli: masterv1.NewChangeServiceClient(cc), store: store, svc: svc}
}

// TestCloseEndsWatches: a Watch waiting for changes ends at Close with
// UNAVAILABLE / MASTER_SHUTTING_DOWN (so a master's graceful stop does not
// wait it out), and a new one is refused the same way.
func TestCloseEndsWatches(t *testing.T) {
	h := start(t, 1024)
	stream, err := h.cli.Watch(t.Context(), &masterv1.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() {
		_, err := stream.Recv()
		ended <- err
	}()
	h.svc.Close()
	select {
	case err := <-ended:
		if status.Code(err) != codes.Unavailable || rpcerr.Reason(err) != "MASTER_SHUTTING_DOWN" {
			t.Fatalf("Watch ended with %v; want UNAVAILABLE / MASTER_SHUTTING_DOWN", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Watch still running 10 s after Close")
	}
	again, err := h.cli.Watch(t.Context(), &masterv1.WatchRequest{})
	if err == nil {
		_, err = again.Recv()
	}
	if rpcerr.Reason(err) != "MASTER_SHUTTING_DOWN" {
		t.Fatalf("Watch after Close: %v", err)
	}
}

func (h *harness) put(t testing.TB, tenant, key string) {
	t.Helper()
	if _, err := h.store.PutStart(context.Background(), meta.PutSpec{Tenant: tenant, Key: key, Size: 8, ClientID: "w"}); err != nil {
		t.Fatalf("PutStart: %v", err)
	}
	if err := h.store.PutEnd(context.Background(), meta.PutEndSpec{Tenant: tenant, Key: key, ClientID: "w", Checksum: 1}); err != nil {
		t.Fatalf("PutEnd: %v", err)
	}
}

func (h *harness) remove(t testing.TB, tenant, key string) {
	t.Helper()
	if err := h.store.Remove(context.Background(), meta.RemoveSpec{Tenant: tenant, Key: key, Force: true}); err != nil {
		t.Fatalf("Remove: %v", err)
	}
}

func TestWatchStreamsDenselyAndResumes(t *testing.T) {
	h := start(t, 0)
	for i := range 10 {
		h.put(t, "t", fmt.Sprintf("k%d", i))
	}
	h.remove(t, "t", "k3")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	st, err := h.cli.Watch(ctx, &masterv1.WatchRequest{FromRevision: 4, Epoch: 77})
	if err != nil {
		t.Fatal(err)
	}
	var got []*masterv1.Change
	for len(got) < 7 {
		resp, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if resp.Epoch != 77 || resp.HeadRevision < 11 {
			t.Fatalf("response header: got epoch %d head %d", resp.Epoch, resp.HeadRevision)
		}
		got = append(got, resp.Changes...)
	}
	// More arrive while watching.
	h.put(t, "t", "late")
	resp, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, resp.Changes...)
	for i, c := range got {
		if want := uint64(5 + i); c.Revision != want {
			t.Fatalf("change %d revision: got %d, want %d", i, c.Revision, want)
		}
	}
	if last := got[len(got)-1]; last.Key != "late" || last.Type != masterv1.ChangeType_CHANGE_TYPE_STORED {
		t.Fatalf("last change: got %v, want stored late", last)
	}
	if c := got[11-5]; c.Key != "k3" || c.Type != masterv1.ChangeType_CHANGE_TYPE_REMOVED {
		t.Fatalf("revision 11: got %v, want removed k3", c)
	}
}

func TestWatchErrors(t *testing.T) {
	h := start(t, 4)
	for i := range 10 {
		h.put(t, "t", fmt.Sprintf("k%d", i))
	}
	tests := []struct {
		name    string
		req     *masterv1.WatchRequest
		code    codes.Code
		reason  string
		compact string
	}{
		{"compacted", &masterv1.WatchRequest{FromRevision: 2}, codes.OutOfRange, "REVISION_COMPACTED", "7"},
		{"from zero after compaction", &masterv1.WatchRequest{}, codes.OutOfRange, "REVISION_COMPACTED", "7"},
		{"epoch mismatch", &masterv1.WatchRequest{FromRevision: 9, Epoch: 76}, codes.FailedPrecondition, "EPOCH_MISMATCH", ""},
		{"beyond head", &masterv1.WatchRequest{FromRevision: 99}, codes.InvalidArgument, "INVALID_PARAMS", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st, err := h.cli.Watch(t.Context(), tt.req)
			if err == nil {
				_, err = st.Recv()
			}
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code: got %v, want %v (%v)", got, tt.code, err)
			}
			if got := rpcerr.Reason(err); got != tt.reason {
				t.Fatalf("reason: got %q, want %q", got, tt.reason)
			}
			if got := rpcerr.Metadata(err)["compact_revision"]; got != tt.compact {
				t.Fatalf("compact_revision: got %q, want %q", got, tt.compact)
			}
		})
	}
}

type rk struct {
	tenant, key string
	medium      masterv1.Medium
}

// TestSnapshotThenWatchIsExact lists with Snapshot while writers run, then
// watches from the snapshot's revision, and checks that the subscriber's
// set equals the master's readable set once the writers stop.
func TestSnapshotThenWatchIsExact(t *testing.T) {
	h := start(t, 0)
	for i := range 30 {
		h.put(t, "t", fmt.Sprintf("pre%d", i))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := fmt.Sprintf("w%d-%d", w, i%10)
				if i%3 == 2 {
					_ = h.store.Remove(context.Background(), meta.RemoveSpec{Tenant: "t", Key: k, Force: true})
					continue
				}
				if _, err := h.store.PutStart(context.Background(), meta.PutSpec{Tenant: "t", Key: k, Size: 8, ClientID: "w"}); err == nil {
					_ = h.store.PutEnd(context.Background(), meta.PutEndSpec{Tenant: "t", Key: k, ClientID: "w"})
				}
			}
		})
	}
	ss, err := h.cli.Snapshot(t.Context(), &masterv1.SnapshotRequest{})
	if err != nil {
		t.Fatal(err)
	}
	set := map[rk]bool{}
	var rev uint64
	pages := 0
	for {
		page, err := ss.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		pages++
		if pages == 1 {
			rev = page.Revision
		} else if page.Revision != rev || page.Epoch != 77 {
			t.Fatalf("page %d: revision %d epoch %d, want %d, 77", pages, page.Revision, page.Epoch, rev)
		}
		for _, e := range page.Entries {
			set[rk{e.Tenant, e.Key, e.Medium}] = true
		}
		if page.Last {
			break
		}
	}
	if pages < 6 {
		t.Fatalf("pages: got %d, want several of 5 entries", pages)
	}
	// Let the writers make changes after the snapshot.
	testutil.Eventually(t, 10*time.Second, func() bool { return h.store.Log().Head() >= rev+50 },
		"the writers to make 50 changes after the snapshot")
	close(stop)
	wg.Wait()
	head := h.store.Log().Head()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ws, err := h.cli.Watch(ctx, &masterv1.WatchRequest{FromRevision: rev, Epoch: 77})
	if err != nil {
		t.Fatal(err)
	}
	for at := rev; at < head; {
		resp, err := ws.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range resp.Changes {
			at = c.Revision
			k := rk{c.Tenant, c.Key, c.Medium}
			switch c.Type {
			case masterv1.ChangeType_CHANGE_TYPE_STORED:
				set[k] = true
			case masterv1.ChangeType_CHANGE_TYPE_REMOVED:
				delete(set, k)
			}
		}
	}
	_, entries, err := h.store.Snapshot(t.Context(), "")
	if err != nil {
		t.Fatal(err)
	}
	want := map[rk]bool{}
	for _, e := range entries {
		want[rk{e.Tenant, e.Key, e.Medium}] = true
	}
	if !maps.Equal(set, want) {
		t.Fatalf("subscriber set (%d) differs from readable set (%d)", len(set), len(want))
	}
}

func TestSnapshotEmptyAndByTenant(t *testing.T) {
	h := start(t, 0)
	read := func(tenant string) (n int, last bool) {
		ss, err := h.cli.Snapshot(t.Context(), &masterv1.SnapshotRequest{Tenant: tenant})
		if err != nil {
			t.Fatal(err)
		}
		for {
			p, err := ss.Recv()
			if err == io.EOF {
				return n, last
			}
			if err != nil {
				t.Fatal(err)
			}
			n += len(p.Entries)
			last = p.Last
		}
	}
	if n, last := read(""); n != 0 || !last {
		t.Fatalf("empty snapshot: got %d entries last=%v, want 0, true", n, last)
	}
	h.put(t, "a", "x")
	h.put(t, "b", "x")
	h.put(t, "b", "y")
	if n, _ := read("b"); n != 2 {
		t.Fatalf("tenant b: got %d entries, want 2", n)
	}
	if n, _ := read("nobody"); n != 0 {
		t.Fatalf("unknown tenant: got %d entries, want 0", n)
	}
}

// TestSlowWatcherFallsOutOfWindow: a watcher that stops reading while the
// log wraps gets REVISION_COMPACTED when it resumes, not a silent gap.
func TestSlowWatcherFallsOutOfWindow(t *testing.T) {
	h := start(t, 64)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	st, err := h.cli.Watch(ctx, &masterv1.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	h.put(t, "t", "first")
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	// Far more than the transport buffers while the client does not read.
	for i := range 4000 {
		h.put(t, "t", fmt.Sprintf("%01000d", i))
	}
	var last uint64
	for {
		resp, err := st.Recv()
		if err != nil {
			if got := rpcerr.Reason(err); got != "REVISION_COMPACTED" {
				t.Fatalf("reason: got %q (%v), want REVISION_COMPACTED", got, err)
			}
			return
		}
		for _, c := range resp.Changes {
			if c.Revision != last+1 && last != 0 {
				t.Fatalf("gap: %d after %d", c.Revision, last)
			}
			last = c.Revision
		}
		if last == 4001 {
			t.Fatal("watcher received everything; want it to fall out of the window")
		}
	}
}
