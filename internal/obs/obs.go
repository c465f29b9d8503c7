// Package obs sets up the observability every Crescent process shares: a
// log/slog JSON logger whose lines carry the trace and span of the
// operation they were logged in, a Prometheus registry with the Go and
// process collectors, and OpenTelemetry tracing (SetupTracing: the SDK,
// the OTLP exporter, their flags). What the call paths use of tracing, and
// pkg/client may import, is in internal/obs/tracing.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package obs

import (
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// NewLogger returns a JSON slog logger writing to w at level ("debug",
// "info", "warn", "error"), tagged with the component name. A record
// logged with the context of a traced operation carries its trace_id and
// span_id (TraceHandler).
func NewLogger(w io.Writer, level, component string) (*slog.Logger, error) {
	var lv slog.Level
	switch strings.ToLower(level) {
	case "debug":
		lv = slog.LevelDebug
	case "", "info":
		lv = slog.LevelInfo
	case "warn", "warning":
		lv = slog.LevelWarn
	case "error":
		lv = slog.LevelError
	default:
		return nil, fmt.Errorf("unknown log level %q (want debug, info, warn or error)", level)
	}
	h := TraceHandler(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: lv}))
	return slog.New(h).With("component", component), nil
}

// NewRegistry returns a Prometheus registry with the Go runtime and process
// collectors registered. Each process owns one; nothing uses the global one.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
