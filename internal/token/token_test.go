package token

import (
	"bytes"
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
			if got == nil && (!o.Is("acme", "obj/1") || o.ReplicaID != 3 || string(o.Group) != "g" || !o.HardPin) {
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

// FuzzParse: arbitrary bytes from the network never panic Parse, and whatever
// it accepts re-signs to the same bytes.
func FuzzParse(f *testing.F) {
	key := testKey(1)
	f.Add(Sign(key, Claims{Mode: Read, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add(Sign(key, Claims{Mode: Write, SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add(Sign(testKey(2), Claims{Mode: Read, SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5)}))
	f.Add(Sign(key, Claims{Mode: Write, Tenant: "t", Key: "k", SegmentID: "s", AllocationID: 1, Expiry: time.UnixMilli(5), ReplicaID: 4, Group: "g", HardPin: true}))
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
				gotObj.ReplicaID != wantObj.ReplicaID || gotObj.HardPin != wantObj.HardPin {
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
