// Command crescent-agent contributes a host's memory (and optionally disk) to
// a Crescent cluster: it owns the segments and their allocators, keeps a
// stream to the master, and serves object bytes on DataService.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/server"
)

func main() {
	cfg := app.DefaultConfig()
	os.Exit(server.Main(server.Process{
		Name: "crescent-agent", Component: "agent", Usage: "--master host:port [flags]",
		EnvExample: "CRESCENT_MASTER", HealthURL: "http://127.0.0.1:9004/readyz",
		Flags:    cfg.RegisterFlags,
		Validate: cfg.Validate,
		LogLevel: func() string { return cfg.LogLevel },
		Security: func() server.Security { return cfg.Security },
		Instance: func() string { return cfg.AgentID },
		Run: func(ctx context.Context, lg *slog.Logger) error {
			return app.New(cfg, lg, obs.NewRegistry()).Run(ctx)
		},
	}, os.Args[1:], os.LookupEnv, os.Stderr))
}
