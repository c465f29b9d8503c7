package testutil

import (
	"sync"
	"time"
)

// Clock is a fake clock for code that takes a `func() time.Time`: it
// stands still until Advance or Set moves it. Safe for concurrent use.
type Clock struct {
	mu  sync.Mutex // guards now
	now time.Time
}

// NewClock returns a clock reading start.
func NewClock(start time.Time) *Clock { return &Clock{now: start} }

// Now is the clock's time (pass c.Now where a func() time.Time is wanted).
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// Set moves the clock to t.
func (c *Clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}
