package meta

import (
	"fmt"
	"testing"

	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
)

var testTracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/master/meta_test")

// TestBatchSpans: a traced batch of 128 puts makes one master.put_start
// (one master.place per round) and one master.put_end under the RPC's
// span, never a span per item, and the stored records name the put_end
// span for the gateway's links.
func TestBatchSpans(t *testing.T) {
	rec := tracectxtest.Install(t)
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 8})
	ctx, rpc := testTracer.Start(t.Context(), "rpc")
	const n = 128
	specs := make([]PutSpec, n)
	ends := make([]PutEndSpec, n)
	for i := range specs {
		specs[i] = PutSpec{Tenant: "t1", Key: fmt.Sprint("k", i), Size: 100, ReplicaNum: 2, ClientID: "w"}
		ends[i] = PutEndSpec{Tenant: "t1", Key: fmt.Sprint("k", i), ClientID: "w", Checksum: 700}
	}
	specs[0].Size = 0 // one invalid item
	head := e.s.log.Head()
	for i, r := range e.s.BatchPutStart(ctx, specs) {
		if (r.Err != nil) != (i == 0) {
			t.Fatalf("put %d: %v", i, r.Err)
		}
	}
	for i, err := range e.s.BatchPutEnd(ctx, ends) {
		if (err != nil) != (i == 0) {
			t.Fatalf("put end %d: %v", i, err)
		}
	}
	rpc.End()

	start := tracectxtest.One(t, rec, "master.put_start")
	tracectxtest.ChildOf(t, start, rpc.SpanContext())
	for key, want := range map[string]string{
		string(tracectx.Items): "128", string(tracectx.Failed): "1", string(tracectx.Reason): "INVALID_PARAMS",
		string(tracectx.Tenant): "t1", string(attrRounds): "1",
	} {
		if got := tracectxtest.Attr(start, key); got != want {
			t.Errorf("put_start %s = %q, want %q", key, got, want)
		}
	}
	tracectxtest.ChildOf(t, tracectxtest.One(t, rec, "master.place"), start.SpanContext())
	end := tracectxtest.One(t, rec, "master.put_end")
	tracectxtest.ChildOf(t, end, rpc.SpanContext())
	if got := tracectxtest.Attr(end, string(tracectx.Failed)); got != "1" {
		t.Errorf("put_end failed = %q, want 1", got)
	}
	if spans := len(rec.Ended()); spans != 4 {
		t.Errorf("%d spans for one batch of %d, want 4 (rpc, put_start, place, put_end)", spans, n)
	}
	links := e.s.log.Links(head, e.s.log.Head(), tracectx.MaxLinks, nil)
	if len(links) != 1 || !links[0].Equal(end.SpanContext()) {
		t.Fatalf("change log links %v, want the put_end span %v", links, end.SpanContext())
	}
}

// TestUntracedStoreMakesNoSpans: without a recording caller the store
// makes no span and its records name none.
func TestUntracedStoreMakesNoSpans(t *testing.T) {
	rec := tracectxtest.Install(t)
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	e.put(t, PutSpec{Key: "a"})
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans for an untraced put", n)
	}
	if links := e.s.log.Links(0, e.s.log.Head(), 8, nil); len(links) != 0 {
		t.Fatalf("untraced records name spans %v", links)
	}
}

// TestEvictAndReconcileSpans: a background eviction pass is a root span;
// a registration's reconcile is a root span linked to the stream's, and
// what it adopts names it.
func TestEvictAndReconcileSpans(t *testing.T) {
	rec := tracectxtest.Install(t)
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	for i := range 9 {
		e.put(t, PutSpec{Key: fmt.Sprint("k", i), Size: 100})
	}
	e.s.evictOverHigh(t.Context())
	ev := tracectxtest.One(t, rec, "master.evict")
	if ev.Parent().IsValid() {
		t.Fatalf("background eviction has parent %v", ev.Parent())
	}
	if got, want := tracectxtest.Attr(ev, string(attrEvicted)), "1"; got != want {
		t.Errorf("evicted = %q, want %q", got, want)
	}
	if got := tracectxtest.Attr(ev, string(attrEvictWhy)); got != "watermark" {
		t.Errorf("reason %q", got)
	}

	s2, err := New(Config{Shards: 4}, Deps{Registry: e.c.Reg, Agents: e.c.Agents, Now: e.clk.Now,
		Identity: cluster.Identity{Epoch: 43, Keys: token.NewRing(0, nil)}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stream := testTracer.Start(t.Context(), "Connect")
	s2.Reconcile(ctx, "agent-0", e.c.Reg.Segments(), e.c.Agents.Table("agent-0"))
	stream.End()
	rc := tracectxtest.One(t, rec, "master.reconcile")
	if rc.Parent().IsValid() || len(rc.Links()) != 1 || !rc.Links()[0].SpanContext.Equal(stream.SpanContext()) {
		t.Fatalf("reconcile parent %v, links %v: want a root linked to the stream", rc.Parent(), rc.Links())
	}
	for key, want := range map[string]string{string(tracectx.Agent): "agent-0", string(attrAdopted): "8", string(attrRebuild): "true"} {
		if got := tracectxtest.Attr(rc, key); got != want {
			t.Errorf("reconcile %s = %q, want %q", key, got, want)
		}
	}
	if links := s2.log.Links(0, s2.log.Head(), 8, nil); len(links) != 1 || !links[0].Equal(rc.SpanContext()) {
		t.Fatalf("adopted records name %v, want the reconcile span", links)
	}
}
