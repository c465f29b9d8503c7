// Command crescent-gateway follows the master's change stream and publishes
// it as Mooncake-compatible KV events on a ZMQ PUB socket, with a replay
// ROUTER, /kv_events/status and GatewayService on its admin and gRPC ports.
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
	"github.com/crescent-kv/crescent/services/gateway/internal/gateway"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		args := os.Args[2:]
		if len(args) == 0 {
			args = []string{"http://127.0.0.1:9005/readyz"}
		}
		os.Exit(server.Healthcheck(args, os.Stderr))
	}
	cfg := gateway.DefaultConfig()
	fs := flag.NewFlagSet("crescent-gateway", flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: crescent-gateway --backend-id ID [flags]\n       crescent-gateway healthcheck [URL]\n\nEvery flag may also be set as CRESCENT_<FLAG> (e.g. CRESCENT_BACKEND_ID) or as a key in the --config YAML file.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := config.Load(fs, os.Args[1:], os.LookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "crescent-gateway:", err)
		os.Exit(2)
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "crescent-gateway: invalid config:", err)
		os.Exit(2)
	}
	lg, err := obs.NewLogger(os.Stderr, cfg.LogLevel, "gateway")
	if err != nil {
		fmt.Fprintln(os.Stderr, "crescent-gateway:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	g, err := gateway.New(cfg, gateway.Deps{}, lg)
	if err != nil {
		lg.Error("gateway setup failed", "err", err)
		os.Exit(1)
	}
	if err := g.Run(ctx); err != nil {
		lg.Error("gateway stopped with error", "err", err)
		os.Exit(1)
	}
	lg.Info("gateway stopped")
}
