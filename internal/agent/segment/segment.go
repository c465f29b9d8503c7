// Package segment holds an agent's segments: ranges of real memory (anonymous
// mmap) or of a preallocated disk file, each with its offset allocator and
// its allocation table. The table is the agent's authoritative record of
// which bytes exist: allocation id → (tenant, key, replica id, size, state
// RESERVED|SEALED, checksum, group, pins, times). Reserve, Release and Seal
// from the master apply to it; the data plane reads and writes through
// Handles that keep an allocation's extent alive while bytes move, so a
// concurrent Release never frees memory that is being copied.
//
// A disk segment also journals its SEALED allocations next to the data file,
// so an agent restarted on the same directory mounts the same segment id with
// its sealed objects intact. RESERVED allocations are never persisted: they
// are gone after a restart, and the master's Reconcile and put timeouts deal
// with the replicas that pointed at them. Before a reopened disk segment is
// registered, VerifySealed checks every sealed object's bytes against its
// checksum and drops the ones that went bad while the agent was down, so
// they are reported lost rather than served.
package segment

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/alloc"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// backing is where a segment's bytes live.
type backing interface {
	readAt(p []byte, off uint64) error
	writeAt(p []byte, off uint64) error
	// slice returns the bytes [off, off+n) in place, or nil when the
	// backing is not addressable memory.
	slice(off, n uint64) []byte
	// hash returns the object checksum (internal/checksum) of [off, off+n).
	hash(off, n uint64) (uint64, error)
	// sync makes written bytes durable (a no-op for memory).
	sync() error
	close() error
}

// entry is one row of the allocation table.
type entry struct {
	id       uint64
	offset   uint64
	size     uint64       // object bytes
	ext      alloc.Extent // allocated bytes (size rounded up to the alignment)
	state    masterv1.AllocationState
	tenant   string
	key      string
	replica  uint32
	checksum uint64
	group    string
	hardPin  bool
	// blank is set while the allocation is a blank reservation (reserved
	// ahead of any put, ReserveItem.blank) that no write has bound to an
	// object yet: tenant, key, replica, group and pins are empty, and the
	// first write open records them from its token (OpenWriteAs). A blank
	// is RESERVED, so it is never journaled nor fed; the table a
	// registration sends lists it flagged (Allocation.blank).
	// (Next to hardPin: the padding before softPin holds it.)
	blank   bool
	softPin int64 // unix ms
	created int64 // unix ms
	sealed  int64 // unix ms
	// epoch is the master epoch of the Reserve that made the allocation
	// (0 when not known); a seal receipt names it. Runtime only: a
	// restarted agent holds no RESERVED allocation to seal on write.
	epoch uint64

	// Runtime only, guarded by Segment.mu.
	writers int // open write handles
	// writeOpens counts the write opens ever (Handle.gen).
	writeOpens uint64
	readers    int  // open read handles
	sealing    bool // a Seal is hashing the bytes; no writes
	released   bool // removed from the table; extent freed when refs reach 0
}

func (e *entry) proto(segID string) *masterv1.Allocation {
	a := &masterv1.Allocation{}
	e.fill(a, segID)
	return a
}

// fill sets a's fields (a is new).
func (e *entry) fill(a *masterv1.Allocation, segID string) {
	a.SegmentId, a.AllocationId, a.Offset, a.Size, a.State = segID, e.id, e.offset, e.size, e.state
	a.Tenant, a.Key, a.ReplicaId, a.Checksum, a.GroupId = e.tenant, e.key, e.replica, e.checksum, e.group
	a.HardPin, a.SoftPinUntilUnixMs, a.CreatedUnixMs, a.SealedUnixMs = e.hardPin, e.softPin, e.created, e.sealed
	a.Blank = e.blank
}

// Segment is one mounted segment.
type Segment struct {
	id     string
	name   string
	medium masterv1.Medium
	store  backing
	jrn    *journal // disk segments only

	// mu guards every field below. Lock order: Segment.mu → journal.mu.
	// No blocking I/O under mu except journal appends (page-cache writes)
	// and the rare journal compaction.
	mu     sync.Mutex
	alloc  *alloc.Allocator
	table  table
	nextID uint64
	refs   int // open handles of any allocation, released ones included
	closed bool
	// corrupt holds the ids dropped because their bytes did not match
	// their sealed checksum or could not be read (VerifySealed at a
	// reopen, lose while serving): opening one answers DATA_LOSS
	// CHECKSUM_MISMATCH instead of ALLOCATION_NOT_FOUND. Bounded by the
	// allocations ever sealed; ids are never reused.
	corrupt map[uint64]struct{}
	// lostSink hears of allocations dropped while serving (SetLostSink).
	lostSink func(LostAllocation)
	// sealedN counts the table's SEALED entries (the others are RESERVED),
	// so that Stats does not walk the table.
	sealedN int
	// resQ holds the ids of RESERVED allocations in the order they were
	// reserved, for ExpireReserved to look at the oldest only, never at the
	// whole table (which holds millions of sealed ones at scale, and a walk
	// of it under mu stalled every write and read for a tenth of a second
	// each sweep). Lazy: an id whose allocation was sealed or released
	// since stays until a sweep reaches it. A blank bound by a write is
	// queued again with its new creation time (OpenWriteAs); its earlier
	// place, whose time is no longer the entry's, is skipped.
	resQ []queued
	// feed records this segment's seals and releases of sealed
	// allocations (SetFeed); nil records nothing.
	feed *Feed
}

// queued is one place in Segment.resQ: an allocation and its creation time
// when it was queued.
type queued struct {
	id uint64
	at int64 // unix ms
}

func newSegment(id, name string, medium masterv1.Medium, store backing, a *alloc.Allocator) *Segment {
	return &Segment{id: id, name: name, medium: medium, store: store, alloc: a, table: newTable(), nextID: 1}
}

// ID is the segment's UUID.
func (s *Segment) ID() string { return s.id }

// Name is a human-readable name ("mem-0", or the disk directory).
func (s *Segment) Name() string { return s.name }

// Medium is memory or disk.
func (s *Segment) Medium() masterv1.Medium { return s.medium }

// SetFeed makes the segment record its changes in f (nil stops it): each
// allocation sealed and each sealed allocation released from now on.
func (s *Segment) SetFeed(f *Feed) {
	s.mu.Lock()
	s.feed = f
	s.mu.Unlock()
}

// SetLogger makes a disk segment log the failures of its journal (a full
// filesystem, an I/O error) and its recovery from them, a line each.
func (s *Segment) SetLogger(lg *slog.Logger) {
	if s.jrn == nil {
		return
	}
	s.jrn.mu.Lock()
	s.jrn.lg = lg
	s.jrn.mu.Unlock()
}

// JournalStats returns a disk segment's journal write and sync failures so
// far and whether it is failing now; ok is false for a memory segment.
func (s *Segment) JournalStats() (failures uint64, failing, ok bool) {
	if s.jrn == nil {
		return 0, false, false
	}
	failures, failing = s.jrn.stats()
	return failures, failing, true
}

// Info describes the segment with its current usage.
func (s *Segment) Info() *masterv1.SegmentInfo {
	s.mu.Lock()
	st := s.alloc.Stats()
	s.mu.Unlock()
	return &masterv1.SegmentInfo{
		SegmentId: s.id, Medium: s.medium, Capacity: st.Capacity, Used: st.Used,
		LargestFreeExtent: st.LargestFree, Alignment: st.Alignment, Name: s.name,
	}
}

// Stats returns the allocator accounting and the number of allocations per
// state.
func (s *Segment) Stats() (alloc.Stats, int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.alloc.Stats(), s.table.len() - s.sealedN, s.sealedN
}

// Table returns a copy of the allocation table, for tests and diagnostics
// (a registration reads it through View).
func (s *Segment) Table() []*masterv1.Allocation {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := make([]masterv1.Allocation, s.table.len())
	out := make([]*masterv1.Allocation, len(all))
	i := 0
	for e := range s.table.all() {
		e.fill(&all[i], s.id)
		out[i] = &all[i]
		i++
	}
	return out[:i]
}

// TableView is a segment's allocation table as of one moment, in id
// order, read out in parts (Fill) while the segment goes on. A
// registration sends millions of allocations: a copy of the whole table as
// Allocations (about 200 bytes each, fresh heap, made under the segment's
// lock) cost the agent more than sending it, on a VM where fresh pages are
// slow; the view holds a pointer per entry, and the Allocations of one
// chunk at a time are filled in under the lock and reused.
//
// An entry keeps what the view shows: one released since is still shown
// (as it last was), one sealed since is shown sealed. Either is what a
// table taken a moment later would show; the view's length never changes.
// A blank reservation no write has bound yet is shown with Allocation.blank
// and no object: the master keeps the put it handed the blank to (its
// write may bind it after this view was taken). One bound since is shown
// bound.
type TableView struct {
	seg     *Segment
	entries []*entry
}

// View returns the table's view.
func (s *Segment) View() *TableView {
	s.mu.Lock()
	entries := make([]*entry, 0, s.table.len())
	for e := range s.table.all() {
		entries = append(entries, e)
	}
	s.mu.Unlock()
	byID := func(a, b *entry) int { return cmp.Compare(a.id, b.id) }
	if !slices.IsSortedFunc(entries, byID) {
		slices.SortFunc(entries, byID) // the old ids come first, from a map
	}
	return &TableView{seg: s, entries: entries}
}

// SegmentID is the segment's id.
func (v *TableView) SegmentID() string { return v.seg.id }

// Len is the number of allocations.
func (v *TableView) Len() int { return len(v.entries) }

// Fill sets each dst[i], cleared first, to allocation from+i (segment id
// left empty: a RegisterChunk names it once).
func (v *TableView) Fill(dst []*masterv1.Allocation, from int) {
	v.seg.mu.Lock()
	defer v.seg.mu.Unlock()
	for i, e := range v.entries[from : from+len(dst)] {
		dst[i].Reset()
		e.fill(dst[i], "")
	}
}

// Lookup returns one allocation.
func (s *Segment) Lookup(id uint64) (*masterv1.Allocation, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.table.get(id)
	if !ok {
		return nil, false
	}
	return e.proto(s.id), true
}

// Errors of this package carry their wire code and reason.
func errNotFound(seg string, id uint64) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND, "no allocation %d in segment %s", id, seg)
}

func errState(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE, format, args...)
}

// errBlank refuses to seal a blank reservation: its bytes, if any, belong
// to no object.
func errBlank(id uint64) error {
	return errState("allocation %d is a blank reservation no write has bound to an object", id)
}

var errClosed = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "segment is closed")

// Reserve allocates space for one replica and records it RESERVED.
func (s *Segment) Reserve(it *masterv1.ReserveItem, now time.Time) (*masterv1.Allocation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, err := s.reserveLocked(it, now.UnixMilli(), 0)
	if err != nil {
		return nil, err
	}
	return e.proto(s.id), nil
}

// reserveLocked is Reserve under master epoch epoch; it returns the new
// table entry.
func (s *Segment) reserveLocked(it *masterv1.ReserveItem, nowMs int64, epoch uint64) (*entry, error) {
	if s.closed {
		return nil, errClosed
	}
	if err := s.journalReadyLocked(nowMs); err != nil {
		return nil, err
	}
	// An empty object still gets one aligned unit so it has an identity.
	ext, err := s.alloc.Allocate(max(it.GetSize(), 1))
	if err != nil {
		if errors.Is(err, alloc.ErrNoSpace) {
			st := s.alloc.Stats()
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE,
				"segment %s cannot hold %d bytes (free %d, largest free extent %d)", s.id, it.GetSize(), st.Free, st.LargestFree)
		}
		return nil, rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, err, "reserve %d bytes", it.GetSize())
	}
	if err := s.takeIDLocked(nowMs); err != nil {
		_ = s.alloc.Free(ext)
		return nil, err
	}
	e := &entry{
		id: s.nextID, offset: ext.Offset, size: it.GetSize(), ext: ext,
		state: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, created: nowMs, epoch: epoch,
	}
	if it.GetBlank() {
		// The object is the write token's, recorded when a write opens;
		// whatever identity the item carries besides is not the put's.
		e.blank = true
	} else {
		e.tenant, e.key, e.replica, e.group = it.GetTenant(), it.GetKey(), it.GetReplicaId(), it.GetGroupId()
		e.hardPin, e.softPin = it.GetHardPin(), it.GetSoftPinUntilUnixMs()
	}
	s.nextID++
	s.table.put(e)
	s.resQ = append(s.resQ, queued{e.id, nowMs})
	return e, nil
}

// takeIDLocked makes sure s.nextID may be handed out: disk segments journal
// a high-water mark ahead of use so ids are never reused across restarts
// (a master may still name a RESERVED allocation that a restart dropped).
func (s *Segment) takeIDLocked(nowMs int64) error {
	if s.jrn == nil {
		return nil
	}
	return s.jrn.ensureID(s.nextID, nowMs)
}

// journalReleaseLocked journals the release of sealed allocation id of a
// disk segment, once the journal is ready for it.
func (s *Segment) journalReleaseLocked(id uint64) error {
	nowMs := time.Now().UnixMilli()
	if err := s.journalReadyLocked(nowMs); err != nil {
		return err
	}
	return s.jrn.appendRelease(id, nowMs)
}

// journalReadyLocked answers whether a disk segment's journal may be
// written: at once when its last write went through; after a failure
// (a full filesystem, an I/O error), SEGMENT_UNAVAILABLE until the
// failure's retry time (journalRetry), and then once the journal has been
// tried again and taken a write (a torn one rewritten from the table).
// Reserve asks first, so a segment that cannot seal takes no puts: the
// master places them elsewhere rather than send bytes the seal would
// refuse. Memory segments are always ready.
func (s *Segment) journalReadyLocked(nowMs int64) error {
	if s.jrn == nil {
		return nil
	}
	return s.jrn.probe(s.sealedLocked, s.nextID, nowMs)
}

// Release frees an allocation. Unknown ids are a no-op. Bytes being read or
// written through open handles stay valid until those handles close.
func (s *Segment) Release(id uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errClosed
	}
	e, ok := s.table.get(id)
	if !ok {
		return nil
	}
	if s.jrn != nil && e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		// Journal the release before the extent can be reused, so a later
		// seal of the same extent always follows it in the journal.
		if err := s.journalReleaseLocked(id); err != nil {
			return fmt.Errorf("journal release of %d: %w", id, err)
		}
	}
	s.table.del(id)
	if e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		s.sealedN--
	}
	e.released = true
	if s.feed != nil && e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		s.feed.released(s, e)
	}
	s.freeIfIdleLocked(e)
	return nil
}

func (s *Segment) freeIfIdleLocked(e *entry) {
	if e.released && e.readers == 0 && e.writers == 0 && !e.sealing {
		// The allocator is the authority; a failure here is a bug.
		_ = s.alloc.Free(e.ext)
	}
}

// SealArg is one allocation to seal.
type SealArg struct {
	ID       uint64
	Checksum uint64
	// SoftPinUntilMs, when non-zero, replaces the soft pin expiry.
	SoftPinUntilMs int64
}

// Seal verifies each allocation's bytes against its checksum and marks the
// matching ones SEALED; for a disk segment it makes the bytes and the table
// durable (one fsync of each for the whole batch) before it returns. A
// mismatch answers DATA_LOSS CHECKSUM_MISMATCH and leaves the allocation
// RESERVED. Sealing an allocation already sealed with the same checksum is OK
// (the master may retry). Results are in args order.
func (s *Segment) Seal(args []SealArg, now time.Time) []error {
	errs := make([]error, len(args))
	type job struct {
		i int
		e *entry
	}
	jobs := make([]job, 0, len(args))
	s.mu.Lock()
	for i, a := range args {
		e, ok := s.table.get(a.ID)
		switch {
		case s.closed:
			errs[i] = errClosed
		case !ok:
			errs[i] = errNotFound(s.id, a.ID)
		case e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED:
			if e.checksum != a.Checksum {
				errs[i] = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH,
					"allocation %d is sealed with checksum %#x, not %#x", a.ID, e.checksum, a.Checksum)
			}
		case e.blank:
			errs[i] = errBlank(a.ID)
		case e.sealing:
			errs[i] = errState("allocation %d is being sealed", a.ID)
		case e.writers > 0:
			errs[i] = errState("allocation %d has a write in progress", a.ID)
		default:
			e.sealing = true
			jobs = append(jobs, job{i, e})
		}
	}
	s.mu.Unlock()
	if len(jobs) == 0 {
		return errs
	}

	// Hash outside the lock: writes are refused while sealing is set.
	ok := make([]bool, len(jobs))
	anyOK := false
	for k, j := range jobs {
		sum, err := s.store.hash(j.e.offset, j.e.size)
		switch {
		case err != nil:
			errs[j.i] = rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "hash allocation %d", j.e.id)
		case sum != args[j.i].Checksum:
			errs[j.i] = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH,
				"allocation %d holds bytes with checksum %#x, want %#x", j.e.id, sum, args[j.i].Checksum)
		default:
			ok[k], anyOK = true, true
		}
	}
	var durErr error
	if anyOK && s.jrn != nil {
		durErr = s.store.sync()
	}

	s.mu.Lock()
	var jrnErr error
	appended := false // a seal record went into the journal
	if anyOK && durErr == nil {
		jrnErr = s.journalReadyLocked(now.UnixMilli())
	}
	for k, j := range jobs {
		e := j.e
		e.sealing = false
		if ok[k] && durErr == nil && jrnErr != nil {
			errs[j.i] = fmt.Errorf("journal seal of %d: %w", e.id, jrnErr)
			s.freeIfIdleLocked(e)
			continue
		}
		if !ok[k] || durErr != nil {
			if ok[k] {
				errs[j.i] = rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, durErr, "sync segment data")
			}
			s.freeIfIdleLocked(e)
			continue
		}
		if e.released {
			// Released while hashing: the master no longer wants it.
			errs[j.i] = errNotFound(s.id, e.id)
			s.freeIfIdleLocked(e)
			continue
		}
		e.state = masterv1.AllocationState_ALLOCATION_STATE_SEALED
		s.sealedN++
		e.checksum = args[j.i].Checksum
		e.sealed = now.UnixMilli()
		if p := args[j.i].SoftPinUntilMs; p != 0 {
			e.softPin = p
		}
		if s.jrn != nil {
			if err := s.jrn.appendSeal(e, now.UnixMilli()); err == nil {
				appended = true
			} else {
				e.state = masterv1.AllocationState_ALLOCATION_STATE_RESERVED
				s.sealedN--
				s.resQ = append(s.resQ, queued{e.id, e.created}) // out of order: expires no sooner
				e.checksum, e.sealed = 0, 0
				errs[j.i] = fmt.Errorf("journal seal of %d: %w", e.id, err)
			}
		}
	}
	if s.feed != nil {
		// While mu still holds the seals in the table (Feed's invariant).
		for k, j := range jobs {
			if ok[k] && errs[j.i] == nil {
				s.feed.sealed(s, j.e)
			}
		}
	}
	s.mu.Unlock()
	if appended {
		if err := s.jrn.sync(now.UnixMilli()); err != nil {
			for k, j := range jobs {
				if ok[k] && errs[j.i] == nil {
					errs[j.i] = fmt.Errorf("sync journal: %w", err)
				}
			}
		}
		s.maybeCompact(now.UnixMilli())
	}
	return errs
}

// ErrSealLater is SealReceived's answer when it cannot seal from the
// checksum computed on receipt: the caller seals with Seal (which hashes
// the allocation) once its handle is closed.
var ErrSealLater = errors.New("segment: seal with Seal")

// SealReceived seals the allocation h writes, whose whole object h has
// just written, with sum, the checksum of the bytes computed as they were
// received, instead of hashing the allocation again as Seal does. It does
// so only when those bytes are certainly the allocation's: a memory
// segment, h the only write handle open now and since h opened, nobody
// else open when it did, and the allocation still RESERVED and not being
// sealed; otherwise it answers ErrSealLater. A sum other than checksum
// answers DATA_LOSS CHECKSUM_MISMATCH and leaves the allocation RESERVED.
// The seal is recorded as Seal's (state, checksum, time, the feed); h
// stays open for the caller to close.
func (h *Handle) SealReceived(checksum, sum uint64, now time.Time) error {
	s, e := h.s, h.e
	if !h.write {
		return ErrSealLater
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case e.blank:
		// Not reachable through the write opens, which all bind a blank;
		// refused here too so no path seals bytes of no object.
		return errBlank(e.id)
	case s.closed, s.jrn != nil, e.released, e.sealing,
		e.state != masterv1.AllocationState_ALLOCATION_STATE_RESERVED,
		!h.alone, e.writers != 1, e.writeOpens != h.gen:
		return ErrSealLater
	case sum != checksum:
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH,
			"allocation %d holds bytes with checksum %#x, want %#x", e.id, sum, checksum)
	}
	e.state = masterv1.AllocationState_ALLOCATION_STATE_SEALED
	s.sealedN++
	e.checksum = checksum
	e.sealed = now.UnixMilli()
	if s.feed != nil {
		s.feed.sealed(s, e)
	}
	return nil
}

// SyncJournal makes journaled releases durable (seals sync themselves).
func (s *Segment) SyncJournal() error {
	if s.jrn == nil {
		return nil
	}
	return s.jrn.sync(time.Now().UnixMilli())
}

func (s *Segment) maybeCompact(nowMs int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || !s.jrn.needsCompaction(s.table.len()) {
		return
	}
	// Best effort: a failed compaction leaves the old journal in place.
	_ = s.jrn.compact(s.sealedLocked(), s.nextID, nowMs)
}

func (s *Segment) sealedLocked() []*entry {
	out := make([]*entry, 0, s.table.len())
	for e := range s.table.all() {
		if e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			out = append(out, e)
		}
	}
	return out
}

// ExpireReserved releases RESERVED allocations created before cutoff that
// nobody is writing or sealing, and returns their ids.
func (s *Segment) ExpireReserved(cutoff time.Time) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []uint64
	var busy []queued
	limit := cutoff.UnixMilli()
	i := 0
	for ; i < len(s.resQ); i++ {
		q := s.resQ[i]
		e, ok := s.table.get(q.id)
		if !ok || e.state != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
			continue // sealed or released since (or listed twice)
		}
		if e.created != q.at {
			// A blank bound since: queued again, further on, with the
			// time of its binding. Stopping here would hold back the
			// older reservations queued after this place.
			continue
		}
		if e.created >= limit {
			break // the rest are younger
		}
		if e.sealing || e.writers > 0 {
			busy = append(busy, q) // looked at again next sweep
			continue
		}
		s.table.del(e.id)
		e.released = true
		s.freeIfIdleLocked(e)
		out = append(out, e.id)
	}
	if i > 0 || len(busy) > 0 {
		s.resQ = append(busy, s.resQ[i:]...) // a fresh array: the old one's head is garbage
	}
	return out
}

// Close unmounts the segment: new operations fail; the backing is unmapped
// or closed once the last open handle closes. It is idempotent.
func (s *Segment) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var err error
	if s.jrn != nil {
		err = s.jrn.close()
	}
	if s.refs == 0 {
		err = errors.Join(err, s.store.close())
	}
	if err != nil {
		return fmt.Errorf("close segment %s: %w", s.id, err)
	}
	return nil
}
