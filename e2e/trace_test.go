package e2e

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	"github.com/crescent-kv/crescent/pkg/client"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
)

// Services as the spans' resources name them (service.name).
const (
	clientService  = "e2e-client"
	masterService  = "crescent-master"
	agentService   = "crescent-agent"
	gatewayService = "crescent-gateway"
)

// traceKeyPrefix begins every object key the test writes, so a span
// attribute holding one (or part of one past the prefix) is found.
const traceKeyPrefix = "e2e-trace-key/"

// TestTracing is issue 16's proof with the real binaries: an in-process
// OTLP receiver collects the spans of the test's SDK client, the master,
// both agents and the gateway. A put of two replicas is one trace holding
// the client's, the master's and both agents' spans, one tree under the
// client's client.put; a get likewise with the agent it read from; a
// BatchPut of 128 objects is one trace of a bounded number of spans; and
// no span carries an object key (--trace-keys is off).
func TestTracing(t *testing.T) {
	r := otlptest.Start(t)
	// Each process (and the test's SDK) exports its batch of spans 100 ms
	// after the first ends, not the SDK's default 5 s; the processes
	// inherit it.
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
	c := StartCluster(t, Options{Agents: 2, Gateway: true, OTLPEndpoint: r.Addr()})

	shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Endpoint: r.Addr(), Insecure: true}, clientService, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = shutdown(context.Background()) })
	// Without seal on write, so the put's PutEnd sends Seal and its
	// master.seal and agent.seal spans are checked (with seal receipts the
	// agents seal inside their transfer.write spans).
	cl := c.ClientWith(client.Config{Tenant: "default", DisableSealOnWrite: true})
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()

	putKey := traceKeyPrefix + "put"
	data := bytes.Repeat([]byte("traced "), 1000)
	if err := cl.Put(ctx, putKey, data, client.WithReplicas(2)); err != nil {
		t.Fatalf("Put: %v", err)
	}
	putRoot := waitRoot(ctx, t, r, "client.put")
	put := waitTrace(ctx, t, r, putRoot, "put", func(spans []otlptest.Span) error {
		if n := len(agentInstances(otlptest.Filter(spans, otlptest.Named("agent.seal")))); n < 2 {
			return fmt.Errorf("agent.seal from %d agents, want 2", n)
		}
		if n := len(agentInstances(otlptest.Filter(spans, serverSpan("transfer.write")))); n < 2 {
			return fmt.Errorf("the agents' transfer.write from %d agents, want 2", n)
		}
		return nil
	})
	byID := index(put)
	if n := len(agentInstances(put)); n != 2 {
		t.Errorf("put: spans from %d agent instances, want 2: %v", n, agentInstances(put))
	}
	for _, s := range put {
		if s.Service != agentService {
			continue
		}
		chain := ancestors(byID, s)
		switch {
		case strings.HasPrefix(s.Name, "agent."):
			// A command on the Connect stream: under the master's span
			// that sent it, under the master's PutStart or PutEnd.
			if !slices.ContainsFunc(chain, otlptest.And(otlptest.Service(masterService), otlptest.Named("master."+strings.TrimPrefix(s.Name, "agent.")))) {
				t.Errorf("put: %s not under the master's span that sent it: ancestors %s", s, names(chain))
			}
		case s.Name == "transfer.write":
			// The bytes: under the client's transfer.write.
			if p, ok := byID[s.ParentSpanID]; !ok || p.Service != clientService || p.Name != "transfer.write" {
				t.Errorf("put: the agent's %s not under the client's transfer.write: ancestors %s", s, names(chain))
			}
		}
	}
	for _, name := range []string{"master.put_start", "master.put_end"} {
		got := otlptest.Filter(put, otlptest.And(otlptest.Service(masterService), otlptest.Named(name)))
		if len(got) != 1 {
			t.Errorf("put: %d %s spans, want 1", len(got), name)
			continue
		}
		// The master's span under its gRPC server span, under the
		// client's gRPC client span, under client.put.
		chain := ancestors(byID, got[0])
		if !slices.ContainsFunc(chain, otlptest.Service(clientService)) {
			t.Errorf("put: %s not under a client span: ancestors %s", name, names(chain))
		}
	}
	for _, name := range []string{"master.reserve", "agent.reserve", "master.seal", "agent.seal"} {
		if n := len(otlptest.Filter(put, otlptest.Named(name))); n != 2 {
			t.Errorf("put: %d %s spans, want 2 (one per replica)", n, name)
		}
	}
	t.Logf("put: one trace of %d spans: %v", len(put), services(put))

	// The gateway announced the put in a batch whose span (a trace of its
	// own) links to the master's master.put_end.
	if end := otlptest.Filter(put, otlptest.Named("master.put_end")); len(end) == 1 {
		_, err := r.WaitForSpan(ctx, func(s otlptest.Span) bool {
			return s.Service == gatewayService && s.Name == "gateway.publish" &&
				slices.ContainsFunc(s.Links, func(l otlptest.Link) bool { return l.SpanID == end[0].SpanID })
		})
		if err != nil {
			t.Errorf("no gateway.publish span linked to the put's master.put_end: %v", err)
		}
	}

	got, err := cl.Get(ctx, putKey)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("Get: %d bytes, not the %d put", len(got), len(data))
	}
	getRoot := waitRoot(ctx, t, r, "client.get")
	get := waitTrace(ctx, t, r, getRoot, "get", func(spans []otlptest.Span) error {
		if len(otlptest.Filter(spans, otlptest.Service(masterService))) == 0 {
			return fmt.Errorf("no master span")
		}
		if len(otlptest.Filter(spans, serverSpan("transfer.read"))) == 0 {
			return fmt.Errorf("no agent's transfer.read")
		}
		return nil
	})
	byID = index(get)
	for _, s := range otlptest.Filter(get, serverSpan("transfer.read")) {
		if p, ok := byID[s.ParentSpanID]; !ok || p.Service != clientService || p.Name != "transfer.read" {
			t.Errorf("get: the agent's %s not under the client's transfer.read: ancestors %s", s, names(ancestors(byID, s)))
		}
	}
	t.Logf("get: one trace of %d spans: %v", len(get), services(get))

	items := make([]client.Item, 128)
	keys := []string{putKey}
	for i := range items {
		items[i] = client.Item{Key: fmt.Sprintf("%sbatch/%d", traceKeyPrefix, i), Data: []byte(fmt.Sprint("value ", i))}
		keys = append(keys, items[i].Key)
	}
	for i, err := range cl.BatchPut(ctx, items, client.WithReplicas(2)) {
		if err != nil {
			t.Fatalf("BatchPut item %d: %v", i, err)
		}
	}
	batchRoot := waitRoot(ctx, t, r, "client.batch_put")
	batch := waitTrace(ctx, t, r, batchRoot, "batch", func(spans []otlptest.Span) error {
		// Both agents sealed and took their bytes.
		if n := len(agentInstances(otlptest.Filter(spans, otlptest.Named("agent.seal")))); n < 2 {
			return fmt.Errorf("agent.seal from %d agents, want 2", n)
		}
		if n := len(agentInstances(otlptest.Filter(spans, serverSpan("transfer.write")))); n < 2 {
			return fmt.Errorf("the agents' transfer.write from %d agents, want 2", n)
		}
		return nil
	})
	// One trace for the call: every span of the batch's RPCs, wherever it
	// was recorded, is in the root's.
	traces := map[string]bool{}
	for _, s := range r.Spans() {
		if s.Name == "client.batch_put" || strings.Contains(s.Name, "/BatchPut") {
			traces[s.TraceID] = true
		}
	}
	if len(traces) != 1 {
		t.Errorf("the batch's spans are in %d traces, want 1", len(traces))
	}
	// Per agent a reservation, a seal and a transfer, each on both sides,
	// plus the RPCs and the master's spans: about 20, nowhere near 128.
	if len(batch) > 40 {
		t.Errorf("batch of %d items: %d spans in its trace, want at most 40: %v", len(items), len(batch), spanNames(batch))
	}
	t.Logf("batch of %d: one trace of %d spans: %v", len(items), len(batch), spanNames(batch))

	// No span, link or status says an object key.
	all := r.Spans()
	for _, s := range all {
		for k, v := range s.Attrs {
			if hasKey(v, keys) {
				t.Errorf("span %s: attribute %s=%v holds an object key", s, k, v)
			}
		}
		for _, l := range s.Links {
			for k, v := range l.Attrs {
				if hasKey(v, keys) {
					t.Errorf("span %s: link attribute %s=%v holds an object key", s, k, v)
				}
			}
		}
		if hasKey(s.StatusMessage, keys) || hasKey(s.Name, keys) {
			t.Errorf("span %s (status %q) names an object key", s, s.StatusMessage)
		}
	}
	t.Logf("%d spans received in all, scanned for the %d keys", len(all), len(keys))
}

// waitRoot waits for the test's client span called name and checks it is
// the root of its trace.
func waitRoot(ctx context.Context, t *testing.T, r *otlptest.Receiver, name string) otlptest.Span {
	t.Helper()
	s, err := r.WaitForSpan(ctx, otlptest.And(otlptest.Service(clientService), otlptest.Named(name)))
	if err != nil {
		t.Fatalf("no %s span from %s: %v", name, clientService, err)
	}
	if !s.Root() {
		t.Fatalf("%s has parent %s: want the root of the call's trace", s, s.ParentSpanID)
	}
	return s
}

// waitTrace waits until root's trace holds spans of the client, the master
// and an agent, ready accepts them, and they form one tree under root;
// it returns them.
func waitTrace(ctx context.Context, t *testing.T, r *otlptest.Receiver, root otlptest.Span, what string, ready func([]otlptest.Span) error) []otlptest.Span {
	t.Helper()
	var last error
	check := func(all []otlptest.Span) error {
		spans := otlptest.Filter(all, func(s otlptest.Span) bool { return s.TraceID == root.TraceID })
		for _, svc := range []string{clientService, masterService, agentService} {
			if len(otlptest.Filter(spans, otlptest.Service(svc))) == 0 {
				return fmt.Errorf("no span from %s", svc)
			}
		}
		if err := ready(spans); err != nil {
			return err
		}
		got, err := otlptest.Tree(spans)
		if err != nil {
			return err
		}
		if got.SpanID != root.SpanID {
			return fmt.Errorf("the trace's root is %s, not %s", got, root)
		}
		return nil
	}
	all, err := r.WaitFor(ctx, func(all []otlptest.Span) bool { last = check(all); return last == nil })
	if err != nil {
		spans := otlptest.Filter(all, func(s otlptest.Span) bool { return s.TraceID == root.TraceID })
		t.Fatalf("%s: trace %s not complete: %v (%v); its spans:\n%s", what, root.TraceID, last, err, dump(spans))
	}
	return otlptest.Filter(all, func(s otlptest.Span) bool { return s.TraceID == root.TraceID })
}

// serverSpan matches an agent's server span called name.
func serverSpan(name string) func(otlptest.Span) bool {
	return func(s otlptest.Span) bool {
		return s.Service == agentService && s.Name == name && s.Kind == tracepb.Span_SPAN_KIND_SERVER
	}
}

// agentInstances counts the spans of each agent (its service.instance.id)
// among spans.
func agentInstances(spans []otlptest.Span) map[string]int {
	out := map[string]int{}
	for _, s := range spans {
		if s.Service == agentService {
			id, _ := s.Resource["service.instance.id"].(string)
			out[id]++
		}
	}
	return out
}

func index(spans []otlptest.Span) map[string]otlptest.Span {
	out := make(map[string]otlptest.Span, len(spans))
	for _, s := range spans {
		out[s.SpanID] = s
	}
	return out
}

// ancestors are s's parent, its parent's, and so on, among byID.
func ancestors(byID map[string]otlptest.Span, s otlptest.Span) []otlptest.Span {
	var out []otlptest.Span
	for p, ok := byID[s.ParentSpanID]; ok && len(out) <= len(byID); p, ok = byID[p.ParentSpanID] {
		out = append(out, p)
	}
	return out
}

func names(spans []otlptest.Span) []string {
	out := make([]string, len(spans))
	for i, s := range spans {
		out[i] = s.Service + ":" + s.Name
	}
	return out
}

// services counts spans by service.
func services(spans []otlptest.Span) map[string]int {
	out := map[string]int{}
	for _, s := range spans {
		out[s.Service]++
	}
	return out
}

// spanNames counts spans by service and name.
func spanNames(spans []otlptest.Span) map[string]int {
	out := map[string]int{}
	for _, s := range spans {
		out[s.Service+":"+s.Name]++
	}
	return out
}

func dump(spans []otlptest.Span) string {
	var b strings.Builder
	for _, s := range spans {
		fmt.Fprintf(&b, "  %s instance %v\n", s, s.Resource["service.instance.id"])
	}
	return b.String()
}

// hasKey reports whether an attribute value holds the key prefix or one
// of keys.
func hasKey(v any, keys []string) bool {
	switch x := v.(type) {
	case string:
		if strings.Contains(x, traceKeyPrefix) {
			return true
		}
		for _, k := range keys {
			if strings.Contains(x, k) {
				return true
			}
		}
	case []byte:
		return hasKey(string(x), keys)
	case []any:
		return slices.ContainsFunc(x, func(e any) bool { return hasKey(e, keys) })
	case map[string]any:
		for k, e := range x {
			if hasKey(k, keys) || hasKey(e, keys) {
				return true
			}
		}
	}
	return false
}
