package ctl

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// progress draws a one-line progress bar on a terminal; it is silent when
// disabled (not a terminal, or a small transfer).
type progress struct {
	w       io.Writer
	label   string
	enabled bool
	start   time.Time

	mu   sync.Mutex // guards last
	last time.Time
}

func newProgress(w io.Writer, label string, enabled bool) *progress {
	return &progress{w: w, label: label, enabled: enabled, start: time.Now()}
}

func (p *progress) update(done, total int64) {
	if !p.enabled || total <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if now.Sub(p.last) < 100*time.Millisecond && done < total {
		return
	}
	p.last = now
	const width = 30
	filled := int(int64(width) * done / total)
	bar := make([]byte, width)
	for i := range bar {
		if i < filled {
			bar[i] = '='
		} else {
			bar[i] = ' '
		}
	}
	secs := now.Sub(p.start).Seconds()
	rate := 0.0
	if secs > 0 {
		rate = float64(done) / secs / (1 << 20)
	}
	fmt.Fprintf(p.w, "\r%s [%s] %3d%% %8.1f MiB/s", p.label, bar, 100*done/total, rate)
}

func (p *progress) done() {
	if p.enabled {
		fmt.Fprintln(p.w)
	}
}
