package segment

import (
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
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
	// A disk read handle's check of the bytes it reads (lost.go): sum
	// hashes them while they come in order from byte 0 (checked bytes so
	// far); unchecked once they did not, or the check ended. cmu guards
	// them: reads of one handle may run concurrently.
	cmu       sync.Mutex
	sum       *checksum.Digest
	checked   uint64
	unchecked bool
}

// Identity is the object and replica a write names (its token's claims):
// views the segment compares, and copies when it binds a blank
// reservation to them (OpenWriteAs).
type Identity struct {
	Tenant, Key, Group []byte
	ReplicaID          uint32
	HardPin            bool
}

// OpenWrite opens a RESERVED allocation for writing, without naming an
// object: a blank reservation is refused, since its bytes would belong to
// none. The data plane opens with OpenWriteAs.
func (s *Segment) OpenWrite(id uint64) (*Handle, error) {
	h := new(Handle)
	if err := s.open(h, id, true, nil, 0); err != nil {
		return nil, err
	}
	return h, nil
}

// OpenWriteAs opens a RESERVED allocation for writing into h, which must
// be a zero Handle (never opened, so a caller opening many allocations at
// once can allocate their Handles together), for the object who names.
//
// A blank reservation is bound to who here, under the segment's lock and
// so before any byte of the write lands: it takes who's tenant, key,
// replica id, group and hard pin, and its reservation grace starts again
// at now (ExpireReserved), since the put that owns it starts now. Any
// other allocation, a blank bound earlier included, is opened only when
// who's tenant and key are the ones it holds: INVALID_TOKEN otherwise.
func (s *Segment) OpenWriteAs(h *Handle, id uint64, who Identity, now time.Time) error {
	return s.open(h, id, true, &who, now.UnixMilli())
}

// OpenRead opens a SEALED allocation for reading.
func (s *Segment) OpenRead(id uint64) (*Handle, error) {
	h := new(Handle)
	if err := s.open(h, id, false, nil, 0); err != nil {
		return nil, err
	}
	return h, nil
}

// open opens allocation id into h. A write names its object in who (nil:
// none, which a blank refuses) at nowMs.
func (s *Segment) open(h *Handle, id uint64, write bool, who *Identity, nowMs int64) error {
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
		switch {
		case who == nil:
			if e.blank {
				return errState("allocation %d is a blank reservation: a write must name its object", id)
			}
		case e.blank:
			s.bindLocked(e, who, nowMs)
		case string(who.Tenant) != e.tenant || string(who.Key) != e.key:
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN,
				"token names object %q/%q; allocation %d holds another", who.Tenant, who.Key, id)
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

// bindLocked records who as blank entry e's object, at nowMs.
func (s *Segment) bindLocked(e *entry, who *Identity, nowMs int64) {
	e.tenant, e.key, e.group = string(who.Tenant), string(who.Key), string(who.Group)
	e.replica, e.hardPin, e.blank = who.ReplicaID, who.HardPin, false
	if nowMs > e.created {
		// Queued again: the old place in resQ no longer matches the
		// entry's time, and ExpireReserved skips it.
		e.created = nowMs
		s.resQ = append(s.resQ, queued{e.id, nowMs})
	}
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

// ReadAt fills p from the object at off. A read handle of a disk segment
// checks the bytes: read in order from byte 0 to the end, they must hash
// to the sealed checksum, and a read must not fail with EIO; otherwise the
// allocation is dropped (lost.go). The read itself still returns the
// bytes (or the error).
func (h *Handle) ReadAt(p []byte, off uint64) error {
	if err := h.bounds(off, uint64(len(p))); err != nil {
		return err
	}
	if len(p) == 0 {
		return nil
	}
	err := h.s.store.readAt(p, h.e.offset+off)
	switch {
	case h.write || h.s.medium != masterv1.Medium_MEDIUM_DISK:
	case err != nil:
		h.readFailed(err)
	default:
		h.checkRead(p, off)
	}
	return err
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
		h.stopCheck()
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

// Object is the tenant and key the allocation holds, fixed by the time h
// opened: at Reserve, or for a blank reservation by the write open that
// bound it (h's own at the latest).
func (h *Handle) Object() (tenant, key string) { return h.e.tenant, h.e.key }
