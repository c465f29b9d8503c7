package obs

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestErrorLogRateLimited(t *testing.T) {
	var buf bytes.Buffer
	e := &errorLog{lg: slog.New(slog.NewJSONHandler(&buf, nil)), every: time.Hour}
	for range 5 {
		e.Handle(errors.New("collector down"))
	}
	if got := strings.Count(buf.String(), "tracing error"); got != 1 {
		t.Fatalf("logged %d times, want 1: %s", got, buf.String())
	}
	e.mu.Lock()
	e.last = time.Now().Add(-2 * time.Hour)
	e.mu.Unlock()
	e.Handle(errors.New("collector down"))
	if !strings.Contains(buf.String(), `"suppressed":4`) {
		t.Fatalf("second line lacks the suppressed count: %s", buf.String())
	}
}
