package testcluster

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"github.com/crescent-kv/crescent/pkg/client"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// The propagation paths of issue 16 that are not gRPC, through a real
// in-process cluster with every span recorded: master commands on the
// agents' Connect streams, the transfer header, and the change stream's
// links to the gateway's publish span. (The OTLP export of the same
// spans is e2e's concern.)

// spansOf returns the ended spans of trace id, by name.
func spansOf(rec *tracetest.SpanRecorder, id trace.TraceID) map[string][]sdktrace.ReadOnlySpan {
	out := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.SpanContext().TraceID() == id {
			out[s.Name()] = append(out[s.Name()], s)
		}
	}
	return out
}

// byID indexes spans by span id.
func byID(spans map[string][]sdktrace.ReadOnlySpan) map[trace.SpanID]sdktrace.ReadOnlySpan {
	out := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, list := range spans {
		for _, s := range list {
			out[s.SpanContext().SpanID()] = s
		}
	}
	return out
}

// parentName is the name of s's parent among ids ("" when absent).
func parentName(ids map[trace.SpanID]sdktrace.ReadOnlySpan, s sdktrace.ReadOnlySpan) string {
	if p, ok := ids[s.Parent().SpanID()]; ok {
		return p.Name()
	}
	return ""
}

func TestTraceOfAPut(t *testing.T) {
	rec := tracectxtest.Install(t)
	c := Start(t, Options{Gateway: true})
	c.WaitSegments(2)
	// Without seal on write, so PutEnd's Seal is traced too (with it, the
	// agents seal within their transfer.write spans and no Seal is sent).
	cl := c.Client(t, func(cfg *client.Config) { cfg.DisableSealOnWrite = true })
	if err := cl.Put(t.Context(), "traced", []byte("some bytes"), client.WithReplicas(2)); err != nil {
		t.Fatal(err)
	}
	put := tracectxtest.One(t, rec, "client.put")
	if put.Parent().IsValid() {
		t.Fatalf("client.put has parent %v: want the root of the call's trace", put.Parent())
	}
	// The agents end their transfer spans once the answer is written:
	// maybe after the client went on.
	var spans map[string][]sdktrace.ReadOnlySpan
	testutil.Eventually(t, 10*time.Second, func() bool {
		spans = spansOf(rec, put.SpanContext().TraceID())
		return len(spans["transfer.write"]) >= 4
	}, "the agents' transfer spans")
	ids := byID(spans)
	// Both agents' spans, each under the master's (or the client's) span
	// that asked for it.
	for name, want := range map[string]struct {
		n      int
		parent string
	}{
		"master.reserve": {2, "master.put_start"},
		"agent.reserve":  {2, "master.reserve"},
		"master.seal":    {2, "master.put_end"},
		"agent.seal":     {2, "master.seal"},
		"transfer.write": {4, ""}, // the client's two and the agents' two
	} {
		if got := len(spans[name]); got != want.n {
			t.Errorf("%d %s spans in the put's trace, want %d (trace: %v)", got, name, want.n, names(spans))
			continue
		}
		for _, s := range spans[name] {
			if want.parent != "" && parentName(ids, s) != want.parent {
				t.Errorf("%s under %q, want %s", name, parentName(ids, s), want.parent)
			}
		}
	}
	agents := map[string]bool{}
	for _, s := range spans["agent.reserve"] {
		agents[tracectxtest.Attr(s, "crescent.agent")] = true
	}
	if len(agents) != 2 {
		t.Errorf("agent.reserve spans from agents %v, want both", agents)
	}
	for _, s := range spans["transfer.write"] {
		if s.SpanKind() == trace.SpanKindServer && parentName(ids, s) != "transfer.write" {
			t.Errorf("agent's transfer.write under %q, want the client's transfer.write", parentName(ids, s))
		}
		if s.SpanKind() == trace.SpanKindClient && parentName(ids, s) != "client.put" {
			t.Errorf("client's transfer.write under %q, want client.put", parentName(ids, s))
		}
	}
	// The gateway announced it in a batch whose span links to the put's
	// master.put_end.
	end := spans["master.put_end"]
	if len(end) != 1 {
		t.Fatalf("%d master.put_end spans in the trace", len(end))
	}
	testutil.Eventually(t, 20*time.Second, func() bool {
		for _, s := range tracectxtest.Named(rec, "gateway.publish") {
			for _, l := range s.Links() {
				if l.SpanContext.SpanID() == end[0].SpanContext().SpanID() {
					return true
				}
			}
		}
		return false
	}, "a gateway.publish span linked to the put's master.put_end")
}

// TestBatchIsOneTrace: a batch of 128 puts is one trace per call, and its
// spans are bounded by the agents and rounds, not the items.
func TestBatchIsOneTrace(t *testing.T) {
	rec := tracectxtest.Install(t)
	c := Start(t, Options{})
	c.WaitSegments(2)
	cl := c.Client(t)
	items := make([]client.Item, 128)
	for i := range items {
		items[i] = client.Item{Key: fmt.Sprint("batch/", i), Data: []byte(fmt.Sprint("value ", i))}
	}
	for i, err := range cl.BatchPut(t.Context(), items, client.WithReplicas(2)) {
		if err != nil {
			t.Fatalf("item %d: %v", i, err)
		}
	}
	keys := make([]string, len(items))
	for i := range items {
		keys[i] = items[i].Key
	}
	if _, errs := cl.BatchGet(t.Context(), keys); errs[0] != nil {
		t.Fatal(errs[0])
	}
	for name, transfer := range map[string]string{"client.batch_put": "transfer.write", "client.batch_get": "transfer.read"} {
		root := tracectxtest.One(t, rec, name)
		if root.Parent().IsValid() {
			t.Fatalf("%s has a parent", name)
		}
		// One transfer per agent it read from or wrote to: the client's
		// span and, its child, the agent's.
		var spans map[string][]sdktrace.ReadOnlySpan
		testutil.Eventually(t, 10*time.Second, func() bool {
			spans = spansOf(rec, root.SpanContext().TraceID())
			clients, servers := 0, 0
			for _, s := range spans[transfer] {
				if s.SpanKind() == trace.SpanKindClient {
					clients++
				} else {
					servers++
				}
			}
			return clients > 0 && servers == clients
		}, "%s: the client's and the agents' %s spans", name, transfer)
		ids := byID(spans)
		for _, s := range spans[transfer] {
			if want := map[trace.SpanKind]string{trace.SpanKindClient: name, trace.SpanKindServer: transfer}[s.SpanKind()]; parentName(ids, s) != want {
				t.Errorf("%s (%v) under %q, want %s", transfer, s.SpanKind(), parentName(ids, s), want)
			}
		}
		total := 0
		for _, list := range spans {
			total += len(list)
		}
		// Per agent: reserve, seal, a transfer each way, their agent
		// halves; plus the RPCs and the store's spans. Nowhere near 128.
		if total > 40 {
			t.Errorf("%s: %d spans in its trace for 128 items: %v", name, total, names(spans))
		}
		t.Logf("%s: %d spans: %v", name, total, names(spans))
	}
	// And no span of the batch started a trace of its own.
	var roots []string
	for _, s := range rec.Ended() {
		if name := s.Name(); !s.Parent().IsValid() && name != "master.reconcile" && name != "master.evict" && !strings.HasPrefix(name, "crescent.master.v1.AdminService/") {
			roots = append(roots, s.Name())
		}
	}
	if len(roots) != 2 {
		t.Errorf("root spans %v, want the two calls'", roots)
	}
}

func names(spans map[string][]sdktrace.ReadOnlySpan) map[string]int {
	out := map[string]int{}
	for name, list := range spans {
		out[name] = len(list)
	}
	return out
}
