package auth_test

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
)

const (
	tokA = "tok-aaaaaaaaaaaaaaaa"
	tokB = "tok-bbbbbbbbbbbbbbbb"
)

func TestParseTokens(t *testing.T) {
	good := "# comment\n\n  # indented comment\n" + tokA + " spiffe://td/tenant/a\r\n" + tokB + "\tspiffe://td/admin/ops\n"
	m, err := auth.ParseTokens([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 2 {
		t.Fatalf("got %d tokens, want 2", len(m))
	}
	if got, want := m[sha256.Sum256([]byte(tokA))], (auth.Principal{"td", auth.RoleTenant, "a"}); got != want {
		t.Errorf("tokA = %v, want %v", got, want)
	}

	secret := "sekrit-" + strings.Repeat("x", 20)
	bad := []struct{ name, file string }{
		{"one field", tokA + "\n"},
		{"three fields", tokA + " spiffe://td/tenant/a extra\n"},
		{"short token", "short spiffe://td/tenant/a\n"},
		{"long token", strings.Repeat("t", 257) + " spiffe://td/tenant/a\n"},
		{"non-ascii token", "tok-ééééééééééééééé spiffe://td/tenant/a\n"},
		{"bad uri", tokA + " spiffe://td/nobody/a\n"},
		{"duplicate", tokA + " spiffe://td/tenant/a\n" + tokA + " spiffe://td/tenant/b\n"},
		{"too many lines", strings.Repeat("\n", auth.MaxTokenEntries+1)},
		{"too large", strings.Repeat("#", auth.MaxTokenFile+1)},
		{"secret not echoed", secret + " spiffe://td/bad/a\n"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			_, err := auth.ParseTokens([]byte(tt.file))
			if !errors.Is(err, auth.ErrInvalidTokens) {
				t.Fatalf("err = %v, want ErrInvalidTokens", err)
			}
			if strings.Contains(err.Error(), "sekrit") || strings.Contains(err.Error(), "tok-") {
				t.Errorf("error echoes a token: %v", err)
			}
		})
	}
	if _, err := auth.ParseTokens([]byte(strings.Repeat("\n", auth.MaxTokenEntries))); err != nil {
		t.Errorf("exactly %d lines: %v", auth.MaxTokenEntries, err)
	}
}

func FuzzParseTokens(f *testing.F) {
	f.Add([]byte(tokA + " spiffe://td/tenant/a\n# c\n\n" + tokB + " spiffe://td/admin/x"))
	f.Add([]byte("x y z\n"))
	f.Add([]byte(tokA + " spiffe://td/tenant/a\r\n" + tokA + " spiffe://td/tenant/a\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := auth.ParseTokens(b)
		if err != nil {
			if !errors.Is(err, auth.ErrInvalidTokens) {
				t.Fatalf("error %v does not wrap ErrInvalidTokens", err)
			}
			return
		}
		if len(m) > auth.MaxTokenEntries {
			t.Fatalf("%d tokens", len(m))
		}
		for _, p := range m {
			if err := p.Validate(); err != nil {
				t.Fatalf("principal %+v invalid: %v", p, err)
			}
		}
	})
}

func TestTokensLookupAndReload(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tokens")
	write := func(s string) {
		t.Helper()
		if err := devcerts.WriteFileAtomic(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(tokA + " spiffe://td/tenant/a\n")
	var logs logBuf
	toks, err := auth.LoadTokens(path, newLogger(&logs))
	if err != nil {
		t.Fatal(err)
	}
	toks.SetReloadCheck(0)
	if p, ok := toks.Lookup(tokA); !ok || p.Name != "a" {
		t.Fatalf("Lookup(tokA) = %v, %v", p, ok)
	}
	for _, bad := range []string{tokB, "", "short", strings.Repeat("x", 10000)} {
		if _, ok := toks.Lookup(bad); ok {
			t.Errorf("Lookup(%.20q) found a principal", bad)
		}
	}

	write(tokB + " spiffe://td/tenant/b\n")
	if p, ok := toks.Lookup(tokB); !ok || p.Name != "b" {
		t.Fatalf("after reload Lookup(tokB) = %v, %v", p, ok)
	}
	if _, ok := toks.Lookup(tokA); ok {
		t.Fatal("tokA still valid after it was removed")
	}
	if got := toks.Reloads(); got != 1 {
		t.Errorf("Reloads = %d, want 1", got)
	}

	write("garbage\n")
	if _, ok := toks.Lookup(tokB); !ok {
		t.Fatal("a bad file replaced the good tokens")
	}
	if got := toks.Reloads(); got != 1 {
		t.Errorf("Reloads = %d after a bad file, want 1", got)
	}
	if n := len(logs.lines("token file reload failed")); n != 1 {
		t.Errorf("%d reload-failed lines, want 1 (logged once)\n%s", n, logs.String())
	}
}

func TestLoadTokensErrors(t *testing.T) {
	if _, err := auth.LoadTokens(filepath.Join(t.TempDir(), "missing"), nil); err == nil {
		t.Error("missing file loaded")
	}
	p := filepath.Join(t.TempDir(), "t")
	if err := devcerts.WriteFileAtomic(p, []byte("bad\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.LoadTokens(p, nil); !errors.Is(err, auth.ErrInvalidTokens) {
		t.Errorf("err = %v, want ErrInvalidTokens", err)
	}
}

func ExampleParseTokens() {
	m, _ := auth.ParseTokens([]byte("# tenant a's batch job\n" + tokA + " spiffe://crescent.local/tenant/a\n"))
	fmt.Println(m[sha256.Sum256([]byte(tokA))])
	// Output: spiffe://crescent.local/tenant/a
}
