package retry

import (
	"context"
	"testing"
	"time"
)

func TestBackoffGrowsCapsAndResets(t *testing.T) {
	b := NewBackoff(10*time.Millisecond, 80*time.Millisecond)
	want := []time.Duration{10, 20, 40, 80, 80}
	for i, w := range want {
		w *= time.Millisecond
		if d := b.Next(); d < w/2 || d > w {
			t.Fatalf("step %d: got %v, want within [%v, %v]", i, d, w/2, w)
		}
	}
	b.Reset()
	if d := b.Next(); d > 10*time.Millisecond {
		t.Fatalf("after Reset: got %v, want <= 10ms", d)
	}
}

func TestWaitHonoursContext(t *testing.T) {
	b := NewBackoff(time.Hour, time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := b.Wait(ctx); err != context.Canceled {
		t.Fatalf("got %v, want context.Canceled", err)
	}
}

func TestDelay(t *testing.T) {
	for attempt, w := range []time.Duration{100, 200, 400, 400} {
		w *= time.Millisecond
		if d := Delay(100*time.Millisecond, 400*time.Millisecond, attempt); d < w/2 || d > w {
			t.Fatalf("attempt %d: got %v, want within [%v, %v]", attempt, d, w/2, w)
		}
	}
}
