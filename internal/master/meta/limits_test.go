package meta

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// gatedAgents holds the first Copy until released, so a test can act while
// a drain is in the middle of a chunk.
type gatedAgents struct {
	*metatest.Agents
	once    sync.Once
	copying chan struct{} // closed at the first Copy
	release chan struct{} // the first Copy returns once this is closed
}

func (g *gatedAgents) Copy(ctx context.Context, agent string, items []*masterv1.CopyItem) ([]*masterv1.ItemStatus, error) {
	g.once.Do(func() {
		close(g.copying)
		<-g.release
	})
	return g.Agents.Copy(ctx, agent, items)
}

func wantStatus(t testing.TB, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(rpcerr.Status(err)); got != code {
		t.Fatalf("code: got %v, want %v (%v)", got, code, err)
	}
	if got := rpcerr.Reason(err); got != reason {
		t.Fatalf("reason: got %q, want %q (%v)", got, reason, err)
	}
}

// TestUndrainStopsDrain: UndrainSegment during a drain returns the segment
// to OK at once; the drain finishes the chunk it is copying (no replica of
// it is dropped), stops before the next one with ABORTED, and every object
// stays readable. The segment then takes allocations again.
func TestUndrainStopsDrain(t *testing.T) {
	c := metatest.NewCluster(2, 1, 1<<20)
	clk := newClock()
	c.Agents.NowMs = func() int64 { return clk.Now().UnixMilli() }
	g := &gatedAgents{Agents: c.Agents, copying: make(chan struct{}), release: make(chan struct{})}
	s, err := New(Config{Shards: 4}, Deps{
		Registry: c.Reg, Agents: g, Now: clk.Now,
		Identity: cluster.Identity{MasterID: "m1", Epoch: 42, Keys: token.NewRing(0, nil)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{s: s, c: c, clk: clk}
	ctx := t.Context()
	const n = drainInFlight*drainChunk + 44
	for i := range n {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%03d", i), Size: 10, Preferred: []string{"seg-0-0"}})
	}
	drained := make(chan error, 1)
	go func() { drained <- s.DrainSegment(ctx, "seg-0-0") }()
	<-g.copying
	if sg, _ := c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
		t.Fatalf("lifecycle during the drain: got %v, want DRAINING", sg.Lifecycle)
	}
	if err := s.UndrainSegment(ctx, "seg-0-0"); err != nil {
		t.Fatalf("undrain during the drain: %v", err)
	}
	close(g.release)
	wantStatus(t, <-drained, codes.FailedPrecondition, "SEGMENT_UNAVAILABLE")
	if sg, _ := c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK {
		t.Fatalf("lifecycle after undrain: got %v, want OK", sg.Lifecycle)
	}
	// The chunks in flight when the undrain came (the first, and the next
	// if it had started: drainInFlight at once) finish; no other starts.
	counts := s.SegmentReplicaCounts()
	if moved := counts["seg-1-0"]; moved%drainChunk != 0 || moved == 0 || moved > drainInFlight*drainChunk || counts["seg-0-0"] != n-moved {
		t.Fatalf("replicas: got %v, want whole chunks of %d moved (at most %d of them) and the rest left", counts, drainChunk, drainInFlight)
	}
	for _, r := range e.records(t) {
		if strings.HasPrefix(r, "removed") {
			t.Fatalf("undrain lost an object: %s", r)
		}
	}
	for i := range n {
		if _, err := s.Get(ctx, GetSpec{Key: fmt.Sprintf("k%03d", i)}); err != nil {
			t.Fatalf("get k%03d after the stopped drain: %v", i, err)
		}
	}
	e.put(t, PutSpec{Key: "after", Size: 10, Preferred: []string{"seg-0-0"}})
	if got := views(s)[ObjectRef{DefaultTenant, "after"}].readableOnSegs; got != "[seg-0-0]" {
		t.Fatalf("put after undrain: readable on %s, want seg-0-0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestUndrainSegment: DRAINED → OK, idempotent on OK, refused on an
// unmounting segment and an unknown one.
func TestUndrainSegment(t *testing.T) {
	e := newEnv(t, 2, 1, 1000, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Key: "a", Preferred: []string{"seg-0-0"}})
	if err := e.s.DrainSegment(ctx, "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := e.s.UndrainSegment(ctx, "seg-0-0"); err != nil {
			t.Fatalf("undrain: %v", err)
		}
		if sg, _ := e.c.Reg.Segment("seg-0-0"); sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK || !sg.CanAllocate() {
			t.Fatalf("after undrain: lifecycle %v, can allocate %v; want OK and true", sg.Lifecycle, sg.CanAllocate())
		}
	}
	// Drain again, then undrain from DRAINED.
	if err := e.s.DrainSegment(ctx, "seg-0-0"); err != nil {
		t.Fatalf("drain after undrain: %v", err)
	}
	if err := e.s.UndrainSegment(ctx, "seg-0-0"); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Reg.SetLifecycle("seg-1-0", masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, e.s.UndrainSegment(ctx, "seg-1-0"), codes.FailedPrecondition, "SEGMENT_UNAVAILABLE")
	wantStatus(t, e.s.UndrainSegment(ctx, "nope"), codes.NotFound, "SEGMENT_NOT_FOUND")
}

// TestScanMatchBudget: a regex page stops once its matching work (key
// bytes × program instructions) reaches matchBudget, however many keys the
// scan budget would allow, and the pages together cover every key.
func TestScanMatchBudget(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<30, Config{Shards: 2})
	ctx := t.Context()
	const n = 16
	for i := range n {
		e.put(t, PutSpec{Tenant: "t", Key: fmt.Sprintf("%02d%s", i, strings.Repeat("z", 4000)), Size: 1})
	}
	// 4002 instructions that die on the first byte: cheap to run, but the
	// budget counts the program's size, the worst case.
	const re = "^a{1000}b{1000}c{1000}d{1000}|^0"
	_, insts, err := CompileKeyRegex(re)
	if err != nil {
		t.Fatal(err)
	}
	perKey := 4003 * insts
	var removed uint64
	pages := 0
	for tok := ""; ; {
		r, _, next, err := e.s.RemoveByRegex(ctx, "t", re, true, tok)
		if err != nil {
			t.Fatal(err)
		}
		removed += r
		pages++
		if tok = next; tok == "" {
			break
		}
	}
	if want := n / (matchBudget/perKey + 1); pages < want || removed != 10 {
		t.Fatalf("removed %d (want the 10 keys starting with 0) in %d pages (want at least %d)", removed, pages, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestTenantChurn races puts, removes and reads on a few tenants that keep
// emptying (so they retire and come back) and checks that no object ever
// lands under a retired id and no idle tenant stays.
func TestTenantChurn(t *testing.T) {
	e := newEnv(t, 2, 2, 1<<20, Config{Shards: 8})
	ctx := t.Context()
	var wg sync.WaitGroup
	var puts atomic.Int64
	for w := range 4 {
		wg.Go(func() {
			for i := range 300 {
				tenant := fmt.Sprintf("t%d", i%3)
				key := fmt.Sprintf("w%d-%d", w, i%5)
				if _, err := e.s.PutStart(ctx, PutSpec{Tenant: tenant, Key: key, Size: 10, ClientID: "c"}); err == nil {
					if e.s.PutEnd(ctx, PutEndSpec{Tenant: tenant, Key: key, ClientID: "c", Checksum: 1}) == nil {
						puts.Add(1)
					}
				}
				_, _ = e.s.Get(ctx, GetSpec{Tenant: tenant, Key: key})
				_ = e.s.Remove(ctx, RemoveSpec{Tenant: tenant, Key: key, Force: true})
				if i%50 == 0 {
					_, _ = e.s.SetTenantQuota(ctx, tenant, 0, uint64(i%2)*100)
				}
			}
		})
	}
	wg.Wait()
	if puts.Load() == 0 {
		t.Fatal("no put succeeded")
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
	for _, q := range e.s.ListTenants(ctx) {
		if q.GetUsedObjects() == 0 && q.GetMaxObjects() == 0 && q.GetMaxBytes() == 0 {
			t.Fatalf("idle tenant %q listed", q.GetTenant())
		}
	}
}
