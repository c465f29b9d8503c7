package prefault

import (
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// unsupported is set once the kernel refused MADV_POPULATE_WRITE.
var unsupported atomic.Bool

func populate(b []byte) {
	if unsupported.Load() {
		return
	}
	page := uintptr(os.Getpagesize())
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	first := (start + page - 1) &^ (page - 1)
	last := (start + uintptr(len(b))) &^ (page - 1)
	if last <= first {
		return
	}
	// madvise needs a page-aligned start; the slice keeps the buffer
	// alive across the call.
	aligned := b[first-start : last-start]
	if err := unix.Madvise(aligned, unix.MADV_POPULATE_WRITE); err == unix.EINVAL || err == unix.ENOSYS {
		unsupported.Store(true)
	}
}
