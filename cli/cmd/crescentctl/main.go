// Command crescentctl is Crescent's operator and user command line: put and
// get bytes, list and remove objects, inspect segments and agents, set
// quotas, watch the KV event stream and generate load.
//
// Exit codes: 0 ok, 1 error, 2 usage, 3 not found.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/crescent-kv/crescent/cli/internal/ctl"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := ctl.Main(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
