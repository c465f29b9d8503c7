package prefault

import (
	"os"
	"runtime"
	"syscall"
	"testing"
	"unsafe"
)

// TestBufferMapsPages: a fresh buffer's pages are not resident until
// written; Buffer makes them resident (mincore(2)) without a write.
func TestBufferMapsPages(t *testing.T) {
	const size = 64 << 20
	b := make([]byte, 0, size)
	before := resident(t, b[:size])
	Buffer(b)
	if unsupported.Load() {
		t.Skip("the kernel lacks MADV_POPULATE_WRITE")
	}
	after := resident(t, b[:size])
	t.Logf("resident pages of a fresh %d MiB buffer: %d before Buffer, %d after", size>>20, before, after)
	if want := size/os.Getpagesize() - 2; after < want {
		t.Fatalf("%d pages resident after Buffer, want at least %d", after, want)
	}
	runtime.KeepAlive(b)
}

// resident counts the pages of b's page-aligned interior in memory.
func resident(t *testing.T, b []byte) int {
	t.Helper()
	page := uintptr(os.Getpagesize())
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	first := (start + page - 1) &^ (page - 1)
	last := (start + uintptr(len(b))) &^ (page - 1)
	vec := make([]byte, (last-first)/page)
	if _, _, e := syscall.Syscall(syscall.SYS_MINCORE, first, last-first, uintptr(unsafe.Pointer(unsafe.SliceData(vec)))); e != 0 {
		t.Fatal(e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}
