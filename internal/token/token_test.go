package token

import (
	"bytes"
	"encoding/hex"
	"errors"
	"testing"
	"time"
)

func testKey(id uint32) SigningKey {
	return SigningKey{ID: id, Secret: bytes.Repeat([]byte{byte(id)}, KeyLen)}
}

func TestVerify(t *testing.T) {
	key, other := testKey(7), testKey(8)
	sameID := SigningKey{ID: key.ID, Secret: other.Secret}
	now := time.UnixMilli(1_000_000)
	c := Claims{Mode: Write, Tenant: "acme", Key: "obj/1", SegmentID: "seg-a", AllocationID: 7, Expiry: now.Add(time.Second),
		ReplicaID: 3, Group: "g", HardPin: true}
	tok := Sign(key, c)
	req := Request{Mode: Write, SegmentID: "seg-a", AllocationID: 7}
	with := func(f func(*Request)) Request { r := req; f(&r); return r }
	tests := []struct {
		name string
		keys []SigningKey
		tok  []byte
		req  Request
		at   time.Time
		want error
	}{
		{"ok", []SigningKey{key}, tok, req, now, nil},
		{"ok at expiry", []SigningKey{key}, tok, req, now.Add(time.Second), nil},
		{"ok caller tenant", []SigningKey{key}, tok, with(func(r *Request) { r.CallerTenant = "acme" }), now, nil},
		{"ok among keys", []SigningKey{other, key}, tok, req, now, nil},
		{"unknown key id", []SigningKey{other}, tok, req, now, ErrUnknownKey},
		{"no keys", nil, tok, req, now, ErrUnknownKey},
		{"wrong secret", []SigningKey{sameID}, tok, req, now, ErrSignature},
		{"wrong mode", []SigningKey{key}, tok, with(func(r *Request) { r.Mode = Read }), now, ErrMismatch},
		{"wrong segment", []SigningKey{key}, tok, with(func(r *Request) { r.SegmentID = "seg-b" }), now, ErrMismatch},
		{"wrong allocation", []SigningKey{key}, tok, with(func(r *Request) { r.AllocationID = 8 }), now, ErrMismatch},
		{"wrong caller tenant", []SigningKey{key}, tok, with(func(r *Request) { r.CallerTenant = "evil" }), now, ErrTenant},
		{"expired", []SigningKey{key}, tok, req, now.Add(1001 * time.Millisecond), ErrExpired},
		{"empty", []SigningKey{key}, nil, req, now, ErrMalformed},
		{"truncated", []SigningKey{key}, tok[:len(tok)-1], req, now, ErrMalformed},
		{"longer", []SigningKey{key}, append(append([]byte(nil), tok...), 0), req, now, ErrMalformed},
		{"version 1", []SigningKey{key}, append([]byte{1}, tok[1:]...), req, now, ErrMalformed},
		{"version 2", []SigningKey{key}, append([]byte{2}, tok[1:]...), req, now, ErrMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, got := Verify(tt.tok, tt.req, tt.at, tt.keys...)
			if !errors.Is(got, tt.want) {
				t.Fatalf("Verify: got %v, want %v", got, tt.want)
			}
			o, got := NewVerifier(tt.keys...).Verify(tt.tok, tt.req, tt.at)
			if !errors.Is(got, tt.want) {
				t.Fatalf("Verifier: got %v, want %v", got, tt.want)
			}
			if got == nil && (!o.Is("acme", "obj/1") || o.ReplicaID != 3 || string(o.Group) != "g" || !o.HardPin || o.Spare) {
				t.Fatalf("Verifier object: got %q/%q replica %d group %q hard pin %v, want acme/obj/1 replica 3 group g hard pin",
					o.Tenant, o.Key, o.ReplicaID, o.Group, o.HardPin)
			}
		})
	}
}

// TestBoundFields: changing any signed byte of a token — each bound field in
// turn — breaks its signature; re-signing a changed claim gives a token
// that does not match the original request.
func TestBoundFields(t *testing.T) {
	key := testKey(3)
	now := time.UnixMilli(5_000)
	base := Claims{Mode: Read, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 9, Expiry: now.Add(time.Minute),
		ReplicaID: 2, Group: "grp", HardPin: true}
	tok := Sign(key, base)
	for i := range len(tok) - macLen {
		if i == 0 {
			continue // the version byte: malformed, not a bad signature
		}
		b := append([]byte(nil), tok...)
		b[i] ^= 0x01
		_, err := Verify(b, Request{Mode: Read, SegmentID: "s", AllocationID: 9}, now, key)
		if err == nil {
			t.Fatalf("byte %d flipped: accepted", i)
		}
	}
	c, err := Parse(tok, key)
	if err != nil {
		t.Fatal(err)
	}
	if c.KeyID != key.ID || c.Tenant != "t" || c.Key != "k" || c.SegmentID != "s" || c.AllocationID != 9 || c.Mode != Read || !c.Expiry.Equal(base.Expiry) ||
		c.ReplicaID != 2 || c.Group != "grp" || !c.HardPin {
		t.Fatalf("Parse: got %+v, want %+v with key id %d", c, base, key.ID)
	}
	for _, tt := range []struct {
		name string
		mut  func(*Claims)
	}{
		{"tenant", func(c *Claims) { c.Tenant = "u" }},
		{"key", func(c *Claims) { c.Key = "k2" }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := base
			tt.mut(&c)
			o, err := NewVerifier(key).Verify(Sign(key, c), Request{Mode: Read, SegmentID: "s", AllocationID: 9}, now)
			if err != nil {
				t.Fatal(err)
			}
			if o.Is(base.Tenant, base.Key) {
				t.Fatalf("token for %q/%q names %q/%q", c.Tenant, c.Key, base.Tenant, base.Key)
			}
		})
	}
}

// TestTokenBytes: a version 3 token without the spare flag is the bytes it
// was before spares (a fixed vector).
func TestTokenBytes(t *testing.T) {
	tok := Sign(testKey(7), Claims{Mode: Write, Tenant: "acme", Key: "obj/1", SegmentID: "seg-a", AllocationID: 7, Expiry: time.UnixMilli(1_001_000),
		ReplicaID: 3, Group: "g", HardPin: true})
	const want = "030000000701000000000000000700000000000f46280000000301050004000500017365672d6161636d656f626a2f3167" +
		"cf2909426a36291061b414d3a59e74e8cdc66a0b1dccfbe63d4a8d0d1b1be280"
	if got := hex.EncodeToString(tok); got != want {
		t.Fatalf("token bytes:\ngot  %s\nwant %s", got, want)
	}
}

// TestSpare: a spare's write token (no key, the spare flag) round-trips
// and verifies with Object.Spare; the flag on a read token or on a token
// that names a key or a group or is hard-pinned, and any flag bit but the hard pin's and the spare's,
// are refused as malformed by Parse, Verify and the Verifier alike.
func TestSpare(t *testing.T) {
	key := testKey(5)
	now := time.UnixMilli(1_000_000)
	spare := Claims{Mode: Write, Tenant: "acme", SegmentID: "seg-a", AllocationID: 7, Expiry: now.Add(time.Second), ReplicaID: 4, Spare: true}
	tok := Sign(key, spare)
	if tok[offFlags] != flagSpare {
		t.Fatalf("flags byte = %#x, want %#x", tok[offFlags], flagSpare)
	}
	c, err := Parse(tok, key)
	spare.KeyID = key.ID
	if err != nil || c.Tenant != spare.Tenant || c.Key != "" || !c.Spare || c.HardPin || c.ReplicaID != 4 || c.Mode != Write || c.AllocationID != 7 {
		t.Fatalf("Parse = %+v, %v; want %+v", c, err, spare)
	}
	req := Request{Mode: Write, SegmentID: "seg-a", AllocationID: 7, CallerTenant: "acme"}
	for _, o := range verifyBoth(t, tok, req, now, nil, key) {
		if !o.Spare || string(o.Tenant) != "acme" || len(o.Key) != 0 || o.ReplicaID != 4 {
			t.Fatalf("object = %+v, want a spare of acme, replica 4, no key", o)
		}
	}
	// The same claims without the flag: an ordinary token, not a spare.
	plain := spare
	plain.Spare = false
	for _, o := range verifyBoth(t, Sign(key, plain), req, now, nil, key) {
		if o.Spare {
			t.Fatal("a token without the spare flag verifies as a spare")
		}
	}

	withBit := func(bit byte) []byte { b := bytes.Clone(tok); b[offFlags] |= bit; return b }
	// Bit 2 under a valid MAC: refused all the same.
	bit2 := appendBody(nil, key.ID, plain)
	bit2[offFlags] = 4
	bit2 = NewSigner(key).macs.sum(bit2, bit2)
	for _, tt := range []struct {
		name string
		tok  []byte
		req  Request
	}{
		{"spare read", Sign(key, Claims{Mode: Read, Tenant: "acme", SegmentID: "seg-a", AllocationID: 7, Expiry: spare.Expiry, Spare: true}),
			Request{Mode: Read, SegmentID: "seg-a", AllocationID: 7}},
		{"spare with a key", Sign(key, Claims{Mode: Write, Tenant: "acme", Key: "k", SegmentID: "seg-a", AllocationID: 7, Expiry: spare.Expiry, Spare: true}), req},
		{"spare with a group", Sign(key, Claims{Mode: Write, Tenant: "acme", Group: "g", SegmentID: "seg-a", AllocationID: 7, Expiry: spare.Expiry, Spare: true}), req},
		{"spare hard-pinned", Sign(key, Claims{Mode: Write, Tenant: "acme", HardPin: true, SegmentID: "seg-a", AllocationID: 7, Expiry: spare.Expiry, Spare: true}), req},
		{"spare of unknown mode", Sign(key, Claims{Mode: 3, Tenant: "acme", SegmentID: "seg-a", AllocationID: 7, Expiry: spare.Expiry, Spare: true}),
			Request{Mode: 3, SegmentID: "seg-a", AllocationID: 7}},
		{"flag bit 2", withBit(4), req},
		{"flag bit 7", withBit(0x80), req},
		{"flag bit 2 signed", bit2, req},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Parse(tt.tok, key); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Parse = %v, want %v", err, ErrMalformed)
			}
			verifyBoth(t, tt.tok, tt.req, now, ErrMalformed, key)
		})
	}
}

// verifyBoth verifies tok with Verify and a Verifier, wants err from both,
// and returns the objects.
func verifyBoth(t *testing.T, tok []byte, r Request, now time.Time, want error, keys ...SigningKey) []Object {
	t.Helper()
	o1, err := Verify(tok, r, now, keys...)
	if !errors.Is(err, want) {
		t.Fatalf("Verify = %v, want %v", err, want)
	}
	o2, err := NewVerifier(keys...).Verify(tok, r, now)
	if !errors.Is(err, want) {
		t.Fatalf("Verifier.Verify = %v, want %v", err, want)
	}
	return []Object{o1, o2}
}

// FuzzParse: arbitrary bytes from the network never panic Parse, and whatever
// it accepts re-signs to the same bytes.
func FuzzParse(f *testing.F) {
	key := testKey(1)
	f.Add(Sign(key, Claims{Mode: Read, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add(Sign(key, Claims{Mode: Write, SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add(Sign(testKey(2), Claims{Mode: Read, SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add(Sign(key, Claims{Mode: Write, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5), ReplicaID: 4, Group: "g", HardPin: true}))
	f.Add(Sign(key, Claims{Mode: Write, Tenant: "t", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5), ReplicaID: 4, Spare: true}))
	f.Add(Sign(key, Claims{Mode: Read, Tenant: "t", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5), Spare: true}))
	f.Add([]byte{3, 0, 0, 0, 1})
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Parse(b, key)
		if err != nil {
			return
		}
		if got := Sign(key, c); string(got) != string(b) {
			t.Fatalf("accepted token does not re-sign to itself")
		}
	})
}

// FuzzVerifierMatchesVerify: on arbitrary bytes the pooled Verifier gives
// exactly Verify's answer and object.
func FuzzVerifierMatchesVerify(f *testing.F) {
	keys := []SigningKey{testKey(1), testKey(2)}
	f.Add(Sign(keys[0], Claims{Mode: Read, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}), "s", uint64(1), "t", int64(4))
	f.Add(Sign(keys[1], Claims{Mode: Write, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}), "s", uint64(1), "", int64(4))
	f.Add(Sign(keys[1], Claims{Mode: Write, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5),
		ReplicaID: 7, Group: "g", HardPin: true}), "s", uint64(1), "t", int64(4))
	f.Add(Sign(keys[0], Claims{Mode: Write, Tenant: "t", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5), ReplicaID: 7, Spare: true}), "s", uint64(1), "t", int64(4))
	f.Add(Sign(keys[0], Claims{Mode: Write, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5), Spare: true}), "s", uint64(1), "t", int64(4))
	f.Add([]byte{1, 2, 3}, "", uint64(0), "", int64(0))
	v := NewVerifier(keys...)
	f.Fuzz(func(t *testing.T, b []byte, seg string, alloc uint64, tenant string, nowMs int64) {
		now := time.UnixMilli(nowMs)
		for _, m := range []Mode{Read, Write} {
			r := Request{Mode: m, SegmentID: seg, AllocationID: alloc, CallerTenant: tenant}
			wantObj, want := Verify(b, r, now, keys...)
			gotObj, got := v.Verify(b, r, now)
			if got != want {
				t.Fatalf("Verifier.Verify: got %v, Verify: %v", got, want)
			}
			if !bytes.Equal(gotObj.Tenant, wantObj.Tenant) || !bytes.Equal(gotObj.Key, wantObj.Key) || !bytes.Equal(gotObj.Group, wantObj.Group) ||
				gotObj.ReplicaID != wantObj.ReplicaID || gotObj.HardPin != wantObj.HardPin || gotObj.Spare != wantObj.Spare {
				t.Fatalf("Verifier.Verify object: got %+v, Verify: %+v", gotObj, wantObj)
			}
		}
	})
}

func TestSignerMatchesSign(t *testing.T) {
	key := testKey(4)
	sg := NewSigner(key)
	for i := range 3 {
		c := Claims{Mode: Read, Tenant: "t", Key: "k", SegmentID: "seg", AllocationID: uint64(i), Expiry: time.UnixMilli(int64(1000 + i))}
		if got, want := sg.Sign(c), Sign(key, c); string(got) != string(want) {
			t.Fatalf("Signer.Sign(%v): got %x, want %x", c, got, want)
		}
	}
}

// TestVerifierAllocates nothing: the agent verifies a token per item of
// every request.
func TestVerifierAllocatesNothing(t *testing.T) {
	if testing.CoverMode() != "" || raceEnabled {
		t.Skip("allocation counts differ under -cover and -race")
	}
	k := testKey(1)
	now := time.UnixMilli(1000)
	tok := Sign(k, Claims{Mode: Read, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: now.Add(time.Minute)})
	v := NewVerifier(testKey(2), k)
	r := Request{Mode: Read, SegmentID: "s", AllocationID: 1, CallerTenant: "t"}
	if n := testing.AllocsPerRun(100, func() {
		if _, err := v.Verify(tok, r, now); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Fatalf("Verifier.Verify: %v allocations per token, want 0", n)
	}
}

func TestRekeyKeepsPools(t *testing.T) {
	a, b, c := testKey(1), testKey(2), testKey(3)
	v := NewVerifier(b, a)
	w := v.Rekey(c, b)
	if got := w.KeyIDs(); len(got) != 2 || got[0] != 3 || got[1] != 2 {
		t.Fatalf("KeyIDs: got %v, want [3 2]", got)
	}
	vb, _ := v.lookup(2)
	wb, _ := w.lookup(2)
	if vb.macs.pool != wb.macs.pool {
		t.Fatalf("Rekey made a new pool for a key it held")
	}
	// Same id, other secret: a new pool and the new secret.
	x := v.Rekey(SigningKey{ID: 2, Secret: c.Secret})
	tok := Sign(SigningKey{ID: 2, Secret: c.Secret}, Claims{Mode: Read, SegmentID: "s", Expiry: time.UnixMilli(10)})
	if _, err := x.Verify(tok, Request{Mode: Read, SegmentID: "s"}, time.UnixMilli(1)); err != nil {
		t.Fatalf("rekeyed secret: %v", err)
	}
}

func TestRing(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	clock := func() time.Time { return now }
	r := NewRing(time.Second, clock)
	req := Request{Mode: Read, SegmentID: "s", AllocationID: 1}
	sign := func() []byte {
		return r.Signer(now).Sign(Claims{Mode: Read, SegmentID: "s", AllocationID: 1, Expiry: now.Add(time.Hour)})
	}
	// An agent's view: the keys of the latest Settings.
	agent := func() *Verifier { return NewVerifier(r.Keys()...) }

	k0 := r.Keys()[0].ID
	tok0 := sign()
	if _, err := agent().Verify(tok0, req, now); err != nil {
		t.Fatalf("first key: %v", err)
	}
	k1 := r.Rotate()
	if got, want := r.Signer(now).KeyID(), k0; got != want {
		t.Fatalf("signing key during activation: got %d, want the previous %d", got, want)
	}
	now = now.Add(time.Second)
	if got, want := r.Signer(now).KeyID(), k1; got != want {
		t.Fatalf("signing key after activation: got %d, want %d", got, want)
	}
	tok1 := sign()
	if _, err := agent().Verify(tok0, req, now); err != nil {
		t.Fatalf("previous key's token after one rotation: %v", err)
	}
	if _, err := agent().Verify(tok1, req, now); err != nil {
		t.Fatalf("current key's token: %v", err)
	}
	r.Rotate()
	if _, err := agent().Verify(tok0, req, now); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("key two rotations old: got %v, want %v", err, ErrUnknownKey)
	}
	if _, err := agent().Verify(tok1, req, now); err != nil {
		t.Fatalf("previous key's token after the second rotation: %v", err)
	}
	if n := len(r.Keys()); n != 2 {
		t.Fatalf("keys sent to agents: got %d, want 2", n)
	}
}

func BenchmarkSign(b *testing.B) {
	key := SigningKey{ID: 1, Secret: NewKey()}
	c := Claims{Mode: Read, Tenant: "default", Key: "model/layer-17/block-0123456789", SegmentID: "0123456789abcdef0123456789abcdef", AllocationID: 7, Expiry: time.Now()}
	b.Run("Sign", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			Sign(key, c)
		}
	})
	b.Run("Signer", func(b *testing.B) {
		b.ReportAllocs()
		s := NewSigner(key)
		for b.Loop() {
			s.Sign(c)
		}
	})
}

// BenchmarkVerify is the agent's check of one token, under the newer and the
// older of its two keys.
func BenchmarkVerify(b *testing.B) {
	now := time.Now()
	older, newer := SigningKey{ID: 1, Secret: NewKey()}, SigningKey{ID: 2, Secret: NewKey()}
	v := NewVerifier(newer, older)
	c := Claims{Mode: Read, Tenant: "default", Key: "model/layer-17/block-0123456789", SegmentID: "0123456789abcdef0123456789abcdef", AllocationID: 7, Expiry: now.Add(time.Minute)}
	r := Request{Mode: Read, SegmentID: c.SegmentID, AllocationID: 7, CallerTenant: "default"}
	for _, k := range []SigningKey{newer, older} {
		tok := Sign(k, c)
		name := "newer"
		if k.ID == older.ID {
			name = "older"
		}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := v.Verify(tok, r, now); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
