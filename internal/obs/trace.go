package obs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/url"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc/credentials"
)

// The standard OpenTelemetry environment variables SetupTracing looks at
// itself; the SDK and the exporter read the others (OTEL_TRACES_SAMPLER,
// OTEL_EXPORTER_OTLP_HEADERS, OTEL_RESOURCE_ATTRIBUTES...).
const (
	envEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envSDKDisabled    = "OTEL_SDK_DISABLED"
	envTracesExporter = "OTEL_TRACES_EXPORTER"
)

// ShutdownTimeout bounds the flush of the spans still queued when a process
// stops (the shutdown function's context may shorten it).
const ShutdownTimeout = 5 * time.Second

// TraceConfig is a process's tracing configuration (issue 16). Tracing is
// off unless an OTLP endpoint is given, by Endpoint or by the standard
// OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the
// exporter reads the other OTEL_EXPORTER_OTLP_* variables (headers,
// timeout, compression, certificates) and the SDK OTEL_TRACES_SAMPLER and
// OTEL_TRACES_SAMPLER_ARG, unless a flag here says otherwise.
type TraceConfig struct {
	// Endpoint is the collector's OTLP/gRPC address: host:port (TLS unless
	// Insecure), or a URL, http://host:port for plaintext or
	// https://host:port for TLS.
	Endpoint string
	// Insecure sends spans in plaintext (a collector beside the process).
	Insecure bool
	// CA is a PEM bundle that verifies the collector's certificate instead
	// of the system roots.
	CA string
	// SampleRatio, when set, samples that fraction of new traces (and
	// follows the caller's decision for the others: parent-based); nil
	// leaves it to OTEL_TRACES_SAMPLER (default: every trace).
	SampleRatio *float64
	// Keys lets spans carry object keys (tracing.Keys); off by default.
	Keys bool
	// ErrorLog receives the SDK's errors (a collector that cannot be
	// reached, spans dropped), at most one a minute; nil is slog.Default().
	ErrorLog *slog.Logger
}

// RegisterFlags binds the fields to fs (so also CRESCENT_<FLAG> and YAML
// keys, internal/config).
func (c *TraceConfig) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Endpoint, "otlp-endpoint", c.Endpoint, "OTLP/gRPC collector to send trace spans to: host:port (TLS unless --otlp-insecure), http://host:port (plaintext) or https://host:port; empty: tracing off unless OTEL_EXPORTER_OTLP_ENDPOINT is set")
	fs.BoolVar(&c.Insecure, "otlp-insecure", c.Insecure, "send spans to --otlp-endpoint in plaintext")
	fs.StringVar(&c.CA, "otlp-ca", c.CA, "PEM CA bundle that verifies the OTLP collector's certificate (default: the system roots)")
	fs.Func("trace-sample-ratio", "fraction of new traces to sample, 0 to 1, following the caller's decision when a call carries one (default: OTEL_TRACES_SAMPLER, else every trace)", func(s string) error {
		r, err := ParseSampleRatio(s)
		if err != nil {
			return err
		}
		c.SampleRatio = &r
		return nil
	})
	fs.BoolVar(&c.Keys, "trace-keys", c.Keys, "add object keys to trace spans (for debugging: keys may be confidential)")
}

// ParseSampleRatio parses a sampling ratio, a number from 0 to 1.
func ParseSampleRatio(s string) (float64, error) {
	r, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || math.IsNaN(r) || r < 0 || r > 1 {
		return 0, fmt.Errorf("invalid sample ratio %q (want a number from 0 to 1)", s)
	}
	return r, nil
}

// Validate checks the flags (the environment is the SDK's to check).
func (c TraceConfig) Validate() error {
	var errs []error
	scheme := ""
	if c.Endpoint != "" {
		var err error
		if scheme, err = checkEndpoint(c.Endpoint); err != nil {
			errs = append(errs, err)
		}
	}
	if c.Insecure && c.CA != "" {
		errs = append(errs, errors.New("otlp-insecure and otlp-ca contradict each other"))
	}
	if c.Insecure && scheme == "https" {
		errs = append(errs, errors.New("otlp-insecure contradicts an https:// otlp-endpoint"))
	}
	if c.CA != "" && scheme == "http" {
		errs = append(errs, errors.New("otlp-ca needs TLS: the otlp-endpoint is http://"))
	}
	if r := c.SampleRatio; r != nil && (math.IsNaN(*r) || *r < 0 || *r > 1) {
		errs = append(errs, fmt.Errorf("trace-sample-ratio %v is not from 0 to 1", *r))
	}
	return errors.Join(errs...)
}

// checkEndpoint accepts host:port or an http(s) URL with a host and
// returns the URL's scheme ("" for host:port).
func checkEndpoint(ep string) (string, error) {
	if strings.Contains(ep, "://") {
		u, err := url.Parse(ep)
		if err != nil {
			return "", fmt.Errorf("otlp-endpoint: %w", err)
		}
		if (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" || u.User != nil {
			return "", fmt.Errorf("otlp-endpoint %q: want http://host:port, https://host:port or host:port", ep)
		}
		return u.Scheme, nil
	}
	host, port, err := net.SplitHostPort(ep)
	if err != nil || host == "" {
		return "", fmt.Errorf("otlp-endpoint %q: want host:port, http://host:port or https://host:port", ep)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return "", fmt.Errorf("otlp-endpoint %q: bad port", ep)
	}
	return "", nil
}

// Enabled reports whether SetupTracing would export spans: an endpoint by
// flag or environment, and neither OTEL_SDK_DISABLED=true nor
// OTEL_TRACES_EXPORTER=none.
func (c TraceConfig) Enabled() bool {
	if v, _ := strconv.ParseBool(os.Getenv(envSDKDisabled)); v {
		return false
	}
	if strings.EqualFold(strings.TrimSpace(os.Getenv(envTracesExporter)), "none") {
		return false
	}
	return c.Target() != ""
}

// Target is the collector spans go to: Endpoint, or else the environment's
// (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT over OTEL_EXPORTER_OTLP_ENDPOINT).
func (c TraceConfig) Target() string {
	for _, ep := range []string{c.Endpoint, os.Getenv(envTracesEndpoint), os.Getenv(envEndpoint)} {
		if ep != "" {
			return ep
		}
	}
	return ""
}

// TraceKeys reports whether spans may carry object keys (--trace-keys).
// Code that pkg/client imports asks tracing.Keys, the same switch, instead.
func TraceKeys() bool { return tracing.Keys() }

// SetupTracing installs the W3C trace context and baggage propagator and,
// when cfg is Enabled, a global TracerProvider that batches spans to the
// OTLP/gRPC exporter, with a resource naming service (crescent-master...),
// instance (service.instance.id; default host-pid), the host and the
// version, under what OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME say.
// Off, the global provider stays the no-op one. It dials nothing: the
// exporter connects on its first export, and export errors go to
// cfg.ErrorLog.
//
// The returned shutdown flushes the queued spans (within ShutdownTimeout
// or ctx's deadline, whichever is first) and turns tracing off again; it
// is never nil, and a second call does nothing. Calling SetupTracing again (tests) replaces the provider:
// tracers obtained before keep working and follow the newest one.
func SetupTracing(ctx context.Context, cfg TraceConfig, service, instance string) (shutdown func(context.Context) error, err error) {
	otel.SetTextMapPropagator(tracing.Propagator)
	tracing.SetKeys(cfg.Keys)
	nop := func(context.Context) error { return nil }
	if err := cfg.Validate(); err != nil {
		return nop, err
	}
	if !cfg.Enabled() {
		return nop, nil
	}
	lg := cfg.ErrorLog
	if lg == nil {
		lg = slog.Default()
	}
	otel.SetErrorHandler(&errorLog{lg: lg, every: time.Minute})

	res, err := traceResource(ctx, service, instance)
	if err != nil {
		if !errors.Is(err, resource.ErrPartialResource) || res == nil {
			return nop, fmt.Errorf("tracing resource: %w", err)
		}
		lg.Warn("tracing resource incomplete", "err", err)
	}
	opts, err := exporterOptions(cfg)
	if err != nil {
		return nop, err
	}
	exp, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return nop, fmt.Errorf("otlp exporter: %w", err)
	}
	tpOpts := []sdktrace.TracerProviderOption{sdktrace.WithBatcher(exp), sdktrace.WithResource(res)}
	if cfg.SampleRatio != nil {
		tpOpts = append(tpOpts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(*cfg.SampleRatio))))
	}
	tp := sdktrace.NewTracerProvider(tpOpts...)
	global.set(tp)
	otel.SetTracerProvider(&global)

	var once sync.Once
	return func(ctx context.Context) error {
		var err error
		once.Do(func() {
			ctx, cancel := context.WithTimeout(ctx, ShutdownTimeout)
			defer cancel()
			global.unset(tp)
			err = tp.Shutdown(ctx)
		})
		return err
	}, nil
}

// traceResource describes the process: ours first, the environment's
// over it.
func traceResource(ctx context.Context, service, instance string) (*resource.Resource, error) {
	if instance == "" {
		host, _ := os.Hostname()
		instance = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	attrs := []resource.Option{resource.WithTelemetrySDK(), resource.WithHost(),
		resource.WithSchemaURL(semconv.SchemaURL),
		resource.WithAttributes(semconv.ServiceName(service), semconv.ServiceInstanceID(instance))}
	if v := version(); v != "" {
		attrs = append(attrs, resource.WithAttributes(semconv.ServiceVersion(v)))
	}
	return resource.New(ctx, append(attrs, resource.WithFromEnv())...)
}

// version is the main module's version when the binary was built from a
// tagged module ("" for a development build).
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok || bi.Main.Version == "" || bi.Main.Version == "(devel)" {
		return ""
	}
	return bi.Main.Version
}

func exporterOptions(cfg TraceConfig) ([]otlptracegrpc.Option, error) {
	var opts []otlptracegrpc.Option
	switch {
	case strings.Contains(cfg.Endpoint, "://"):
		opts = append(opts, otlptracegrpc.WithEndpointURL(cfg.Endpoint))
	case cfg.Endpoint != "":
		opts = append(opts, otlptracegrpc.WithEndpoint(cfg.Endpoint))
	}
	switch {
	case cfg.Insecure:
		opts = append(opts, otlptracegrpc.WithInsecure())
	case cfg.CA != "":
		pem, err := os.ReadFile(cfg.CA)
		if err != nil {
			return nil, fmt.Errorf("otlp-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("otlp-ca %s: no PEM certificate in it", cfg.CA)
		}
		opts = append(opts, otlptracegrpc.WithTLSCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	}
	return opts, nil
}

// errorLog is the SDK's error handler: a collector that is down fails
// every batch, so it logs the first error and then at most one every
// interval, with the count of those it left out.
type errorLog struct {
	lg    *slog.Logger
	every time.Duration

	mu         sync.Mutex // guards last, suppressed
	last       time.Time
	suppressed int
}

func (e *errorLog) Handle(err error) {
	e.mu.Lock()
	now := time.Now()
	if !e.last.IsZero() && now.Sub(e.last) < e.every {
		e.suppressed++
		e.mu.Unlock()
		return
	}
	n := e.suppressed
	e.last, e.suppressed = now, 0
	e.mu.Unlock()
	e.lg.Warn("tracing error", "err", err, "suppressed", n)
}

// global is the TracerProvider SetupTracing installs once as the global
// one, forwarding to the newest SDK provider. otel's global provider
// hands its first delegate to every tracer obtained before it and its
// current value to every one after; a forwarder lets tracers held by
// long-lived objects (otelgrpc's stats handlers, package-level tracers)
// follow a second SetupTracing, and a shut-down provider be dropped.
var global switchProvider

type switchProvider struct {
	embedded.TracerProvider
	cur atomic.Pointer[providerHolder]
}

type providerHolder struct{ tp trace.TracerProvider }

var noopProvider = &providerHolder{tp: noop.NewTracerProvider()}

func (p *switchProvider) set(tp trace.TracerProvider) { p.cur.Store(&providerHolder{tp: tp}) }

// unset turns p off if tp is still the current provider.
func (p *switchProvider) unset(tp trace.TracerProvider) {
	if h := p.cur.Load(); h != nil && h.tp == tp {
		p.cur.CompareAndSwap(h, noopProvider)
	}
}

// TracingEnabled reports whether p forwards to a provider (tracing.Active
// asks).
func (p *switchProvider) TracingEnabled() bool {
	h := p.cur.Load()
	return h != nil && h != noopProvider
}

func (p *switchProvider) load() *providerHolder {
	if h := p.cur.Load(); h != nil {
		return h
	}
	return noopProvider
}

func (p *switchProvider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	return &switchTracer{p: p, name: name, opts: opts}
}

// switchTracer is a tracer of the current provider, obtained again when
// the provider changes.
type switchTracer struct {
	embedded.Tracer
	p     *switchProvider
	name  string
	opts  []trace.TracerOption
	cache atomic.Pointer[cachedTracer]
}

type cachedTracer struct {
	from *providerHolder
	t    trace.Tracer
}

func (t *switchTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	h := t.p.load()
	c := t.cache.Load()
	if c == nil || c.from != h {
		c = &cachedTracer{from: h, t: h.tp.Tracer(t.name, t.opts...)}
		t.cache.Store(c)
	}
	return c.t.Start(ctx, name, opts...)
}
