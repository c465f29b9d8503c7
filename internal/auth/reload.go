package auth

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultReloadCheck is how often, at most, Source and Tokens look at their
// files for changes.
const DefaultReloadCheck = time.Second

// maxFileBytes bounds what a reload reads from a PEM file.
const maxFileBytes = 1 << 20

// stamp is what a cheap check compares: a file's modification time and size.
type stamp struct {
	mtime time.Time
	size  int64
}

// watcher decides when a set of files has changed. It starts nothing: poll
// is called on use, and at most one caller at a time does the I/O (the others
// return at once and keep using the current material).
type watcher struct {
	paths   []string
	limit   int64
	every   atomic.Int64 // ReloadCheck in nanoseconds; <= 0 means on every use
	nextDue atomic.Int64 // UnixNano before which poll does nothing

	// mu guards stamps, sum and lastErr; taken with TryLock by the one
	// caller that checks the files.
	mu      sync.Mutex
	stamps  []stamp
	sum     [sha256.Size]byte // of the last file set seen (applied or rejected)
	lastErr string            // the last error reported, so a stuck failure is logged once
}

func newWatcher(limit int64, paths ...string) *watcher {
	w := &watcher{paths: paths, limit: limit}
	w.every.Store(int64(DefaultReloadCheck))
	return w
}

// readAll reads every file (stamped before reading, so the content is at
// least as new as the stamps) for the first load.
func (w *watcher) readAll() ([]stamp, [][]byte, error) {
	st := make([]stamp, len(w.paths))
	data := make([][]byte, len(w.paths))
	for i, p := range w.paths {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, nil, err
		}
		st[i] = stamp{fi.ModTime(), fi.Size()}
		if data[i], err = readLimited(p, w.limit); err != nil {
			return nil, nil, err
		}
	}
	return st, data, nil
}

// init records the first loaded file set.
func (w *watcher) init(st []stamp, data [][]byte, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stamps, w.sum = st, sumOf(data)
	w.nextDue.Store(now.UnixNano() + w.every.Load())
}

// poll checks the files if the interval has passed and, when their content
// differs from the last set seen, calls apply with it. It returns the error
// to log (nil when there is nothing new to report: a failure that persists
// unchanged is reported once).
func (w *watcher) poll(now time.Time, apply func([][]byte) error) error {
	if now.UnixNano() < w.nextDue.Load() {
		return nil
	}
	if !w.mu.TryLock() {
		return nil
	}
	defer w.mu.Unlock()
	w.nextDue.Store(now.UnixNano() + w.every.Load())
	err := w.pollLocked(now, apply)
	if err == nil {
		w.lastErr = ""
		return nil
	}
	if err.Error() == w.lastErr {
		return nil
	}
	w.lastErr = err.Error()
	return err
}

func (w *watcher) pollLocked(now time.Time, apply func([][]byte) error) error {
	st := make([]stamp, len(w.paths))
	for i, p := range w.paths {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		st[i] = stamp{fi.ModTime(), fi.Size()}
	}
	if equalStamps(st, w.stamps) && !recent(st, now) {
		return nil
	}
	w.stamps = st
	data := make([][]byte, len(w.paths))
	for i, p := range w.paths {
		var err error
		if data[i], err = readLimited(p, w.limit); err != nil {
			w.stamps = nil // read again next time
			return err
		}
	}
	sum := sumOf(data)
	if sum == w.sum {
		return nil
	}
	w.sum = sum
	return apply(data)
}

// settle is how long after a file's modification time its stamp is not
// trusted: file systems keep mtime at a kernel tick's granularity, so two
// same-size writes within one tick would otherwise look alike. Until then
// the content is hashed on every check.
const settle = 2 * time.Second

func recent(st []stamp, now time.Time) bool {
	for _, s := range st {
		if now.Sub(s.mtime) < settle {
			return true
		}
	}
	return false
}

func equalStamps(a, b []stamp) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].mtime.Equal(b[i].mtime) || a[i].size != b[i].size {
			return false
		}
	}
	return true
}

// sumOf hashes a file set, each file length-prefixed so boundaries count.
func sumOf(data [][]byte) [sha256.Size]byte {
	h := sha256.New()
	for _, d := range data {
		_, _ = fmt.Fprintf(h, "%d:", len(d))
		_, _ = h.Write(d)
	}
	var s [sha256.Size]byte
	h.Sum(s[:0])
	return s
}

var errTooLarge = errors.New("file too large")

func readLimited(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: %w (more than %d bytes)", path, errTooLarge, limit)
	}
	return b, nil
}
