package app

import (
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"github.com/prometheus/client_golang/prometheus"
)

// TestRebuildSpan: a recovery is one master.rebuild span, a trace of its
// own, from start to its end, with its outcome.
func TestRebuildSpan(t *testing.T) {
	rec := tracectxtest.Install(t)
	t0 := time.Unix(1_800_000_000, 0)
	for _, tc := range []struct {
		registering int
		outcome     string
		end         time.Duration
	}{{0, "recovered", 2 * time.Second}, {1, "recovery_max", 8 * time.Second}} {
		r, err := newRecovery(2*time.Second, 8*time.Second, func() int { return tc.registering }, prometheus.NewRegistry(), testutil.Logger())
		if err != nil {
			t.Fatal(err)
		}
		r.start(t0)
		for at := time.Second; at <= 8*time.Second; at += time.Second {
			r.check(t0.Add(at))
		}
		spans := tracectxtest.Named(rec, "master.rebuild")
		s := spans[len(spans)-1]
		if s.Parent().IsValid() || !s.StartTime().Equal(t0) || s.EndTime().Sub(s.StartTime()) != tc.end {
			t.Fatalf("rebuild span parent %v, %v to %v; want a root from %v lasting %v", s.Parent(), s.StartTime(), s.EndTime(), t0, tc.end)
		}
		if got := tracectxtest.Attr(s, string(attrRecovery)); got != tc.outcome {
			t.Fatalf("outcome %q, want %q", got, tc.outcome)
		}
	}
	if n := len(tracectxtest.Named(rec, "master.rebuild")); n != 2 {
		t.Fatalf("%d rebuild spans for 2 recoveries", n)
	}
}
