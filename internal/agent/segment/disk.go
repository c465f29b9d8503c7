package segment

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/alloc"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/google/uuid"
	"golang.org/x/sys/unix"
)

// disk is a preallocated file read and written with pread/pwrite.
type disk struct {
	f *os.File
}

func (d *disk) readAt(p []byte, off uint64) error {
	_, err := d.f.ReadAt(p, int64(off))
	if errors.Is(err, io.EOF) {
		// Preallocated by truncate: a hole reads as zeros up to the size.
		return nil
	}
	return err
}

func (d *disk) writeAt(p []byte, off uint64) error {
	_, err := d.f.WriteAt(p, int64(off))
	return err
}

func (d *disk) slice(uint64, uint64) []byte { return nil }

var hashBufs = sync.Pool{New: func() any { b := make([]byte, 1<<20); return &b }}

func (d *disk) hash(off, n uint64) (uint64, error) {
	bp := hashBufs.Get().(*[]byte)
	defer hashBufs.Put(bp)
	buf := *bp
	h := checksum.New()
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if _, err := d.f.ReadAt(buf[:k], int64(off)); err != nil {
			return 0, err
		}
		_, _ = h.Write(buf[:k])
		off += k
		n -= k
	}
	return h.Sum64(), nil
}

// rehash returns both the xxhash64 (the object checksum before issue 18)
// and the checksum of [off, off+n), in one read of the bytes.
func (d *disk) rehash(off, n uint64) (old, sum uint64, err error) {
	bp := hashBufs.Get().(*[]byte)
	defer hashBufs.Put(bp)
	buf := *bp
	oh, h := xxhash.New(), checksum.New()
	for n > 0 {
		k := min(n, uint64(len(buf)))
		if err := d.readAt(buf[:k], off); err != nil {
			return 0, 0, err
		}
		_, _ = oh.Write(buf[:k])
		_, _ = h.Write(buf[:k])
		off += k
		n -= k
	}
	return oh.Sum64(), h.Sum64(), nil
}

func (d *disk) sync() error  { return fdatasync(d.f) }
func (d *disk) close() error { return d.f.Close() }

// Recovery reports what OpenDisk found in an existing directory.
type Recovery struct {
	// Existing is true when the segment was reopened (same id).
	Existing bool
	// Sealed is the number of sealed allocations restored.
	Sealed int
	// TruncatedBytes is the size of a torn or corrupt journal tail dropped.
	TruncatedBytes int
	// Rehashed is the number of objects whose xxhash64 checksum (a
	// journal written before issue 18) was replaced by their XXH3-64 one;
	// Mismatched of them did not match their old checksum either and keep
	// it, so verification finds them corrupt.
	Rehashed, Mismatched int
}

// OpenDisk mounts the disk segment in dir: it reopens an existing one (same
// id, sealed allocations restored, RESERVED ones gone) or creates a new one
// of size bytes (a preallocated data file and a fresh journal). An existing
// segment whose capacity differs from size is an error: resizing would
// silently drop or strand objects.
func OpenDisk(dir string, size uint64) (*Segment, Recovery, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, Recovery{}, fmt.Errorf("disk segment %s: %w", dir, err)
	}
	jpath := filepath.Join(dir, journalName)
	raw, err := os.ReadFile(jpath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		s, err := createDisk(dir, size)
		return s, Recovery{}, err
	case err != nil:
		return nil, Recovery{}, fmt.Errorf("disk segment %s: %w", dir, err)
	}
	hdr, err := decodeHeader(raw)
	if err != nil {
		return nil, Recovery{}, fmt.Errorf("disk segment %s: %w", dir, err)
	}
	a, err := alloc.New(size, alloc.DiskAlignment)
	if err != nil {
		return nil, Recovery{}, fmt.Errorf("disk segment %s: %w", dir, err)
	}
	if hdr.capacity != a.Capacity() || hdr.alignment != alloc.DiskAlignment {
		return nil, Recovery{}, fmt.Errorf("disk segment %s holds a segment of %d bytes (alignment %d); --disk-size asks for %d: move or remove the directory to change it",
			dir, hdr.capacity, hdr.alignment, a.Capacity())
	}
	recs, valid := decodeRecords(raw[headerLen:])
	rec := Recovery{Existing: true, TruncatedBytes: len(raw) - headerLen - valid}
	live, limit := replay(recs)
	// In id order, so the table's ring takes the recent ids (table.put).
	entries := slices.SortedFunc(maps.Values(live), func(x, y *entry) int { return cmp.Compare(x.id, y.id) })
	exts := make([]alloc.Extent, len(entries))
	for i, e := range entries {
		exts[i] = alloc.Extent{Offset: e.offset, Size: a.ExtentSize(max(e.size, 1))}
	}
	exts, err = a.Restore(exts)
	if err != nil {
		return nil, Recovery{}, fmt.Errorf("disk segment %s: journal describes impossible extents: %w", dir, err)
	}
	df, err := os.OpenFile(filepath.Join(dir, dataName), os.O_RDWR, 0)
	if err != nil {
		return nil, Recovery{}, fmt.Errorf("disk segment %s: data file: %w", dir, err)
	}
	if st, err := df.Stat(); err != nil || uint64(st.Size()) < hdr.capacity {
		_ = df.Close()
		return nil, Recovery{}, fmt.Errorf("disk segment %s: data file shorter than the segment capacity %d", dir, hdr.capacity)
	}
	var jf journalFile
	jsize := int64(headerLen + valid)
	of, err := os.OpenFile(jpath, os.O_RDWR|os.O_APPEND, 0)
	if err == nil {
		jf = wrapJournalFile(osJournalFile{of})
		if rec.TruncatedBytes > 0 {
			if err = jf.Truncate(jsize); err == nil {
				err = jf.Sync()
			}
		}
	}
	if err != nil {
		_ = df.Close()
		if jf != nil {
			_ = jf.Close()
		}
		return nil, Recovery{}, fmt.Errorf("disk segment %s: journal: %w", dir, err)
	}
	records := len(recs)
	if hdr.flags&flagXXH3 == 0 {
		// Sealed under xxhash64: rehash once, and rewrite the journal with
		// the new checksums and the flag before anything is appended to it.
		d := &disk{f: df}
		for _, e := range entries {
			old, sum, err := d.rehash(e.offset, e.size)
			if err != nil {
				_ = df.Close()
				_ = jf.Close()
				return nil, Recovery{}, fmt.Errorf("disk segment %s: rehash allocation %d: %w", dir, e.id, err)
			}
			rec.Rehashed++
			if old != e.checksum {
				rec.Mismatched++
				continue
			}
			e.checksum = sum
		}
		hdr.flags |= flagXXH3
		nf, nsize, err := writeJournal(dir, hdr, limit, entries)
		_ = jf.Close()
		if err != nil {
			if nf != nil {
				_ = nf.Close()
			}
			_ = df.Close()
			return nil, Recovery{}, fmt.Errorf("disk segment %s: rewrite journal: %w", dir, err)
		}
		jf, jsize, records = nf, nsize, 1+len(entries)
	}
	s := newSegment(hdr.id.String(), dir, masterv1.Medium_MEDIUM_DISK, &disk{f: df}, a)
	s.jrn = &journal{dir: dir, hdr: hdr, path: jpath, f: jf, size: jsize, records: records, idLimit: limit, slack: compactSlack}
	s.nextID = max(limit, 1)
	for i, e := range entries {
		e.ext = exts[i]
		s.table.put(e)
		if e.state == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			s.sealedN++
		} else {
			s.resQ = append(s.resQ, queued{e.id, e.created})
		}
	}
	rec.Sealed = len(live)
	return s, rec, nil
}

func createDisk(dir string, size uint64) (*Segment, error) {
	a, err := alloc.New(size, alloc.DiskAlignment)
	if err != nil {
		return nil, fmt.Errorf("disk segment %s: %w", dir, err)
	}
	df, err := os.OpenFile(filepath.Join(dir, dataName), os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("disk segment %s: %w", dir, err)
	}
	if err := preallocate(df, int64(a.Capacity())); err != nil {
		_ = df.Close()
		return nil, fmt.Errorf("disk segment %s: preallocate %d bytes: %w", dir, a.Capacity(), err)
	}
	hdr := journalHeader{id: uuid.New(), capacity: a.Capacity(), alignment: alloc.DiskAlignment, flags: flagXXH3}
	// The journal is written last: a directory without one is not a segment.
	jf, jsize, err := writeJournal(dir, hdr, 1, nil)
	if err != nil {
		if jf != nil {
			_ = jf.Close()
		}
		_ = df.Close()
		return nil, fmt.Errorf("disk segment %s: journal: %w", dir, err)
	}
	s := newSegment(hdr.id.String(), dir, masterv1.Medium_MEDIUM_DISK, &disk{f: df}, a)
	s.jrn = &journal{dir: dir, hdr: hdr, path: filepath.Join(dir, journalName), f: jf, size: jsize, records: 1, idLimit: 1, slack: compactSlack}
	return s, nil
}

// preallocate reserves the file's blocks with fallocate, falling back to
// truncate (a sparse file) where the filesystem cannot.
func preallocate(f *os.File, size int64) error {
	for {
		err := unix.Fallocate(int(f.Fd()), 0, 0, size)
		switch {
		case err == nil:
			return f.Sync()
		case err == unix.EINTR:
			continue
		case err == unix.EOPNOTSUPP || err == unix.ENOSYS:
			if err := f.Truncate(size); err != nil {
				return err
			}
			return f.Sync()
		default:
			return err
		}
	}
}
