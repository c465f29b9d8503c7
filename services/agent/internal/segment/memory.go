package segment

import (
	"fmt"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/services/agent/internal/alloc"
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

func (m *memory) hash(off, n uint64) (uint64, error) { return xxhash.Sum64(m.data[off : off+n]), nil }

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
	return newSegment(uuid.NewString(), name, masterv1.Medium_MEDIUM_MEMORY, &memory{data: data}, a), nil
}

const maxInt = int(^uint(0) >> 1)
