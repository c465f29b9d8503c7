package token

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
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

// TestReceiptV1Bytes: a receipt that names no key is version 1, the bytes
// it was before version 2 (a fixed vector), and opens whatever tenant and
// key OpenObject is given, with none in its claims.
func TestReceiptV1Bytes(t *testing.T) {
	key := testKey(7)
	r := Receipt{SegmentID: "seg-a", AllocationID: 9, Size: 1 << 20, Checksum: 0xfeed, Epoch: 3}
	const want = "010000000700000000000000090000000000100000000000000000feed0000000000000003057365672d61" +
		"db4a881abdc5a30f45730c6576094ba8378d0199ce17b6e7e46143a055b040d8"
	for name, b := range map[string][]byte{"SignReceipt": SignReceipt(key, r), "ReceiptKeys.Sign": NewReceiptKeys(key).Sign(r)} {
		if got := hex.EncodeToString(b); got != want {
			t.Fatalf("%s:\ngot  %s\nwant %s", name, got, want)
		}
	}
	b, _ := hex.DecodeString(want)
	r.KeyID = key.ID
	for _, obj := range [][2]string{{"", ""}, {"t", "k"}} {
		if got, err := NewReceiptKeys(key).OpenObject(b, obj[0], obj[1]); err != nil || got != r {
			t.Fatalf("OpenObject(%q, %q) = %+v, %v; want %+v", obj[0], obj[1], got, err, r)
		}
	}
}

// TestReceiptObject: a receipt that names a key is version 2, byte for
// byte version 1's but for the version; it opens only with its tenant and
// key, which its claims then hold.
func TestReceiptObject(t *testing.T) {
	key, other := testKey(7), testKey(8)
	r := Receipt{SegmentID: "seg-a", AllocationID: 9, Size: 1 << 20, Checksum: 0xfeed, Epoch: 3, Tenant: "acme", Key: "obj/1"}
	b := SignReceipt(key, r)
	if got := NewReceiptKeys(key).Sign(r); !bytes.Equal(got, b) {
		t.Fatalf("ReceiptKeys.Sign = %x, want SignReceipt's %x", got, b)
	}
	v1 := r
	v1.Tenant, v1.Key = "", ""
	b1 := SignReceipt(key, v1)
	if b[0] != receiptVersionObject || !bytes.Equal(b[1:len(b)-macLen], b1[1:len(b1)-macLen]) || bytes.Equal(b[len(b)-macLen:], b1[len(b1)-macLen:]) {
		t.Fatalf("version 2 receipt %x, version 1 %x: want the same body but the version, another MAC", b, b1)
	}
	rk := NewReceiptKeys(other, key)
	got, err := rk.OpenObject(b, "acme", "obj/1")
	r.KeyID = key.ID
	if err != nil || got != r {
		t.Fatalf("OpenObject = %+v, %v; want %+v", got, err, r)
	}
	v1.KeyID = key.ID
	if p, err := ParseReceipt(b); err != nil || p != v1 {
		t.Fatalf("ParseReceipt = %+v, %v; want %+v (no tenant, no key)", p, err, v1)
	}
	// The lengths are in the MAC: moving a byte between tenant and key
	// does not open.
	for _, tt := range []struct {
		name, tenant, key string
		b                 []byte
		want              error
	}{
		{"other key", "acme", "obj/2", b, ErrSignature},
		{"other tenant", "acme2", "obj/1", b, ErrSignature},
		{"tenant and key shifted", "acmeo", "bj/1", b, ErrSignature},
		{"no key", "acme", "", b, ErrSignature},
		{"no object (Open)", "", "", b, ErrSignature},
		{"downgraded to version 1", "acme", "obj/1", append([]byte{receiptVersion}, b[1:]...), ErrSignature},
		{"version 1 upgraded to 2", "", "", append([]byte{receiptVersionObject}, b1[1:]...), ErrSignature},
		{"version 3", "acme", "obj/1", append([]byte{3}, b[1:]...), ErrMalformed},
		{"altered checksum", "acme", "obj/1", func() []byte { c := bytes.Clone(b); c[rOffChecksum] ^= 1; return c }(), ErrSignature},
		{"unknown key", "acme", "obj/1", SignReceipt(testKey(9), r), ErrUnknownKey},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := rk.OpenObject(tt.b, tt.tenant, tt.key); !errors.Is(err, tt.want) {
				t.Fatalf("OpenObject = %v, want %v", err, tt.want)
			}
		})
	}
	if _, err := rk.Open(b); !errors.Is(err, ErrSignature) {
		t.Fatalf("Open of a version 2 receipt = %v, want %v", err, ErrSignature)
	}
}

// TestReceiptKeysAllocations: opening a receipt of either version
// allocates nothing once the pools are warm (the master opens one per put).
func TestReceiptKeysAllocations(t *testing.T) {
	if testing.CoverMode() != "" || raceEnabled {
		t.Skip("allocation counts differ under -cover and -race")
	}
	key := testKey(7)
	rk := NewReceiptKeys(key)
	b1 := SignReceipt(key, Receipt{SegmentID: "s", AllocationID: 1})
	b2 := SignReceipt(key, Receipt{SegmentID: "s", AllocationID: 1, Tenant: "t", Key: "k"})
	if n := testing.AllocsPerRun(100, func() {
		if _, err := rk.OpenObject(b1, "t", "k"); err != nil {
			t.Fatal(err)
		}
		if _, err := rk.OpenObject(b2, "t", "k"); err != nil {
			t.Fatal(err)
		}
	}); n > 2 {
		// The claims' segment id string, one per receipt.
		t.Fatalf("OpenObject: %v allocations for two receipts, want at most 2", n)
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
	f.Add(SignReceipt(key, Receipt{SegmentID: "seg-a", AllocationID: 9, Size: 1, Checksum: 2, Epoch: 3}), "", "")
	f.Add(SignReceipt(key, Receipt{}), "t", "k")
	f.Add(SignReceipt(key, Receipt{SegmentID: "seg-a", AllocationID: 9, Size: 1, Checksum: 2, Epoch: 3, Tenant: "t", Key: "k"}), "t", "k")
	f.Add(SignReceipt(key, Receipt{SegmentID: "seg-a", AllocationID: 9, Tenant: "t", Key: "k"}), "t", "k2")
	f.Add(SignReceipt(key, Receipt{Key: "k"}), "", "k")
	f.Add(Sign(key, Claims{Mode: Write, SegmentID: "s"}), "", "")
	f.Add([]byte{receiptVersion}, "", "")
	f.Add([]byte{receiptVersionObject}, "t", "k")
	f.Fuzz(func(t *testing.T, b []byte, tenant, objKey string) {
		p, perr := ParseReceipt(b)
		r, err := rk.OpenObject(b, tenant, objKey)
		if err != nil {
			return
		}
		if r.Key != "" && (r.Tenant != tenant || r.Key != objKey) {
			t.Fatalf("OpenObject(%q, %q) = %+v: bound to another object", tenant, objKey, r)
		}
		unbound := r
		unbound.Tenant, unbound.Key = "", ""
		if perr != nil || p != unbound {
			t.Fatalf("OpenObject = %+v but ParseReceipt = %+v, %v", r, p, perr)
		}
		// Only a receipt the key signed opens, and it re-signs to itself.
		if got := SignReceipt(key, r); !bytes.Equal(got, b) {
			t.Fatalf("opened %x, which re-signs to %x", b, got)
		}
	})
}
