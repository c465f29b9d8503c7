package server

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"log/slog"
	"strings"
	"testing"
)

func TestMainExitCodes(t *testing.T) {
	var addr string
	proc := func(run error) Process {
		return Process{
			Name: "crescent-test", Component: "test", Usage: "[flags]", EnvExample: "CRESCENT_ADDR", HealthURL: "http://127.0.0.1:1/readyz",
			Flags: func(fs *flag.FlagSet) { fs.StringVar(&addr, "addr", "x", "an address") },
			Validate: func() error {
				if addr == "" {
					return errors.New("addr must be set")
				}
				return nil
			},
			LogLevel: func() string { return "error" },
			Run:      func(context.Context, *slog.Logger) error { return run },
		}
	}
	noEnv := func(string) (string, bool) { return "", false }
	tests := []struct {
		name string
		run  error
		args []string
		want int
		out  string
	}{
		{"runs", nil, nil, 0, ""},
		{"run fails", errors.New("boom"), nil, 1, "boom"},
		{"help", nil, []string{"--help"}, 0, "CRESCENT_ADDR"},
		{"unknown flag", nil, []string{"--nope"}, 2, "nope"},
		{"invalid config", nil, []string{"--addr", ""}, 2, "addr must be set"},
		{"healthcheck down", nil, []string{"healthcheck"}, 1, "healthcheck"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			if got := Main(proc(tt.run), tt.args, noEnv, &out); got != tt.want {
				t.Fatalf("exit code: got %d, want %d (output %q)", got, tt.want, out.String())
			}
			if !strings.Contains(out.String(), tt.out) {
				t.Fatalf("output %q lacks %q", out.String(), tt.out)
			}
		})
	}
}
