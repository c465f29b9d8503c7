package segment

import (
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Handle is an open read or write of one allocation. Its extent stays
// allocated until Close, even if the allocation is released meanwhile.
type Handle struct {
	s     *Segment
	e     *entry
	write bool
	// A write handle's place among the allocation's write opens
	// (entry.writeOpens after its own) and whether it was the only one
	// open then: SealReceived's proof that no other write overlapped.
	gen   uint64
	alone bool
	once  sync.Once
}

// OpenWrite opens a RESERVED allocation for writing.
func (s *Segment) OpenWrite(id uint64) (*Handle, error) {
	h := new(Handle)
	if err := s.open(h, id, true); err != nil {
		return nil, err
	}
	return h, nil
}

// OpenWriteTo is OpenWrite into h, which must be a zero Handle (never
// opened), so a caller opening many allocations at once can allocate their
// Handles together.
func (s *Segment) OpenWriteTo(h *Handle, id uint64) error {
	return s.open(h, id, true)
}

// OpenRead opens a SEALED allocation for reading.
func (s *Segment) OpenRead(id uint64) (*Handle, error) {
	h := new(Handle)
	if err := s.open(h, id, false); err != nil {
		return nil, err
	}
	return h, nil
}

func (s *Segment) open(h *Handle, id uint64, write bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errClosed
	}
	e, ok := s.table.get(id)
	if !ok {
		if _, bad := s.corrupt[id]; bad {
			return errCorruptAllocation(s.id, id)
		}
		return errNotFound(s.id, id)
	}
	if write {
		if e.state != masterv1.AllocationState_ALLOCATION_STATE_RESERVED || e.sealing {
			return errState("allocation %d is %s; writes need RESERVED", id, stateName(e))
		}
		e.writers++
		e.writeOpens++
		h.gen, h.alone = e.writeOpens, e.writers == 1
	} else {
		if e.state != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			return errState("allocation %d is %s; reads need SEALED", id, stateName(e))
		}
		e.readers++
	}
	s.refs++
	h.s, h.e, h.write = s, e, write
	return nil
}

func stateName(e *entry) string {
	if e.sealing {
		return "SEALING"
	}
	if e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		return "SEALED"
	}
	return "RESERVED"
}

// Size is the object size in bytes.
func (h *Handle) Size() uint64 { return h.e.size }

// Checksum is the sealed checksum (0 while RESERVED).
func (h *Handle) Checksum() uint64 { return h.e.checksum }

// ID is the allocation id.
func (h *Handle) ID() uint64 { return h.e.id }

// CheckBounds reports OUT_OF_BOUNDS unless [off, off+n) lies inside the
// object.
func (h *Handle) CheckBounds(off, n uint64) error { return h.bounds(off, n) }

func (h *Handle) bounds(off, n uint64) error {
	if off > h.e.size || n > h.e.size-off {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS,
			"bytes [%d, %d) lie outside allocation %d of %d bytes", off, off+n, h.e.id, h.e.size)
	}
	return nil
}

// WriteAt copies p into the object at off, after checking the bounds.
func (h *Handle) WriteAt(p []byte, off uint64) error {
	if !h.write {
		return errState("allocation %d is open for reading", h.e.id)
	}
	if err := h.bounds(off, uint64(len(p))); err != nil {
		return err
	}
	if len(p) == 0 {
		return nil
	}
	return h.s.store.writeAt(p, h.e.offset+off)
}

// ReadAt fills p from the object at off.
func (h *Handle) ReadAt(p []byte, off uint64) error {
	if err := h.bounds(off, uint64(len(p))); err != nil {
		return err
	}
	if len(p) == 0 {
		return nil
	}
	return h.s.store.readAt(p, h.e.offset+off)
}

// Bytes returns the object's bytes [off, off+n) in place for a memory
// segment (valid until Close; read-only for read handles), or nil for a disk
// segment.
func (h *Handle) Bytes(off, n uint64) ([]byte, error) {
	if err := h.bounds(off, n); err != nil {
		return nil, err
	}
	return h.s.store.slice(h.e.offset+off, n), nil
}

// MapOffset is where the object's byte off lies in the segment's mapping
// (what SharedFD maps), after checking that [off, off+n) lies inside the
// object.
func (h *Handle) MapOffset(off, n uint64) (uint64, error) {
	if err := h.bounds(off, n); err != nil {
		return 0, err
	}
	return h.e.offset + off, nil
}

// WritableBytes returns the object's bytes [off, off+n) in place for a
// write handle of a memory segment, so a caller can receive straight into
// the mapping (valid until Close), or nil for a disk segment (use WriteAt).
func (h *Handle) WritableBytes(off, n uint64) ([]byte, error) {
	if !h.write {
		return nil, errState("allocation %d is open for reading", h.e.id)
	}
	return h.Bytes(off, n)
}

// Close ends the read or write; it is idempotent.
func (h *Handle) Close() {
	h.once.Do(func() {
		s := h.s
		s.mu.Lock()
		defer s.mu.Unlock()
		if h.write {
			h.e.writers--
		} else {
			h.e.readers--
		}
		s.freeIfIdleLocked(h.e)
		s.refs--
		if s.closed && s.refs == 0 {
			_ = s.store.close()
		}
	})
}

// Segment is the segment of the allocation.
func (h *Handle) Segment() *Segment { return h.s }

// Epoch is the master epoch of the Reserve that made the allocation (0
// when not known).
func (h *Handle) Epoch() uint64 { return h.e.epoch }

// Object is the tenant and key the allocation was reserved for (fixed at
// Reserve).
func (h *Handle) Object() (tenant, key string) { return h.e.tenant, h.e.key }
