package segment

import (
	"errors"
	"io"
	"sync"
	"syscall"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

// A disk segment checks the bytes it serves. Every reader of a whole
// object — the transfer listener, DataService.Read and BatchRead, a copy
// to another agent — reads a disk allocation through Handle.ReadAt in
// order from byte 0 to the end; the handle hashes the bytes as they pass
// and compares the sum with the sealed checksum at the end. A mismatch, or
// a read that fails with EIO, drops the allocation at once (lose): its
// release is journaled, later reads answer CHECKSUM_MISMATCH, and the
// segment's lost sink (SetLostSink) hears of it so the master removes the
// replica and the event stream announces it gone. Without this a disk
// gone bad under a running agent served bytes every client refused, for
// as long as the agent ran, while the master and the schedulers went on
// counting the replica readable.
//
// The bytes that failed were already on their way to the client, which
// checks the checksum itself and tries another replica: the agent cannot
// take back a length it promised. Memory segments are not checked (their
// bytes go out from the mapping, never through a read; a client still
// refuses bad ones). Partial reads are not checked. A client whose read
// failed its checksum where the agent could not tell (a memory segment, an
// object read in several requests) asks the agent to check the allocation
// itself (Handle.Verify, TRANSFER_OP_VERIFY).

// LostAllocation is a SEALED allocation a segment dropped while serving it.
type LostAllocation struct {
	// Medium is the segment's.
	Medium masterv1.Medium
	// Allocation is the dropped allocation as the table held it (segment
	// id, allocation id, tenant, key, replica id, offset, size, checksum).
	Allocation *masterv1.Allocation
	// Got is what the bytes hashed to; 0 when Err is set.
	Got uint64
	// Err is the read error (EIO) that made the bytes unreadable, or nil
	// for a checksum mismatch.
	Err error
	// JournalErr is set when the release could not be journaled (or
	// synced): the allocation is gone from this process, but a restart
	// without --verify-disk brings it back until a read finds it again.
	JournalErr error
}

// Reason is the loss in a few words, for logs and the master.
func (l LostAllocation) Reason() string {
	if l.Err != nil {
		return "read: " + l.Err.Error()
	}
	return "checksum mismatch"
}

// SetLostSink makes the segment call sink with every allocation it drops
// while serving (nil stops it). sink is called without any segment lock
// held, from the reader's goroutine: it must not block for long.
func (s *Segment) SetLostSink(sink func(LostAllocation)) {
	s.mu.Lock()
	s.lostSink = sink
	s.mu.Unlock()
}

// SetLostSink sets sink on every segment (Segment.SetLostSink).
func (s *Set) SetLostSink(sink func(LostAllocation)) {
	for _, sg := range s.segs {
		sg.SetLostSink(sink)
	}
}

// digests are the Digests of read handles checking disk bytes.
var digests = sync.Pool{New: func() any { return checksum.New() }}

// checkRead follows a disk read handle's successful read of p at off: bytes
// read in order from 0 are hashed, and the last of them compared with the
// sealed checksum. A read out of order ends the check (a Copy reads the
// pieces of one handle from several goroutines at once).
func (h *Handle) checkRead(p []byte, off uint64) {
	h.cmu.Lock()
	if h.unchecked || off != h.checked {
		h.stopCheckLocked()
		h.cmu.Unlock()
		return
	}
	if h.sum == nil {
		h.sum = digests.Get().(*checksum.Digest)
		h.sum.Reset()
	}
	_, _ = h.sum.Write(p)
	h.checked += uint64(len(p))
	if h.checked < h.e.size {
		h.cmu.Unlock()
		return
	}
	got := h.sum.Sum64()
	h.stopCheckLocked()
	h.cmu.Unlock()
	if got != h.e.checksum {
		h.s.lose(h.e, got, nil)
	}
}

// readFailed follows a disk read handle's failed read: EIO drops the
// allocation.
func (h *Handle) readFailed(err error) {
	h.stopCheck()
	if errors.Is(err, syscall.EIO) {
		h.s.lose(h.e, 0, err)
	}
}

// stopCheck ends the handle's check and returns its Digest.
func (h *Handle) stopCheck() {
	h.cmu.Lock()
	h.stopCheckLocked()
	h.cmu.Unlock()
}

func (h *Handle) stopCheckLocked() {
	h.unchecked = true
	if h.sum != nil {
		digests.Put(h.sum)
		h.sum = nil
	}
}

// lose drops sealed entry e, found bad while serving it, and tells the
// lost sink. An entry no longer in the table (released meanwhile, or
// dropped by another reader first) is left alone.
func (s *Segment) lose(e *entry, got uint64, cause error) {
	s.mu.Lock()
	if cur, ok := s.table.get(e.id); s.closed || !ok || cur != e || e.state != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		s.mu.Unlock()
		return
	}
	a := e.proto(s.id)
	jerr := s.dropLocked(e, true)
	sink := s.lostSink
	s.mu.Unlock()
	if jerr == nil && s.jrn != nil {
		jerr = s.jrn.sync(time.Now().UnixMilli())
	}
	if sink != nil {
		sink(LostAllocation{Medium: s.medium, Allocation: a, Got: got, Err: cause, JournalErr: jerr})
	}
}

// dropLocked removes sealed entry e, found corrupt, from the table: its
// release is journaled first when journal is set (the error is returned;
// e is dropped all the same, since these bytes are never served again by
// this process), the feed records the release, the extent is freed once
// no handle holds it, and reads of its id answer CHECKSUM_MISMATCH.
func (s *Segment) dropLocked(e *entry, journal bool) error {
	var jerr error
	if s.jrn != nil && journal {
		jerr = s.journalReleaseLocked(e.id)
	}
	s.table.del(e.id)
	s.sealedN--
	e.released = true
	if s.feed != nil {
		s.feed.released(s, e)
	}
	s.freeIfIdleLocked(e)
	if s.corrupt == nil {
		s.corrupt = make(map[uint64]struct{})
	}
	s.corrupt[e.id] = struct{}{}
	return jerr
}

// Verify reads the allocation's bytes again, whole, and compares them with
// the sealed checksum (a read handle; TRANSFER_OP_VERIFY). nil: they
// match. DATA_LOSS CHECKSUM_MISMATCH: they do not, or a read failed with
// EIO or found the data file cut short; the allocation is dropped (lose),
// as a read that found them bad would. Any other read error is returned as
// it is, and nothing is dropped.
func (h *Handle) Verify() error {
	if h.write {
		return errState("allocation %d is open for writing", h.e.id)
	}
	sum, err := h.s.store.hash(h.e.offset, h.e.size)
	switch {
	case err != nil && !errors.Is(err, syscall.EIO) && !errors.Is(err, io.EOF):
		return err
	case err != nil:
		h.s.lose(h.e, 0, err)
	case sum != h.e.checksum:
		h.s.lose(h.e, sum, nil)
	default:
		return nil
	}
	return errCorruptAllocation(h.s.id, h.e.id)
}
