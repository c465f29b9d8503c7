package testutil

import (
	"bytes"
	"strings"
	"sync"
)

// LogBuffer is an io.Writer for a test's logger that many goroutines may
// write while the test reads it (a bytes.Buffer is not safe for that).
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String is everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Count is the number of non-overlapping occurrences of s written so far.
func (l *LogBuffer) Count(s string) int { return strings.Count(l.String(), s) }
