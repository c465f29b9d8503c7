package testutil

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recordingTB records Fatalf instead of stopping the test, and can carry
// a context of its own.
type recordingTB struct {
	testing.TB
	ctx   context.Context
	fatal string
}

func (r *recordingTB) Helper()                  {}
func (r *recordingTB) Context() context.Context { return r.ctx }
func (r *recordingTB) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
}

func TestEventually(t *testing.T) {
	var n atomic.Int32
	Eventually(t, 10*time.Second, func() bool { return n.Add(1) == 3 }, "the third call")
	if n.Load() != 3 {
		t.Fatalf("cond called %d times, want 3", n.Load())
	}

	r := &recordingTB{TB: t, ctx: t.Context()}
	Eventually(r, 20*time.Millisecond, func() bool { return false }, "%s %d", "never", 7)
	if !strings.Contains(r.fatal, "timed out after 20ms waiting for never 7") {
		t.Fatalf("Fatalf(%q)", r.fatal)
	}

	r = &recordingTB{TB: t, ctx: t.Context()}
	EventuallyNoError(r, 20*time.Millisecond, func() error { return errors.New("still 3 left") })
	if !strings.Contains(r.fatal, "still 3 left") {
		t.Fatalf("Fatalf(%q)", r.fatal)
	}

	// A test whose context ends stops waiting at once.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	r = &recordingTB{TB: t, ctx: ctx}
	start := time.Now()
	Eventually(r, time.Hour, func() bool { return false }, "forever")
	if r.fatal == "" || time.Since(start) > 10*time.Second {
		t.Fatalf("after the context ended: Fatalf(%q) after %v", r.fatal, time.Since(start))
	}
}

func TestClock(t *testing.T) {
	start := time.Unix(100, 0)
	c := NewClock(start)
	c.Advance(time.Minute)
	if got := c.Now(); !got.Equal(start.Add(time.Minute)) {
		t.Fatalf("Now = %v", got)
	}
	c.Set(start)
	if got := c.Now(); !got.Equal(start) {
		t.Fatalf("Now after Set = %v", got)
	}
	Logger().Info("discarded")
}

func TestPublisherEndpoint(t *testing.T) {
	p, err := StartPublisher()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(p.Endpoint(), "tcp://127.0.0.1:") {
		t.Fatalf("endpoint %q", p.Endpoint())
	}
	p.Close()
}
