package server

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"log/slog"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil/otlptest"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
)

func TestMainExitCodes(t *testing.T) {
	var addr string
	proc := func(run error) Process {
		return Process{
			Name: "crescent-test", Component: "test", Usage: "[flags]", EnvExample: "CRESCENT_ADDR", HealthURL: "http://127.0.0.1:1/readyz",
			Flags: func(fs *flag.FlagSet) { fs.StringVar(&addr, "addr", "x", "an address") },
			Validate: func() error {
				if addr == "" {
					return errors.New("addr must be set")
				}
				return nil
			},
			LogLevel: func() string { return "error" },
			Run:      func(context.Context, *slog.Logger) error { return run },
		}
	}
	noEnv := func(string) (string, bool) { return "", false }
	tests := []struct {
		name string
		run  error
		args []string
		want int
		out  string
	}{
		{"runs", nil, nil, 0, ""},
		{"run fails", errors.New("boom"), nil, 1, "boom"},
		{"help", nil, []string{"--help"}, 0, "CRESCENT_ADDR"},
		{"unknown flag", nil, []string{"--nope"}, 2, "nope"},
		{"invalid config", nil, []string{"--addr", ""}, 2, "addr must be set"},
		{"healthcheck down", nil, []string{"healthcheck"}, 1, "healthcheck"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			if got := Main(proc(tt.run), tt.args, noEnv, &out); got != tt.want {
				t.Fatalf("exit code: got %d, want %d (output %q)", got, tt.want, out.String())
			}
			if !strings.Contains(out.String(), tt.out) {
				t.Fatalf("output %q lacks %q", out.String(), tt.out)
			}
		})
	}
}

// TestMainTracing: the tracing flags come from the environment like every
// flag; Run's spans reach the collector (flushed after Run returns) with
// the process's name and instance, and its log lines carry their ids.
func TestMainTracing(t *testing.T) {
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"} {
		t.Setenv(k, "")
	}
	r := otlptest.Start(t)
	env := map[string]string{"CRESCENT_OTLP_ENDPOINT": r.Endpoint(), "CRESCENT_TRACE_SAMPLE_RATIO": "1", "CRESCENT_TRACE_KEYS": "true"}
	var traceID string
	var keys bool
	proc := Process{
		Name: "crescent-test", Component: "test", Usage: "[flags]", EnvExample: "CRESCENT_X",
		Flags:    func(*flag.FlagSet) {},
		Validate: func() error { return nil },
		LogLevel: func() string { return "info" },
		Instance: func() string { return "test-7" },
		Run: func(ctx context.Context, lg *slog.Logger) error {
			ctx, span := otel.Tracer("test").Start(ctx, "work")
			defer span.End()
			traceID, keys = span.SpanContext().TraceID().String(), obs.TraceKeys()
			lg.InfoContext(ctx, "working")
			return nil
		},
	}
	var out bytes.Buffer
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	if got := Main(proc, nil, lookup, &out); got != 0 {
		t.Fatalf("exit code %d: %s", got, out.String())
	}
	if !keys {
		t.Error("CRESCENT_TRACE_KEYS=true: TraceKeys false in Run")
	}
	tid, _ := trace.TraceIDFromHex(traceID)
	if !tid.IsValid() {
		t.Fatal("Run's span has no trace id: tracing not set up")
	}
	if !strings.Contains(out.String(), `"msg":"working","component":"test","trace_id":"`+traceID+`"`) {
		t.Fatalf("log line lacks the trace id %s: %s", traceID, out.String())
	}
	spans := r.ByTrace(traceID) // flushed when Main returned
	if len(spans) != 1 || spans[0].Service != "crescent-test" || spans[0].Resource["service.instance.id"] != "test-7" {
		t.Fatalf("spans: got %v", spans)
	}

	out.Reset()
	env = map[string]string{"CRESCENT_TRACE_SAMPLE_RATIO": "2"}
	if got := Main(proc, nil, lookup, &out); got != 2 || !strings.Contains(out.String(), "sample ratio") {
		t.Fatalf("bad ratio: exit code %d, output %s", got, out.String())
	}
	out.Reset()
	env = map[string]string{"CRESCENT_OTLP_ENDPOINT": "no-port"}
	if got := Main(proc, nil, lookup, &out); got != 2 || !strings.Contains(out.String(), "otlp-endpoint") {
		t.Fatalf("bad endpoint: exit code %d, output %s", got, out.String())
	}
}
