package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The SDK against testutil.Fake: a master and agents on loopback ports,
// reached through real gRPC connections and the bulk transfer protocol.

// paths runs f once with the bulk transfer path and once with gRPC
// DataService only.
func paths(t *testing.T, f func(t *testing.T, transfer bool)) {
	for _, transfer := range []bool{true, false} {
		name := "grpc"
		if transfer {
			name = "transfer"
		}
		t.Run(name, func(t *testing.T) { f(t, transfer) })
	}
}

func newClient(t *testing.T, f *testutil.Fake, cfg client.Config) *client.Client {
	t.Helper()
	cfg.Master = f.Addr()
	if cfg.Backoff == 0 {
		cfg.Backoff = time.Millisecond
	}
	c, err := client.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// setup starts a fake with two agents and a client for it.
func setup(t *testing.T, transfer bool, fc testutil.FakeConfig) (*testutil.Fake, *client.Client) {
	t.Helper()
	fc.Transfer = transfer
	f := testutil.NewFake(t, fc)
	return f, newClient(t, f, client.Config{DisableTransfer: !transfer, ChunkSize: 64 << 10, SmallObject: 8 << 10})
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*31) + seed
	}
	return b
}

func TestPutGetRoundTrip(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		ctx := t.Context()
		// Empty, small (unary BatchWrite/BatchRead), streamed in several
		// chunks.
		for _, size := range []int{0, 100, 8 << 10, 8<<10 + 1, 300 << 10} {
			key := fmt.Sprintf("obj-%d", size)
			data := pattern(size, byte(size))
			var progressed atomic.Int64
			if err := c.Put(ctx, key, data, client.WithReplicas(2), client.WithGroup("g1"),
				client.WithPutProgress(func(done, total int64) { progressed.Store(done) })); err != nil {
				t.Fatalf("Put %d bytes: %v", size, err)
			}
			if got, want := progressed.Load(), int64(2*size); got != want {
				t.Errorf("size %d: progress reached %d, want %d", size, got, want)
			}
			if got, ok := f.Object("default", key); !ok || !bytes.Equal(got, data) {
				t.Fatalf("size %d: the fake holds %d bytes (stored %v)", size, len(got), ok)
			}
			got, err := c.Get(ctx, key)
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("Get %d bytes: got %d bytes, err %v", size, len(got), err)
			}
			buf := make([]byte, size+10)
			n, err := c.GetInto(ctx, key, buf)
			if err != nil || n != size || !bytes.Equal(buf[:n], data) {
				t.Fatalf("GetInto %d bytes: n=%d err=%v", size, n, err)
			}
			var w bytes.Buffer
			var last int64
			wn, err := c.GetTo(ctx, key, &w, func(done, total int64) {
				if total != int64(size) {
					t.Errorf("GetTo progress total %d, want %d", total, size)
				}
				last = done
			})
			if err != nil || wn != int64(size) || !bytes.Equal(w.Bytes(), data) || (size > 0 && last != int64(size)) {
				t.Fatalf("GetTo %d bytes: wrote %d (progress %d), err %v", size, wn, last, err)
			}
			info, err := c.Stat(ctx, key)
			if err != nil || info.Size != uint64(size) || info.GroupID != "g1" || len(info.Replicas) != 2 ||
				!slices.Equal(info.Media(), []masterv1.Medium{masterv1.Medium_MEDIUM_MEMORY}) {
				t.Fatalf("Stat %d bytes: %+v, %v", size, info, err)
			}
			if ok, err := c.Exist(ctx, key); !ok || err != nil {
				t.Fatalf("Exist %q: %v, %v", key, ok, err)
			}
		}
		if ok, err := c.Exist(ctx, "missing"); ok || err != nil {
			t.Fatalf("Exist of a missing key: %v, %v", ok, err)
		}
	})
}

// TestLargeTransferObject: an object larger than one transfer request
// travels in several, into the caller's buffer and through a reused one.
func TestLargeTransferObject(t *testing.T) {
	f, c := setup(t, true, testutil.FakeConfig{Agents: 1})
	ctx := t.Context()
	data := pattern(16<<20+5, 7)
	if err := c.PutFrom(ctx, "big", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	if got, err := c.Get(ctx, "big"); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get: %d bytes, %v", len(got), err)
	}
	var w bytes.Buffer
	if n, err := c.GetTo(ctx, "big", &w, nil); err != nil || n != int64(len(data)) || !bytes.Equal(w.Bytes(), data) {
		t.Fatalf("GetTo: %d bytes, %v", n, err)
	}
	if got := f.Calls("TransferWrite"); got != 2 {
		t.Errorf("the put took %d transfer requests, want 2", got)
	}
}

func TestPutFrom(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		data := pattern(200<<10, 3)
		if err := c.PutFrom(t.Context(), "file", bytes.NewReader(data), int64(len(data)), client.WithReplicas(2)); err != nil {
			t.Fatal(err)
		}
		if got, _ := f.Object("default", "file"); !bytes.Equal(got, data) {
			t.Fatalf("stored %d bytes, want %d", len(got), len(data))
		}
		if err := c.PutFrom(t.Context(), "bad", failingReader{}, 10); err == nil {
			t.Fatal("PutFrom of a failing reader must fail")
		}
	})
}

type failingReader struct{}

func (failingReader) ReadAt([]byte, int64) (int, error) { return 0, errors.New("disk on fire") }

func TestPutErrors(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		ctx := t.Context()
		if err := c.Put(ctx, "k", []byte("one")); err != nil {
			t.Fatal(err)
		}
		if err := c.Put(ctx, "k", []byte("two")); !errors.Is(err, client.ErrExists) {
			t.Fatalf("second Put: %v, want ErrExists", err)
		}
		if err := c.Put(ctx, "k", []byte("three"), client.WithUpsert()); err != nil {
			t.Fatalf("upsert: %v", err)
		}
		if got, _ := c.Get(ctx, "k"); string(got) != "three" {
			t.Fatalf("after upsert Get = %q", got)
		}
		if err := c.Put(ctx, "k3", []byte("x"), client.WithReplicas(3)); !errors.Is(err, client.ErrNoSpace) {
			t.Fatalf("3 replicas on 2 segments: %v, want ErrNoSpace", err)
		}
		if _, err := c.Admin().SetTenantQuota(ctx, &masterv1.SetTenantQuotaRequest{Tenant: "small", MaxObjects: 1}); err != nil {
			t.Fatal(err)
		}
		small := c.Tenant("small")
		if err := small.Put(ctx, "a", []byte("a")); err != nil {
			t.Fatal(err)
		}
		if err := small.Put(ctx, "b", []byte("b")); !errors.Is(err, client.ErrQuotaExceeded) {
			t.Fatalf("over quota: %v, want ErrQuotaExceeded", err)
		}

		// A failed replica write revokes the put: nothing stays behind.
		f.SetAgentHook(func(agent int, _ string) error {
			if agent == 1 {
				return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent 1 is gone")
			}
			return nil
		})
		for _, size := range []int{10, 100 << 10} {
			key := fmt.Sprintf("w-%d", size)
			revokes := f.Calls("PutRevoke")
			if err := c.Put(ctx, key, pattern(size, 1), client.WithReplicas(2)); err == nil {
				t.Fatalf("Put of %d bytes with a failing replica succeeded", size)
			}
			if got := f.Calls("PutRevoke"); got != revokes+1 {
				t.Fatalf("%d PutRevoke calls after the failed put, want %d", got, revokes+1)
			}
			if ok, _ := c.Exist(ctx, key); ok {
				t.Fatalf("%q exists after its put failed", key)
			}
		}
	})
}

// TestPutChecksumMismatch: a PutEnd the master refuses for its checksum is
// not revoked by the client (the master already failed the put).
func TestPutChecksumMismatch(t *testing.T) {
	f, c := setup(t, false, testutil.FakeConfig{})
	f.SetHook(func(method string) error {
		if method == "PutEnd" {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "replica 1 does not match")
		}
		return nil
	})
	if err := c.Put(t.Context(), "k", []byte("v")); !errors.Is(err, client.ErrChecksum) {
		t.Fatalf("Put: %v, want ErrChecksum", err)
	}
	if n := f.Calls("PutRevoke"); n != 0 {
		t.Fatalf("%d PutRevoke calls after a checksum refusal, want 0", n)
	}
	f.SetHook(func(method string) error {
		if method == "PutEnd" {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "boom")
		}
		return nil
	})
	if err := c.Put(t.Context(), "k2", []byte("v")); err == nil {
		t.Fatal("Put with a failing PutEnd succeeded")
	}
	if n := f.Calls("PutRevoke"); n != 1 {
		t.Fatalf("%d PutRevoke calls after a failed PutEnd, want 1", n)
	}
}

func TestGetFallsBack(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		ctx := t.Context()
		small, large := pattern(100, 1), pattern(100<<10, 2)
		for key, data := range map[string][]byte{"small": small, "large": large} {
			if err := c.Put(ctx, key, data, client.WithReplicas(2)); err != nil {
				t.Fatal(err)
			}
			f.Corrupt("default", key, 0)
			got, err := c.Get(ctx, key)
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("Get %s with replica 0 corrupt: %d bytes, %v", key, len(got), err)
			}
			f.Corrupt("default", key, 1)
			if _, err := c.Get(ctx, key); !errors.Is(err, client.ErrChecksum) {
				t.Fatalf("Get %s with both replicas corrupt: %v, want ErrChecksum", key, err)
			}
			var w bytes.Buffer
			if _, err := c.GetTo(ctx, key, &w, nil); !errors.Is(err, client.ErrChecksum) {
				t.Fatalf("GetTo %s with both replicas corrupt: %v, want ErrChecksum", key, err)
			}
		}
		// An agent that fails every read: the other replica answers.
		if err := c.Put(ctx, "k", large, client.WithReplicas(2)); err != nil {
			t.Fatal(err)
		}
		f.SetAgentHook(func(agent int, _ string) error {
			if agent == 0 {
				return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent 0 is gone")
			}
			return nil
		})
		if got, err := c.Get(ctx, "k"); err != nil || !bytes.Equal(got, large) {
			t.Fatalf("Get with agent 0 failing: %d bytes, %v", len(got), err)
		}
		var w bytes.Buffer
		if n, err := c.GetTo(ctx, "k", &w, nil); err != nil || n != int64(len(large)) {
			t.Fatalf("GetTo with agent 0 failing: %d bytes, %v", n, err)
		}
		f.SetAgentHook(func(int, string) error {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "all gone")
		})
		if _, err := c.GetTo(ctx, "k", &w, nil); err == nil {
			t.Fatal("GetTo with every agent failing succeeded")
		}
	})
}

// TestGetStoppedAgent: a replica on an agent that is down (connection
// refused) is skipped, on either path.
func TestGetStoppedAgent(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		data := pattern(50<<10, 9)
		if err := c.Put(t.Context(), "k", data, client.WithReplicas(2)); err != nil {
			t.Fatal(err)
		}
		f.Agent(0).Stop()
		if got, err := c.Get(t.Context(), "k"); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("Get with agent 0 down: %d bytes, %v", len(got), err)
		}
		if err := c.Put(t.Context(), "k2", data, client.WithReplicas(2)); err == nil {
			t.Fatal("Put to a stopped agent succeeded")
		}
	})
}

// TestLocalReplicaFirst: a client on host-1 reads the replica there.
func TestLocalReplicaFirst(t *testing.T) {
	f := testutil.NewFake(t, testutil.FakeConfig{})
	c := newClient(t, f, client.Config{HostID: "host-1", DisableTransfer: true})
	if err := c.Put(t.Context(), "k", []byte("local"), client.WithReplicas(2)); err != nil {
		t.Fatal(err)
	}
	f.Corrupt("default", "k", 0) // host-0's copy: never read
	if _, err := c.Get(t.Context(), "k"); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.BatchGet(t.Context(), []string{"k"}); string(got[0]) != "local" {
		t.Fatalf("BatchGet read %q", got[0])
	}
}

func TestGetErrors(t *testing.T) {
	_, c := setup(t, true, testutil.FakeConfig{})
	ctx := t.Context()
	if _, err := c.Get(ctx, "missing"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Get: %v, want ErrNotFound", err)
	}
	if _, err := c.GetTo(ctx, "missing", io.Discard, nil); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("GetTo: %v, want ErrNotFound", err)
	}
	if _, err := c.Stat(ctx, "missing"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Stat: %v, want ErrNotFound", err)
	}
	if err := c.Put(ctx, "k", []byte("0123456789")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetInto(ctx, "k", make([]byte, 4)); !errors.Is(err, client.ErrInvalid) {
		t.Fatalf("GetInto a short buffer: %v, want ErrInvalid", err)
	}
}

func TestRemove(t *testing.T) {
	clk := testutil.NewClock(time.Unix(1000, 0))
	f, c := setup(t, false, testutil.FakeConfig{Now: clk.Now})
	ctx := t.Context()
	if err := c.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if err := c.Remove(ctx, "k", false); !errors.Is(err, client.ErrLeased) {
		t.Fatalf("Remove of a leased object: %v, want ErrLeased", err)
	}
	clk.Advance(11 * time.Second) // past the 10 s lease
	if err := c.Remove(ctx, "k", false); err != nil {
		t.Fatalf("Remove after the lease: %v", err)
	}
	if err := c.Remove(ctx, "k", false); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("second Remove: %v, want ErrNotFound", err)
	}
	if err := c.Put(ctx, "pinned", []byte("v"), client.WithHardPin(), client.WithSoftPin(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := c.Remove(ctx, "pinned", false); !errors.Is(err, client.ErrBusy) {
		t.Fatalf("Remove of a hard-pinned object: %v, want ErrBusy", err)
	}
	if err := c.Remove(ctx, "pinned", true); err != nil {
		t.Fatalf("forced Remove: %v", err)
	}
	if keys := f.Keys("default"); len(keys) != 0 {
		t.Fatalf("left %v", keys)
	}
}

func TestRemoveScansFollowPages(t *testing.T) {
	clk := testutil.NewClock(time.Unix(1000, 0))
	f, c := setup(t, false, testutil.FakeConfig{PageSize: 7, Now: clk.Now})
	ctx := t.Context()
	var items []client.Item
	for i := range 30 {
		items = append(items, client.Item{Key: fmt.Sprintf("p/%03d", i), Data: []byte{byte(i)}}, client.Item{Key: fmt.Sprintf("q/%03d", i), Data: []byte{byte(i)}})
	}
	for i, err := range c.BatchPut(ctx, items) {
		if err != nil {
			t.Fatalf("BatchPut %s: %v", items[i].Key, err)
		}
	}
	if _, err := c.Get(ctx, "p/005"); err != nil { // leased: skipped without force
		t.Fatal(err)
	}
	removed, skipped, err := c.RemoveByPrefix(ctx, "p/", false)
	if err != nil || removed != 29 || skipped != 1 {
		t.Fatalf("RemoveByPrefix: removed %d skipped %d, %v; want 29, 1", removed, skipped, err)
	}
	if got := f.Calls("RemoveByPrefix"); got < 5 {
		t.Fatalf("%d RemoveByPrefix calls for 30 keys in pages of 7", got)
	}
	removed, skipped, err = c.RemoveByRegex(ctx, `^q/00[0-9]$`, false)
	if err != nil || removed != 10 || skipped != 0 {
		t.Fatalf("RemoveByRegex: removed %d skipped %d, %v; want 10, 0", removed, skipped, err)
	}
	if _, _, err := c.RemoveByRegex(ctx, `(`, false); !errors.Is(err, client.ErrInvalid) {
		t.Fatalf("RemoveByRegex of a bad regex: %v, want ErrInvalid", err)
	}
	removed, skipped, err = c.RemoveAll(ctx, false)
	if err != nil || removed != 20 || skipped != 1 {
		t.Fatalf("RemoveAll: removed %d skipped %d, %v; want 20, 1", removed, skipped, err)
	}
	if removed, _, err = c.RemoveAll(ctx, true); err != nil || removed != 1 {
		t.Fatalf("forced RemoveAll: removed %d, %v", removed, err)
	}
}

func TestList(t *testing.T) {
	f, c := setup(t, false, testutil.FakeConfig{PageSize: 4})
	ctx := t.Context()
	var items []client.Item
	for i := range 10 {
		items = append(items, client.Item{Key: fmt.Sprintf("a/%02d", i), Data: pattern(i, 0)})
	}
	items = append(items, client.Item{Key: "b/0", Data: []byte("x")})
	if err := errors.Join(c.BatchPut(ctx, items, client.WithGroup("g"))...); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for o, err := range c.List(ctx, "a/") {
		if err != nil {
			t.Fatal(err)
		}
		if o.GetGroupId() != "g" || o.GetSize() != uint64(len(keys)) {
			t.Fatalf("object %v", o)
		}
		keys = append(keys, o.GetKey())
	}
	if len(keys) != 10 || !slices.IsSorted(keys) || f.Calls("ListObjects") != 3 {
		t.Fatalf("listed %v in %d calls, want the 10 a/ keys in 3 pages", keys, f.Calls("ListObjects"))
	}
	n := 0
	for range c.List(ctx, "") {
		if n++; n == 5 {
			break
		}
	}
	f.SetHook(func(string) error { return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "boom") })
	for _, err := range c.List(ctx, "") {
		if err == nil {
			t.Fatal("List against a failing master yielded an object")
		}
	}
}

func TestBatch(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		ctx := t.Context()
		// More items than one data-plane batch holds, a few streamed.
		var items []client.Item
		for i := range 300 {
			size := 64 + i
			if i%100 == 7 {
				size = 20 << 10
			}
			items = append(items, client.Item{Key: fmt.Sprintf("b/%03d", i), Data: pattern(size, byte(i))})
		}
		if err := c.Put(ctx, "b/000", []byte("taken")); err != nil {
			t.Fatal(err)
		}
		errs := c.BatchPut(ctx, items, client.WithReplicas(2))
		for i, err := range errs {
			if want := i == 0; errors.Is(err, client.ErrExists) != want || (err != nil) != want {
				t.Fatalf("BatchPut item %d: %v", i, err)
			}
		}
		keys := make([]string, len(items))
		for i, it := range items {
			keys[i] = it.Key
		}
		keys = append(keys, "missing")
		got, gerrs := c.BatchGet(ctx, keys)
		for i, k := range keys {
			want := []byte("taken")
			switch {
			case k == "missing":
				if !errors.Is(gerrs[i], client.ErrNotFound) {
					t.Fatalf("BatchGet missing: %v", gerrs[i])
				}
				continue
			case i > 0:
				want = items[i].Data
			}
			if gerrs[i] != nil || !bytes.Equal(got[i], want) {
				t.Fatalf("BatchGet %s: %d bytes, %v", k, len(got[i]), gerrs[i])
			}
		}
		bufs := make([][]byte, len(keys))
		for i := range bufs {
			bufs[i] = make([]byte, 20<<10)
		}
		bufs[1] = make([]byte, 3) // too small
		sizes, ierrs := c.BatchGetInto(ctx, keys, bufs)
		for i := 2; i < len(items); i++ {
			if ierrs[i] != nil || !bytes.Equal(bufs[i][:sizes[i]], items[i].Data) {
				t.Fatalf("BatchGetInto %s: %d bytes, %v", keys[i], sizes[i], ierrs[i])
			}
		}
		if !errors.Is(ierrs[1], client.ErrInvalid) {
			t.Fatalf("BatchGetInto into a short buffer: %v, want ErrInvalid", ierrs[1])
		}
		_, ierrs = c.BatchGetInto(ctx, keys, bufs[:2])
		if !errors.Is(ierrs[0], client.ErrInvalid) {
			t.Fatalf("BatchGetInto with too few buffers: %v, want ErrInvalid", ierrs[0])
		}
		ex, err := c.BatchExist(ctx, []string{"b/001", "missing"})
		if err != nil || !slices.Equal(ex, []bool{true, false}) {
			t.Fatalf("BatchExist: %v, %v", ex, err)
		}
		rerrs := c.BatchRemove(ctx, []string{"b/001", "missing"}, true)
		if rerrs[0] != nil || !errors.Is(rerrs[1], client.ErrNotFound) {
			t.Fatalf("BatchRemove: %v", rerrs)
		}
		if n := len(f.Keys("default")); n != 299 {
			t.Fatalf("%d keys left, want 299", n)
		}
	})
}

// TestBatchFallsBack: items whose first replica fails or is corrupt are
// read from the other one.
func TestBatchFallsBack(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		ctx := t.Context()
		var items []client.Item
		for i := range 10 {
			items = append(items, client.Item{Key: fmt.Sprintf("k%d", i), Data: pattern(100, byte(i))})
		}
		if err := errors.Join(c.BatchPut(ctx, items, client.WithReplicas(2))...); err != nil {
			t.Fatal(err)
		}
		f.Corrupt("default", "k3", 0)
		keys := []string{"k0", "k1", "k2", "k3"}
		check := func(what string) {
			t.Helper()
			got, errs := c.BatchGet(ctx, keys)
			for i := range keys {
				if errs[i] != nil || !bytes.Equal(got[i], items[i].Data) {
					t.Fatalf("%s: BatchGet %s: %d bytes, %v", what, keys[i], len(got[i]), errs[i])
				}
			}
		}
		check("replica 0 of k3 corrupt")
		f.SetAgentHook(func(agent int, _ string) error {
			if agent == 0 {
				return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent 0 is gone")
			}
			return nil
		})
		check("agent 0 failing")
		f.Corrupt("default", "k3", 1)
		if _, errs := c.BatchGet(ctx, keys); errs[3] == nil {
			t.Fatal("BatchGet of an object with no good replica succeeded")
		}
		f.Agent(0).Stop()
		f.Corrupt("default", "k3", 1) // heal replica 1
		check("agent 0 down")
	})
}

func TestBatchPutFailures(t *testing.T) {
	paths(t, func(t *testing.T, transfer bool) {
		f, c := setup(t, transfer, testutil.FakeConfig{})
		ctx := t.Context()
		items := []client.Item{{Key: "a", Data: []byte("a")}, {Key: "b", Data: pattern(20<<10, 1)}}
		f.SetAgentHook(func(int, string) error {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "down")
		})
		for i, err := range c.BatchPut(ctx, items) {
			if err == nil {
				t.Fatalf("item %d stored with every agent failing", i)
			}
		}
		if f.Calls("BatchPutRevoke") != 1 || len(f.Keys("default")) != 0 {
			t.Fatalf("%d BatchPutRevoke calls, keys %v; want 1 and none", f.Calls("BatchPutRevoke"), f.Keys("default"))
		}
		f.SetAgentHook(nil)
		for _, method := range []string{"BatchPutStart", "BatchPutEnd"} {
			f.SetHook(func(m string) error {
				if m == method {
					return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "boom")
				}
				return nil
			})
			for i, err := range c.BatchPut(ctx, items) {
				if err == nil {
					t.Fatalf("%s failing: item %d stored", method, i)
				}
			}
		}
		f.SetHook(nil)
		if err := errors.Join(c.BatchPut(ctx, items)...); err != nil {
			t.Fatal(err)
		}
		for _, method := range []string{"BatchGetReplicaList", "BatchRemove", "BatchExist"} {
			f.SetHook(func(m string) error {
				if m == method {
					return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "boom")
				}
				return nil
			})
			var failed bool
			switch method {
			case "BatchGetReplicaList":
				_, errs := c.BatchGet(ctx, []string{"a", "b"})
				failed = errs[0] != nil && errs[1] != nil
			case "BatchRemove":
				errs := c.BatchRemove(ctx, []string{"a", "b"}, false)
				failed = errs[0] != nil && errs[1] != nil
			case "BatchExist":
				_, err := c.BatchExist(ctx, []string{"a"})
				failed = err != nil
			}
			if !failed {
				t.Fatalf("%s failing: the batch call succeeded", method)
			}
		}
	})
}

func TestRetries(t *testing.T) {
	f := testutil.NewFake(t, testutil.FakeConfig{})
	c := newClient(t, f, client.Config{Attempts: 3})
	var fails atomic.Int32
	f.SetHook(func(m string) error {
		if m == "Exist" && fails.Add(-1) >= 0 {
			return status.Error(codes.Unavailable, "connection reset")
		}
		return nil
	})
	fails.Store(2)
	if _, err := c.Exist(t.Context(), "k"); err != nil {
		t.Fatalf("Exist after 2 transient failures, 3 attempts: %v", err)
	}
	fails.Store(3)
	if _, err := c.Exist(t.Context(), "k"); err == nil {
		t.Fatalf("Exist after 3 transient failures: %v, want the failure", err)
	}
	before := f.Calls("QueryRoute")
	f.SetHook(func(string) error {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "no")
	})
	if _, err := c.Stat(t.Context(), "k"); !errors.Is(err, client.ErrInvalid) || f.Calls("QueryRoute") != before+1 {
		t.Fatalf("Stat: %v after %d calls; a permanent error is not retried", err, f.Calls("QueryRoute"))
	}
	// The backoff's schedule and its context are TestCallBackoff's, on a
	// fake clock.
}

// TestNotLeaderRedirect: a master that is not the leader answers
// NOT_LEADER naming the leader; the client switches to it and retries.
func TestNotLeaderRedirect(t *testing.T) {
	leader := testutil.NewFake(t, testutil.FakeConfig{})
	follower := testutil.NewFake(t, testutil.FakeConfig{})
	follower.SetHook(func(string) error {
		return &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, Msg: "not the leader", Metadata: map[string]string{"leader": leader.Addr()}}
	})
	c := newClient(t, follower, client.Config{})
	if err := c.Put(t.Context(), "k", []byte("v")); err != nil {
		t.Fatalf("Put through a follower: %v", err)
	}
	if got, ok := leader.Object("default", "k"); !ok || string(got) != "v" {
		t.Fatalf("the leader holds %q, %v", got, ok)
	}
	if follower.Calls("PutStart") != 1 {
		t.Fatalf("the follower saw %d PutStart calls, want 1", follower.Calls("PutStart"))
	}
}

// TestCancelledPutRevokes: a put whose caller gave up is revoked, since
// the master may have started it.
func TestCancelledPutRevokes(t *testing.T) {
	f := testutil.NewFake(t, testutil.FakeConfig{})
	c := newClient(t, f, client.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := c.Put(ctx, "k", []byte("v")); !errors.Is(err, context.Canceled) && status.Code(err) != codes.Canceled {
		t.Fatalf("Put with a cancelled context: %v", err)
	}
	if f.Calls("PutRevoke") != 1 {
		t.Fatalf("%d PutRevoke calls, want 1", f.Calls("PutRevoke"))
	}
	if errs := c.BatchPut(ctx, []client.Item{{Key: "a"}}); errs[0] == nil || f.Calls("BatchPutRevoke") != 1 {
		t.Fatalf("BatchPut with a cancelled context: %v, %d revokes", errs[0], f.Calls("BatchPutRevoke"))
	}
}

func TestTenantsAndRawClients(t *testing.T) {
	f := testutil.NewFake(t, testutil.FakeConfig{})
	c := newClient(t, f, client.Config{Tenant: "t1"})
	ctx := t.Context()
	if err := c.Put(ctx, "k", []byte("one")); err != nil {
		t.Fatal(err)
	}
	other := c.Tenant("t2")
	if other.TenantName() != "t2" || c.Tenant("").TenantName() != "default" {
		t.Fatalf("tenant names %q, %q", other.TenantName(), c.Tenant("").TenantName())
	}
	if _, err := other.Get(ctx, "k"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("t2 sees t1's key: %v", err)
	}
	if r, err := c.Objects().GetSize(ctx, &masterv1.GetSizeRequest{Tenant: "t1", Key: "k"}); err != nil || r.GetSize() != 3 {
		t.Fatalf("GetSize: %v, %v", r, err)
	}
	if r, err := c.Admin().ListSegments(ctx, &masterv1.ListSegmentsRequest{}); err != nil || len(r.GetSegments()) != 2 {
		t.Fatalf("ListSegments: %v, %v", r, err)
	}
	snap, err := c.Changes().Snapshot(ctx, &masterv1.SnapshotRequest{})
	if err == nil {
		_, err = snap.Recv()
	}
	if status.Code(err) != codes.Unimplemented {
		t.Fatalf("Snapshot on a master without ChangeService: %v", err)
	}
	if err := other.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Put(ctx, "k2", []byte("x")); err == nil {
		t.Fatal("Put after Close (of a view sharing the connections) succeeded")
	}
}
