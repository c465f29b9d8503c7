package token

import (
	"crypto/rand"
	"encoding/binary"
	"sync"
	"sync/atomic"
	"time"
)

// Ring is the master's signing keys: the newest and the one before it,
// which is what agents are sent and accept. Rotate makes a new key and
// retires the oldest; the new key starts signing only after the activation
// delay, the time the re-sent Settings need to reach every agent, so no
// agent is handed a token under a key it does not hold yet. Until then the
// previous key keeps signing.
//
// A token signed just before the new key activates lives its TTL under the
// previous key, which agents drop at the next rotation: so TTL + activation
// must stay below the rotation interval (the master's config checks it with
// a factor of two to spare).
//
// Safe for concurrent use; Signer and Keys never block.
type Ring struct {
	activation time.Duration
	now        func() time.Time

	// mu serialises Rotate; readers load st without it.
	mu sync.Mutex
	st atomic.Pointer[ringState]
}

// ringState is immutable once published.
type ringState struct {
	newest, previous *Signer // previous is nil before the first rotation
	keys             []SigningKey
	// activeAt is when newest starts signing; before it previous does.
	activeAt time.Time
	// receipts caches the receipt keys derived from keys (ReceiptKeys).
	receipts receiptKeysOnce
}

// NewRing returns a Ring with one fresh key, signing at once. activation
// is the delay before a rotated-in key signs; now is the clock (nil:
// time.Now). It does no I/O.
func NewRing(activation time.Duration, now func() time.Time) *Ring {
	if now == nil {
		now = time.Now
	}
	var b [4]byte
	_, _ = rand.Read(b[:]) // a random first id, so two masters' ids rarely meet
	k := SigningKey{ID: binary.BigEndian.Uint32(b[:]), Secret: NewKey()}
	r := &Ring{activation: activation, now: now}
	r.st.Store(&ringState{newest: NewSigner(k), keys: []SigningKey{k}})
	return r
}

// NewRingWithKey returns a Ring whose only key is k, signing at once (for
// tests that need to know the secret).
func NewRingWithKey(k SigningKey) *Ring {
	r := &Ring{now: time.Now}
	r.st.Store(&ringState{newest: NewSigner(k), keys: []SigningKey{{ID: k.ID, Secret: append([]byte(nil), k.Secret...)}}})
	return r
}

// Rotate makes a new key the newest (signing after the activation delay)
// and keeps the newest as the previous; the key before that is retired. It
// returns the new key's id.
func (r *Ring) Rotate() uint32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.st.Load()
	k := SigningKey{ID: old.newest.KeyID() + 1, Secret: NewKey()}
	r.st.Store(&ringState{
		newest:   NewSigner(k),
		previous: old.newest,
		keys:     []SigningKey{k, old.keys[0]},
		activeAt: r.now().Add(r.activation),
	})
	return k.ID
}

// Signer returns the signer of the key that signs at now.
func (r *Ring) Signer(now time.Time) *Signer {
	st := r.st.Load()
	if st.previous != nil && now.Before(st.activeAt) {
		return st.previous
	}
	return st.newest
}

// Keys returns the keys agents must accept, newest first. The slice and its
// secrets are shared: callers must not modify them.
func (r *Ring) Keys() []SigningKey { return r.st.Load().keys }
