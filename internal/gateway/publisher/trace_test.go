package publisher

import (
	"fmt"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.opentelemetry.io/otel/trace"
)

func sc(i int) trace.SpanContext {
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{byte(i), 1}, SpanID: trace.SpanID{byte(i), 1}, TraceFlags: trace.FlagsSampled})
}

func scs(from, n int) []trace.SpanContext {
	var out []trace.SpanContext
	for i := range n {
		out = append(out, sc(from+i))
	}
	return out
}

// TestQueueLinks: a linked push's links go to the take that takes its last
// item, distinct and at most tracectx.MaxLinks; those of dropped pushes are
// forgotten; the queue remembers at most maxLinkMarks pushes.
func TestQueueLinks(t *testing.T) {
	q := newQueue(10)
	mk := func(n int) []item { return make([]item, n) }
	taken := func(k int) []trace.SpanContext {
		t.Helper()
		q.take(nil, k)
		return q.linksTaken(nil)
	}
	q.pushLinked(mk(3), statedir.Position{}, scs(1, 2))
	q.pushLinked(mk(3), statedir.Position{}, scs(2, 2)) // shares span 2
	q.push(mk(2), statedir.Position{})
	if got := taken(2); len(got) != 0 {
		t.Fatalf("a take before the first push's last item got links %v", got)
	}
	if got := taken(4); len(got) != 3 || !got[0].Equal(sc(1)) || !got[2].Equal(sc(3)) {
		t.Fatalf("links of the first two pushes = %v, want spans 1, 2, 3", got)
	}
	if got := taken(9); len(got) != 0 {
		t.Fatalf("an unlinked push's take got links %v", got)
	}
	// Bounded per batch.
	q.pushLinked(mk(1), statedir.Position{}, scs(10, 20))
	q.pushLinked(mk(1), statedir.Position{}, scs(40, 5))
	if got := taken(9); len(got) != tracectx.MaxLinks {
		t.Fatalf("%d links for one batch, max %d", len(got), tracectx.MaxLinks)
	}
	// Dropped: pushes overrun a full queue; their links are not reported.
	q.pushLinked(mk(10), statedir.Position{}, scs(60, 1))
	q.push(mk(10), statedir.Position{})
	if got := taken(10); len(got) != 0 {
		t.Fatalf("links of dropped events reported: %v", got)
	}
	if len(q.marks) != 0 {
		t.Fatalf("%d marks left after every event was taken", len(q.marks))
	}
	for i := range 3 * maxLinkMarks {
		q.pushLinked(mk(0), statedir.Position{Revision: uint64(i + 1)}, scs(i, 1)) // no items: no mark
		q.pushLinked(mk(1), statedir.Position{}, scs(i, 1))
		if q.n == len(q.buf) {
			q.take(nil, 5)
		}
	}
	if len(q.marks) > maxLinkMarks {
		t.Fatalf("%d marks kept, max %d", len(q.marks), maxLinkMarks)
	}
}

// TestPublishAndReplaySpans: a batch's gateway.publish span (a trace of its
// own) links to the spans behind its events; a replay request is served
// in a gateway.replay span; the wire is what it was.
func TestPublishAndReplaySpans(t *testing.T) {
	rec := tracectxtest.Install(t)
	p := start(t, testConfig())
	c := collect(t, p, kvevent.Options{Logger: testutil.Logger()})
	testutil.Eventually(t, 10*time.Second, func() bool { return p.Stats().Subscribers > 0 }, "the subscriber")
	var evs []kvevent.Event
	for i := range 3 {
		evs = append(evs, kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: fmt.Sprint("k", i), Medium: kvevent.MediumCPU})
	}
	p.EnqueueLinkedAt(statedir.Position{Epoch: 1, Revision: 3}, scs(1, 12), evs...)
	testutil.Eventually(t, 10*time.Second, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.n == 3 }, "the batch")
	testutil.Eventually(t, 10*time.Second, func() bool { return len(tracectxtest.Named(rec, "gateway.publish")) == 1 }, "the publish span")
	span := tracectxtest.Named(rec, "gateway.publish")[0]
	if span.Parent().IsValid() {
		t.Errorf("publish span has parent %v: want links only", span.Parent())
	}
	if l := span.Links(); len(l) != tracectx.MaxLinks || !l[0].SpanContext.Equal(sc(1)) {
		t.Errorf("publish span links %v, want the first %d of the batch's", l, tracectx.MaxLinks)
	}
	if got := tracectxtest.Attr(span, string(tracectx.Items)); got != "3" {
		t.Errorf("items %q", got)
	}
	if got := tracectxtest.Attr(span, string(attrSeq)); got != "1" {
		t.Errorf("seq %q", got)
	}

	var got []uint64
	if err := kvevent.Replay(t.Context(), p.ReplayEndpoint(), 1, kvevent.ReplayOptions{}, func(b kvevent.Batch) error {
		got = append(got, b.Seq)
		return nil
	}); err != nil || len(got) != 1 {
		t.Fatalf("Replay = %v, %v", got, err)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return len(tracectxtest.Named(rec, "gateway.replay")) == 1 }, "the replay span")
	if n := tracectxtest.Attr(tracectxtest.Named(rec, "gateway.replay")[0], string(tracectx.Items)); n != "1" {
		t.Errorf("replay span items %q, want 1", n)
	}
}
