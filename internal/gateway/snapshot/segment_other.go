//go:build !linux

package snapshot

// newSegment returns an empty reply segment of n bytes on the Go heap
// (see segment_linux.go for why Linux maps them instead).
func newSegment(n int) ([]byte, error) { return make([]byte, 0, n), nil }

// freeSegment leaves a segment to the collector.
func freeSegment([]byte) {}
