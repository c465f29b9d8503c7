package testutil

import (
	"fmt"
	"log/slog"
	"testing"
	"time"
)

// PollInterval is how often Eventually checks its condition.
const PollInterval = 2 * time.Millisecond

// Eventually polls cond until it holds and fails the test (t.Fatalf) when
// timeout passes or the test's context ends first. msg and args describe
// what was awaited ("the source to catch up to %d").
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	if err := Poll(t, timeout, func() error {
		if cond() {
			return nil
		}
		return errNotYet
	}); err != nil {
		t.Fatalf("timed out after %v waiting for %s", timeout, fmt.Sprintf(msg, args...))
	}
}

// EventuallyNoError polls f until it returns nil and fails the test with
// f's last error when timeout passes or the test's context ends first.
func EventuallyNoError(t testing.TB, timeout time.Duration, f func() error) {
	t.Helper()
	if err := Poll(t, timeout, f); err != nil {
		t.Fatalf("condition not met after %v: %v", timeout, err)
	}
}

// errNotYet is Eventually's error for a condition that does not hold.
var errNotYet = fmt.Errorf("condition does not hold")

// Poll calls f every PollInterval until it returns nil (Poll returns nil),
// timeout passes or t's context ends (Poll returns f's last error).
func Poll(t testing.TB, timeout time.Duration, f func() error) error {
	t.Helper()
	ctx := t.Context()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(PollInterval)
	defer tick.Stop()
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-deadline.C:
			return err
		case <-tick.C:
		}
	}
}

// Logger returns a logger that discards everything.
func Logger() *slog.Logger { return slog.New(slog.DiscardHandler) }
