package ctl

import (
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
)

// TestTrace: --trace runs the command in a root span, sends every span to
// the collector before exiting and prints the trace id; the master's
// server span (the cluster runs in this process, under the same provider)
// is a child of the command's client call.
func TestTrace(t *testing.T) {
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "CRESCENT_OTLP_ENDPOINT", "CRESCENT_TRACE"} {
		t.Setenv(k, "")
	}
	t.Setenv("OTEL_TRACES_SAMPLER", "always_off") // --trace samples anyway
	c := testcluster.Start(t, testcluster.Options{Agents: -1})
	r := otlptest.Start(t)

	// The master's server span ends after its answer went out. Here, where
	// the master shares the command's process and so its TracerProvider,
	// the command may have shut that provider down (flushing its spans
	// before exiting) before the server span ended, and the span is then
	// dropped — under load, once in some 40 runs. Across processes, as
	// crescentctl runs, that cannot happen; here the command runs again.
	var (
		m      []string
		root   otlptest.Span
		spans  []otlptest.Span
		server otlptest.Span
	)
	for try := 1; server.SpanID == ""; try++ {
		code, _, errOut := run(t, c.MasterAddr(), "--otlp-endpoint", r.Endpoint(), "--trace", "stat", "no/such/key")
		if code != ExitNotFound {
			t.Fatalf("exit %d, want %d: %s", code, ExitNotFound, errOut)
		}
		m = regexp.MustCompile(`(?m)^trace_id: ([0-9a-f]{32})$`).FindStringSubmatch(errOut)
		if m == nil {
			t.Fatalf("no trace_id line on stderr: %q", errOut)
		}
		spans = r.ByTrace(m[1]) // flushed before Main returned
		var err error
		if root, err = otlptest.Tree(spans); err != nil {
			t.Fatalf("%v: %v", err, spans)
		}
		if root.Name != "crescentctl stat" || root.Service != "crescentctl" || root.StatusCode != tracepb.Status_STATUS_CODE_ERROR || root.Attrs["crescentctl.exit_code"] != int64(ExitNotFound) {
			t.Fatalf("root span: got %v %v %v", root, root.StatusCode, root.Attrs)
		}
		for _, s := range spans {
			if strings.Contains(s.StatusMessage, "no/such/key") || strings.Contains(s.Name, "no/such/key") {
				t.Fatalf("span names the key (no --trace-keys): %v %q", s, s.StatusMessage)
			}
		}
		// The server span may also reach the collector after the
		// command's own spans: wait for it a while.
		err = testutil.Poll(t, 5*time.Second, func() error {
			for _, s := range r.ByTrace(m[1]) {
				if s.Kind == tracepb.Span_SPAN_KIND_SERVER && strings.HasPrefix(s.Name, "crescent.master.v1.ObjectService/") {
					server = s
					return nil
				}
			}
			return errors.New("no server span")
		})
		if err != nil && try == 3 {
			t.Fatalf("no ObjectService server span in trace %s, nor in the two tries before", m[1])
		}
	}
	// Up from the server span: a client call, then (maybe through the
	// SDK's own spans) the root.
	p, ok := r.Parent(server)
	if !ok || p.Kind != tracepb.Span_SPAN_KIND_CLIENT {
		t.Fatalf("server span's parent: got %v (%v), want a client span", p, ok)
	}
	for p.SpanID != root.SpanID {
		if p, ok = r.Parent(p); !ok {
			t.Fatalf("server span %v does not descend from the root %v", server, root)
		}
	}
}

func TestTraceUsage(t *testing.T) {
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "CRESCENT_OTLP_ENDPOINT"} {
		t.Setenv(k, "")
	}
	for _, args := range [][]string{
		{"--trace", "ls"},
		{"--otlp-endpoint", "no-port", "ls"},
		{"--otlp-endpoint", "https://c:4317", "--otlp-insecure", "ls"},
	} {
		if code, _, errOut := run(t, "127.0.0.1:1", args...); code != ExitUsage || !strings.HasPrefix(errOut, "crescentctl: ") {
			t.Errorf("crescentctl %v: exit %d, stderr %q; want %d", args, code, errOut, ExitUsage)
		}
	}
}
