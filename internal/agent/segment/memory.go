package segment

import (
	"context"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/alloc"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/google/uuid"
	"golang.org/x/sys/unix"
)

// memory is an anonymous private mapping. MAP_NORESERVE: pages are committed
// on first touch, so a large --memory costs nothing until objects arrive.
type memory struct {
	data []byte
}

func (m *memory) readAt(p []byte, off uint64) error {
	copy(p, m.data[off:])
	return nil
}

func (m *memory) writeAt(p []byte, off uint64) error {
	copy(m.data[off:], p)
	return nil
}

func (m *memory) slice(off, n uint64) []byte { return m.data[off : off+n : off+n] }

func (m *memory) hash(off, n uint64) (uint64, error) { return checksum.Sum(m.data[off : off+n]), nil }

func (m *memory) sync() error { return nil }

func (m *memory) close() error {
	if m.data == nil {
		return nil
	}
	err := unix.Munmap(m.data)
	m.data = nil
	return err
}

// NewMemory maps size bytes of anonymous memory as a new segment with a fresh
// UUID (a memory segment is never the same segment twice).
func NewMemory(name string, size uint64) (*Segment, error) {
	a, err := alloc.New(size, alloc.MemoryAlignment)
	if err != nil {
		return nil, fmt.Errorf("memory segment %s: %w", name, err)
	}
	n := a.Capacity()
	if n > uint64(maxInt) {
		return nil, fmt.Errorf("memory segment %s: size %d too large", name, n)
	}
	data, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("memory segment %s: mmap %d bytes: %w", name, n, err)
	}
	// Transparent huge pages where the kernel offers them (THP "madvise" or
	// "always"): 512 times fewer page-table entries for the segment. On the
	// development VM (nested paging) a 4 KiB page's first touch cost 20-35
	// µs and a receive into cold 4 KiB pages cost the agent 2-6 times what
	// raw TCP's receive into a reused buffer did; with huge pages the
	// prefault of 448 MiB took 1.3 s instead of 7.9 s of CPU, and the
	// agent's receive of a 1 MiB put fell below raw TCP's (BENCHMARKS.md,
	// "1 MiB at wire speed"). Advice only: without THP nothing changes.
	_ = unix.Madvise(data, unix.MADV_HUGEPAGE)
	return newSegment(uuid.NewString(), name, masterv1.Medium_MEDIUM_MEMORY, &memory{data: data}, a), nil
}

// Prefault writes one zero byte to every page of a fresh memory segment so
// the kernel (and, under a hypervisor, the host) backs the whole mapping now
// rather than on the first write of each object: a first touch costs
// 10-20 µs a page on the development VM (BENCHMARKS.md), which a put of
// 4 KiB objects into fresh memory would otherwise pay per object. It must run
// before the segment is offered to the master (the pages are all zero then,
// so the writes change nothing); a segment holding allocations is refused.
// Disk segments are left alone (their pages are the page cache's). It
// returns early with ctx's error if ctx ends.
func (s *Segment) Prefault(ctx context.Context) error {
	m, ok := s.store.(*memory)
	if !ok {
		return nil
	}
	// mu is held throughout: nothing else may use a segment before it is
	// offered, and Close must not unmap the pages under the loop.
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("segment %s: closed", s.id)
	}
	if n := s.table.len(); n > 0 {
		return fmt.Errorf("segment %s: prefault of a segment holding %d allocations", s.id, n)
	}
	const page, step = 4096, 64 << 20
	for start := 0; start < len(m.data); start += step {
		if err := ctx.Err(); err != nil {
			return err
		}
		end := min(start+step, len(m.data))
		for i := start; i < end; i += page {
			m.data[i] = 0
		}
	}
	return nil
}

const maxInt = int(^uint(0) >> 1)
