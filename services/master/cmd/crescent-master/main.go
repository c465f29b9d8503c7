// Command crescent-master is Crescent's metadata master: it decides where
// every object lives and whether it is readable, serves ObjectService,
// ChangeService, AdminService and the agents' SegmentService on one gRPC port.
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
	"github.com/crescent-kv/crescent/services/master/internal/app"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		os.Exit(server.Healthcheck(os.Args[2:], os.Stderr))
	}
	cfg := app.DefaultConfig()
	fs := flag.NewFlagSet("crescent-master", flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: crescent-master [flags]\n       crescent-master healthcheck [URL]\n\nEvery flag may also be set as CRESCENT_<FLAG> (e.g. CRESCENT_GRPC_ADDR) or as a key in the --config YAML file.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := config.Load(fs, os.Args[1:], os.LookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "crescent-master:", err)
		os.Exit(2)
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "crescent-master: invalid config:", err)
		os.Exit(2)
	}
	lg, err := obs.NewLogger(os.Stderr, cfg.LogLevel, "master")
	if err != nil {
		fmt.Fprintln(os.Stderr, "crescent-master:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := app.Run(ctx, cfg, lg); err != nil {
		lg.Error("master stopped with error", "err", err)
		os.Exit(1)
	}
	lg.Info("master stopped")
}
