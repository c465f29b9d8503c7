// Package ctl implements crescentctl's commands on pkg/client.
package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
	"golang.org/x/term"
)

// Exit codes.
const (
	ExitOK       = 0
	ExitError    = 1
	ExitUsage    = 2
	ExitNotFound = 3
)

// usageError marks errors in how the command was called.
type usageError struct{ error }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// env is what every command shares.
type env struct {
	master  string
	tenant  string
	output  string
	timeout time.Duration
	// grpcData: bytes through DataService only (--grpc-data).
	grpcData bool

	stdin          io.Reader
	stdout, stderr io.Writer
}

func (e *env) json() bool { return e.output == "json" }

func (e *env) client(ctx context.Context) (*client.Client, error) {
	return client.New(ctx, client.Config{Master: e.master, Tenant: e.tenant, DisableTransfer: e.grpcData})
}

// printJSON writes v as one JSON line.
func (e *env) printJSON(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(e.stdout, string(b))
	return err
}

// tty reports whether w is a terminal (progress bars only then).
func tty(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// Main runs crescentctl with args and returns the exit code.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	e := &env{stdin: stdin, stdout: stdout, stderr: stderr}
	root := &cobra.Command{
		Use:           "crescentctl",
		Short:         "Store, fetch and inspect objects in a Crescent KV-cache cluster",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	pf := root.PersistentFlags()
	pf.StringVar(&e.master, "master", envOr("CRESCENT_MASTER", "localhost:50051"), "master gRPC address (env CRESCENT_MASTER)")
	pf.StringVar(&e.tenant, "tenant", envOr("CRESCENT_TENANT", "default"), "tenant (env CRESCENT_TENANT)")
	pf.StringVarP(&e.output, "output", "o", "", "output format: json (one object per line); for get, the destination file (- for stdout)")
	pf.DurationVar(&e.timeout, "timeout", 0, "overall deadline (0 = none)")
	pf.BoolVar(&e.grpcData, "grpc-data", false, "move object bytes through the agents' gRPC DataService instead of their bulk transfer listeners")
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(
		putCmd(e), getCmd(e), statCmd(e), rmCmd(e), lsCmd(e),
		segmentsCmd(e), agentsCmd(e), drainCmd(e), quotaCmd(e), statusCmd(e),
		watchCmd(e), benchCmd(e),
	)
	var cancel context.CancelFunc = func() {}
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		if e.output != "" && e.output != "json" && cmd.Name() != "get" {
			return usagef("unknown output format %q (want json)", e.output)
		}
		if e.timeout > 0 {
			var c context.Context
			c, cancel = context.WithTimeout(cmd.Context(), e.timeout)
			cmd.SetContext(c)
		}
		return nil
	}
	err := root.ExecuteContext(ctx)
	cancel()
	if err == nil {
		return ExitOK
	}
	if !errors.As(err, new(usageError)) {
		err = rpcerr.FromStatus(err) // "REASON: message" rather than "rpc error: code = …"
	}
	fmt.Fprintln(stderr, "crescentctl:", err)
	var ue usageError
	switch {
	case errors.As(err, &ue):
		return ExitUsage
	case errors.Is(err, client.ErrNotFound):
		return ExitNotFound
	}
	return ExitError
}

func envOr(k, def string) string {
	if v, ok := os.LookupEnv(k); ok && v != "" {
		return v
	}
	return def
}

// exactArgs is cobra.ExactArgs as a usage error.
func exactArgs(n int) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return usagef("want %d argument(s), got %d", n, len(args))
		}
		return nil
	}
}

// withClient adapts a command body that talks to the cluster: it connects a
// client for the command's context and closes it afterwards.
func (e *env) withClient(f func(ctx context.Context, c *client.Client, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c, err := e.client(cmd.Context())
		if err != nil {
			return err
		}
		defer c.Close()
		return f(cmd.Context(), c, args)
	}
}
