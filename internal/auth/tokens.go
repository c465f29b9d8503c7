package auth

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials"
)

// Limits of a token file (ParseTokens enforces them).
const (
	MinTokenLen     = 16
	MaxTokenLen     = 256
	MaxTokenFile    = 1 << 20
	MaxTokenEntries = 10000 // lines, comments and blanks included
)

// ErrInvalidTokens is wrapped by every ParseTokens error. Errors name the
// line, never the token.
var ErrInvalidTokens = errors.New("auth: invalid token file")

// Tokens maps static bearer tokens to principals, for clients that cannot
// hold a certificate. The file is reloaded on change like Source's. Only
// SHA-256 hashes of the tokens are kept.
type Tokens struct {
	path    string
	lg      *slog.Logger
	w       *watcher
	cur     atomic.Pointer[map[[sha256.Size]byte]Principal]
	reloads atomic.Uint64
}

// LoadTokens reads the token file at path (see ParseTokens for its format).
func LoadTokens(path string, lg *slog.Logger) (*Tokens, error) {
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	t := &Tokens{path: path, lg: lg, w: newWatcher(MaxTokenFile, path)}
	st, data, err := t.w.readAll()
	if err != nil {
		return nil, fmt.Errorf("auth: load tokens: %w", err)
	}
	m, err := ParseTokens(data[0])
	if err != nil {
		return nil, err
	}
	t.cur.Store(&m)
	t.w.init(st, data, time.Now())
	return t, nil
}

// SetReloadCheck is Source.SetReloadCheck for the token file.
func (t *Tokens) SetReloadCheck(d time.Duration) {
	t.w.every.Store(int64(d))
	t.w.nextDue.Store(0)
}

// Reloads counts successful reloads (not the first load).
func (t *Tokens) Reloads() uint64 { return t.reloads.Load() }

// Len is the number of tokens currently loaded.
func (t *Tokens) Len() int { return len(*t.current()) }

func (t *Tokens) current() *map[[sha256.Size]byte]Principal {
	err := t.w.poll(time.Now(), func(data [][]byte) error {
		m, err := ParseTokens(data[0])
		if err != nil {
			return err
		}
		t.cur.Store(&m)
		n := t.reloads.Add(1)
		t.lg.Info("token file reloaded", "path", t.path, "tokens", len(m), "reloads", n)
		return nil
	})
	if err != nil {
		t.lg.Warn("token file reload failed; keeping the current tokens", "path", t.path, "err", err)
	}
	return t.cur.Load()
}

// Lookup returns the principal of token. The token is hashed and the hash
// looked up, so timing reveals nothing about the tokens themselves.
func (t *Tokens) Lookup(token string) (Principal, bool) {
	if t == nil || len(token) < MinTokenLen || len(token) > MaxTokenLen {
		return Principal{}, false
	}
	m := t.current()
	p, ok := (*m)[sha256.Sum256([]byte(token))]
	return p, ok
}

// ParseTokens parses a token file: one "<token> <spiffe-uri>" per line
// (separated by spaces or tabs), lines starting with '#' (after leading
// blanks) are comments, blank lines are skipped, CRLF is accepted. A token is
// 16..256 bytes of printable ASCII without spaces; the URI is a valid SPIFFE
// id (ParseSPIFFE). The file is at most 1 MiB and 10000 lines; a token may
// appear once. The map is keyed by sha256(token).
func ParseTokens(b []byte) (map[[sha256.Size]byte]Principal, error) {
	if len(b) > MaxTokenFile {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrInvalidTokens, MaxTokenFile)
	}
	lines := bytes.Count(b, []byte{'\n'})
	if len(b) > 0 && b[len(b)-1] != '\n' {
		lines++ // an unterminated last line
	}
	if lines > MaxTokenEntries {
		return nil, fmt.Errorf("%w: more than %d lines", ErrInvalidTokens, MaxTokenEntries)
	}
	m := make(map[[sha256.Size]byte]Principal)
	for ln := 1; len(b) > 0; ln++ {
		var line []byte
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			line, b = b, nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		s := strings.TrimLeft(string(line), " \t")
		if s == "" || s[0] == '#' {
			continue
		}
		fields := strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == '\t' })
		if len(fields) != 2 {
			return nil, fmt.Errorf("%w: line %d: want \"<token> <spiffe-uri>\", got %d fields", ErrInvalidTokens, ln, len(fields))
		}
		tok, uri := fields[0], fields[1]
		if err := validToken(tok); err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", ErrInvalidTokens, ln, err)
		}
		p, err := ParseSPIFFE(uri)
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", ErrInvalidTokens, ln, err)
		}
		h := sha256.Sum256([]byte(tok))
		if _, dup := m[h]; dup {
			return nil, fmt.Errorf("%w: line %d: token repeats an earlier one", ErrInvalidTokens, ln)
		}
		m[h] = p
	}
	return m, nil
}

func validToken(tok string) error {
	if len(tok) < MinTokenLen || len(tok) > MaxTokenLen {
		return fmt.Errorf("token must be %d..%d bytes, got %d", MinTokenLen, MaxTokenLen, len(tok))
	}
	for i := 0; i < len(tok); i++ {
		if c := tok[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("token byte %d is not printable ASCII", i)
		}
	}
	return nil
}

// BearerCredentials sends "authorization: Bearer <token>" with every call,
// and only over a secure transport.
func BearerCredentials(token string) credentials.PerRPCCredentials {
	return bearer{value: "Bearer " + token}
}

type bearer struct{ value string }

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": b.value}, nil
}

func (bearer) RequireTransportSecurity() bool { return true }
