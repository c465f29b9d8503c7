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
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"syscall"
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

// Accept is lis.Accept for a listener's serve loop: a temporary failure
// (out of descriptors or memory, a connection aborted before it was
// accepted) is logged and tried again after a delay doubling from 5 ms to
// 1 s, as net/http does, instead of spinning; the delay honours ctx. It
// returns ctx's error once ctx ends, else a lasting failure as "what
// listener: err".
func Accept(ctx context.Context, lis net.Listener, lg *slog.Logger, what string) (net.Conn, error) {
	var delay time.Duration
	for {
		nc, err := lis.Accept()
		switch {
		case err == nil:
			return nc, nil
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case !temporary(err):
			return nil, fmt.Errorf("%s listener: %w", what, err)
		}
		delay = min(max(2*delay, 5*time.Millisecond), time.Second)
		lg.Warn(what+" accept failed; retrying", "err", err, "delay", delay)
		if Sleep(ctx, delay) != nil {
			return nil, ctx.Err()
		}
	}
}

func temporary(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ENOBUFS) ||
		errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.ECONNABORTED)
}

// Streak says how loudly a reconnect loop logs its failures, so a long
// outage (no leader while etcd is down, a master restarting at scale) is a
// few warnings rather than several lines a second from every agent and
// gateway: the first failure of a streak, and then one every Every, are
// loud (warnings, carrying how many failed and for how long); the others
// are quiet (debug). The zero value is ready; Every 0 means 10 s. Not safe
// for concurrent use: one loop owns it.
type Streak struct {
	Every time.Duration

	n           int       // failures since the last success
	first, last time.Time // the streak's first failure, its last loud one
}

// Fail counts a failure at now. It reports whether to log it loudly, with
// the failures so far in the streak and how long it has lasted.
func (s *Streak) Fail(now time.Time) (loud bool, failures int, lasted time.Duration) {
	every := s.Every
	if every <= 0 {
		every = 10 * time.Second
	}
	s.n++
	if s.n == 1 {
		s.first, s.last = now, now
		return true, 1, 0
	}
	if now.Sub(s.last) >= every {
		s.last = now
		return true, s.n, now.Sub(s.first)
	}
	return false, s.n, now.Sub(s.first)
}

// FailLevel is Fail as the level to log the failure at: warn when loud,
// debug otherwise.
func (s *Streak) FailLevel(now time.Time) (lvl slog.Level, failures int, lasted time.Duration) {
	loud, failures, lasted := s.Fail(now)
	if loud {
		return slog.LevelWarn, failures, lasted
	}
	return slog.LevelDebug, failures, lasted
}

// Succeed ends the streak and returns its failures and length (0 when
// there was none), for a line saying the outage is over.
func (s *Streak) Succeed(now time.Time) (failures int, lasted time.Duration) {
	failures = s.n
	if failures > 0 {
		lasted = now.Sub(s.first)
	}
	s.n = 0
	return failures, lasted
}
