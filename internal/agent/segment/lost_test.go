package segment

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/testutil"
)

// lostSink collects what a segment reports lost.
type lostSink struct {
	mu   sync.Mutex
	lost []LostAllocation
}

func (l *lostSink) add(a LostAllocation) {
	l.mu.Lock()
	l.lost = append(l.lost, a)
	l.mu.Unlock()
}

func (l *lostSink) all() []LostAllocation {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]LostAllocation(nil), l.lost...)
}

// openFilled seals objects of sizes into a fresh 8 MiB disk segment,
// reopens it and collects what it reports lost.
func openFilled(t *testing.T, sizes ...int) (string, []sealedObj, *Segment, *lostSink) {
	t.Helper()
	dir := t.TempDir()
	objs := fillDisk(t, dir, 8<<20, sizes...)
	s, _, err := OpenDisk(dir, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	sink := new(lostSink)
	s.SetLostSink(sink.add)
	return dir, objs, s, sink
}

// readChunks reads allocation id whole through one handle, k bytes at a
// time, as the data plane's readers do.
func readChunks(t *testing.T, s *Segment, id uint64, k int) ([]byte, error) {
	t.Helper()
	h, err := s.OpenRead(id)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	out := make([]byte, h.Size())
	for off := 0; off < len(out); off += k {
		if err := h.ReadAt(out[off:min(off+k, len(out))], uint64(off)); err != nil {
			return out, err
		}
	}
	return out, nil
}

// TestReadDropsCorrupt: bytes of a sealed disk allocation changed under a
// running segment are found by the first read of the whole object; the
// allocation is dropped (reported once to the lost sink, reads answer
// CHECKSUM_MISMATCH, its extent freed once the reader closes) and the drop
// is journaled, so a reopen does not bring it back. Intact objects and
// partial reads drop nothing.
func TestReadDropsCorrupt(t *testing.T) {
	dir, objs, s, sink := openFilled(t, 10_000, 1<<20, 70_000)
	bad := objs[1]
	testutil.FlipByte(t, filepath.Join(dir, dataName), bad.alloc.GetOffset()+700_000)
	usedBefore := s.Info().GetUsed()

	// A partial read of the bad object, and reads out of order, do not
	// check: nothing is dropped.
	h, err := s.OpenRead(bad.alloc.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	for _, off := range []uint64{0, 600_000, 4096} {
		if err := h.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
	}
	h.Close()
	for i, o := range objs {
		got, err := readChunks(t, s, o.alloc.GetAllocationId(), 256<<10)
		if err != nil {
			t.Fatalf("read %s: %v", o.alloc.GetKey(), err)
		}
		if i != 1 && !bytes.Equal(got, o.data) {
			t.Fatalf("intact object %s differs", o.alloc.GetKey())
		}
	}
	lost := sink.all()
	if len(lost) != 1 {
		t.Fatalf("%d allocations reported lost, want 1: %+v", len(lost), lost)
	}
	l := lost[0]
	if a := l.Allocation; a.GetAllocationId() != bad.alloc.GetAllocationId() || a.GetKey() != bad.alloc.GetKey() || a.GetTenant() != "t" ||
		a.GetSegmentId() != s.ID() || a.GetReplicaId() != 1 || a.GetChecksum() != checksum.Sum(bad.data) ||
		l.Got == a.GetChecksum() || l.Err != nil || l.JournalErr != nil || l.Reason() != "checksum mismatch" {
		t.Fatalf("lost = %+v (%v), want allocation %d with its checksum, got differing", l, l.Allocation, bad.alloc.GetAllocationId())
	}
	_, err = s.OpenRead(bad.alloc.GetAllocationId())
	wantReason(t, err, "CHECKSUM_MISMATCH")
	if _, ok := s.Lookup(bad.alloc.GetAllocationId()); ok {
		t.Fatal("dropped allocation still in the table (would be registered)")
	}
	if got, want := s.Info().GetUsed(), usedBefore-(1<<20); got != want {
		t.Fatalf("used = %d, want %d (the corrupt extent freed)", got, want)
	}
	// Reading the intact ones again reports nothing more.
	for _, i := range []int{0, 2} {
		if _, err := readChunks(t, s, objs[i].alloc.GetAllocationId(), 1<<20); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(sink.all()); n != 1 {
		t.Fatalf("%d reported after reading intact objects again, want 1", n)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2, rec, err := OpenDisk(dir, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if rec.Sealed != len(objs)-1 {
		t.Fatalf("sealed after reopen = %d, want %d (the drop journaled)", rec.Sealed, len(objs)-1)
	}
}

// eioStore fails reads of [from, to) with EIO.
type eioStore struct {
	backing
	from, to uint64
}

func (e *eioStore) readAt(p []byte, off uint64) error {
	if off < e.to && off+uint64(len(p)) > e.from {
		return &pathError{err: syscall.EIO}
	}
	return e.backing.readAt(p, off)
}

// pathError mimics what os.File.ReadAt returns.
type pathError struct{ err error }

func (e *pathError) Error() string { return "read segment.data: " + e.err.Error() }
func (e *pathError) Unwrap() error { return e.err }

// TestReadEIODropsAllocation: a read that fails with EIO drops the
// allocation at once, whatever part of it was being read.
func TestReadEIODropsAllocation(t *testing.T) {
	_, objs, s, sink := openFilled(t, 10_000, 20_000)
	bad := objs[1]
	s.store = &eioStore{backing: s.store, from: bad.alloc.GetOffset() + 15_000, to: bad.alloc.GetOffset() + 15_001}

	if _, err := readChunks(t, s, objs[0].alloc.GetAllocationId(), 4096); err != nil {
		t.Fatal(err)
	}
	_, err := readChunks(t, s, bad.alloc.GetAllocationId(), 4096)
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of the bad object = %v, want EIO", err)
	}
	lost := sink.all()
	if len(lost) != 1 || lost[0].Allocation.GetAllocationId() != bad.alloc.GetAllocationId() || !errors.Is(lost[0].Err, syscall.EIO) {
		t.Fatalf("lost = %+v, want allocation %d with EIO", lost, bad.alloc.GetAllocationId())
	}
	if r := lost[0].Reason(); r != "read: read segment.data: input/output error" {
		t.Fatalf("reason = %q", r)
	}
	_, err = s.OpenRead(bad.alloc.GetAllocationId())
	wantReason(t, err, "CHECKSUM_MISMATCH")
}

// TestConcurrentReadsDropNothing: pieces of one handle read from several
// goroutines at once, in any order (a Copy does), never drop an intact
// allocation.
func TestConcurrentReadsDropNothing(t *testing.T) {
	_, objs, s, sink := openFilled(t, 1<<20)
	id := objs[0].alloc.GetAllocationId()
	for range 20 {
		h, err := s.OpenRead(id)
		if err != nil {
			t.Fatal(err)
		}
		const pieces = 16
		piece := h.Size() / pieces
		out := make([]byte, h.Size())
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for i := g; i < pieces; i += 4 {
					if err := h.ReadAt(out[uint64(i)*piece:uint64(i+1)*piece], uint64(i)*piece); err != nil {
						t.Error(err)
					}
				}
			})
		}
		wg.Wait()
		h.Close()
		if !bytes.Equal(out, objs[0].data) {
			t.Fatal("pieces read concurrently differ from the object")
		}
	}
	if lost := sink.all(); len(lost) != 0 {
		t.Fatalf("an intact allocation read concurrently was reported lost: %+v", lost)
	}
}

// TestVerifyCutShortFile: Verify of an allocation whose bytes lie past the
// end of a data file cut short under the segment (a truncate, a restore
// from a short copy) drops it, as a read that found them bad would; an
// allocation still inside the file verifies.
func TestVerifyCutShortFile(t *testing.T) {
	dir, objs, s, sink := openFilled(t, 10_000, 20_000)
	if err := os.Truncate(filepath.Join(dir, dataName), int64(objs[1].alloc.GetOffset()+100)); err != nil {
		t.Fatal(err)
	}
	verify := func(id uint64) error {
		h, err := s.OpenRead(id)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		return h.Verify()
	}
	if err := verify(objs[0].alloc.GetAllocationId()); err != nil {
		t.Fatalf("Verify of the allocation inside the file = %v", err)
	}
	wantReason(t, verify(objs[1].alloc.GetAllocationId()), "CHECKSUM_MISMATCH")
	if lost := sink.all(); len(lost) != 1 || !errors.Is(lost[0].Err, io.EOF) || lost[0].Medium != masterv1.Medium_MEDIUM_DISK {
		t.Fatalf("lost = %+v, want the cut allocation with EOF", lost)
	}
}
