package token

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"testing"
	"time"
)

func TestReceipt(t *testing.T) {
	key, other := testKey(7), testKey(8)
	r := Receipt{SegmentID: "seg-a", AllocationID: 9, Size: 1 << 20, Checksum: 0xfeed, Epoch: 3}
	b := SignReceipt(key, r)
	rk := NewReceiptKeys(key, other)
	if got := NewReceiptKeys(key).Sign(r); !bytes.Equal(got, b) {
		t.Fatalf("ReceiptKeys.Sign = %x, want SignReceipt's %x", got, b)
	}
	got, err := rk.Open(b)
	r.KeyID = key.ID
	if err != nil || got != r {
		t.Fatalf("Open = %+v, %v; want %+v", got, err, r)
	}
	if p, err := ParseReceipt(b); err != nil || p != r {
		t.Fatalf("ParseReceipt = %+v, %v; want %+v", p, err, r)
	}
	flip := func(i int) []byte { c := bytes.Clone(b); c[i] ^= 1; return c }
	tok := Sign(key, Claims{Mode: Write, Tenant: "t", Key: "k", SegmentID: "seg-a", AllocationID: 9, Expiry: time.UnixMilli(1 << 40)})
	// A token under the same key, cut or padded to a receipt's framing,
	// never opens: the receipt key is derived, not the token key.
	asReceipt := append([]byte{receiptVersion}, tok[1:]...)
	tests := []struct {
		name string
		rk   *ReceiptKeys
		b    []byte
		want error
	}{
		{"altered allocation", rk, flip(rOffAlloc + 7), ErrSignature},
		{"altered size", rk, flip(rOffSize + 7), ErrSignature},
		{"altered checksum", rk, flip(rOffChecksum), ErrSignature},
		{"altered epoch", rk, flip(rOffEpoch + 7), ErrSignature},
		{"altered segment", rk, flip(receiptHeaderLen), ErrSignature},
		{"altered mac", rk, flip(len(b) - 1), ErrSignature},
		{"unknown key", NewReceiptKeys(other), b, ErrUnknownKey},
		{"same id other secret", NewReceiptKeys(SigningKey{ID: key.ID, Secret: other.Secret}), b, ErrSignature},
		{"no keys", nil, b, ErrUnknownKey},
		{"empty", rk, nil, ErrMalformed},
		{"truncated", rk, b[:len(b)-1], ErrMalformed},
		{"padded", rk, append(bytes.Clone(b), 0), ErrMalformed},
		{"bad version", rk, flip(0), ErrMalformed},
		{"token", rk, tok, ErrMalformed},
		{"token as receipt", rk, asReceipt, nil},
		{"receipt signed under the token key", rk, tokenKeyReceipt(key, r), ErrSignature},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.rk.Open(tt.b)
			if tt.want == nil {
				if err == nil {
					t.Fatal("Open accepted a token as a receipt")
				}
				return
			}
			if !errors.Is(err, tt.want) {
				t.Fatalf("Open = %v, want %v", err, tt.want)
			}
		})
	}
	// A receipt is never a token.
	if _, err := Verify(b, Request{Mode: Write, SegmentID: "seg-a", AllocationID: 9}, time.UnixMilli(0), key); err == nil {
		t.Fatal("Verify accepted a receipt as a token")
	}
}

// tokenKeyReceipt is a receipt MACed under the token secret itself, as a
// forger holding a token's MAC construction would make it.
func tokenKeyReceipt(k SigningKey, r Receipt) []byte {
	m := hmac.New(sha256.New, k.Secret)
	b := appendReceiptBody(nil, k.ID, r)
	m.Write(b)
	return m.Sum(b)
}

func TestRingReceiptKeys(t *testing.T) {
	ring := NewRing(0, nil)
	r := Receipt{SegmentID: "s", AllocationID: 1, Size: 2, Checksum: 3, Epoch: 4}
	b := ring.ReceiptKeys().Sign(r)
	if first, again := ring.ReceiptKeys(), ring.ReceiptKeys(); first != again {
		t.Fatal("ReceiptKeys is derived again without a rotation")
	}
	ring.Rotate()
	// The previous key still opens (agents may still sign with it).
	if _, err := ring.ReceiptKeys().Open(b); err != nil {
		t.Fatalf("after one rotation: %v", err)
	}
	ring.Rotate()
	if _, err := ring.ReceiptKeys().Open(b); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("after two rotations: %v, want ErrUnknownKey", err)
	}
}

func FuzzOpenReceipt(f *testing.F) {
	key := testKey(7)
	rk := NewReceiptKeys(key)
	f.Add(SignReceipt(key, Receipt{SegmentID: "seg-a", AllocationID: 9, Size: 1, Checksum: 2, Epoch: 3}))
	f.Add(SignReceipt(key, Receipt{}))
	f.Add(Sign(key, Claims{Mode: Write, SegmentID: "s"}))
	f.Add([]byte{receiptVersion})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, perr := ParseReceipt(b)
		r, err := rk.Open(b)
		if err != nil {
			return
		}
		if perr != nil || p != r {
			t.Fatalf("Open = %+v but ParseReceipt = %+v, %v", r, p, perr)
		}
		// Only a receipt the key signed opens, and it re-signs to itself.
		if got := SignReceipt(key, r); !bytes.Equal(got, b) {
			t.Fatalf("opened %x, which re-signs to %x", b, got)
		}
	})
}
