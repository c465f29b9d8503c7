package ctl

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"

	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// tracer traces a command (issue 16): with an OTLP endpoint (--otlp-endpoint
// or OTEL_EXPORTER_OTLP_ENDPOINT) the command runs inside a root span
// named after it, parent of every RPC it makes, and the spans are flushed
// before crescentctl exits; --trace samples that trace whatever the
// sampler says and prints its id to stderr, for the tracing backend's
// search box.
type tracer struct {
	cfg   obs.TraceConfig
	trace bool

	span trace.Span                      // the command's root span; nil untraced
	stop func(ctx context.Context) error // obs.SetupTracing's shutdown
}

func (t *tracer) register(pf *pflag.FlagSet) {
	pf.StringVar(&t.cfg.Endpoint, "otlp-endpoint", envOr("CRESCENT_OTLP_ENDPOINT", ""), "OTLP/gRPC collector to send the command's trace to: host:port (TLS unless --otlp-insecure), http://host:port or https://host:port (env CRESCENT_OTLP_ENDPOINT; OTEL_EXPORTER_OTLP_ENDPOINT is read too)")
	pf.BoolVar(&t.cfg.Insecure, "otlp-insecure", envBool("CRESCENT_OTLP_INSECURE"), "send spans to --otlp-endpoint in plaintext (env CRESCENT_OTLP_INSECURE)")
	pf.StringVar(&t.cfg.CA, "otlp-ca", envOr("CRESCENT_OTLP_CA", ""), "PEM CA bundle that verifies the OTLP collector (default: the system roots) (env CRESCENT_OTLP_CA)")
	pf.BoolVar(&t.trace, "trace", envBool("CRESCENT_TRACE"), "trace this command whatever the sampler says and print its trace_id to stderr; needs --otlp-endpoint (env CRESCENT_TRACE)")
}

// envBool is a boolean environment variable (unset or unparsable: false).
func envBool(k string) bool {
	v, _ := strconv.ParseBool(envOr(k, "false"))
	return v
}

// start sets tracing up and opens the command's root span in its context.
func (t *tracer) start(cmd *cobra.Command, stderr io.Writer) error {
	if err := t.cfg.Validate(); err != nil {
		return usagef("%v", err)
	}
	if !t.cfg.Enabled() {
		if t.trace {
			return usagef("--trace needs --otlp-endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT): the trace has to go somewhere")
		}
		return nil
	}
	if t.trace {
		always := 1.0
		t.cfg.SampleRatio = &always
	}
	t.cfg.ErrorLog = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	stop, err := obs.SetupTracing(cmd.Context(), t.cfg, "crescentctl", "")
	if err != nil {
		return err
	}
	t.stop = stop
	ctx, span := otel.Tracer("github.com/crescent-kv/crescent/cli").Start(cmd.Context(), cmd.CommandPath(),
		trace.WithSpanKind(trace.SpanKindClient))
	t.span = span
	cmd.SetContext(ctx)
	return nil
}

// finish ends the root span with the command's exit code (its error
// message may name object keys, which spans do not carry), flushes the
// spans, and with --trace prints the trace id.
func (t *tracer) finish(code int, stderr io.Writer) {
	if t.span != nil {
		t.span.SetAttributes(attribute.Int("crescentctl.exit_code", code))
		if code != ExitOK {
			t.span.SetStatus(otelcodes.Error, "exit code "+strconv.Itoa(code))
		}
		t.span.End()
	}
	if t.stop != nil {
		if err := t.stop(context.Background()); err != nil {
			fmt.Fprintln(stderr, "crescentctl: trace not flushed:", err)
		}
	}
	if t.trace && t.span != nil && t.span.SpanContext().IsValid() {
		fmt.Fprintln(stderr, "trace_id:", t.span.SpanContext().TraceID().String())
	}
}
