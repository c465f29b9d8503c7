package session

import (
	"bytes"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
)

// testTokenKey is the harness master's first token key.
var testTokenKey = token.SigningKey{ID: 1, Secret: []byte("0123456789abcdef0123456789abcdef")}

// sameKeys reports whether got lists exactly want, in order.
func sameKeys(got []*masterv1.TokenKey, want ...token.SigningKey) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if got[i].GetId() != want[i].ID || !bytes.Equal(got[i].GetKey(), want[i].Secret) {
			return false
		}
	}
	return true
}

// TestRotationResendsSettings: every rotation re-sends Settings to every
// agent with the new key first and the previous one after it; the key two
// rotations old is no longer sent.
func TestRotationResendsSettings(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	agents := []*fakeAgent{h.connectAgent("a1"), h.connectAgent("a2")}
	keys := func(a *fakeAgent) []*masterv1.TokenKey {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.settings.GetTokenKeys()
	}
	for _, a := range agents {
		if got := keys(a); !sameKeys(got, testTokenKey) {
			t.Fatalf("agent %s first keys: got %v, want [%d]", a.id, got, testTokenKey.ID)
		}
	}
	ring := h.m.id.Keys
	for round := range 2 {
		id := h.m.RotateTokenKey()
		want := ring.Keys()
		if len(want) != 2 || want[0].ID != id {
			t.Fatalf("round %d: ring keys %v, want the new key %d first of 2", round, want, id)
		}
		for _, a := range agents {
			testutil.Eventually(t, 5*time.Second, func() bool { return sameKeys(keys(a), want...) }, "agent %s keys after rotation %d", a.id, round)
		}
	}
	// A session that registers after the rotations gets the same keys.
	late := h.connectAgent("a3")
	if got := late.settings.GetTokenKeys(); !sameKeys(got, ring.Keys()...) {
		t.Fatalf("late agent keys: got %v, want %v", got, ring.Keys())
	}
}
