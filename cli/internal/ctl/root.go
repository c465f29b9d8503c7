// Package ctl implements crescentctl's commands on pkg/client.
package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
	"golang.org/x/term"
	"google.golang.org/grpc/codes"
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
	// TLS files (--tls-ca, --tls-cert, --tls-key) and the bearer token's
	// file (--token-file), for a cluster with mTLS (issue 14).
	tlsCA, tlsCert, tlsKey string
	tokenFile              string
	// shmSockets: the same-host agents' shared-memory sockets
	// (--shm-socket), client.Config.SharedMemorySockets.
	shmSockets []string

	stdin          io.Reader
	stdout, stderr io.Writer
}

func (e *env) json() bool { return e.output == "json" }

func (e *env) client(ctx context.Context) (*client.Client, error) {
	cfg := client.Config{Master: e.master, Tenant: e.tenant, DisableTransfer: e.grpcData, SharedMemorySockets: e.shmSockets}
	if err := e.security(&cfg); err != nil {
		return nil, err
	}
	return client.New(ctx, cfg)
}

// security applies the TLS and token flags to cfg.
func (e *env) security(cfg *client.Config) error {
	files := auth.Files{CA: e.tlsCA, Cert: e.tlsCert, Key: e.tlsKey}
	if !files.Enabled() {
		if e.tokenFile != "" {
			return usagef("--token-file needs --tls-ca: a token is never sent in plaintext")
		}
		return nil
	}
	if err := files.Validate(); err != nil {
		return usagef("--tls-ca, --tls-cert, --tls-key: %v", err)
	}
	tc, err := client.TLSFromFiles(files.CA, files.Cert, files.Key)
	if err != nil {
		return err
	}
	cfg.TLS = tc
	if e.tokenFile != "" {
		if cfg.BearerToken, err = readToken(e.tokenFile); err != nil {
			return err
		}
	}
	return nil
}

// readToken reads a bearer token from path: one line (surrounding blanks
// and a final newline are ignored), so it never appears on a command line
// or in the process list.
func readToken(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	const limit = auth.MaxTokenLen + 64 // room for blanks around it
	b, err := io.ReadAll(io.LimitReader(f, limit))
	if err != nil {
		return "", err
	}
	tok := strings.TrimSpace(string(b))
	switch {
	case len(b) == limit || len(tok) > auth.MaxTokenLen:
		return "", fmt.Errorf("token file %s: longer than a token (%d bytes at most)", path, auth.MaxTokenLen)
	case tok == "":
		return "", fmt.Errorf("token file %s is empty", path)
	case strings.ContainsAny(tok, " \t\r\n"):
		return "", fmt.Errorf("token file %s: want the token alone on one line", path)
	}
	return tok, nil
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
	pf.StringVar(&e.master, "master", envOr("CRESCENT_MASTER", "localhost:50051"), "master gRPC address host:port, or several comma-separated (m1:50051,m2:50051,m3:50051) for a leader and standbys: commands go to the leader, following NOT_LEADER redirects within --timeout (env CRESCENT_MASTER)")
	pf.StringVar(&e.tenant, "tenant", envOr("CRESCENT_TENANT", "default"), "tenant (env CRESCENT_TENANT)")
	pf.StringVarP(&e.output, "output", "o", "", "output format: json (one object per line); for get, the destination file (- for stdout)")
	pf.DurationVar(&e.timeout, "timeout", 0, "overall deadline (0 = none)")
	pf.BoolVar(&e.grpcData, "grpc-data", false, "move object bytes through the agents' gRPC DataService instead of their bulk transfer listeners")
	pf.StringVar(&e.tlsCA, "tls-ca", envOr("CRESCENT_TLS_CA", ""), "CA bundle that verifies the cluster's servers; turns TLS on (env CRESCENT_TLS_CA)")
	pf.StringVar(&e.tlsCert, "tls-cert", envOr("CRESCENT_TLS_CERT", ""), "client certificate (its SPIFFE id is who you are: tenant, admin) (env CRESCENT_TLS_CERT)")
	pf.StringVar(&e.tlsKey, "tls-key", envOr("CRESCENT_TLS_KEY", ""), "the client certificate's key (env CRESCENT_TLS_KEY)")
	pf.StringSliceVar(&e.shmSockets, "shm-socket", envList("CRESCENT_SHM_SOCKETS"), "Unix socket of an agent on this host that shares its memory (crescent-agent --shm-socket); repeat or comma-separate for several: replicas in its segments move by memcpy, the rest over TCP (env CRESCENT_SHM_SOCKETS)")
	pf.StringVar(&e.tokenFile, "token-file", envOr("CRESCENT_TOKEN_FILE", ""), "file holding a bearer token, for a principal without a certificate; needs --tls-ca (env CRESCENT_TOKEN_FILE)")
	var tr tracer
	tr.register(pf)
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(
		putCmd(e), getCmd(e), statCmd(e), rmCmd(e), lsCmd(e),
		segmentsCmd(e), agentsCmd(e), drainCmd(e), quotaCmd(e), statusCmd(e),
		watchCmd(e), benchCmd(e), certsCmd(e), cpCmd(e), mvCmd(e), prefetchCmd(e),
	)
	var cancel context.CancelFunc = func() {}
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		if e.output != "" && e.output != "json" && cmd.Name() != "get" {
			return usagef("unknown output format %q (want json)", e.output)
		}
		if err := tr.start(cmd, stderr); err != nil {
			return err
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
	code := exitCode(err, stderr)
	tr.finish(code, stderr)
	return code
}

// exitCode reports err on stderr and returns the exit code it means.
func exitCode(err error, stderr io.Writer) int {
	if err == nil {
		return ExitOK
	}
	if !errors.As(err, new(usageError)) {
		err = rpcerr.FromStatus(err) // "REASON: message" rather than "rpc error: code = …"
	}
	msg := err.Error()
	if code, ok := codeOnly(err); ok {
		msg += " (" + code.String() + ")"
	}
	fmt.Fprintln(stderr, "crescentctl:", msg)
	var ue usageError
	switch {
	case errors.As(err, &ue):
		return ExitUsage
	case errors.Is(err, client.ErrChecksum):
		// Bad bytes met, even when the object is gone since (its agents
		// dropped the bad replicas and the fresh list found none): an
		// error, not a plain miss.
		return ExitError
	case errors.Is(err, client.ErrNotFound):
		return ExitNotFound
	}
	return ExitError
}

// codeOnly returns the gRPC code of an RPC error that carries no reason
// (an authorizer's Unauthenticated or PermissionDenied): its message alone
// would not say which refusal it is.
func codeOnly(err error) (codes.Code, bool) {
	var re *rpcerr.Error
	if !errors.As(err, &re) || re.Reason != masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		return codes.OK, false
	}
	c := re.Code()
	return c, c != codes.OK && c != codes.Unknown
}

func envOr(k, def string) string {
	if v, ok := os.LookupEnv(k); ok && v != "" {
		return v
	}
	return def
}

// envList is k's comma-separated values (blanks around each dropped, empty
// ones skipped), or none.
func envList(k string) []string {
	var out []string
	for v := range strings.SplitSeq(envOr(k, ""), ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
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
