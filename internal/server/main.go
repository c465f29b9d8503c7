package server

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"strings"
	"syscall"

	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/obs"
)

// Process describes one Crescent binary for Main: the part every main.go
// would otherwise repeat (healthcheck subcommand, flags + env + YAML,
// validation, JSON logger, tracing, SIGINT/SIGTERM).
type Process struct {
	// Name is the binary ("crescent-agent"); Component tags its logs ("agent").
	Name, Component string
	// Usage is the usage line after the name ("--master host:port [flags]").
	Usage string
	// EnvExample names one env variable in the help text ("CRESCENT_MASTER").
	EnvExample string
	// HealthURL is what `NAME healthcheck` probes without an argument
	// (with https instead of http when TLS is configured).
	HealthURL string
	// Flags binds the configuration to fs; Validate checks it once loaded;
	// LogLevel reads the loaded level.
	Flags    func(fs *flag.FlagSet)
	Validate func() error
	LogLevel func() string
	// Security reads the loaded security configuration (nil: none); the
	// healthcheck subcommand takes its CA (and certificate) from it.
	Security func() Security
	// Instance reads the loaded name of this instance (the master or agent
	// id), its traces' service.instance.id; nil or "" is host-pid.
	Instance func() string
	// Run serves until ctx ends (SIGINT or SIGTERM).
	Run func(ctx context.Context, lg *slog.Logger) error
}

// Main runs p with args (os.Args[1:]) and returns the exit code: 0 after a
// clean stop or --help, 1 when Run fails, 2 for bad flags or configuration.
//
// Every process gets the tracing flags (obs.TraceConfig: --otlp-endpoint,
// --otlp-insecure, --otlp-ca, --trace-sample-ratio, --trace-keys); the
// standard OTEL_* variables are read from the process environment by the
// OpenTelemetry SDK itself. Tracing is set up before Run and its queued
// spans flushed after it returns.
func Main(p Process, args []string, lookupEnv func(string) (string, bool), stderr io.Writer) int {
	fs := flag.NewFlagSet(p.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	p.Flags(fs)
	var tc obs.TraceConfig
	tc.RegisterFlags(fs)
	if len(args) > 0 && args[0] == "healthcheck" {
		return p.healthcheck(fs, args[1:], lookupEnv, stderr)
	}
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s\n       %s healthcheck [URL] [flags]\n\n"+
			"Every flag may also be set as CRESCENT_<FLAG> (e.g. %s) or as a key in the --config YAML file.\n\nFlags:\n",
			p.Name, p.Usage, p.Name, p.EnvExample)
		fs.PrintDefaults()
	}
	if err := config.Load(fs, args, lookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "%s: %v\n", p.Name, err)
		return 2
	}
	if err := errors.Join(p.Validate(), tc.Validate()); err != nil {
		fmt.Fprintf(stderr, "%s: invalid config: %v\n", p.Name, err)
		return 2
	}
	lg, err := obs.NewLogger(stderr, p.LogLevel(), p.Component)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", p.Name, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	instance := ""
	if p.Instance != nil {
		instance = p.Instance()
	}
	tc.ErrorLog = lg
	stopTracing, err := obs.SetupTracing(ctx, tc, p.Name, instance)
	if err != nil {
		fmt.Fprintf(stderr, "%s: tracing: %v\n", p.Name, err)
		return 2
	}
	if tc.Enabled() {
		lg.Info("tracing on", "otlp_endpoint", tc.Target(), "sample_ratio", tc.SampleRatio, "trace_keys", tc.Keys)
	}
	code := 0
	if err := p.Run(ctx, lg); err != nil {
		lg.Error("stopped with error", "err", err)
		code = 1
	} else {
		lg.Info("stopped")
	}
	if err := stopTracing(context.Background()); err != nil {
		lg.Warn("tracing: spans not flushed", "err", err)
	}
	return code
}

// healthcheck is `NAME healthcheck [URL] [flags]`: the flags, environment
// and YAML file are read as for a start (only the TLS ones matter), so the
// probe finds the CA where the process does. Without a URL it probes
// HealthURL, over https when TLS is configured.
func (p Process) healthcheck(fs *flag.FlagSet, args []string, lookupEnv func(string) (string, bool), stderr io.Writer) int {
	u := ""
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		u, args = args[0], args[1:]
	}
	if err := config.Load(fs, args, lookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "%s healthcheck: %v\n", p.Name, err)
		return 2
	}
	var sec Security
	if p.Security != nil {
		sec = p.Security()
	}
	if u == "" {
		u = p.HealthURL
		if u == "" {
			u = DefaultHealthURL
		}
		if sec.TLS() {
			u = httpsURL(u)
		}
	}
	return healthcheck(u, sec, stderr)
}
