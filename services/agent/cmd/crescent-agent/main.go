// Command crescent-agent contributes a host's memory (and optionally disk) to
// a Crescent cluster: it owns the segments and their allocators, keeps a
// stream to the master, and serves object bytes on DataService.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/crescent-kv/crescent/pkg/config"
	"github.com/crescent-kv/crescent/pkg/obs"
	"github.com/crescent-kv/crescent/pkg/server"
	"github.com/crescent-kv/crescent/services/agent/internal/app"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		args := os.Args[2:]
		if len(args) == 0 {
			args = []string{"http://127.0.0.1:9004/readyz"}
		}
		os.Exit(server.Healthcheck(args, os.Stderr))
	}
	cfg := app.DefaultConfig()
	fs := flag.NewFlagSet("crescent-agent", flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: crescent-agent --master host:port [flags]\n       crescent-agent healthcheck [URL]\n\nEvery flag may also be set as CRESCENT_<FLAG> (e.g. CRESCENT_MASTER) or as a key in the --config YAML file.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := config.Load(fs, os.Args[1:], os.LookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "crescent-agent:", err)
		os.Exit(2)
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "crescent-agent: invalid config:", err)
		os.Exit(2)
	}
	lg, err := obs.NewLogger(os.Stderr, cfg.LogLevel, "agent")
	if err != nil {
		fmt.Fprintln(os.Stderr, "crescent-agent:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := app.New(cfg, lg, obs.NewRegistry()).Run(ctx); err != nil {
		lg.Error("agent stopped with error", "err", err)
		os.Exit(1)
	}
}
