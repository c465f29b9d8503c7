package meta

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// hugePage is the size of an x86-64 / arm64 (4 KiB base) transparent huge
// page.
const hugePage = 2 << 20

// adviseHugePages asks for transparent huge pages on the whole huge pages
// inside [p, p+n), memory the caller just allocated and has not touched.
// Advice only: an error (THP "never", an old kernel) changes nothing.
func adviseHugePages(p unsafe.Pointer, n int) {
	base := uintptr(p)
	start := (base + hugePage - 1) &^ (hugePage - 1)
	end := (base + uintptr(n)) &^ (hugePage - 1)
	if end <= start {
		return
	}
	_ = unix.Madvise(unsafe.Slice((*byte)(unsafe.Add(p, start-base)), end-start), unix.MADV_HUGEPAGE)
}
