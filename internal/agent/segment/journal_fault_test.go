package segment

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// fullDisk fails the journal's files as a filesystem that runs out of room
// does: while room is not negative, a write stores what still fits and
// fails ENOSPC for the rest (a short write, as write(2) makes one); a
// truncate or a sync fails with EIO when told to.
type fullDisk struct {
	mu           sync.Mutex
	room         int64 // bytes writes may still store; < 0: unlimited
	failTruncate bool
	failSync     bool
}

func (d *fullDisk) set(room int64, failTruncate, failSync bool) {
	d.mu.Lock()
	d.room, d.failTruncate, d.failSync = room, failTruncate, failSync
	d.mu.Unlock()
}

// install makes every journal file opened until the test ends go through d.
func (d *fullDisk) install(t *testing.T) {
	d.set(-1, false, false)
	orig := wrapJournalFile
	wrapJournalFile = func(f journalFile) journalFile { return &faultyFile{orig(f), d} }
	t.Cleanup(func() { wrapJournalFile = orig })
}

type faultyFile struct {
	journalFile
	d *fullDisk
}

func (f *faultyFile) Write(b []byte) (int, error) {
	f.d.mu.Lock()
	room := f.d.room
	if room >= 0 {
		f.d.room = max(0, room-int64(len(b)))
	}
	f.d.mu.Unlock()
	if room < 0 || room >= int64(len(b)) {
		return f.journalFile.Write(b)
	}
	n, err := f.journalFile.Write(b[:room])
	if err == nil {
		err = syscall.ENOSPC
	}
	return n, err
}

func (f *faultyFile) Truncate(size int64) error {
	f.d.mu.Lock()
	fail := f.d.failTruncate
	f.d.mu.Unlock()
	if fail {
		return syscall.EIO
	}
	return f.journalFile.Truncate(size)
}

func (f *faultyFile) Sync() error {
	f.d.mu.Lock()
	fail := f.d.failSync
	f.d.mu.Unlock()
	if fail {
		return syscall.EIO
	}
	return f.journalFile.Sync()
}

// TestJournalWriteFailures: a journal write or sync that fails (a full
// filesystem, an I/O error) fails the seal with SEGMENT_UNAVAILABLE, makes
// Reserve refuse until the journal has been tried again, and never costs
// an object acknowledged before or after it: the reopened segment holds
// every seal that succeeded. Before, a record a full disk had cut short
// stayed in the journal, the seals acknowledged once there was room again
// were appended after it, and the next reopen dropped them all as a torn
// tail.
func TestJournalWriteFailures(t *testing.T) {
	cases := []struct {
		name string
		// fail makes the next journal write fail on d.
		fail func(d *fullDisk)
		// torn: the journal is rewritten from the table when tried again.
		torn bool
	}{
		{"a short write, cut off again", func(d *fullDisk) { d.set(20, false, false) }, false},
		{"a short write that cannot be cut off", func(d *fullDisk) { d.set(20, true, false) }, true},
		{"nothing written", func(d *fullDisk) { d.set(0, false, false) }, false},
		{"fdatasync fails", func(d *fullDisk) { d.set(-1, false, true) }, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var d fullDisk
			d.install(t)
			dir := t.TempDir()
			s, _, err := OpenDisk(dir, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = s.Close() }()
			now := t0
			acked := map[uint64][]byte{}
			put := func(key string) (uint64, []byte, error) {
				t.Helper()
				data := randBytes(3000, uint64(len(acked)+len(key)))
				a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: uint64(len(data)), Tenant: "t", Key: key}, now)
				if err != nil {
					return 0, nil, err
				}
				write(t, s, a.GetAllocationId(), data)
				err = s.Seal([]SealArg{{ID: a.GetAllocationId(), Checksum: checksum.Sum(data)}}, now)[0]
				if err == nil {
					acked[a.GetAllocationId()] = data
				}
				return a.GetAllocationId(), data, err
			}
			for _, k := range []string{"a", "b"} {
				if _, _, err := put(k); err != nil {
					t.Fatalf("put %s: %v", k, err)
				}
			}

			tc.fail(&d)
			id, data, err := put("c")
			if rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
				t.Fatalf("seal on a failing journal = %v, want SEGMENT_UNAVAILABLE", err)
			}
			if failures, failing := s.jrn.stats(); failures != 1 || !failing {
				t.Fatalf("journal stats = %d failures, failing %v; want 1, true", failures, failing)
			}
			// Refused at once, before any byte is sent: the master places
			// the put elsewhere.
			if _, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: 10, Tenant: "t", Key: "x"}, now.Add(journalRetry/2)); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
				t.Fatalf("Reserve on a failing journal = %v, want SEGMENT_UNAVAILABLE", err)
			}

			// Tried again while still failing: refused again, no
			// temporary journal left behind (it would hold the disk's
			// room). The room left would take a small record but not the
			// seal's: the try must not take that for a recovery.
			d.set(20, false, tc.name == "fdatasync fails")
			now = now.Add(journalRetry)
			if _, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: 10, Tenant: "t", Key: "x"}, now); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
				t.Fatalf("Reserve while the disk is still full = %v, want SEGMENT_UNAVAILABLE", err)
			}
			if _, err := os.Stat(filepath.Join(dir, journalName+".tmp")); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("temporary journal after a failed rewrite: %v", err)
			}

			// Room again: the next try after the retry time goes through,
			// and so does everything after it, c's seal included.
			d.set(-1, false, false)
			now = now.Add(journalRetry)
			if err := s.Seal([]SealArg{{ID: id, Checksum: checksum.Sum(data)}}, now)[0]; err != nil {
				t.Fatalf("seal c again once there is room: %v", err)
			}
			acked[id] = data
			for _, k := range []string{"d", "e"} {
				if _, _, err := put(k); err != nil {
					t.Fatalf("put %s after the failure: %v", k, err)
				}
			}
			if _, failing := s.jrn.stats(); failing {
				t.Fatal("journal still failing after writes went through")
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}

			s2, rec, err := OpenDisk(dir, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = s2.Close() }()
			if rec.TruncatedBytes != 0 || rec.Sealed != len(acked) {
				t.Fatalf("reopened: %+v, want %d sealed and nothing truncated", rec, len(acked))
			}
			for id, data := range acked {
				if b := read(t, s2, id); !bytes.Equal(b, data) {
					t.Fatalf("allocation %d reads other bytes after the reopen", id)
				}
			}
		})
	}
}

// TestJournalReleaseOnFailingJournal: a release the journal cannot record
// is refused (SEGMENT_UNAVAILABLE) and keeps the allocation, so its extent
// is never reused while the journal could still name it sealed; once the
// journal takes writes again the release goes through and survives a
// reopen.
func TestJournalReleaseOnFailingJournal(t *testing.T) {
	var d fullDisk
	d.install(t)
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	data := randBytes(100, 1)
	a := reserve(t, s, "k", 100)
	write(t, s, a.GetAllocationId(), data)
	if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
		t.Fatal(err)
	}
	d.set(5, false, false)
	if err := s.Release(a.GetAllocationId()); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("Release on a full disk = %v, want SEGMENT_UNAVAILABLE", err)
	}
	if _, ok := s.Lookup(a.GetAllocationId()); !ok {
		t.Fatal("a release the journal did not record dropped the allocation")
	}
	d.set(-1, false, false)
	// The failure's retry time is a second of the wall clock here.
	s.jrn.mu.Lock()
	s.jrn.retryAt = 0
	s.jrn.mu.Unlock()
	if err := s.Release(a.GetAllocationId()); err != nil {
		t.Fatalf("Release once there is room: %v", err)
	}
	if err := s.SyncJournal(); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	s2, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s2.Close() }()
	if rec.Sealed != 0 || rec.TruncatedBytes != 0 {
		t.Fatalf("reopened: %+v, want nothing sealed, nothing truncated", rec)
	}
}

// TestJournalDirSyncFails: a compaction whose rename went through but whose
// directory sync failed leaves the new journal as the only one by that
// name; the segment must not go on appending to the old file (unlinked by
// the rename: every seal after it was lost at the next reopen). It takes
// no objects until the journal was written again whole, then every seal
// acknowledged survives a reopen.
func TestJournalDirSyncFails(t *testing.T) {
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	now := t0
	acked := 0
	put := func(key string) error {
		t.Helper()
		data := randBytes(3000, uint64(acked+len(key)))
		a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: uint64(len(data)), Tenant: "t", Key: key}, now)
		if err != nil {
			return err
		}
		write(t, s, a.GetAllocationId(), data)
		if err := s.Seal([]SealArg{{ID: a.GetAllocationId(), Checksum: checksum.Sum(data)}}, now)[0]; err != nil {
			return err
		}
		acked++
		return nil
	}
	for _, k := range []string{"a", "b"} {
		if err := put(k); err != nil {
			t.Fatal(err)
		}
	}
	orig := syncDir
	t.Cleanup(func() { syncDir = orig })
	syncDir = func(string) error { return syscall.EIO }
	s.mu.Lock()
	err = s.jrn.compact(s.sealedLocked(), s.nextID, now.UnixMilli())
	s.mu.Unlock()
	syncDir = orig
	if rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("compaction whose directory sync failed = %v, want SEGMENT_UNAVAILABLE", err)
	}
	if err := put("early"); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("put right after = %v, want SEGMENT_UNAVAILABLE", err)
	}
	now = now.Add(journalRetry)
	for _, k := range []string{"c", "d"} {
		if err := put(k); err != nil {
			t.Fatalf("put %s after the retry time: %v", k, err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s2.Close() }()
	if rec.Sealed != acked {
		t.Fatalf("reopened with %d sealed, want the %d acknowledged", rec.Sealed, acked)
	}
}
