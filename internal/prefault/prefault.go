// Package prefault maps a large new buffer's pages in one system call
// before it is written.
//
// Writing a fresh buffer faults once per 4 KiB page. On bare metal a fault
// costs well under a microsecond, but in a virtual machine whose page
// tables the hypervisor shadows each one exits to it: on the 2-vCPU VM of
// BENCHMARKS.md, first-touch writes of 300 MB took 800 ms (76,800 faults,
// about 10 µs each) and stalled the other vCPU's threads for up to 3 ms,
// while madvise(MADV_POPULATE_WRITE) mapped the same 300 MB in 50 ms. A
// gateway that encodes a 300 MB snapshot reply into new buffers pays that
// on its live path's CPUs (issue 13).
package prefault

// Buffer maps the pages of b's backing array (b[:cap(b)]) that lie wholly
// inside it, so that writing b does not fault on them. Pages already
// mapped stay as they are; the contents do not change. It is best-effort:
// where the kernel lacks MADV_POPULATE_WRITE (Linux before 5.14) or on
// other systems, it does nothing.
func Buffer(b []byte) {
	if cap(b) < minBytes {
		return
	}
	populate(b[:cap(b)])
}

// minBytes is the smallest buffer worth a system call (below it the
// faults cost less than the call).
const minBytes = 256 << 10
