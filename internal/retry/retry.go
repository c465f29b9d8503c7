// Package retry is the jittered exponential backoff every Crescent
// reconnect loop uses (agents to the master, the gateway to the master,
// KV-event subscribers to the gateway, the SDK's retries): the delay doubles
// from Min to Max, each wait is drawn uniformly from [d/2, d], and every wait
// honours its context. Reset after a healthy session.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is a reusable backoff schedule. It is not safe for concurrent use:
// each retry loop owns one.
type Backoff struct {
	min, max, cur time.Duration
	t             *time.Timer
}

// NewBackoff returns a schedule from lo to hi.
func NewBackoff(lo, hi time.Duration) *Backoff {
	lo = max(lo, time.Millisecond)
	return &Backoff{min: lo, max: max(hi, lo), cur: lo}
}

// Reset starts the schedule over (after a healthy session).
func (b *Backoff) Reset() { b.cur = b.min }

// Next returns the next delay and advances the schedule.
func (b *Backoff) Next() time.Duration {
	d := Jitter(b.cur)
	b.cur = min(b.cur*2, b.max)
	return d
}

// Wait sleeps for the next delay, or until ctx ends (returning its error).
func (b *Backoff) Wait(ctx context.Context) error {
	d := b.Next()
	if b.t == nil {
		b.t = time.NewTimer(d)
	} else {
		b.t.Reset(d)
	}
	select {
	case <-ctx.Done():
		b.t.Stop()
		return ctx.Err()
	case <-b.t.C:
		return nil
	}
}

// Sleep waits d, or until ctx ends (returning its error).
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Delay is the stateless form: the delay before attempt (0-based), base·2^attempt
// capped at hi, jittered.
func Delay(base, hi time.Duration, attempt int) time.Duration {
	d := base
	for i := 0; i < attempt && d < hi; i++ {
		d *= 2
	}
	return Jitter(min(d, hi))
}

// Jitter draws uniformly from [d/2, d].
func Jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}
