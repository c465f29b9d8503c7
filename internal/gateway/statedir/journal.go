package statedir

import (
	"bufio"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// MaxPayload is the largest record payload (kvevent messages are far
// smaller); Append refuses larger ones and decoders reject them unread.
const MaxPayload = 64 << 20

const (
	journalMagic     = "CRSJRNL1"
	journalVersion   = 1
	journalHeaderLen = 8 + 4 + EpochLen
	recPrefixLen     = 8       // len u32, crc u32
	recFixedLen      = 5 * 8   // seq, master epoch, master revision, last event id, unix ms
	keepBufLen       = 1 << 20 // Append's scratch buffer is dropped above this
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// errShort is a record cut short by the end of the data.
var errShort = errors.New("statedir: record cut short")

// appendRecord appends r's encoding (see the package documentation).
func appendRecord(b []byte, r Record) []byte {
	le := binary.LittleEndian
	b = le.AppendUint32(b, uint32(recFixedLen+len(r.Payload)))
	b = le.AppendUint32(b, 0) // the CRC, below
	start := len(b)
	b = le.AppendUint64(b, r.Seq)
	b = le.AppendUint64(b, r.Master.Epoch)
	b = le.AppendUint64(b, r.Master.Revision)
	b = le.AppendUint64(b, r.LastEventID)
	b = le.AppendUint64(b, uint64(r.UnixMilli))
	b = append(b, r.Payload...)
	le.PutUint32(b[start-4:], crc32.Checksum(b[start:], castagnoli))
	return b
}

// recordLen checks a record's 8-byte prefix and returns the length of the
// record (prefix included).
func recordLen(prefix []byte) (int, error) {
	l := binary.LittleEndian.Uint32(prefix)
	if l < recFixedLen {
		return 0, corruptf("record length %d < %d", l, recFixedLen)
	}
	if l-recFixedLen > MaxPayload {
		return 0, corruptf("record payload of %d bytes, limit %d", l-recFixedLen, MaxPayload)
	}
	return recPrefixLen + int(l), nil
}

// decodeRecord decodes the record at the start of b and returns it and its
// length. Its Payload aliases b. errShort: b ends within the record.
func decodeRecord(b []byte) (Record, int, error) {
	if len(b) < recPrefixLen {
		return Record{}, 0, errShort
	}
	n, err := recordLen(b)
	if err != nil {
		return Record{}, 0, err
	}
	if len(b) < n {
		return Record{}, 0, errShort
	}
	le := binary.LittleEndian
	body := b[recPrefixLen:n:n]
	if got, want := crc32.Checksum(body, castagnoli), le.Uint32(b[4:]); got != want {
		return Record{}, 0, corruptf("record CRC-32C %#x, want %#x", got, want)
	}
	return Record{
		Seq:         le.Uint64(body[0:]),
		Master:      Position{Epoch: le.Uint64(body[8:]), Revision: le.Uint64(body[16:])},
		LastEventID: le.Uint64(body[24:]),
		UnixMilli:   int64(le.Uint64(body[32:])),
		Payload:     body[recFixedLen:],
	}, n, nil
}

func appendJournalHeader(b []byte, e Epoch) []byte {
	b = append(b, journalMagic...)
	b = binary.LittleEndian.AppendUint32(b, journalVersion)
	return append(b, e[:]...)
}

func checkJournalHeader(b []byte, e Epoch) error {
	if string(b[:8]) == spoilMark {
		return corruptf("marked invalid in place: the journal failed in an earlier run")
	}
	if string(b[:8]) != journalMagic {
		return corruptf("bad magic %q", b[:8])
	}
	if v := binary.LittleEndian.Uint32(b[8:]); v != journalVersion {
		return corruptf("version %d, want %d", v, journalVersion)
	}
	if got := Epoch(b[12 : 12+EpochLen]); got != e {
		return corruptf("publisher epoch %v, want %v", got, e)
	}
	return nil
}

// jfile is a journal file: its name and the first seq it holds.
type jfile struct {
	name  string
	first uint64
}

func journalName(first uint64) string {
	return fmt.Sprintf("%s%020d%s", journalPrefix, first, journalSuffix)
}

// listJournal returns the journal files, oldest first. Other names are
// ignored.
func listJournal(dir string) ([]jfile, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("statedir: %w", err)
	}
	var fs []jfile
	for _, e := range ents {
		n := e.Name()
		num, okPrefix := strings.CutPrefix(n, journalPrefix)
		num, okSuffix := strings.CutSuffix(num, journalSuffix)
		first, err := strconv.ParseUint(num, 10, 64)
		if !okPrefix || !okSuffix || len(num) != 20 || err != nil || !e.Type().IsRegular() {
			continue
		}
		fs = append(fs, jfile{n, first})
	}
	slices.SortFunc(fs, func(a, b jfile) int { return cmp.Compare(a.first, b.first) })
	return fs, nil
}

// compactLocked deletes the journal files a checkpoint at seq makes
// unnecessary: a file goes when a newer file exists whose first seq is at
// most max(0, seq-KeepSeqs)+1 (≤ seq+1), so every record it holds is
// folded into the checkpoint and older than the replay ring's reserve.
// The newest file (the one being appended to) is never deleted.
func (d *Dir) compactLocked(seq uint64) {
	var floor uint64
	if seq > d.opts.KeepSeqs {
		floor = seq - d.opts.KeepSeqs
	}
	files, err := listJournal(d.path)
	if err != nil {
		d.lg.Warn("journal compaction failed", "err", err)
		return
	}
	removed := 0
	for i := 0; i+1 < len(files) && files[i+1].first <= floor+1; i++ {
		if err := os.Remove(d.file(files[i].name)); err != nil {
			d.lg.Warn("journal compaction failed", "file", files[i].name, "err", err)
			break
		}
		removed++
	}
	if removed > 0 {
		if err := syncDir(d.path); err != nil {
			d.lg.Warn("journal compaction: directory fsync failed", "err", err)
		}
		d.lg.Debug("journal compacted", "files_removed", removed, "checkpoint_seq", seq)
	}
}

// Replay calls fn, in order, for every journaled record with Seq > after,
// verifying every record of every file: CRC-32C, lengths, the files'
// publisher epoch (which must be e), names, and strictly increasing
// sequence numbers. A torn record at the tail of the newest file is
// truncated away with a warning, and Replay ends there successfully; any
// other failed check is an error wrapping ErrCorrupt (as is an INVALID
// marker). fn's error is returned as is. fn may keep r.Payload.
//
// Replay must be called before OpenJournal in a process (it refuses while a
// journal is open): see the package documentation.
func (d *Dir) Replay(e Epoch, after uint64, fn func(Record) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.beforeJournalLocked("Replay"); err != nil {
		return err
	}
	last, err := d.scanLocked(e, func(r Record) error {
		if r.Seq > after {
			return fn(r)
		}
		return nil
	})
	if err != nil {
		d.verified = nil
		return err
	}
	d.verified = &scanState{epoch: e, lastSeq: last}
	return nil
}

// Tail returns the journal's last records, oldest first: at most
// maxRecords, with at most maxBytes of payload in all, for restoring the
// replay ring. It checks what Replay checks (and truncates a torn tail the
// same way).
func (d *Dir) Tail(e Epoch, maxRecords, maxBytes int) ([]Record, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.beforeJournalLocked("Tail"); err != nil {
		return nil, err
	}
	var q []Record
	head, bytes := 0, 0
	last, err := d.scanLocked(e, func(r Record) error {
		if len(r.Payload) > maxBytes || maxRecords <= 0 {
			// The ring is contiguous: nothing before r can be in it.
			clear(q)
			q, head, bytes = q[:0], 0, 0
			return nil
		}
		q = append(q, r)
		bytes += len(r.Payload)
		for len(q)-head > maxRecords || bytes > maxBytes {
			bytes -= len(q[head].Payload)
			q[head] = Record{}
			head++
		}
		if head > 1024 && head > len(q)/2 {
			n := copy(q, q[head:])
			clear(q[n:])
			q, head = q[:n], 0
		}
		return nil
	})
	if err != nil {
		d.verified = nil
		return nil, err
	}
	d.verified = &scanState{epoch: e, lastSeq: last}
	return slices.Clip(q[head:]), nil
}

func (d *Dir) beforeJournalLocked(op string) error {
	if err := d.checkOpenLocked(); err != nil {
		return err
	}
	if d.journal != nil {
		return fmt.Errorf("statedir: %s while a journal is open (call it before OpenJournal)", op)
	}
	return nil
}

// scanLocked verifies the journal under epoch e, calling fn (if not nil)
// for every record in order, truncating a torn tail of the newest file and
// removing a newest file left without records. It returns the last seq.
func (d *Dir) scanLocked(e Epoch, fn func(Record) error) (uint64, error) {
	if err := d.checkValid(); err != nil {
		return 0, err
	}
	files, err := listJournal(d.path)
	if err != nil {
		return 0, err
	}
	var last uint64
	for i, jf := range files {
		newest := i == len(files)-1
		records, err := d.scanFile(jf, e, newest, &last, fn)
		if err != nil {
			return 0, err
		}
		if newest && records == 0 {
			// A crash between creating the file and writing its first
			// record (or a torn first record): it holds nothing, and
			// the next file may need its name.
			d.lg.Warn("empty journal file removed", "file", jf.name)
			if err := os.Remove(d.file(jf.name)); err != nil {
				return 0, fmt.Errorf("statedir: %w", err)
			}
			if err := syncDir(d.path); err != nil {
				return 0, fmt.Errorf("statedir: %w", err)
			}
		}
	}
	return last, nil
}

// scanFile verifies one journal file; see scanLocked. last is the seq of
// the record before the file's and is advanced past its records.
func (d *Dir) scanFile(jf jfile, e Epoch, newest bool, last *uint64, fn func(Record) error) (records int, err error) {
	path := d.file(jf.name)
	flag := os.O_RDONLY
	if newest {
		flag = os.O_RDWR // for truncating a torn tail
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return 0, fmt.Errorf("statedir: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("statedir: %w", err)
	}
	if st.Size() < journalHeaderLen && newest {
		// Killed between creating the file and writing its header.
		return 0, nil
	}
	records, torn, err := scanRecords(f, st.Size(), jf.first, e, newest, last, fn)
	if err != nil {
		if errors.Is(err, ErrCorrupt) {
			err = fmt.Errorf("%s: %w", path, err)
		}
		return records, err
	}
	if torn != nil {
		d.lg.Warn("torn journal tail truncated", "file", path, "offset", torn.off, "size", st.Size(), "reason", torn.reason)
		if err := f.Truncate(torn.off); err != nil {
			return records, fmt.Errorf("statedir: %w", err)
		}
		if err := f.Sync(); err != nil {
			return records, fmt.Errorf("statedir: %w", err)
		}
	}
	return records, nil
}

// tornTail is where a journal file's torn tail starts, and why.
type tornTail struct {
	off    int64
	reason error
}

// scanRecords verifies the journal file of size bytes in ra, named after
// first, under epoch e: its header and every record, whose seqs must
// follow last (advanced past them). fn, if not nil, gets each record. A
// bad record that is the last thing in the newest file — cut short,
// ending at the end of the file, or followed only by zeros (the file's
// size reached the disk, its data did not) — is a torn write: the records
// before it count and torn says where to cut. Any other bad record, or one
// in an older file, is ErrCorrupt. Allocations are bounded by MaxPayload
// and by size, whatever the lengths in the file say.
func scanRecords(ra io.ReaderAt, size int64, first uint64, e Epoch, newest bool, last *uint64, fn func(Record) error) (records int, torn *tornTail, err error) {
	if size < journalHeaderLen {
		return 0, nil, corruptf("journal header cut short (%d bytes)", size)
	}
	br := bufio.NewReaderSize(io.NewSectionReader(ra, 0, size), int(min(size, ioBufLen)))
	var hb [journalHeaderLen]byte
	if _, err := io.ReadFull(br, hb[:]); err != nil {
		return 0, nil, fmt.Errorf("statedir: read journal: %w", err)
	}
	if err := checkJournalHeader(hb[:], e); err != nil {
		return 0, nil, err
	}
	off := int64(journalHeaderLen)
	var prefix [recPrefixLen]byte
	for off < size {
		rest := size - off
		var bad error
		atEOF := false // the bad record's declared end is the end of the file
		if rest < recPrefixLen {
			bad = errShort
		} else if _, err := io.ReadFull(br, prefix[:]); err != nil {
			return records, nil, fmt.Errorf("statedir: read journal: %w", err)
		} else if n, err := recordLen(prefix[:]); err != nil {
			bad = err
		} else if int64(n) > rest {
			bad = errShort
		} else {
			// Allocated only now: n is within the limit and the file.
			buf := make([]byte, n)
			copy(buf, prefix[:])
			if _, err := io.ReadFull(br, buf[recPrefixLen:]); err != nil {
				return records, nil, fmt.Errorf("statedir: read journal: %w", err)
			}
			r, _, err := decodeRecord(buf)
			if err != nil {
				bad, atEOF = err, int64(n) == rest
			} else {
				// The CRC holds: this is what was written, never a tear.
				if r.Seq <= *last {
					return records, nil, corruptf("offset %d: seq %d after %d", off, r.Seq, *last)
				}
				if records == 0 && r.Seq != first {
					return records, nil, corruptf("first seq %d, the file's name says %d", r.Seq, first)
				}
				*last = r.Seq
				records++
				off += int64(n)
				if fn != nil {
					if err := fn(r); err != nil {
						return records, nil, err
					}
				}
				continue
			}
		}
		short := bad == errShort
		if short {
			bad = corruptf("record cut short by the end of the file")
		}
		if !newest {
			return records, nil, fmt.Errorf("offset %d (not the newest file): %w", off, bad)
		}
		if !short && !atEOF {
			zeros, err := zerosFrom(ra, off, size)
			if err != nil {
				return records, nil, fmt.Errorf("statedir: read journal: %w", err)
			}
			if !zeros {
				return records, nil, fmt.Errorf("offset %d (data follows): %w", off, bad)
			}
		}
		return records, &tornTail{off: off, reason: bad}, nil
	}
	return records, nil, nil
}

// zerosFrom reports whether ra holds only zero bytes from off to size.
func zerosFrom(ra io.ReaderAt, off, size int64) (bool, error) {
	buf := make([]byte, min(size-off, 64<<10))
	for off < size {
		n, err := ra.ReadAt(buf[:min(int64(len(buf)), size-off)], off)
		for _, c := range buf[:n] {
			if c != 0 {
				return false, nil
			}
		}
		if err != nil && (err != io.EOF || n == 0) {
			return false, err
		}
		off += int64(n)
	}
	return true, nil
}

// Journal appends records to the journal files of one publisher epoch. One
// goroutine appends; Sync and Close may be called from others.
type Journal struct {
	d            *Dir
	epoch        Epoch
	syncInterval time.Duration
	maxFileBytes int64

	// mu guards the fields below. Lock order: Dir.mu before mu.
	mu       sync.Mutex
	f        *os.File // the current file; nil until the next Append creates one
	size     int64    // of f
	lastSeq  uint64   // the last seq appended (or found in the journal)
	dirty    bool     // f has writes not yet fsynced
	lastSync time.Time
	err      error // sticky: the journal failed
	closed   bool
	buf      []byte // Append's scratch (one record's encoding)
	syncs    int    // fsyncs of records, for tests
}

// OpenJournal opens the journal for appending under publisher epoch e. Its
// first Append starts a new file (so does rotation). The existing journal
// must be of epoch e (else ErrCorrupt: Reset first; after Reset a new
// epoch starts clean). Unless Replay or Tail verified the journal in this
// process, OpenJournal verifies it (and truncates a torn tail) itself. One
// journal may be open at a time.
func (d *Dir) OpenJournal(e Epoch) (*Journal, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpenLocked(); err != nil {
		return nil, err
	}
	if d.journal != nil {
		return nil, errors.New("statedir: a journal is already open")
	}
	if err := d.checkValid(); err != nil {
		return nil, err
	}
	if v := d.verified; v == nil || v.epoch != e {
		last, err := d.scanLocked(e, nil)
		if err != nil {
			return nil, err
		}
		d.verified = &scanState{epoch: e, lastSeq: last}
	}
	// The newest file may hold records a killed process wrote but never
	// fsynced; once a newer file exists a lost tail there is corruption.
	files, err := listJournal(d.path)
	if err != nil {
		return nil, err
	}
	if len(files) > 0 {
		if err := syncFile(d.file(files[len(files)-1].name)); err != nil {
			return nil, fmt.Errorf("statedir: %w", err)
		}
	}
	j := &Journal{
		d:            d,
		epoch:        e,
		syncInterval: d.opts.SyncInterval,
		maxFileBytes: d.opts.MaxFileBytes,
		lastSeq:      d.verified.lastSeq,
		lastSync:     time.Now(),
	}
	d.journal = j
	return j, nil
}

func syncFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Append journals r with one write(2) (no buffering: a killed process loses
// nothing it appended) and fsyncs when Options.SyncInterval has passed
// since the last fsync (every time when it is 0). r.Seq must be greater
// than every seq journaled before (gaps are fine) and r.Payload at most
// MaxPayload; such errors leave the journal usable. A failed write or
// fsync fails the journal: this and every later Append return the same
// error, and dir/INVALID is created so the next start resets.
func (j *Journal) Append(r Record) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return ErrClosed
	}
	if j.err != nil {
		return j.err
	}
	if r.Seq <= j.lastSeq {
		return fmt.Errorf("statedir: append seq %d after %d: sequence numbers must increase", r.Seq, j.lastSeq)
	}
	if len(r.Payload) > MaxPayload {
		return fmt.Errorf("statedir: append seq %d: payload of %d bytes, limit %d", r.Seq, len(r.Payload), MaxPayload)
	}
	j.buf = appendRecord(j.buf[:0], r)
	if j.f != nil && j.size > journalHeaderLen && j.size+int64(len(j.buf)) > j.maxFileBytes {
		// Rotate. The file is fsynced before the next one exists, so
		// only the newest file can lose a tail to a machine crash.
		err := j.syncLocked()
		if cerr := j.f.Close(); err == nil {
			err = cerr
		}
		j.f = nil
		if err != nil {
			return j.failLocked(err)
		}
	}
	if j.f == nil {
		if err := j.createLocked(r.Seq); err != nil {
			return j.failLocked(err)
		}
	}
	if _, err := j.f.Write(j.buf); err != nil {
		return j.failLocked(err)
	}
	j.size += int64(len(j.buf))
	j.lastSeq = r.Seq
	j.dirty = true
	if cap(j.buf) > keepBufLen {
		j.buf = nil
	}
	if j.syncInterval == 0 || time.Since(j.lastSync) >= j.syncInterval {
		if err := j.syncLocked(); err != nil {
			return j.failLocked(err)
		}
	}
	return nil
}

// createLocked starts the file journal-<first>.log: header written and
// fsynced, directory fsynced.
func (j *Journal) createLocked(first uint64) error {
	path := j.d.file(journalName(first))
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return err
	}
	_, err = f.Write(appendJournalHeader(nil, j.epoch))
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = syncDir(j.d.path)
	}
	if err != nil {
		f.Close()
		_ = os.Remove(path)
		return err
	}
	j.f, j.size, j.dirty = f, journalHeaderLen, false
	return nil
}

func (j *Journal) syncLocked() error {
	if j.f != nil && j.dirty {
		if err := j.f.Sync(); err != nil {
			return err
		}
		j.syncs++
	}
	j.dirty = false
	j.lastSync = time.Now()
	return nil
}

// failLocked fails the journal with err (for good: after a failed write or
// fsync the file's state is unknown) and marks the directory INVALID.
func (j *Journal) failLocked(err error) error {
	j.err = fmt.Errorf("statedir: journal failed: %w", err)
	j.d.lg.Error("journal failed; the next start resets the state", "err", err)
	j.d.markInvalid(j.err)
	return j.err
}

// Sync fsyncs what was appended. The publisher calls it when it idles (the
// interval is checked only in Append) and at stop.
func (j *Journal) Sync() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return ErrClosed
	}
	if j.err != nil {
		return j.err
	}
	if err := j.syncLocked(); err != nil {
		return j.failLocked(err)
	}
	return nil
}

// Close fsyncs and closes the journal. It returns the journal's failure,
// if it failed. Closing a closed journal does nothing.
func (j *Journal) Close() error {
	last, failed, err := j.close()
	d := j.d
	d.mu.Lock()
	if d.journal == j {
		d.journal = nil
		if !failed {
			d.verified = &scanState{epoch: j.epoch, lastSeq: last}
		} else {
			d.verified = nil
		}
	}
	d.mu.Unlock()
	return err
}

func (j *Journal) close() (last uint64, failed bool, err error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return j.lastSeq, j.err != nil, nil
	}
	j.closed = true
	if j.f != nil {
		if j.err == nil {
			if serr := j.syncLocked(); serr != nil {
				j.failLocked(serr)
			}
		}
		if cerr := j.f.Close(); j.err == nil && cerr != nil {
			j.failLocked(cerr)
		}
		j.f = nil
	}
	return j.lastSeq, j.err != nil, j.err
}
