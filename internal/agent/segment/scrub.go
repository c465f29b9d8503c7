package segment

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"golang.org/x/time/rate"
)

// A scrub re-reads a live disk segment's sealed objects in the background
// and checks each against its sealed checksum (Handle.Verify), so that
// bytes gone bad on the device are found and reported (lost.go) before a
// client meets them, and objects nobody reads are checked too. VerifySealed
// does the same once before the segment is served; a scrub runs beside
// the data plane, rate-limited so it never takes the device from it.

// scrubStep is the most bytes a scrub asks the limiter for at once (and
// so the least burst the limiter must allow).
const scrubStep = 1 << 20

// ScrubReport is what one scrub pass found.
type ScrubReport struct {
	// Allocations and Bytes were verified (object bytes); Lost of them
	// were dropped (bad or unreadable). Allocations released during the
	// pass are skipped and not counted.
	Allocations, Lost int
	Bytes             uint64
	Took              time.Duration
}

// Scrub verifies every allocation SEALED when it starts, in offset order,
// at most lim's rate of object bytes (lim's burst must be at least 1 MiB;
// nil: no limit). Bad ones are dropped and reported to the lost sink as a
// read that found them bad would (Handle.Verify). It returns when done or
// when ctx ends (with ctx's error and the report so far); another read
// error (not EIO) stops it too. Its memory is one pointer per sealed
// allocation for the pass. Memory segments are not scrubbed (nil error,
// empty report).
func (s *Segment) Scrub(ctx context.Context, lim *rate.Limiter) (ScrubReport, error) {
	var rep ScrubReport
	if s.medium != masterv1.Medium_MEDIUM_DISK {
		return rep, nil
	}
	if lim != nil && lim.Limit() != rate.Inf && lim.Burst() < scrubStep {
		return rep, fmt.Errorf("scrub segment %s: the limiter's burst %d is below %d bytes", s.id, lim.Burst(), scrubStep)
	}
	start := time.Now()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return rep, errClosed
	}
	entries := s.sealedLocked()
	s.mu.Unlock()
	slices.SortFunc(entries, func(x, y *entry) int { return cmp.Compare(x.offset, y.offset) })
	for i, e := range entries {
		entries[i] = nil // the pass holds no entry it is done with
		for n := e.size; lim != nil && n > 0; {
			k := min(n, scrubStep)
			if err := lim.WaitN(ctx, int(k)); err != nil {
				// The wait would outlast ctx's deadline (the burst was
				// checked): the pass ends with ctx.
				<-ctx.Done()
				rep.Took = time.Since(start)
				return rep, ctx.Err()
			}
			n -= k
		}
		if err := ctx.Err(); err != nil {
			rep.Took = time.Since(start)
			return rep, err
		}
		h, err := s.OpenRead(e.id) // ids are never reused: e itself
		if err != nil {
			continue // released (or dropped) since the pass started
		}
		err = h.Verify()
		h.Close()
		rep.Allocations++
		rep.Bytes += e.size
		switch {
		case err == nil:
		case rpcerr.Reason(err) == "CHECKSUM_MISMATCH":
			rep.Lost++
		default:
			rep.Took = time.Since(start)
			return rep, err
		}
	}
	rep.Took = time.Since(start)
	return rep, nil
}
