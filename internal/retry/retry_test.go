package retry

import (
	"context"
	"slices"
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

// TestStreak: the first failure and one per Every are loud, with the count
// and length of the streak; a success ends it, and the next failure is
// the first of a new one.
func TestStreak(t *testing.T) {
	s := Streak{Every: 10 * time.Second}
	t0 := time.Unix(1000, 0)
	var got []int
	for i := range 25 { // a failure every second
		if loud, n, lasted := s.Fail(t0.Add(time.Duration(i) * time.Second)); loud {
			got = append(got, n)
			if lasted != time.Duration(n-1)*time.Second {
				t.Fatalf("failure %d: lasted %v, want %v", n, lasted, time.Duration(n-1)*time.Second)
			}
		}
	}
	if want := []int{1, 11, 21}; !slices.Equal(got, want) {
		t.Fatalf("loud failures %v, want %v", got, want)
	}
	if n, lasted := s.Succeed(t0.Add(30 * time.Second)); n != 25 || lasted != 30*time.Second {
		t.Fatalf("Succeed = %d, %v; want 25, 30s", n, lasted)
	}
	if n, _ := s.Succeed(t0.Add(31 * time.Second)); n != 0 {
		t.Fatalf("Succeed with no streak = %d, want 0", n)
	}
	if loud, n, _ := s.Fail(t0.Add(32 * time.Second)); !loud || n != 1 {
		t.Fatalf("first failure of a new streak: loud %v, n %d", loud, n)
	}
}
