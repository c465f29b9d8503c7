// Command crescent-gateway republishes the master's change stream as
// Mooncake Store KV events on a ZMQ PUB socket, with a replay ROUTER and
// status on its admin port.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/crescent-kv/crescent/internal/gateway/gateway"
	"github.com/crescent-kv/crescent/internal/server"
)

func main() {
	cfg := gateway.DefaultConfig()
	os.Exit(server.Main(server.Process{
		Name: "crescent-gateway", Component: "gateway", Usage: "--backend-id ID [flags]",
		EnvExample: "CRESCENT_BACKEND_ID", HealthURL: "http://127.0.0.1:9005/readyz",
		Flags:    cfg.RegisterFlags,
		Validate: cfg.Validate,
		LogLevel: func() string { return cfg.LogLevel },
		Security: func() server.Security { return cfg.Security },
		Run: func(ctx context.Context, lg *slog.Logger) error {
			g, err := gateway.New(cfg, gateway.Deps{}, lg)
			if err != nil {
				return err
			}
			return g.Run(ctx)
		},
	}, os.Args[1:], os.LookupEnv, os.Stderr))
}
