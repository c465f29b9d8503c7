package statedir

import (
	"bufio"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"iter"
	"math"
	"os"

	"github.com/cespare/xxhash/v2"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// Limits of a checkpoint entry. They match the master's input limits
// (internal/master/meta: MaxTenantLen, MaxKeyLen, MaxGroupLen), so every
// entry the master can hold fits; a decoder allocates nothing larger.
const (
	MaxTenantLen = 256
	MaxKeyLen    = 4096
	MaxGroupLen  = 1024
)

const (
	ckptMagic      = "CRSCKPT1"
	ckptVersion    = 1
	ckptHeaderLen  = 8 + 4 + EpochLen + 8*8
	ckptTrailerLen = 8
	// Medium bytes (explicit: the format must not follow kvevent's iota).
	ckptMediumCPU  = 1
	ckptMediumDisk = 2
	// runBufMax bounds the buffered run: a longer run is split in two
	// runs of the same tenant.
	runBufMax = 1 << 20
	// ioBufLen is the bufio size for checkpoints (and journal reads).
	ioBufLen = 1 << 20
)

func corruptf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...)
}

// LoadCheckpoint streams the checkpoint's entries to fn (as kvevent.Event
// values of Type kvevent.Stored with Tenant, Key, Medium and GroupID set)
// and returns its header. found is false, with a nil error, when there is
// no checkpoint. A checkpoint that fails a check — or an INVALID marker —
// is an error wrapping ErrCorrupt; fn's own error is returned as is. The
// whole file's checksum is verified before fn is called, but a structural
// error can still end the load after some calls: on any error, discard
// what fn received.
func (d *Dir) LoadCheckpoint(fn func(kvevent.Event) error) (h Header, found bool, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpenLocked(); err != nil {
		return Header{}, false, err
	}
	if err := d.checkValid(); err != nil {
		return Header{}, false, err
	}
	path := d.file(checkpointName)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return Header{}, false, nil
	}
	if err != nil {
		return Header{}, false, fmt.Errorf("statedir: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Header{}, false, fmt.Errorf("statedir: %w", err)
	}
	var mark [len(spoilMark)]byte
	if _, err := f.ReadAt(mark[:], 0); err == nil && string(mark[:]) == spoilMark {
		return Header{}, false, corruptf("%s: marked invalid in place: the journal failed in an earlier run", path)
	}
	h, err = decodeCheckpoint(f, st.Size(), fn)
	if err != nil {
		if errors.Is(err, ErrCorrupt) {
			err = fmt.Errorf("%s: %w", path, err)
		}
		return Header{}, false, err
	}
	return h, true, nil
}

// WriteCheckpoint writes h and entries as the checkpoint, atomically: to
// checkpoint.tmp, fsynced, renamed over checkpoint, directory fsynced.
// h.Entries is ignored (the entries are counted). entries must yield each
// tenant's entries together for a compact file (announced.Set.All does);
// a tenant that comes back only costs another run. An entry over the
// limits, of a medium other than CPU or disk, or of a type other than
// Stored (or unset) fails the write and leaves the old checkpoint.
//
// Then it compacts the journal: a file is deleted when a newer file
// exists whose first seq is at most max(0, h.Seq-KeepSeqs)+1, so no
// record the checkpoint lacks, nor one the replay ring may want, is lost.
func (d *Dir) WriteCheckpoint(h Header, entries iter.Seq[kvevent.Event]) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpenLocked(); err != nil {
		return err
	}
	if h.Subscribers < 0 {
		return fmt.Errorf("statedir: checkpoint: negative subscriber count %d", h.Subscribers)
	}
	if d.invalidated.Load() {
		return ErrInvalidated
	}
	tmp := d.file(checkpointTmp)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		return fmt.Errorf("statedir: %w", err)
	}
	err = writeCheckpoint(f, h, entries)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, d.file(checkpointName))
	}
	if err == nil {
		err = syncDir(d.path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("statedir: write checkpoint: %w", err)
	}
	d.compactLocked(h.Seq)
	return nil
}

// writeCheckpoint writes the whole checkpoint to the empty file f. The
// header's counts are known only at the end, so the body is written after
// a header-sized gap, the header patched in, and the file read back for
// the trailer's hash (from the page cache: a fraction of the write's cost).
func writeCheckpoint(f *os.File, h Header, entries iter.Seq[kvevent.Event]) error {
	if _, err := f.Seek(ckptHeaderLen, io.SeekStart); err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, ioBufLen)
	enc := ckptEncoder{w: bw}
	if entries != nil {
		for ev := range entries {
			if err := enc.add(ev); err != nil {
				return err
			}
		}
	}
	if err := enc.flush(); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	h.Entries = enc.entries
	if _, err := f.WriteAt(appendCkptHeader(nil, h, enc.runs), 0); err != nil {
		return err
	}
	end := ckptHeaderLen + enc.bytes
	dg := xxhash.New()
	if n, err := io.CopyBuffer(dg, io.NewSectionReader(f, 0, end), make([]byte, ioBufLen)); err != nil || n != end {
		return cmp.Or(err, fmt.Errorf("read back %d of %d bytes", n, end))
	}
	_, err := f.WriteAt(binary.LittleEndian.AppendUint64(nil, dg.Sum64()), end)
	return err
}

func appendCkptHeader(b []byte, h Header, runs uint64) []byte {
	le := binary.LittleEndian
	b = append(b, ckptMagic...)
	b = le.AppendUint32(b, ckptVersion)
	b = append(b, h.PublisherEpoch[:]...)
	b = le.AppendUint64(b, h.Seq)
	b = le.AppendUint64(b, h.Master.Epoch)
	b = le.AppendUint64(b, h.Master.Revision)
	b = le.AppendUint64(b, h.LastEventID)
	b = le.AppendUint64(b, uint64(h.WrittenUnixMilli))
	b = le.AppendUint64(b, uint64(h.Subscribers))
	b = le.AppendUint64(b, h.Entries)
	return le.AppendUint64(b, runs)
}

func decodeCkptHeader(b []byte) (h Header, runs uint64, err error) {
	le := binary.LittleEndian
	if string(b[:8]) != ckptMagic {
		return Header{}, 0, corruptf("checkpoint: bad magic %q", b[:8])
	}
	if v := le.Uint32(b[8:]); v != ckptVersion {
		return Header{}, 0, corruptf("checkpoint: version %d, want %d", v, ckptVersion)
	}
	copy(h.PublisherEpoch[:], b[12:12+EpochLen])
	b = b[12+EpochLen:]
	h.Seq = le.Uint64(b[0:])
	h.Master.Epoch = le.Uint64(b[8:])
	h.Master.Revision = le.Uint64(b[16:])
	h.LastEventID = le.Uint64(b[24:])
	h.WrittenUnixMilli = int64(le.Uint64(b[32:]))
	subs := le.Uint64(b[40:])
	if subs > math.MaxInt32 {
		return Header{}, 0, corruptf("checkpoint: subscriber count %d", subs)
	}
	h.Subscribers = int(subs)
	h.Entries = le.Uint64(b[48:])
	runs = le.Uint64(b[56:])
	if runs > h.Entries {
		return Header{}, 0, corruptf("checkpoint: %d tenant runs for %d entries", runs, h.Entries)
	}
	return h, runs, nil
}

// ckptEncoder writes tenant runs. A run is buffered (its count comes
// first) up to runBufMax bytes.
type ckptEncoder struct {
	w       io.Writer
	tenant  string // the buffered run's tenant
	run     []byte // its encoded entries
	count   uint64 // and their number
	entries uint64 // entries written or buffered
	runs    uint64 // runs written
	bytes   int64  // bytes written
	scratch []byte
}

func (c *ckptEncoder) add(ev kvevent.Event) error {
	if ev.Type != kvevent.Stored && ev.Type != kvevent.TypeUnknown {
		return fmt.Errorf("checkpoint entry %q/%q: type %v, want stored", ev.Tenant, ev.Key, ev.Type)
	}
	var m byte
	switch ev.Medium {
	case kvevent.MediumCPU:
		m = ckptMediumCPU
	case kvevent.MediumDisk:
		m = ckptMediumDisk
	default:
		return fmt.Errorf("checkpoint entry %q/%q: medium %v", ev.Tenant, ev.Key, ev.Medium)
	}
	if len(ev.Tenant) > MaxTenantLen || len(ev.Key) > MaxKeyLen || len(ev.GroupID) > MaxGroupLen {
		return fmt.Errorf("checkpoint entry: tenant, key or group over %d, %d, %d bytes (%d, %d, %d)",
			MaxTenantLen, MaxKeyLen, MaxGroupLen, len(ev.Tenant), len(ev.Key), len(ev.GroupID))
	}
	if c.count > 0 && (ev.Tenant != c.tenant || len(c.run) >= runBufMax) {
		if err := c.flush(); err != nil {
			return err
		}
	}
	c.tenant = ev.Tenant
	c.run = append(c.run, m)
	c.run = binary.AppendUvarint(c.run, uint64(len(ev.Key)))
	c.run = append(c.run, ev.Key...)
	c.run = binary.AppendUvarint(c.run, uint64(len(ev.GroupID)))
	c.run = append(c.run, ev.GroupID...)
	c.count++
	c.entries++
	return nil
}

// flush writes the buffered run, if any.
func (c *ckptEncoder) flush() error {
	if c.count == 0 {
		return nil
	}
	b := binary.AppendUvarint(c.scratch[:0], uint64(len(c.tenant)))
	b = append(b, c.tenant...)
	b = binary.AppendUvarint(b, c.count)
	c.scratch = b
	if _, err := c.w.Write(b); err != nil {
		return err
	}
	if _, err := c.w.Write(c.run); err != nil {
		return err
	}
	c.bytes += int64(len(b) + len(c.run))
	c.runs++
	c.count = 0
	c.run = c.run[:0]
	return nil
}

// decodeCheckpoint verifies and decodes the size-byte checkpoint in ra: the
// trailer's hash over everything before it first, then the structure,
// calling fn for each entry. Allocations are bounded by the entry limits
// and the buffer size, whatever the lengths in the file say.
func decodeCheckpoint(ra io.ReaderAt, size int64, fn func(kvevent.Event) error) (Header, error) {
	if size < ckptHeaderLen+ckptTrailerLen {
		return Header{}, corruptf("checkpoint: %d bytes, shorter than header and trailer", size)
	}
	bodyLen := size - ckptTrailerLen
	bufLen := int(min(bodyLen, ioBufLen))
	dg := xxhash.New()
	if n, err := io.CopyBuffer(dg, io.NewSectionReader(ra, 0, bodyLen), make([]byte, bufLen)); err != nil || n != bodyLen {
		return Header{}, fmt.Errorf("statedir: read checkpoint: %w", cmp.Or(err, io.ErrUnexpectedEOF))
	}
	var tr [ckptTrailerLen]byte
	if _, err := ra.ReadAt(tr[:], bodyLen); err != nil {
		return Header{}, fmt.Errorf("statedir: read checkpoint: %w", err)
	}
	if got, want := dg.Sum64(), binary.LittleEndian.Uint64(tr[:]); got != want {
		return Header{}, corruptf("checkpoint: xxhash64 %#x, trailer says %#x", got, want)
	}

	r := ckptReader{br: bufio.NewReaderSize(io.NewSectionReader(ra, 0, bodyLen), bufLen)}
	var hb [ckptHeaderLen]byte
	if _, err := io.ReadFull(r.br, hb[:]); err != nil {
		return Header{}, corruptf("checkpoint: header: %v", err)
	}
	h, runs, err := decodeCkptHeader(hb[:])
	if err != nil {
		return Header{}, err
	}
	left := h.Entries
	var group string // groups repeat: reuse the last one's string
	for range runs {
		tenant, err := r.str(MaxTenantLen, "tenant")
		if err != nil {
			return Header{}, err
		}
		count, err := r.uvarint()
		if err != nil {
			return Header{}, err
		}
		if count == 0 || count > left {
			return Header{}, corruptf("checkpoint: run of %d entries, %d left of %d", count, left, h.Entries)
		}
		left -= count
		ev := kvevent.Event{Type: kvevent.Stored, Tenant: string(tenant)}
		for range count {
			m, err := r.br.ReadByte()
			if err != nil {
				return Header{}, corruptf("checkpoint: entry: %v", err)
			}
			switch m {
			case ckptMediumCPU:
				ev.Medium = kvevent.MediumCPU
			case ckptMediumDisk:
				ev.Medium = kvevent.MediumDisk
			default:
				return Header{}, corruptf("checkpoint: medium byte %d", m)
			}
			key, err := r.str(MaxKeyLen, "key")
			if err != nil {
				return Header{}, err
			}
			ev.Key = string(key)
			g, err := r.str(MaxGroupLen, "group")
			if err != nil {
				return Header{}, err
			}
			if string(g) != group {
				group = string(g)
			}
			ev.GroupID = group
			if fn != nil {
				if err := fn(ev); err != nil {
					return Header{}, err
				}
			}
		}
	}
	if left != 0 {
		return Header{}, corruptf("checkpoint: %d of %d entries missing", left, h.Entries)
	}
	if _, err := r.br.ReadByte(); err != io.EOF {
		return Header{}, corruptf("checkpoint: bytes after the last entry")
	}
	return h, nil
}

type ckptReader struct {
	br *bufio.Reader
}

// uvarint reads a canonical (minimal) uvarint.
func (r *ckptReader) uvarint() (uint64, error) {
	var x uint64
	var s uint
	for i := range binary.MaxVarintLen64 {
		b, err := r.br.ReadByte()
		if err != nil {
			return 0, corruptf("checkpoint: uvarint: %v", err)
		}
		if b < 0x80 {
			if i == binary.MaxVarintLen64-1 && b > 1 {
				return 0, corruptf("checkpoint: uvarint overflows")
			}
			if b == 0 && i > 0 {
				return 0, corruptf("checkpoint: uvarint not minimal")
			}
			return x | uint64(b)<<s, nil
		}
		x |= uint64(b&0x7f) << s
		s += 7
	}
	return 0, corruptf("checkpoint: uvarint overflows")
}

// str reads a uvarint length (at most limit) and that many bytes, valid
// until the next read.
func (r *ckptReader) str(limit int, what string) ([]byte, error) {
	n, err := r.uvarint()
	if err != nil {
		return nil, err
	}
	if n > uint64(limit) {
		return nil, corruptf("checkpoint: %s of %d bytes, limit %d", what, n, limit)
	}
	// The buffer holds at least min(limit, what is left): Peek cannot fail
	// with ErrBufferFull on a well-formed file.
	b, err := r.br.Peek(int(n))
	if err != nil {
		return nil, corruptf("checkpoint: %s: %v", what, err)
	}
	_, _ = r.br.Discard(int(n))
	return b, nil
}
