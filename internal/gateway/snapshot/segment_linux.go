package snapshot

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// newSegment maps an empty reply segment of n bytes outside the Go heap,
// its pages populated at once (MAP_POPULATE: one system call instead of
// one page fault per 4 KiB page as the build writes it). In a VM whose
// page tables the hypervisor shadows a fault exits to it: on the 2-vCPU
// VM of BENCHMARKS.md, first-touch writes of 300 MB took 800 ms (76,800
// faults, about 10 µs each) and stalled the other vCPU's threads for up to
// 3 ms, MAP_POPULATE mapped the same in 45 ms, and a cold 1M-entry build
// went from about 1.1 s to 0.55 s. Outside the heap, the
// segments a snapshot needs (300 MB per reply of a million entries, up to
// three replies while two consumers fetch) neither move the collector's
// heap goal up and down with every reply nor come back from it, released
// by its scavenger, to be faulted in again: with them on the heap the live
// p99 of BenchmarkGatewayStateLive's remote phase was 6.9-17.4 ms, with
// them mapped 4.0-7.5 ms (BENCHMARKS.md, issue 13).
//
// A segment must be given back with freeSegment once nothing reads it:
// the recorder does when a reply's last reader released it and the free
// list is full, and when it drops its buffers (replyIdle, stop). Reading a
// freed segment faults, so Recorder.Snapshot copies what it returns.
func newSegment(n int) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("snapshot: map a %d-byte reply segment: %w", n, err)
	}
	return b[:0], nil
}

// freeSegment unmaps a segment newSegment returned (any length of it).
func freeSegment(b []byte) {
	if err := unix.Munmap(b[:cap(b)]); err != nil {
		panic(fmt.Sprintf("snapshot: unmap a reply segment of %d bytes: %v", cap(b), err))
	}
}
