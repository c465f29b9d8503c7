package server

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/obs"
)

// Process describes one Crescent binary for Main: the part every main.go
// would otherwise repeat (healthcheck subcommand, flags + env + YAML,
// validation, JSON logger, SIGINT/SIGTERM).
type Process struct {
	// Name is the binary ("crescent-agent"); Component tags its logs ("agent").
	Name, Component string
	// Usage is the usage line after the name ("--master host:port [flags]").
	Usage string
	// EnvExample names one env variable in the help text ("CRESCENT_MASTER").
	EnvExample string
	// HealthURL is what `NAME healthcheck` probes without an argument.
	HealthURL string
	// Flags binds the configuration to fs; Validate checks it once loaded;
	// LogLevel reads the loaded level.
	Flags    func(fs *flag.FlagSet)
	Validate func() error
	LogLevel func() string
	// Run serves until ctx ends (SIGINT or SIGTERM).
	Run func(ctx context.Context, lg *slog.Logger) error
}

// Main runs p with args (os.Args[1:]) and returns the exit code: 0 after a
// clean stop or --help, 1 when Run fails, 2 for bad flags or configuration.
func Main(p Process, args []string, lookupEnv func(string) (string, bool), stderr io.Writer) int {
	if len(args) > 0 && args[0] == "healthcheck" {
		url := p.HealthURL
		if len(args) > 1 {
			url = args[1]
		}
		return Healthcheck([]string{url}, stderr)
	}
	fs := flag.NewFlagSet(p.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	p.Flags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s\n       %s healthcheck [URL]\n\n"+
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
	if err := p.Validate(); err != nil {
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
	if err := p.Run(ctx, lg); err != nil {
		lg.Error("stopped with error", "err", err)
		return 1
	}
	lg.Info("stopped")
	return 0
}
