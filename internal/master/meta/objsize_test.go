package meta

import (
	"testing"
	"unsafe"
)

// TestObjectSize holds an object to 112 bytes, a size class of its own: a
// field more takes it to the 128-byte class, 16 bytes per object more
// (BenchmarkHeapPerObject, issue 18's 200 B per object).
func TestObjectSize(t *testing.T) {
	if n := unsafe.Sizeof(object{}); n > 112 {
		t.Fatalf("object is %d bytes, want at most 112", n)
	}
}
