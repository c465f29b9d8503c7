package link

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/dataplane"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// copyTarget is another agent: a memory segment behind a real data plane's
// bulk transfer listener on loopback.
type copyTarget struct {
	mem      *segment.Segment
	key      token.SigningKey
	endpoint string
}

func newCopyTarget(t testing.TB, size uint64) *copyTarget {
	t.Helper()
	mem, err := segment.NewMemory("target", size)
	if err != nil {
		t.Fatal(err)
	}
	set := segment.NewSet(mem)
	keys := &dataplane.Keyring{}
	key := token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys.Set([]*masterv1.TokenKey{{Id: key.ID, Key: key.Secret}})
	srv := dataplane.New(dataplane.Config{}, dataplane.Deps{Segments: set, Keys: keys, Registerer: obs.NewRegistry()}, testutil.Logger())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.ServeTransfer(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Error(err)
		}
		_ = set.Close()
	})
	return &copyTarget{mem: mem, key: key, endpoint: lis.Addr().String()}
}

// reserve reserves size bytes for key at the target and returns the
// allocation and its write token.
func (c *copyTarget) reserve(t testing.TB, key string, size int) (*masterv1.AllocationRef, []byte) {
	t.Helper()
	a, err := c.mem.Reserve(&masterv1.ReserveItem{SegmentId: c.mem.ID(), Size: uint64(size), Tenant: "t", Key: key, ReplicaId: 2}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	tok := token.Sign(c.key, token.Claims{Mode: token.Write, Tenant: "t", Key: key, SegmentID: c.mem.ID(), AllocationID: a.GetAllocationId(),
		Expiry: time.Now().Add(time.Minute)})
	return &masterv1.AllocationRef{SegmentId: c.mem.ID(), AllocationId: a.GetAllocationId()}, tok
}

// copyLink is a link that is never run: copyResult is called directly.
func copyLink(t testing.TB, cfg Config, segs ...*segment.Segment) *Link {
	t.Helper()
	cfg.MasterAddr, cfg.AgentID, cfg.DataEndpoint = "passthrough:///master", "a1", "a1:1"
	l, err := New(cfg, Deps{Segments: segment.NewSet(segs...)}, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func pattern(n, seed int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*seed + i>>8)
	}
	return b
}

// TestCopyBatchOverTransfer: a batched copy moves many objects from a
// memory and a disk segment to another agent's bulk transfer listener
// (small ones sharing requests, one larger than a request in ranges), and
// answers per item: a forged token, an unknown source and an item without
// an endpoint fail alone, the others arrive intact (the target's seal
// checks every checksum).
func TestCopyBatchOverTransfer(t *testing.T) {
	mem, err := segment.NewMemory("mem-0", 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	disk, _, err := segment.OpenDisk(t.TempDir(), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	l := copyLink(t, Config{CopyRequestBytes: 64 << 10, CopyMaxBytes: 128 << 10, CopyConnsPerPeer: 2}, mem, disk)
	tgt := newCopyTarget(t, 16<<20)

	type obj struct {
		data []byte
		src  *masterv1.Allocation
		seg  *segment.Segment
	}
	var objs []obj
	for i := range 40 {
		seg, size := mem, 4<<10+i
		if i%3 == 0 {
			seg = disk
		}
		if i == 7 || i == 9 {
			size = 300<<10 + i // larger than a request: sent in ranges
		}
		data := pattern(size, i+1)
		objs = append(objs, obj{data: data, src: sealedAlloc(t, seg, fmt.Sprintf("k%d", i), data), seg: seg})
	}
	var items []*masterv1.CopyItem
	for i, o := range objs {
		dst, tok := tgt.reserve(t, fmt.Sprintf("k%d", i), len(o.data))
		items = append(items, &masterv1.CopyItem{
			Source:                 &masterv1.AllocationRef{SegmentId: o.seg.ID(), AllocationId: o.src.GetAllocationId()},
			TargetEndpoint:         "unused:1",
			TargetTransferEndpoint: tgt.endpoint,
			Target:                 dst, TargetToken: tok,
		})
	}
	items[5].TargetToken = []byte("forged")
	items[11].Source = &masterv1.AllocationRef{SegmentId: mem.ID(), AllocationId: 999999}
	items[13] = proto.CloneOf(items[13])
	items[13].TargetEndpoint, items[13].TargetTransferEndpoint = "", ""
	res := l.copyResult(t.Context(), &masterv1.CopyRequest{RequestId: 9, Items: items})
	if res.GetRequestId() != 9 || len(res.GetItems()) != len(items) || res.GetStatus() != nil {
		t.Fatalf("result: id %d, %d items for %d, status %v", res.GetRequestId(), len(res.GetItems()), len(items), res.GetStatus())
	}
	want := map[int]string{5: "INVALID_TOKEN", 11: "ALLOCATION_NOT_FOUND", 13: "INVALID_PARAMS"}
	var seals []segment.SealArg
	for i, st := range res.GetItems() {
		if w, bad := want[i]; bad {
			if st.GetReason() != w {
				t.Errorf("item %d: got %v, want %s", i, st, w)
			}
			continue
		}
		if st.GetCode() != 0 {
			t.Errorf("item %d: got %v, want OK", i, st)
			continue
		}
		seals = append(seals, segment.SealArg{ID: items[i].GetTarget().GetAllocationId(), Checksum: checksum.Sum(objs[i].data)})
	}
	for i, err := range tgt.mem.Seal(seals, time.Now()) {
		if err != nil {
			t.Errorf("target allocation %d: %v (the bytes differ from the source's)", seals[i].ID, err)
		}
	}
}

// TestCopyTargetUnreachable: a target whose transfer listener is gone
// fails every one of its items with AGENT_UNAVAILABLE, within the peer
// timeout, and the copy returns.
func TestCopyTargetUnreachable(t *testing.T) {
	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	l := copyLink(t, Config{CopyPeerTimeout: 2 * time.Second}, mem)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := lis.Addr().String()
	_ = lis.Close()
	var items []*masterv1.CopyItem
	for i := range 3 {
		a := sealedAlloc(t, mem, fmt.Sprintf("k%d", i), pattern(1000, i))
		items = append(items, &masterv1.CopyItem{Source: &masterv1.AllocationRef{SegmentId: mem.ID(), AllocationId: a.GetAllocationId()},
			TargetTransferEndpoint: gone, Target: &masterv1.AllocationRef{SegmentId: "t", AllocationId: uint64(i + 1)}, TargetToken: []byte("x")})
	}
	res := l.copyResult(t.Context(), &masterv1.CopyRequest{RequestId: 1, Items: items})
	for i, st := range res.GetItems() {
		if st.GetReason() != "AGENT_UNAVAILABLE" {
			t.Fatalf("item %d: got %v, want AGENT_UNAVAILABLE", i, st)
		}
	}
}

// TestCopyRequestLimits: a request of more than MaxCopyItems items, or one
// that mixes the single and batch forms, is refused whole before anything
// is opened or dialled; the single form without its fields is refused.
func TestCopyRequestLimits(t *testing.T) {
	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	l := copyLink(t, Config{}, mem)
	item := &masterv1.CopyItem{Source: &masterv1.AllocationRef{SegmentId: mem.ID(), AllocationId: 1}, TargetTransferEndpoint: "127.0.0.1:1",
		Target: &masterv1.AllocationRef{SegmentId: "t", AllocationId: 1}}
	many := make([]*masterv1.CopyItem, MaxCopyItems+1)
	for i := range many {
		many[i] = item
	}
	for _, tc := range []struct {
		name string
		req  *masterv1.CopyRequest
		want string
	}{
		{"too many items", &masterv1.CopyRequest{Items: many}, "LIMIT_EXCEEDED"},
		{"both forms", &masterv1.CopyRequest{Items: []*masterv1.CopyItem{item}, Source: item.GetSource()}, "INVALID_PARAMS"},
		{"empty single form", &masterv1.CopyRequest{}, "INVALID_PARAMS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := l.copyResult(t.Context(), tc.req)
			if len(res.GetItems()) != 0 || res.GetStatus().GetReason() != tc.want {
				t.Fatalf("got %d items, status %v; want the request refused with %s", len(res.GetItems()), res.GetStatus(), tc.want)
			}
		})
	}
}

// FuzzCopyRequest feeds arbitrary bytes, decoded as a CopyRequest from the
// master, to the agent's copy (every endpoint pointed at a closed loopback
// port, so nothing leaves the machine): never a panic, and either the
// request is refused whole or every item gets a status; nothing is copied
// from an allocation that is not SEALED here.
func FuzzCopyRequest(f *testing.F) {
	ref := &masterv1.AllocationRef{SegmentId: "mem-0", AllocationId: 1}
	for _, r := range []*masterv1.CopyRequest{
		{Items: []*masterv1.CopyItem{{Source: ref, TargetTransferEndpoint: "x:1", Target: ref, TargetToken: []byte("t")}}},
		{Items: []*masterv1.CopyItem{{Source: ref, TargetEndpoint: "x:1", Target: ref}, {}, nil}},
		{Source: ref, Target: ref, TargetEndpoint: "x:1"},
		{Source: ref, Items: []*masterv1.CopyItem{{}}},
		{},
	} {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		f.Fatal(err)
	}
	a, err := mem.Reserve(&masterv1.ReserveItem{SegmentId: mem.ID(), Size: 100, Tenant: "t", Key: "k", ReplicaId: 1}, time.Now())
	if err != nil {
		f.Fatal(err)
	}
	if err := mem.Seal([]segment.SealArg{{ID: a.GetAllocationId(), Checksum: checksum.Sum(make([]byte, 100))}}, time.Now())[0]; err != nil {
		f.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	closed := lis.Addr().String()
	_ = lis.Close()
	l, err := New(Config{MasterAddr: "passthrough:///m", AgentID: "a1", DataEndpoint: "a1:1", CopyPeerTimeout: time.Second},
		Deps{Segments: segment.NewSet(mem)}, testutil.Logger())
	if err != nil {
		f.Fatal(err)
	}
	defer l.Close()
	f.Fuzz(func(t *testing.T, data []byte) {
		var r masterv1.CopyRequest
		if proto.Unmarshal(data, &r) != nil {
			return
		}
		if r.TargetEndpoint != "" {
			r.TargetEndpoint = "passthrough:///" + closed
		}
		for _, it := range r.GetItems() {
			if it == nil {
				continue
			}
			if it.TargetEndpoint != "" {
				it.TargetEndpoint = "passthrough:///" + closed
			}
			if it.TargetTransferEndpoint != "" {
				it.TargetTransferEndpoint = closed
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		res := l.copyResult(ctx, &r)
		if checkCopy(&r) != nil {
			if len(res.GetItems()) != 0 || res.GetStatus().GetCode() == 0 {
				t.Fatalf("refused request answered %v", res)
			}
			return
		}
		if n := len(r.GetItems()); n > 0 && len(res.GetItems()) != n {
			t.Fatalf("%d statuses for %d items", len(res.GetItems()), n)
		}
		for i, st := range res.GetItems() {
			if st.GetCode() == 0 {
				t.Fatalf("item %d copied to a closed port: %v", i, r.GetItems()[i])
			}
		}
	})
}

// TestCopyBatchFallsBackToDataService: an item whose target registered no
// bulk transfer endpoint is copied through the target's DataService, in
// the same batch as items that go over the transfer path, each answered in
// its place.
func TestCopyBatchFallsBackToDataService(t *testing.T) {
	mem, err := segment.NewMemory("mem-0", 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	l := copyLink(t, Config{}, mem)
	xt := newCopyTarget(t, 4<<20) // over the transfer path
	// The DataService target: a real data plane over its own segment.
	gmem, err := segment.NewMemory("grpc-target", 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	gset := segment.NewSet(gmem)
	defer gset.Close()
	keys := &dataplane.Keyring{}
	keys.Set([]*masterv1.TokenKey{{Id: xt.key.ID, Key: xt.key.Secret}})
	l.deps.CopyDialOptions = []grpc.DialOption{serveData(t, dataplane.New(dataplane.Config{}, dataplane.Deps{Segments: gset, Keys: keys}, testutil.Logger()))}
	gt := &copyTarget{mem: gmem, key: xt.key}

	var items []*masterv1.CopyItem
	var sums []uint64
	for i := range 4 {
		data := pattern(5000+i, i+2)
		src := sealedAlloc(t, mem, fmt.Sprintf("k%d", i), data)
		it := &masterv1.CopyItem{Source: &masterv1.AllocationRef{SegmentId: mem.ID(), AllocationId: src.GetAllocationId()}}
		if i%2 == 0 {
			it.Target, it.TargetToken = xt.reserve(t, fmt.Sprintf("k%d", i), len(data))
			it.TargetTransferEndpoint = xt.endpoint
		} else {
			it.Target, it.TargetToken = gt.reserve(t, fmt.Sprintf("k%d", i), len(data))
			it.TargetEndpoint = "passthrough:///grpc-target"
		}
		items = append(items, it)
		sums = append(sums, checksum.Sum(data))
	}
	res := l.copyResult(t.Context(), &masterv1.CopyRequest{RequestId: 3, Items: items})
	for i, st := range res.GetItems() {
		if st.GetCode() != 0 {
			t.Fatalf("item %d: %v", i, st)
		}
		tgt := xt.mem
		if i%2 == 1 {
			tgt = gmem
		}
		if err := tgt.Seal([]segment.SealArg{{ID: items[i].GetTarget().GetAllocationId(), Checksum: sums[i]}}, time.Now())[0]; err != nil {
			t.Fatalf("item %d at its target: %v", i, err)
		}
	}
}

// TestCopyReleasedMeanwhileIsNotAWarning: a copy item whose source or
// target the master released after it sent the copy (its object removed,
// its move given up) fails ALLOCATION_NOT_FOUND for the master to read,
// and is logged at Debug, not as a failure; any other failure is still a
// warning, which counts the released items beside it.
func TestCopyReleasedMeanwhileIsNotAWarning(t *testing.T) {
	mem, err := segment.NewMemory("mem-0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	var logs testutil.LogBuffer
	cfg := Config{MasterAddr: "passthrough:///master", AgentID: "a1", DataEndpoint: "a1:1"}
	l, err := New(cfg, Deps{Segments: segment.NewSet(mem)}, slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	tgt := newCopyTarget(t, 1<<20)
	data := pattern(4<<10, 3)
	item := func(key string) *masterv1.CopyItem {
		src := sealedAlloc(t, mem, key, data)
		dst, tok := tgt.reserve(t, key, len(data))
		return &masterv1.CopyItem{Source: &masterv1.AllocationRef{SegmentId: mem.ID(), AllocationId: src.GetAllocationId()},
			TargetTransferEndpoint: tgt.endpoint, Target: dst, TargetToken: tok}
	}
	released := item("source-released")
	if err := mem.Release(released.GetSource().GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	targetGone := item("target-released")
	if err := tgt.mem.Release(targetGone.GetTarget().GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	res := l.copyResult(t.Context(), &masterv1.CopyRequest{RequestId: 1, Items: []*masterv1.CopyItem{released, targetGone, item("ok")}})
	for i, want := range []string{"ALLOCATION_NOT_FOUND", "ALLOCATION_NOT_FOUND", ""} {
		if got := res.GetItems()[i].GetReason(); got != want {
			t.Fatalf("item %d: %v, want reason %q", i, res.GetItems()[i], want)
		}
	}
	if n := logs.Count(`"level":"WARN"`); n != 0 {
		t.Fatalf("%d warnings for copies whose allocations were released meanwhile:\n%s", n, logs.String())
	}
	if n := logs.Count(`"released_meanwhile":2`); n != 1 {
		t.Fatalf("no Debug line counting the 2 released items:\n%s", logs.String())
	}

	forged := item("forged")
	forged.TargetToken = []byte("forged")
	released = item("released-again")
	if err := mem.Release(released.GetSource().GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	l.copyResult(t.Context(), &masterv1.CopyRequest{RequestId: 2, Items: []*masterv1.CopyItem{forged, released}})
	if n := logs.Count(`"msg":"copy items failed"`); n != 1 || logs.Count(`"failed":1,"released_meanwhile":1`) != 1 {
		t.Fatalf("a forged token beside a released source: want one warning counting each:\n%s", logs.String())
	}
}
