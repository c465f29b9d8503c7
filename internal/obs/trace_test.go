package obs_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// cleanEnv clears the OpenTelemetry variables the tests depend on, so a
// developer's environment does not change their outcome.
func cleanEnv(t *testing.T) {
	t.Helper()
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
		"OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
		"OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE"} {
		t.Setenv(k, "")
	}
}

func setup(t *testing.T, cfg obs.TraceConfig, service string) func() {
	t.Helper()
	shutdown, err := obs.SetupTracing(t.Context(), cfg, service, "i-1")
	if err != nil {
		t.Fatal(err)
	}
	var done bool
	flush := func() {
		if done {
			return
		}
		done = true
		if err := shutdown(context.Background()); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	}
	t.Cleanup(flush)
	return flush
}

func ratio(r float64) *float64 { return &r }

func TestSetupTracingExports(t *testing.T) {
	cleanEnv(t)
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test,team=kv")
	r := otlptest.Start(t)
	flush := setup(t, obs.TraceConfig{Endpoint: r.Endpoint()}, "crescent-master")

	if !tracing.Active() {
		t.Fatal("tracing.Active false after SetupTracing with an endpoint")
	}
	_, span := otel.Tracer("test").Start(t.Context(), "op")
	if !span.SpanContext().IsSampled() {
		t.Fatal("span not sampled with the default sampler")
	}
	span.End()
	flush() // shutdown flushes the batch

	got := r.Spans()
	if len(got) != 1 {
		t.Fatalf("got %d spans, want 1", len(got))
	}
	s := got[0]
	if s.Name != "op" || s.TraceID != span.SpanContext().TraceID().String() || s.Scope != "test" {
		t.Fatalf("span: got %v", s)
	}
	host, _ := os.Hostname()
	for k, want := range map[string]any{
		"service.name": "crescent-master", "service.instance.id": "i-1", "host.name": host,
		"deployment.environment.name": "test", "team": "kv", "telemetry.sdk.language": "go",
	} {
		if got := s.Resource[k]; got != want {
			t.Errorf("resource %s: got %v, want %v", k, got, want)
		}
	}

	// After shutdown tracing is off: spans are no longer recorded.
	if tracing.Active() {
		t.Fatal("tracing.Active true after shutdown")
	}
	_, span = otel.Tracer("test").Start(t.Context(), "after")
	if span.IsRecording() || span.SpanContext().IsSampled() {
		t.Fatal("span recorded after shutdown")
	}
	span.End()
}

func TestSetupTracingServiceNameFromEnv(t *testing.T) {
	cleanEnv(t)
	t.Setenv("OTEL_SERVICE_NAME", "renamed")
	r := otlptest.Start(t)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", r.Endpoint()) // endpoint from the environment only
	flush := setup(t, obs.TraceConfig{}, "crescent-agent")
	_, span := otel.Tracer("test").Start(t.Context(), "op")
	span.End()
	flush()
	got := r.Spans()
	if len(got) != 1 || got[0].Service != "renamed" {
		t.Fatalf("got %v, want one span of service renamed", got)
	}
}

func TestSetupTracingSampler(t *testing.T) {
	tests := []struct {
		name        string
		env         map[string]string
		ratio       *float64
		wantSampled bool
	}{
		{"default samples every trace", nil, nil, true},
		{"env always_off", map[string]string{"OTEL_TRACES_SAMPLER": "always_off"}, nil, false},
		{"env ratio 0", map[string]string{"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, nil, false},
		{"env parentbased ratio 1", map[string]string{"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, nil, true},
		{"flag 0", nil, ratio(0), false},
		{"flag 1 over env always_off", map[string]string{"OTEL_TRACES_SAMPLER": "always_off"}, ratio(1), true},
		{"flag 0 over env always_on", map[string]string{"OTEL_TRACES_SAMPLER": "always_on"}, ratio(0), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cleanEnv(t)
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			r := otlptest.Start(t)
			flush := setup(t, obs.TraceConfig{Endpoint: r.Endpoint(), SampleRatio: tt.ratio}, "s")
			_, span := otel.Tracer("test").Start(t.Context(), "op")
			if got := span.SpanContext().IsSampled(); got != tt.wantSampled {
				t.Fatalf("sampled: got %v, want %v", got, tt.wantSampled)
			}
			span.End()
			flush()
			if got, want := len(r.Spans()), map[bool]int{true: 1}[tt.wantSampled]; got != want {
				t.Fatalf("exported: got %d spans, want %d", got, want)
			}
		})
	}
}

// TestSetupTracingRatioFollowsParent: with a ratio, a call whose caller
// sampled its trace is sampled (parent-based), whatever the ratio.
func TestSetupTracingRatioFollowsParent(t *testing.T) {
	cleanEnv(t)
	r := otlptest.Start(t)
	setup(t, obs.TraceConfig{Endpoint: r.Endpoint(), SampleRatio: ratio(0)}, "s")
	carrier := propagation.MapCarrier{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	ctx := otel.GetTextMapPropagator().Extract(t.Context(), carrier)
	_, span := otel.Tracer("test").Start(ctx, "op")
	defer span.End()
	if !span.SpanContext().IsSampled() || span.SpanContext().TraceID().String() != "0af7651916cd43dd8448eb211c80319c" {
		t.Fatalf("got %v, want a sampled child of the remote parent", span.SpanContext())
	}
}

// TestSetupTracingOff: with no endpoint nothing is installed but the
// propagator, nothing is exported and no goroutine is left (TestMain's
// goleak; this test checks at its own end too).
func TestSetupTracingOff(t *testing.T) {
	cleanEnv(t)
	r := otlptest.Start(t)
	for _, env := range []map[string]string{
		nil,
		{"OTEL_EXPORTER_OTLP_ENDPOINT": r.Endpoint(), "OTEL_SDK_DISABLED": "true"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": r.Endpoint(), "OTEL_TRACES_EXPORTER": "none"},
	} {
		for k, v := range env {
			t.Setenv(k, v)
		}
		if (obs.TraceConfig{}).Enabled() {
			t.Fatalf("Enabled with env %v", env)
		}
		shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{}, "s", "")
		if err != nil {
			t.Fatal(err)
		}
		_, span := otel.Tracer("test").Start(t.Context(), "op")
		if span.IsRecording() || tracing.Active() {
			t.Fatalf("recording span with tracing off (env %v)", env)
		}
		span.End()
		if err := shutdown(t.Context()); err != nil {
			t.Fatal(err)
		}
		// The propagator passes a caller's context on.
		carrier := propagation.MapCarrier{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
		ctx := otel.GetTextMapPropagator().Extract(t.Context(), carrier)
		_, span = otel.Tracer("test").Start(ctx, "op")
		out := propagation.MapCarrier{}
		otel.GetTextMapPropagator().Inject(trace.ContextWithSpan(t.Context(), span), out)
		if !strings.Contains(out["traceparent"], "0af7651916cd43dd8448eb211c80319c") {
			t.Fatalf("traceparent not passed on with tracing off: %v", out)
		}
	}
	if got := r.Requests(); got != 0 {
		t.Fatalf("receiver got %d requests with tracing off", got)
	}
	r.Close()
	goleak.VerifyNone(t)
}

// TestSetupTracingTwice: a tracer obtained before the first setup follows
// the second (a test process sets tracing up per test).
func TestSetupTracingTwice(t *testing.T) {
	cleanEnv(t)
	early := otel.Tracer("early")
	r1, r2 := otlptest.Start(t), otlptest.Start(t)
	flush1 := setup(t, obs.TraceConfig{Endpoint: r1.Endpoint()}, "one")
	_, s := early.Start(t.Context(), "first")
	s.End()
	flush1()
	flush2 := setup(t, obs.TraceConfig{Endpoint: r2.Endpoint()}, "two")
	_, s = early.Start(t.Context(), "second")
	s.End()
	flush2()
	if got := r1.Spans(); len(got) != 1 || got[0].Name != "first" {
		t.Fatalf("receiver 1: got %v", got)
	}
	if got := r2.Spans(); len(got) != 1 || got[0].Name != "second" || got[0].Service != "two" {
		t.Fatalf("receiver 2: got %v", got)
	}
}

// TestSetupTracingErrorLog: an export the collector refuses is logged to
// ErrorLog (as JSON, like every other line), not to otel's stderr logger.
func TestSetupTracingErrorLog(t *testing.T) {
	cleanEnv(t)
	r := otlptest.Start(t)
	r.Fail(status.Error(codes.InvalidArgument, "rejected")) // not retried by the exporter
	var buf bytes.Buffer
	lg := slog.New(slog.NewJSONHandler(&buf, nil))
	shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Endpoint: r.Endpoint(), ErrorLog: lg}, "s", "")
	if err != nil {
		t.Fatal(err)
	}
	_, s := otel.Tracer("test").Start(t.Context(), "op")
	s.End()
	if err := shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if r.Requests() == 0 {
		t.Fatal("no export attempted")
	}
	if !strings.Contains(buf.String(), `"msg":"tracing error"`) || !strings.Contains(buf.String(), "rejected") {
		t.Fatalf("refused export not logged: %q", buf.String())
	}
}

func TestSetupTracingKeys(t *testing.T) {
	cleanEnv(t)
	for _, on := range []bool{true, false} {
		shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Keys: on}, "s", "")
		if err != nil {
			t.Fatal(err)
		}
		if obs.TraceKeys() != on || tracing.Keys() != on {
			t.Fatalf("TraceKeys: got %v, want %v", obs.TraceKeys(), on)
		}
		_ = shutdown(t.Context())
	}
}

func TestTraceConfigValidate(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name string
		cfg  obs.TraceConfig
		ok   bool
	}{
		{"empty", obs.TraceConfig{}, true},
		{"host:port", obs.TraceConfig{Endpoint: "collector:4317"}, true},
		{"ipv6", obs.TraceConfig{Endpoint: "[::1]:4317"}, true},
		{"http url", obs.TraceConfig{Endpoint: "http://collector:4317"}, true},
		{"https url with ca", obs.TraceConfig{Endpoint: "https://collector:4317", CA: "ca.pem"}, true},
		{"no port", obs.TraceConfig{Endpoint: "collector"}, false},
		{"port 0", obs.TraceConfig{Endpoint: "collector:0"}, false},
		{"port too big", obs.TraceConfig{Endpoint: "collector:70000"}, false},
		{"no host", obs.TraceConfig{Endpoint: ":4317"}, false},
		{"grpc scheme", obs.TraceConfig{Endpoint: "grpc://collector:4317"}, false},
		{"url without host", obs.TraceConfig{Endpoint: "http://"}, false},
		{"url with user", obs.TraceConfig{Endpoint: "http://u:p@collector:4317"}, false},
		{"garbage", obs.TraceConfig{Endpoint: "http://%zz"}, false},
		{"insecure and ca", obs.TraceConfig{Endpoint: "c:4317", Insecure: true, CA: "ca.pem"}, false},
		{"insecure https", obs.TraceConfig{Endpoint: "https://c:4317", Insecure: true}, false},
		{"ca over http", obs.TraceConfig{Endpoint: "http://c:4317", CA: "ca.pem"}, false},
		{"ratio 0.01", obs.TraceConfig{SampleRatio: ratio(0.01)}, true},
		{"ratio negative", obs.TraceConfig{SampleRatio: ratio(-0.1)}, false},
		{"ratio above 1", obs.TraceConfig{SampleRatio: ratio(1.5)}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if (err == nil) != tt.ok {
				t.Fatalf("Validate: got %v, want ok=%v", err, tt.ok)
			}
		})
	}
	t.Run("bad ca file", func(t *testing.T) {
		cleanEnv(t)
		bad := filepath.Join(dir, "bad.pem")
		if err := os.WriteFile(bad, []byte("not a certificate"), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, ca := range []string{bad, filepath.Join(dir, "missing.pem")} {
			if _, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Endpoint: "c:4317", CA: ca}, "s", ""); err == nil {
				t.Fatalf("SetupTracing with CA %s: no error", ca)
			}
		}
	})
}

func TestTraceConfigFlags(t *testing.T) {
	tests := []struct {
		args  []string
		ok    bool
		ratio *float64
	}{
		{nil, true, nil},
		{[]string{"--trace-sample-ratio", "0.25"}, true, ratio(0.25)},
		{[]string{"--trace-sample-ratio", "0"}, true, ratio(0)},
		{[]string{"--trace-sample-ratio", "NaN"}, false, nil},
		{[]string{"--trace-sample-ratio", "2"}, false, nil},
		{[]string{"--trace-sample-ratio", "-1"}, false, nil},
		{[]string{"--trace-sample-ratio", "x"}, false, nil},
		{[]string{"--otlp-endpoint", "c:4317", "--otlp-insecure", "--trace-keys"}, true, nil},
	}
	for _, tt := range tests {
		var c obs.TraceConfig
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		fs.SetOutput(new(bytes.Buffer))
		c.RegisterFlags(fs)
		err := fs.Parse(tt.args)
		if (err == nil) != tt.ok {
			t.Fatalf("%v: got %v, want ok=%v", tt.args, err, tt.ok)
		}
		if !tt.ok {
			continue
		}
		if (c.SampleRatio == nil) != (tt.ratio == nil) || (c.SampleRatio != nil && *c.SampleRatio != *tt.ratio) {
			t.Fatalf("%v: ratio got %v, want %v", tt.args, c.SampleRatio, tt.ratio)
		}
	}
}

func TestTraceHandler(t *testing.T) {
	var buf bytes.Buffer
	lg, err := obs.NewLogger(&buf, "debug", "test")
	if err != nil {
		t.Fatal(err)
	}
	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	traced := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}))

	lg.InfoContext(traced, "in a span", "k", "v")
	lg.With("a", 1).WarnContext(traced, "with attrs")
	lg.Log(traced, slog.LevelError, "via Log")
	lg.InfoContext(t.Context(), "no span")
	lg.Info("no context")
	lg.DebugContext(trace.ContextWithSpanContext(t.Context(), trace.SpanContext{}), "invalid span")

	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 6 {
		t.Fatalf("got %d lines, want 6: %s", len(lines), buf.String())
	}
	for i, line := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		if m["component"] != "test" {
			t.Errorf("line %d lost its component: %s", i, line)
		}
		if i < 3 {
			if m["trace_id"] != "0af7651916cd43dd8448eb211c80319c" || m["span_id"] != "b7ad6b7169203331" {
				t.Errorf("line %d lacks the ids: %s", i, line)
			}
		} else if _, ok := m["trace_id"]; ok {
			t.Errorf("line %d has a trace_id without a span: %s", i, line)
		}
	}
	if !strings.Contains(lines[1], `"a":1`) {
		t.Errorf("With attrs lost: %s", lines[1])
	}
}

// TestTraceHandlerSharedRecord: a record given to two handlers gets the ids
// from the wrapped one without the other seeing them.
func TestTraceHandlerSharedRecord(t *testing.T) {
	var a, b bytes.Buffer
	ha := obs.TraceHandler(slog.NewJSONHandler(&a, nil))
	hb := slog.NewJSONHandler(&b, nil)
	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	ctx := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}))
	r := slog.NewRecord(time.Now(), slog.LevelInfo, "m", 0)
	r.AddAttrs(slog.Int("a1", 1), slog.Int("a2", 2), slog.Int("a3", 3), slog.Int("a4", 4), slog.Int("a5", 5), slog.Int("a6", 6))
	if err := ha.Handle(ctx, r); err != nil {
		t.Fatal(err)
	}
	if err := hb.Handle(ctx, r); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(a.String(), "trace_id") || strings.Contains(b.String(), "trace_id") || strings.Contains(b.String(), "BUG") {
		t.Fatalf("wrapped: %s\nother: %s", a.String(), b.String())
	}
}

// TestSetupTracingBadResourceEnv: a malformed OTEL_RESOURCE_ATTRIBUTES
// is reported and the rest of the resource kept; tracing still starts.
func TestSetupTracingBadResourceEnv(t *testing.T) {
	cleanEnv(t)
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "no-equals-sign,%zz=1")
	r := otlptest.Start(t)
	var buf bytes.Buffer
	shutdown, err := obs.SetupTracing(t.Context(), obs.TraceConfig{Endpoint: r.Endpoint(), ErrorLog: slog.New(slog.NewJSONHandler(&buf, nil))}, "crescent-gateway", "g-1")
	if err != nil {
		t.Fatal(err)
	}
	_, s := otel.Tracer("test").Start(t.Context(), "op")
	s.End()
	if err := shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := r.Spans(); len(got) != 1 || got[0].Service != "crescent-gateway" || got[0].Resource["service.instance.id"] != "g-1" {
		t.Fatalf("spans: got %v", got)
	}
	if !strings.Contains(buf.String(), "tracing resource incomplete") {
		t.Fatalf("malformed env not reported: %q", buf.String())
	}
}
