package ctl

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// drainShowingProgress runs DrainSegment (which answers when the drain
// ends) and meanwhile polls the segment's entry (GetSegment: the same
// entry the segments listing shows) every interval, showing a running
// drain's counts on line.
func drainShowingProgress(ctx context.Context, admin masterv1.AdminServiceClient, req *masterv1.DrainSegmentRequest, line *drainLine, interval time.Duration) (*masterv1.DrainSegmentResponse, error) {
	type answer struct {
		r   *masterv1.DrainSegmentResponse
		err error
	}
	done := make(chan answer, 1)
	go func() {
		r, err := admin.DrainSegment(ctx, req)
		done <- answer{r, err}
	}()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case a := <-done:
			if a.err == nil {
				line.show(a.r.GetCounts())
			}
			line.end()
			return a.r, a.err
		case <-t.C:
			// A failed poll is skipped: the drain's own answer decides.
			g, err := admin.GetSegment(ctx, &masterv1.GetSegmentRequest{SegmentId: req.GetSegmentId()})
			if d := g.GetSegment().GetDrain(); err == nil && d.GetState() == masterv1.DrainState_DRAIN_STATE_RUNNING {
				line.show(d.GetCounts())
			}
		}
	}
}

// drainLine shows a drain's progress: on a terminal one line rewritten in
// place, otherwise a line each time the counts changed.
type drainLine struct {
	w       io.Writer
	segment string
	rewrite bool
	start   time.Time
	last    string // the counts last shown
	shown   bool
}

func newDrainLine(w io.Writer, segment string, rewrite bool) *drainLine {
	return &drainLine{w: w, segment: segment, rewrite: rewrite, start: time.Now()}
}

func (l *drainLine) show(c *masterv1.DrainCounts) {
	done := c.GetMoved() + c.GetDropped()
	pct := uint64(100)
	if c.GetTotal() > 0 {
		pct = min(100, 100*done/c.GetTotal())
	}
	counts := fmt.Sprintf("drain %s: moved %d/%d (%d%%), offloaded %d, evicted %d, dropped %d, failed %d",
		l.segment, c.GetMoved(), c.GetTotal(), pct, c.GetOffloaded(), c.GetEvicted(), c.GetDropped(), c.GetFailed())
	if !l.rewrite && counts == l.last {
		return
	}
	l.last, l.shown = counts, true
	rate := 0.0
	if secs := time.Since(l.start).Seconds(); secs > 0 {
		rate = float64(c.GetMoved()) / secs
	}
	if l.rewrite {
		fmt.Fprintf(l.w, "\r%s, %.0f/s\x1b[K", counts, rate) // \x1b[K clears the rest of the old line
		return
	}
	fmt.Fprintf(l.w, "%s, %.0f/s\n", counts, rate)
}

// end finishes a rewritten line.
func (l *drainLine) end() {
	if l.rewrite && l.shown {
		fmt.Fprintln(l.w)
	}
}

// drainColumn is the segments table's DRAIN column: the running or last
// drain as "STATE moved/total", and what else it did when anything; "-"
// for none.
func drainColumn(d *masterv1.DrainProgress) string {
	if d == nil {
		return "-"
	}
	c := d.GetCounts()
	out := fmt.Sprintf("%s %d/%d", strings.TrimPrefix(d.GetState().String(), "DRAIN_STATE_"), c.GetMoved(), c.GetTotal())
	if c.GetOffloaded()+c.GetEvicted()+c.GetDropped()+c.GetLeft() > 0 {
		out += fmt.Sprintf(" offloaded=%d evicted=%d dropped=%d left=%d", c.GetOffloaded(), c.GetEvicted(), c.GetDropped(), c.GetLeft())
	}
	return out
}

// drainJSON is the segments listing's "drain" field (nil for none).
func drainJSON(d *masterv1.DrainProgress) map[string]any {
	if d == nil {
		return nil
	}
	c := d.GetCounts()
	return map[string]any{
		"state": strings.TrimPrefix(d.GetState().String(), "DRAIN_STATE_"), "no_evict": d.GetNoEvict(),
		"started_unix_ms": d.GetStartedUnixMs(), "finished_unix_ms": d.GetFinishedUnixMs(), "error": d.GetError(),
		"total": c.GetTotal(), "moved": c.GetMoved(), "evicted": c.GetEvicted(), "offloaded": c.GetOffloaded(), "dropped": c.GetDropped(),
		"failed": c.GetFailed(), "left": c.GetLeft(), "writes_waited": c.GetWritesWaited(),
	}
}
