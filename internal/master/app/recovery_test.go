package app

import (
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// TestRecoveryWaitsForRegistrations: recovery lasts at least the grace, then
// while any agent is registering, and ends at max whatever they do; the
// time it took is a metric.
func TestRecoveryWaitsForRegistrations(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	for _, tc := range []struct {
		name        string
		registering []int // Registering() at t0+1s, +2s, ...
		wantEnd     time.Duration
	}{
		{"nobody registering ends at the grace", []int{0, 0, 0, 0}, 2 * time.Second},
		{"a registration past the grace holds it", []int{1, 1, 2, 1, 0, 0}, 5 * time.Second},
		{"max ends it", []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 8 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := 0
			r, err := newRecovery(2*time.Second, 8*time.Second, func() int { return n }, prometheus.NewRegistry(), testutil.Logger())
			if err != nil {
				t.Fatal(err)
			}
			if rec, _, _ := r.check(t0); !rec {
				t.Fatal("recovering before Run: got false, want true")
			}
			r.start(t0)
			var ended time.Duration
			for i, reg := range tc.registering {
				n = reg
				at := time.Duration(i+1) * time.Second
				if rec, _, _ := r.check(t0.Add(at)); !rec && ended == 0 {
					ended = at
				}
			}
			if ended != tc.wantEnd {
				t.Fatalf("recovery ended at %v, want %v", ended, tc.wantEnd)
			}
			if got := promtest.ToFloat64(r.seconds); got != tc.wantEnd.Seconds() {
				t.Fatalf("crescent_master_recovery_seconds: got %v, want %v", got, tc.wantEnd.Seconds())
			}
			if got := promtest.ToFloat64(r.recovering); got != 0 {
				t.Fatalf("crescent_master_recovering after the end: got %v, want 0", got)
			}
		})
	}
}
