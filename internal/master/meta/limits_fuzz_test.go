package meta

import (
	"strings"
	"testing"
)

// FuzzScanToken: RemoveByPrefix/RemoveByRegex page tokens come from the
// network. Decoding never panics, accepts only shards that exist and keys
// within the key limit, and accepts exactly the tokens encodeScanToken
// makes.
func FuzzScanToken(f *testing.F) {
	s := &Store{shards: make([]shard, 16)}
	for _, tok := range []string{"", "s0", "s15", "s16", "s3.YWJj", "s3.", "s-1", "s01", "x", "s3.YWJj=", "s3.!!", "s9999999999999999999"} {
		f.Add(tok)
	}
	f.Fuzz(func(t *testing.T, tok string) {
		c, err := s.decodeScanToken(tok)
		if err != nil || tok == "" {
			return
		}
		if c.shard < 0 || c.shard >= len(s.shards) || len(c.after) > MaxKeyLen {
			t.Fatalf("%q decoded to %+v", tok, c)
		}
		if got := encodeScanToken(c); got != tok {
			t.Fatalf("%q decoded to %+v, which encodes as %q", tok, c, got)
		}
	})
}

// FuzzCompileKeyRegex: patterns come from the network. Compiling never
// panics and accepts only patterns within the length and program limits.
func FuzzCompileKeyRegex(f *testing.F) {
	for _, re := range []string{"^a", "(a|aa)*b{1000}", "a{1000}b{1000}c{1000}d{1000}e{1000}", "(x{1000}){1000}", "a(", `\pL+`, strings.Repeat("a", MaxRegexLen+1)} {
		f.Add(re)
	}
	f.Fuzz(func(t *testing.T, re string) {
		rx, insts, err := CompileKeyRegex(re)
		if err != nil {
			return
		}
		if len(re) > MaxRegexLen || insts > MaxRegexInsts || insts <= 0 {
			t.Fatalf("%q accepted with %d instructions", re, insts)
		}
		_ = rx.MatchString("tenant/key-0001")
	})
}
