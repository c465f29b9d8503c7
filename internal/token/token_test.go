package token

import (
	"errors"
	"testing"
	"time"
)

func TestVerify(t *testing.T) {
	key, other := NewKey(), NewKey()
	now := time.UnixMilli(1_000_000)
	tok := Sign(key, Claims{Mode: Write, SegmentID: "seg-a", AllocationID: 7, Expiry: now.Add(time.Second)})
	tests := []struct {
		name  string
		key   []byte
		tok   []byte
		mode  Mode
		seg   string
		alloc uint64
		at    time.Time
		want  error
	}{
		{"ok", key, tok, Write, "seg-a", 7, now, nil},
		{"wrong key", other, tok, Write, "seg-a", 7, now, ErrSignature},
		{"wrong mode", key, tok, Read, "seg-a", 7, now, ErrMismatch},
		{"wrong segment", key, tok, Write, "seg-b", 7, now, ErrMismatch},
		{"wrong allocation", key, tok, Write, "seg-a", 8, now, ErrMismatch},
		{"expired", key, tok, Write, "seg-a", 7, now.Add(2 * time.Second), ErrExpired},
		{"empty", key, nil, Write, "seg-a", 7, now, ErrMalformed},
		{"truncated", key, tok[:len(tok)-1], Write, "seg-a", 7, now, ErrMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Verify(tt.key, tt.tok, tt.mode, tt.seg, tt.alloc, tt.at); !errors.Is(got, tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
			if got := NewVerifier(tt.key).Verify(tt.tok, tt.mode, tt.seg, tt.alloc, tt.at); !errors.Is(got, tt.want) {
				t.Fatalf("Verifier: got %v, want %v", got, tt.want)
			}
		})
	}
	flipped := append([]byte(nil), tok...)
	flipped[5] ^= 1
	if err := Verify(key, flipped, Write, "seg-a", 7, now); !errors.Is(err, ErrSignature) {
		t.Fatalf("tampered token: got %v, want %v", err, ErrSignature)
	}
}

// FuzzParse: arbitrary bytes from the network never panic Parse, and whatever
// it accepts re-signs to the same bytes.
func FuzzParse(f *testing.F) {
	key := []byte("0123456789abcdef0123456789abcdef")
	f.Add(Sign(key, Claims{Mode: Read, SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Parse(key, b)
		if err != nil {
			return
		}
		if got := Sign(key, c); string(got) != string(b) {
			t.Fatalf("accepted token does not re-sign to itself")
		}
	})
}

// FuzzVerifierMatchesVerify: on arbitrary bytes the pooled Verifier gives
// exactly Verify's answer.
func FuzzVerifierMatchesVerify(f *testing.F) {
	key := []byte("0123456789abcdef0123456789abcdef")
	f.Add(Sign(key, Claims{Mode: Read, SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}), "s", uint64(1), int64(4))
	f.Add([]byte{1, 2, 3}, "", uint64(0), int64(0))
	v := NewVerifier(key)
	f.Fuzz(func(t *testing.T, b []byte, seg string, alloc uint64, nowMs int64) {
		now := time.UnixMilli(nowMs)
		for _, m := range []Mode{Read, Write} {
			want := Verify(key, b, m, seg, alloc, now)
			if got := v.Verify(b, m, seg, alloc, now); !errors.Is(got, want) && got != want {
				t.Fatalf("Verifier.Verify: got %v, Verify: %v", got, want)
			}
		}
	})
}

func TestSignerMatchesSign(t *testing.T) {
	key := NewKey()
	sg := NewSigner(key)
	for i := range 3 {
		c := Claims{Mode: Read, SegmentID: "seg", AllocationID: uint64(i), Expiry: time.UnixMilli(int64(1000 + i))}
		if got, want := sg.Sign(c), Sign(key, c); string(got) != string(want) {
			t.Fatalf("Signer.Sign(%v): got %x, want %x", c, got, want)
		}
	}
}

func BenchmarkSign(b *testing.B) {
	key := NewKey()
	c := Claims{Mode: Read, SegmentID: "0123456789abcdef0123456789abcdef", AllocationID: 7, Expiry: time.Now()}
	b.Run("Sign", func(b *testing.B) {
		for b.Loop() {
			Sign(key, c)
		}
	})
	b.Run("Signer", func(b *testing.B) {
		s := NewSigner(key)
		for b.Loop() {
			s.Sign(c)
		}
	})
}
