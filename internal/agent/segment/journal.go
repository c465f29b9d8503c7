package segment

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/google/uuid"
	"golang.org/x/sys/unix"
)

// The journal is an append-only file next to a disk segment's data. It holds
// a header naming the segment, then records, each framed as
//
//	payload_len u32 | crc32c(payload) u32 | payload
//
// and payload[0] is the record type:
//
//	recSeal    id u64 | offset u64 | size u64 | replica u32 | checksum u64 |
//	           flags u8 (bit 0: hard pin) | soft_pin_ms i64 | created_ms i64 |
//	           sealed_ms i64 | tenant, key, group (each uvarint length + bytes)
//	recRelease id u64
//	recIDLimit limit u64: ids below limit may have been handed out
//
// The header ends with flags u32 (zero in journals written before issue
// 18): bit 0 (flagXXH3) says the seal records' checksums are XXH3-64
// (internal/checksum). A journal without it holds xxhash64 checksums;
// OpenDisk rehashes its objects once and rewrites it with the flag.
//
// All integers are big-endian. Replay stops at the first record that is
// short or fails its CRC (a write torn by a crash); the file is truncated
// there. When dead records outnumber live ones the journal is rewritten to a
// temporary file, synced, and renamed over the old one.
//
// Since replay drops every record after a bad one, no record is ever
// appended after one that may be bad: a write that fails part way (a full
// filesystem) is cut off again before the next, and a journal that could
// not be cut off, or whose fdatasync failed, is rewritten whole from the
// table before anything more is appended to it. Otherwise the seals
// acknowledged after a moment of ENOSPC would be lost at the next restart.
const (
	journalMagic   = "CRSJRNL1"
	headerLen      = 8 + 16 + 8 + 8 + 4 + 4
	frameLen       = 8
	maxPayload     = 1 << 20
	idBlock        = 1 << 16
	compactSlack   = 4096
	recSeal        = 1
	recRelease     = 2
	recIDLimit     = 3
	journalName    = "segment.journal"
	dataName       = "segment.data"
	sealFixedBytes = 1 + 8 + 8 + 8 + 4 + 8 + 1 + 8 + 8 + 8

	// flagXXH3 marks a journal whose checksums are XXH3-64.
	flagXXH3 = 1 << 0
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// errCorrupt marks a journal that cannot be used at all (bad header).
var errCorrupt = errors.New("segment journal: corrupt")

type journalHeader struct {
	id        uuid.UUID
	capacity  uint64
	alignment uint64
	flags     uint32
}

func (h journalHeader) encode() []byte {
	b := make([]byte, 0, headerLen)
	b = append(b, journalMagic...)
	b = append(b, h.id[:]...)
	b = binary.BigEndian.AppendUint64(b, h.capacity)
	b = binary.BigEndian.AppendUint64(b, h.alignment)
	b = binary.BigEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
	return binary.BigEndian.AppendUint32(b, h.flags)
}

func decodeHeader(b []byte) (journalHeader, error) {
	if len(b) < headerLen || string(b[:8]) != journalMagic {
		return journalHeader{}, fmt.Errorf("%w: bad header", errCorrupt)
	}
	if crc32.Checksum(b[:40], castagnoli) != binary.BigEndian.Uint32(b[40:44]) {
		return journalHeader{}, fmt.Errorf("%w: header checksum", errCorrupt)
	}
	var h journalHeader
	copy(h.id[:], b[8:24])
	h.capacity = binary.BigEndian.Uint64(b[24:32])
	h.alignment = binary.BigEndian.Uint64(b[32:40])
	h.flags = binary.BigEndian.Uint32(b[44:48])
	if h.alignment == 0 || h.alignment&(h.alignment-1) != 0 || h.capacity < h.alignment {
		return journalHeader{}, fmt.Errorf("%w: capacity %d alignment %d", errCorrupt, h.capacity, h.alignment)
	}
	return h, nil
}

// record is one decoded journal record.
type record struct {
	typ   byte
	id    uint64 // seal, release; the limit for recIDLimit
	entry *entry // seal only
}

func frame(payload []byte) []byte {
	b := make([]byte, 0, frameLen+len(payload))
	b = binary.BigEndian.AppendUint32(b, uint32(len(payload)))
	b = binary.BigEndian.AppendUint32(b, crc32.Checksum(payload, castagnoli))
	return append(b, payload...)
}

func encodeSeal(e *entry) []byte {
	p := make([]byte, 0, sealFixedBytes+len(e.tenant)+len(e.key)+len(e.group)+15)
	p = append(p, recSeal)
	p = binary.BigEndian.AppendUint64(p, e.id)
	p = binary.BigEndian.AppendUint64(p, e.offset)
	p = binary.BigEndian.AppendUint64(p, e.size)
	p = binary.BigEndian.AppendUint32(p, e.replica)
	p = binary.BigEndian.AppendUint64(p, e.checksum)
	var flags byte
	if e.hardPin {
		flags |= 1
	}
	p = append(p, flags)
	p = binary.BigEndian.AppendUint64(p, uint64(e.softPin))
	p = binary.BigEndian.AppendUint64(p, uint64(e.created))
	p = binary.BigEndian.AppendUint64(p, uint64(e.sealed))
	for _, s := range []string{e.tenant, e.key, e.group} {
		p = binary.AppendUvarint(p, uint64(len(s)))
		p = append(p, s...)
	}
	return frame(p)
}

func encodeU64(typ byte, v uint64) []byte {
	p := binary.BigEndian.AppendUint64([]byte{typ}, v)
	return frame(p)
}

// decodeRecords decodes the records in b (the journal after its header). It
// returns the records of the longest valid prefix and that prefix's length;
// bytes after it are a torn or corrupt tail.
func decodeRecords(b []byte) ([]record, int) {
	var out []record
	pos := 0
	for {
		rest := b[pos:]
		if len(rest) < frameLen {
			return out, pos
		}
		n := binary.BigEndian.Uint32(rest[:4])
		if n == 0 || n > maxPayload || uint64(len(rest)-frameLen) < uint64(n) {
			return out, pos
		}
		payload := rest[frameLen : frameLen+int(n)]
		if crc32.Checksum(payload, castagnoli) != binary.BigEndian.Uint32(rest[4:8]) {
			return out, pos
		}
		r, ok := decodePayload(payload)
		if !ok {
			return out, pos
		}
		out = append(out, r)
		pos += frameLen + int(n)
	}
}

func decodePayload(p []byte) (record, bool) {
	switch p[0] {
	case recRelease, recIDLimit:
		if len(p) != 9 {
			return record{}, false
		}
		return record{typ: p[0], id: binary.BigEndian.Uint64(p[1:])}, true
	case recSeal:
		if len(p) < sealFixedBytes || p[37]&^1 != 0 {
			return record{}, false
		}
		be := binary.BigEndian
		e := &entry{
			id:       be.Uint64(p[1:]),
			offset:   be.Uint64(p[9:]),
			size:     be.Uint64(p[17:]),
			replica:  be.Uint32(p[25:]),
			checksum: be.Uint64(p[29:]),
			hardPin:  p[37]&1 != 0,
			softPin:  int64(be.Uint64(p[38:])),
			created:  int64(be.Uint64(p[46:])),
			sealed:   int64(be.Uint64(p[54:])),
			state:    masterv1.AllocationState_ALLOCATION_STATE_SEALED,
		}
		rest := p[sealFixedBytes:]
		var strs [3]string
		for i := range strs {
			l, n := binary.Uvarint(rest)
			// Lengths are canonical uvarints, so a record has one encoding.
			if n <= 0 || n != uvarintLen(l) || l > uint64(len(rest)-n) {
				return record{}, false
			}
			strs[i] = string(rest[n : n+int(l)])
			rest = rest[n+int(l):]
		}
		if len(rest) != 0 {
			return record{}, false
		}
		e.tenant, e.key, e.group = strs[0], strs[1], strs[2]
		return record{typ: recSeal, id: e.id, entry: e}, true
	}
	return record{}, false
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// replay folds records into the live sealed table and the id high-water mark.
func replay(recs []record) (map[uint64]*entry, uint64) {
	live := map[uint64]*entry{}
	var limit uint64
	for _, r := range recs {
		switch r.typ {
		case recSeal:
			live[r.id] = r.entry
			limit = max(limit, r.id+1)
		case recRelease:
			delete(live, r.id)
		case recIDLimit:
			limit = max(limit, r.id)
		}
	}
	return live, limit
}

type journal struct {
	dir  string
	hdr  journalHeader
	path string

	// mu guards every field below. Taken under Segment.mu.
	mu      sync.Mutex
	f       journalFile
	size    int64 // bytes of whole records (and the header) in f
	records int
	idLimit uint64
	// slack is how many dead records are tolerated beyond the live ones.
	slack int

	// err is the last write or sync failure (ENOSPC, EIO), nil again once
	// a write and its sync go through. While it is set, Reserve refuses
	// for journalRetry after each failed attempt, so the master places
	// puts on another segment instead of sending bytes that cannot be
	// sealed (Segment.journalReadyLocked).
	err error
	// torn says f may hold a partial record, or pages the kernel failed
	// to write back: replay stops at the first bad record and drops every
	// one after it, so nothing may be appended until the journal has been
	// rewritten from the table (compact). A failed write whose partial
	// record could be cut off again (truncate) does not tear it.
	torn bool
	// retryAt is when, failing, the next attempt may be made (unix ms).
	retryAt int64
	// need is the size of the largest write that failed since the last
	// recovery: a probe writes as much (and cuts it off again), since a
	// full filesystem may still take a smaller write in a block the file
	// already holds, which would prove nothing.
	need int
	// failures counts write and sync failures, for the metrics.
	failures uint64
	// lg, when set, hears of failures and recoveries (a line each).
	lg *slog.Logger
}

// journalRetry is how long a failed journal refuses new reservations
// before it is tried again.
const journalRetry = time.Second

// journalFile is the journal's open file: os.File, or a test's wrapper
// that fails like a full disk.
type journalFile interface {
	Write(b []byte) (int, error)
	Truncate(size int64) error
	// Sync is fdatasync.
	Sync() error
	Close() error
}

// osJournalFile is a journal file on the filesystem.
type osJournalFile struct{ *os.File }

func (f osJournalFile) Sync() error { return fdatasync(f.File) }

// wrapJournalFile is applied to every journal file opened; tests replace it
// to inject failures.
var wrapJournalFile = func(f journalFile) journalFile { return f }

// unavailable is the error of an operation refused or failed because the
// journal cannot be written: the segment cannot take objects now, so the
// master's placement skips it (SEGMENT_UNAVAILABLE).
func (j *journal) unavailable(err error) error {
	return rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, err, "disk segment journal %s", j.path)
}

// failLocked records a write or sync failure.
func (j *journal) failLocked(err error, torn bool, nowMs int64) error {
	j.need = max(j.need, 1)
	if j.err == nil && j.lg != nil {
		j.lg.Warn("disk segment journal cannot be written; the segment takes no new objects until it can",
			"journal", j.path, "err", err, "torn", torn || j.torn)
	}
	j.err, j.torn = err, j.torn || torn
	j.retryAt = nowMs + journalRetry.Milliseconds()
	j.failures++
	return j.unavailable(err)
}

// recoveredLocked clears a failure after a write and sync went through.
func (j *journal) recoveredLocked() {
	if j.err != nil && j.lg != nil {
		j.lg.Info("disk segment journal writable again", "journal", j.path, "after", j.err)
	}
	j.err, j.torn, j.need = nil, false, 0
}

// writeLocked appends b. A failed write is cut off again, so the file
// ends with whole records; when even that fails the journal is torn.
func (j *journal) writeLocked(b []byte, nowMs int64) error {
	if j.f == nil {
		return os.ErrClosed
	}
	if j.torn {
		return j.unavailable(j.err)
	}
	n, err := j.f.Write(b)
	if err != nil {
		torn := false
		if n > 0 {
			torn = j.f.Truncate(j.size) != nil
		}
		j.need = max(j.need, len(b))
		return j.failLocked(err, torn, nowMs)
	}
	j.size += int64(n)
	j.records++
	return nil
}

func (j *journal) append(b []byte, nowMs int64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.writeLocked(b, nowMs)
}

func (j *journal) appendSeal(e *entry, nowMs int64) error {
	return j.append(encodeSeal(e), nowMs)
}

func (j *journal) appendRelease(id uint64, nowMs int64) error {
	return j.append(encodeU64(recRelease, id), nowMs)
}

// ensureID durably raises the id high-water mark past id when needed.
func (j *journal) ensureID(id uint64, nowMs int64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if id < j.idLimit {
		return nil
	}
	limit := id + idBlock
	if err := j.writeLocked(encodeU64(recIDLimit, limit), nowMs); err != nil {
		return err
	}
	if err := j.f.Sync(); err != nil {
		return j.failLocked(err, true, nowMs)
	}
	j.idLimit = limit
	return nil
}

// sync makes the appended records durable. A failed fdatasync may have
// lost pages anywhere in what was appended since the last one, so the
// journal is torn until rewritten. (Only a probe or a rewrite ends a
// failure: a sync that follows a failed append proves nothing.)
func (j *journal) sync(nowMs int64) error {
	j.mu.Lock()
	f := j.f
	j.mu.Unlock()
	if f == nil {
		return os.ErrClosed
	}
	err := f.Sync()
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f != f {
		// Rewritten meanwhile: the new file was synced whole.
		return nil
	}
	if err != nil {
		return j.failLocked(err, true, nowMs)
	}
	return nil
}

// probe tries the journal again after a failure: a torn one is rewritten
// from sealed (the table's sealed entries, the truth the journal lost
// track of); another takes as many bytes as the write that failed, in id
// limit records it already holds, synced and then cut off again to give
// the room back. Refused until the failure's retry time.
func (j *journal) probe(sealed func() []*entry, nextID uint64, nowMs int64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	switch {
	case j.err == nil:
		return nil
	case j.f == nil:
		return os.ErrClosed
	case nowMs < j.retryAt:
		return j.unavailable(j.err)
	case j.torn:
		return j.compactLocked(sealed(), nextID, nowMs)
	}
	rec := encodeU64(recIDLimit, j.idLimit)
	k := (j.need + len(rec) - 1) / len(rec)
	size, records := j.size, j.records
	if err := j.writeLocked(bytes.Repeat(rec, k), nowMs); err != nil {
		return err
	}
	if err := j.f.Sync(); err != nil {
		return j.failLocked(err, true, nowMs)
	}
	// Records it already holds: kept if they cannot be cut off.
	if j.f.Truncate(size) == nil {
		j.size, j.records = size, records
	} else {
		j.records = records + k
	}
	j.recoveredLocked()
	return nil
}

func (j *journal) needsCompaction(live int) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.err == nil && j.records > 2*live+j.slack
}

// compact rewrites the journal with only the live sealed entries.
func (j *journal) compact(sealed []*entry, nextID uint64, nowMs int64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.compactLocked(sealed, nextID, nowMs)
}

func (j *journal) compactLocked(sealed []*entry, nextID uint64, nowMs int64) error {
	if j.f == nil {
		return os.ErrClosed
	}
	limit := max(j.idLimit, nextID)
	f, size, err := writeJournal(j.dir, j.hdr, limit, sealed)
	if f != nil {
		_ = j.f.Close()
		j.f, j.size, j.records, j.idLimit = f, size, 1+len(sealed), limit
	}
	switch {
	case err == nil:
		j.recoveredLocked()
		return nil
	case errors.Is(err, errRenamed):
		// The old file was replaced: appending to it would write into an
		// unlinked file, lost at the next reopen. Torn: written again
		// whole (its name synced) before anything is appended.
		return j.failLocked(err, true, nowMs)
	case j.err != nil:
		// A failing journal stays failing; a healthy one keeps its
		// file (a compaction is an optimisation).
		return j.failLocked(err, false, nowMs)
	}
	return err
}

// stats returns the failures so far and whether the journal is failing.
func (j *journal) stats() (failures uint64, failing bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.failures, j.err != nil
}

func (j *journal) close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}

// errRenamed marks a writeJournal error that came after the rename: the
// journal's name already points to the new file (whose bytes are synced),
// so the old file, open or not, is no journal any more and must never be
// appended to again; the rename itself may not be durable yet.
var errRenamed = errors.New("new journal renamed into place")

// writeJournal writes a fresh journal (header, id limit, seals) to a
// temporary file, syncs it, renames it into place, syncs the directory, and
// returns it open for appending, with its size. On failure before the
// rename the temporary file is removed (it may hold most of a journal's
// size, on a full disk). A failure after it (the directory's sync, opening
// the new file) wraps errRenamed, and returns the new file too when it
// could be opened: the caller must give up its old one either way.
func writeJournal(dir string, hdr journalHeader, limit uint64, sealed []*entry) (journalFile, int64, error) {
	tmp := filepath.Join(dir, journalName+".tmp")
	final := filepath.Join(dir, journalName)
	buf := hdr.encode()
	buf = append(buf, encodeU64(recIDLimit, limit)...)
	for _, e := range sealed {
		buf = append(buf, encodeSeal(e)...)
	}
	renamed := false
	err := func() error {
		of, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		f := wrapJournalFile(osJournalFile{of})
		if _, err := f.Write(buf); err != nil {
			_ = f.Close()
			return err
		}
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		if err := os.Rename(tmp, final); err != nil {
			return err
		}
		renamed = true
		return syncDir(dir)
	}()
	if err != nil && !renamed {
		_ = os.Remove(tmp)
		return nil, 0, err
	}
	// Opened again by its final name, so its errors name the journal.
	of, oerr := os.OpenFile(final, os.O_WRONLY|os.O_APPEND, 0)
	if oerr != nil {
		return nil, 0, fmt.Errorf("%w: %w", errRenamed, errors.Join(err, oerr))
	}
	f := wrapJournalFile(osJournalFile{of})
	if err != nil {
		return f, int64(len(buf)), fmt.Errorf("%w: sync the directory: %w", errRenamed, err)
	}
	return f, int64(len(buf)), nil
}

func fdatasync(f *os.File) error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err != unix.EINTR {
			return err
		}
	}
}

// syncDir syncs a directory (a variable: tests make it fail).
var syncDir = func(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
