// Command crescent-master is Crescent's metadata master: it decides where
// every object lives and whether it is readable, serves ObjectService,
// ChangeService, AdminService and the agents' SegmentService on one gRPC port.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/server"
)

func main() {
	cfg := app.DefaultConfig()
	os.Exit(server.Main(server.Process{
		Name: "crescent-master", Component: "master", Usage: "[flags]",
		EnvExample: "CRESCENT_GRPC_ADDR", HealthURL: "http://127.0.0.1:9003/readyz",
		Flags:    cfg.RegisterFlags,
		Validate: cfg.Validate,
		LogLevel: func() string { return cfg.LogLevel },
		Security: func() server.Security { return cfg.Security },
		Instance: func() string { return cfg.MasterID },
		Run:      func(ctx context.Context, lg *slog.Logger) error { return app.Run(ctx, cfg, lg) },
	}, os.Args[1:], os.LookupEnv, os.Stderr))
}
