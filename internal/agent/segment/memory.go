package segment

import (
	"context"
	"errors"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/alloc"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/google/uuid"
	"golang.org/x/sys/unix"
)

// memory is an anonymous private mapping, or, for a segment shared with
// same-host clients (NewSharedMemory), a shared mapping of a memfd. MAP_NORESERVE:
// pages are committed on first touch, so a large --memory costs nothing
// until objects arrive.
type memory struct {
	data []byte
	// fd is the memfd behind a shared segment's mapping, -1 otherwise.
	fd int
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
	if m.fd >= 0 {
		err = errors.Join(err, unix.Close(m.fd))
		m.fd = -1
	}
	return err
}

// NewMemory maps size bytes of anonymous memory as a new segment with a fresh
// UUID (a memory segment is never the same segment twice).
func NewMemory(name string, size uint64) (*Segment, error) {
	return newMemory(name, size, false)
}

// NewSharedMemory is NewMemory backed by a memfd mapped MAP_SHARED, so the
// segment's bytes can be handed to a same-host client (SharedFD, the
// shared-memory data path of internal/xfer/shm). The memfd is sealed
// against shrinking and growing: a client holding it cannot truncate it
// under the agent's mapping (which would make the agent's next access
// fault). Only an agent with the shared-memory listener on makes these:
// shmem gets huge pages only where the host's shmem_enabled allows them,
// and on 4 KiB pages prefault is 13-44 times slower than on anonymous huge
// pages (BENCHMARKS.md, "Same-host shared memory"), so the others keep
// anonymous memory.
func NewSharedMemory(name string, size uint64) (*Segment, error) {
	return newMemory(name, size, true)
}

func newMemory(name string, size uint64, shared bool) (*Segment, error) {
	a, err := alloc.New(size, alloc.MemoryAlignment)
	if err != nil {
		return nil, fmt.Errorf("memory segment %s: %w", name, err)
	}
	n := a.Capacity()
	if n > uint64(maxInt) {
		return nil, fmt.Errorf("memory segment %s: size %d too large", name, n)
	}
	m := &memory{fd: -1}
	if shared {
		if m.fd, err = memfd(name, int64(n)); err != nil {
			return nil, fmt.Errorf("memory segment %s: %w", name, err)
		}
		m.data, err = unix.Mmap(m.fd, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_NORESERVE)
	} else {
		m.data, err = unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	}
	if err != nil {
		if m.fd >= 0 {
			_ = unix.Close(m.fd)
		}
		return nil, fmt.Errorf("memory segment %s: mmap %d bytes: %w", name, n, err)
	}
	// Transparent huge pages where the kernel offers them (THP "madvise" or
	// "always"): 512 times fewer page-table entries for the segment. On the
	// development VM (nested paging) a 4 KiB page's first touch cost 20-35
	// µs and a receive into cold 4 KiB pages cost the agent 2-6 times what
	// raw TCP's receive into a reused buffer did; with huge pages the
	// prefault of 448 MiB took 1.3 s instead of 7.9 s of CPU, and the
	// agent's receive of a 1 MiB put fell below raw TCP's (BENCHMARKS.md,
	// "1 MiB at wire speed"). Advice only: without THP nothing changes. A
	// shared (memfd) mapping gets huge pages only where
	// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them
	// ("advise" or "always"; the development VM says "never").
	_ = unix.Madvise(m.data, unix.MADV_HUGEPAGE)
	return newSegment(uuid.NewString(), name, masterv1.Medium_MEDIUM_MEMORY, m, a), nil
}

// memfd creates a memfd of n bytes, sealed against changes of its size.
func memfd(name string, n int64) (int, error) {
	fd, err := unix.MemfdCreate("crescent-"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, n); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("memfd of %d bytes: %w", n, err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("seal memfd: %w", err)
	}
	return fd, nil
}

// DupSharedFD returns a duplicate of the memfd behind a segment made by
// NewSharedMemory, and the size of its mapping, for passing to a same-host
// client (SCM_RIGHTS); the caller closes it. ok is false for any other
// segment and for a closed one.
func (s *Segment) DupSharedFD() (fd int, size uint64, ok bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, isMem := s.store.(*memory)
	if !isMem || s.closed || m.fd < 0 {
		return -1, 0, false, nil
	}
	fd, err = unix.FcntlInt(uintptr(m.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, 0, false, fmt.Errorf("segment %s: dup memfd: %w", s.id, err)
	}
	return fd, uint64(len(m.data)), true, nil
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
