package segment

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"testing/synctest"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"golang.org/x/time/rate"
)

// TestScrub: a pass verifies every sealed object at the limiter's rate
// (1 MiB/s for 4 MiB: at least 3 s, fake time), drops the one whose bytes
// were changed on disk under the running segment (reported to the lost
// sink) and leaves the others; a second pass finds nothing more.
func TestScrub(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		dir, objs, s, sink := openFilled(t, 1<<20, 1<<20, 2<<20, 10_000)
		bad := objs[2]
		testutil.FlipByte(t, filepath.Join(dir, dataName), bad.alloc.GetOffset()+1<<20+5)
		var total uint64
		for _, o := range objs {
			total += uint64(len(o.data))
		}
		start := time.Now()
		rep, err := s.Scrub(t.Context(), rate.NewLimiter(1<<20, scrubStep))
		if err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took < 3*time.Second {
			t.Fatalf("a pass over %d bytes at 1 MiB/s took %v, want at least 3s", total, took)
		}
		if rep.Allocations != len(objs) || rep.Bytes != total || rep.Lost != 1 {
			t.Fatalf("report = %+v, want %d allocations, %d bytes, 1 lost", rep, len(objs), total)
		}
		if lost := sink.all(); len(lost) != 1 || lost[0].Allocation.GetAllocationId() != bad.alloc.GetAllocationId() {
			t.Fatalf("lost = %+v, want allocation %d", lost, bad.alloc.GetAllocationId())
		}
		if _, ok := s.Lookup(bad.alloc.GetAllocationId()); ok {
			t.Fatal("the bad allocation is still in the table")
		}
		rep, err = s.Scrub(t.Context(), nil)
		if err != nil || rep.Allocations != len(objs)-1 || rep.Lost != 0 {
			t.Fatalf("second pass = %+v, %v; want %d allocations, none lost", rep, err, len(objs)-1)
		}
	})
}

// TestScrubStops: a pass ends when its context does, between objects,
// with what it did so far; nothing is dropped.
func TestScrubStops(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		_, objs, s, sink := openFilled(t, 1<<20, 1<<20, 1<<20)
		ctx, cancel := context.WithTimeout(t.Context(), 1500*time.Millisecond)
		defer cancel()
		rep, err := s.Scrub(ctx, rate.NewLimiter(1<<20, scrubStep))
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Scrub = %v, want DeadlineExceeded", err)
		}
		if rep.Allocations == 0 || rep.Allocations >= len(objs) {
			t.Fatalf("report = %+v, want some of %d allocations", rep, len(objs))
		}
		if len(sink.all()) != 0 || len(s.Table()) != len(objs) {
			t.Fatalf("a stopped pass dropped something: %d lost, %d rows", len(sink.all()), len(s.Table()))
		}
	})
}
