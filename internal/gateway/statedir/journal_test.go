package statedir

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
)

func seqs(from, to uint64) []uint64 {
	var s []uint64
	for q := from; q <= to; q++ {
		s = append(s, q)
	}
	return s
}

// rec is the test record of seq: payload sizes vary, seq%4 == 0 is a
// heartbeat (no payload).
func rec(seq uint64) Record {
	var p []byte
	if seq%4 != 0 {
		p = []byte(strings.Repeat(fmt.Sprintf("payload-%d;", seq), int(seq%5)+1))
	}
	return Record{Seq: seq, Master: Position{Epoch: 1 + seq/100, Revision: seq * 10}, LastEventID: seq * 64,
		UnixMilli: 1_700_000_000_000 + int64(seq), Payload: p}
}

// writeJournal opens a journal, appends rec(q) for each q and closes it.
func writeJournal(t testing.TB, d *Dir, e Epoch, qs []uint64) {
	t.Helper()
	j, err := d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range qs {
		if err := j.Append(rec(q)); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
}

func replay(d *Dir, e Epoch, after uint64) ([]Record, error) {
	var got []Record
	err := d.Replay(e, after, func(r Record) error {
		got = append(got, r)
		return nil
	})
	return got, err
}

func replayAll(t testing.TB, d *Dir, e Epoch, after uint64) []Record {
	t.Helper()
	got, err := replay(d, e, after)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// checkRecords compares got with rec(q) for q in want.
func checkRecords(t testing.TB, got []Record, want []uint64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got %d records (%v), want %d (%v)", len(got), seqsOf(got), len(want), want)
	}
	for i, q := range want {
		w := rec(q)
		if g := got[i]; g.Seq != w.Seq || g.Master != w.Master || g.LastEventID != w.LastEventID ||
			g.UnixMilli != w.UnixMilli || !bytes.Equal(g.Payload, w.Payload) {
			t.Fatalf("record %d\n got %+v\nwant %+v", i, g, w)
		}
	}
}

func seqsOf(rs []Record) []uint64 {
	var s []uint64
	for _, r := range rs {
		s = append(s, r.Seq)
	}
	return s
}

func journalFiles(t testing.TB, d *Dir) []jfile {
	t.Helper()
	fs, err := listJournal(d.Path())
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

func fileSize(t testing.TB, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

func TestJournalRoundTrip(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	opts := Options{SyncInterval: time.Hour, MaxFileBytes: 300}
	d := openDir(t, dir, opts)
	e := NewEpoch()
	// Gaps are burned sequence numbers.
	want := []uint64{1, 2, 3, 5, 8, 9, 10, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27, 28, 40}
	j, err := d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range want {
		if err := j.Append(rec(q)); err != nil {
			t.Fatal(err)
		}
	}
	big := Record{Seq: 41, Payload: bytes.Repeat([]byte{7}, 1000)} // larger than a file
	if err := j.Append(big); err != nil {
		t.Fatal(err)
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	fs := journalFiles(t, d)
	if len(fs) < 4 {
		t.Fatalf("%d journal files, want rotation into several", len(fs))
	}
	for _, f := range fs {
		if size := fileSize(t, filepath.Join(dir, f.name)); size > opts.MaxFileBytes && f.first != 41 {
			t.Errorf("%s: %d bytes, limit %d", f.name, size, opts.MaxFileBytes)
		}
	}
	d.Close()

	d = openDir(t, dir, opts)
	got := replayAll(t, d, e, 0)
	if last := got[len(got)-1]; last.Seq != 41 || !bytes.Equal(last.Payload, big.Payload) {
		t.Fatalf("last record %d, want the big one", last.Seq)
	}
	checkRecords(t, got[:len(got)-1], want)
	checkRecords(t, replayAll(t, d, e, 9)[:9], []uint64{10, 11, 12, 20, 21, 22, 23, 24, 25})
	if got := replayAll(t, d, e, 41); len(got) != 0 {
		t.Fatalf("Replay after the last: %v", seqsOf(got))
	}

	// A new OpenJournal continues in a new file.
	before := len(journalFiles(t, d))
	writeJournal(t, d, e, []uint64{42, 43})
	if n := len(journalFiles(t, d)); n != before+1 {
		t.Fatalf("%d files after a reopen, want %d", n, before+1)
	}
	checkRecords(t, replayAll(t, d, e, 41), []uint64{42, 43})
}

func TestJournalAppendChecks(t *testing.T) {
	d := openDir(t, t.TempDir(), Options{})
	e := NewEpoch()
	j, err := d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.OpenJournal(e); err == nil {
		t.Fatal("second OpenJournal succeeded")
	}
	if err := j.Append(Record{Seq: 0}); err == nil {
		t.Fatal("seq 0 accepted")
	}
	if err := j.Append(rec(5)); err != nil {
		t.Fatal(err)
	}
	for _, q := range []uint64{5, 4} {
		if err := j.Append(rec(q)); err == nil {
			t.Fatalf("seq %d after 5 accepted", q)
		}
	}
	if err := j.Append(Record{Seq: 6, Payload: make([]byte, MaxPayload+1)}); err == nil {
		t.Fatal("oversized payload accepted")
	}
	if err := j.Append(rec(6)); err != nil {
		t.Fatalf("the journal failed on refused appends: %v", err)
	}
	if err := d.Replay(e, 0, func(Record) error { return nil }); err == nil {
		t.Fatal("Replay with an open journal succeeded")
	}
	if _, err := d.Tail(e, 1, 1); err == nil {
		t.Fatal("Tail with an open journal succeeded")
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	if err := j.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := j.Append(rec(7)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Append after Close: %v, want ErrClosed", err)
	}
	// Reopened, the journal knows its last seq.
	j, err = d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.Append(rec(6)); err == nil {
		t.Fatal("seq 6 accepted again after a reopen")
	}
	if err := j.Append(rec(7)); err != nil {
		t.Fatal(err)
	}
	d.Close() // closes the journal
	if err := j.Append(rec(8)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Append after Dir.Close: %v, want ErrClosed", err)
	}
	d = openDir(t, d.Path(), Options{})
	checkRecords(t, replayAll(t, d, e, 0), []uint64{5, 6, 7})
}

// TestJournalTornTail cuts the newest file's last record at every length:
// Replay drops it and succeeds, and appends continue after it.
func TestJournalTornTail(t *testing.T) {
	t.Parallel()
	for _, inLast := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d records in the last file", inLast), func(t *testing.T) {
			e := NewEpoch()
			const n = 7
			recLen := int64(len(appendRecord(nil, rec(n))))
			for k := range recLen {
				dir := t.TempDir()
				d := openDir(t, dir, Options{SyncInterval: time.Hour})
				writeJournal(t, d, e, seqs(1, n-uint64(inLast)))
				writeJournal(t, d, e, seqs(n-uint64(inLast)+1, n))
				fs := journalFiles(t, d)
				path := filepath.Join(dir, fs[len(fs)-1].name)
				size := fileSize(t, path)
				if err := os.Truncate(path, size-recLen+k); err != nil {
					t.Fatal(err)
				}
				d.Close()

				d = openDir(t, dir, Options{SyncInterval: time.Hour})
				checkRecords(t, replayAll(t, d, e, 0), seqs(1, n-1))
				if inLast == 1 {
					if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
						t.Fatalf("cut at %d: the emptied newest file is still there (%v)", k, err)
					}
				} else if got := fileSize(t, path); got != size-recLen {
					t.Fatalf("cut at %d: newest file %d bytes, want %d", k, got, size-recLen)
				}
				writeJournal(t, d, e, []uint64{n, n + 1})
				checkRecords(t, replayAll(t, d, e, 0), seqs(1, n+1))
			}
		})
	}
}

// TestJournalTornTailKinds: what counts as a torn tail of the newest file
// (truncated) and what is corruption.
func TestJournalTornTailKinds(t *testing.T) {
	t.Parallel()
	e := NewEpoch()
	setup := func(t *testing.T) (*Dir, string) {
		dir := t.TempDir()
		d := openDir(t, dir, Options{SyncInterval: time.Hour})
		writeJournal(t, d, e, seqs(1, 4))
		writeJournal(t, d, e, seqs(5, 8))
		fs := journalFiles(t, d)
		return d, filepath.Join(dir, fs[len(fs)-1].name)
	}
	appendBytes := func(t *testing.T, path string, b []byte) {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write(b); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	lastLen := int64(len(appendRecord(nil, rec(8))))

	t.Run("zeros after the last record", func(t *testing.T) {
		d, path := setup(t)
		size := fileSize(t, path)
		appendBytes(t, path, make([]byte, 5000))
		checkRecords(t, replayAll(t, d, e, 0), seqs(1, 8))
		if got := fileSize(t, path); got != size {
			t.Fatalf("size %d, want %d", got, size)
		}
	})
	t.Run("last record zeroed", func(t *testing.T) {
		d, path := setup(t)
		size := fileSize(t, path)
		if err := os.Truncate(path, size-lastLen); err != nil {
			t.Fatal(err)
		}
		appendBytes(t, path, make([]byte, lastLen))
		checkRecords(t, replayAll(t, d, e, 0), seqs(1, 7))
	})
	t.Run("bad CRC in the last record", func(t *testing.T) {
		d, path := setup(t)
		testutil.FlipByte(t, path, uint64(fileSize(t, path)-1))
		checkRecords(t, replayAll(t, d, e, 0), seqs(1, 7))
		// Truncated on disk: a second replay agrees, with no warning needed.
		checkRecords(t, replayAll(t, d, e, 0), seqs(1, 7))
	})
	t.Run("bad CRC followed by a record", func(t *testing.T) {
		d, path := setup(t)
		testutil.FlipByte(t, path, uint64(fileSize(t, path)-lastLen-1))
		if _, err := replay(d, e, 0); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Replay: %v, want ErrCorrupt", err)
		}
	})
	t.Run("garbage after the last record", func(t *testing.T) {
		d, path := setup(t)
		appendBytes(t, path, []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10})
		if _, err := replay(d, e, 0); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Replay: %v, want ErrCorrupt", err)
		}
	})
	t.Run("valid record out of order", func(t *testing.T) {
		d, path := setup(t)
		appendBytes(t, path, appendRecord(nil, rec(3)))
		if _, err := replay(d, e, 0); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Replay: %v, want ErrCorrupt", err)
		}
	})
}

func TestJournalCorruptOlderFile(t *testing.T) {
	t.Parallel()
	e := NewEpoch()
	setup := func(t *testing.T) (*Dir, string) {
		dir := t.TempDir()
		d := openDir(t, dir, Options{SyncInterval: time.Hour})
		writeJournal(t, d, e, seqs(1, 4))
		writeJournal(t, d, e, seqs(5, 8))
		return d, filepath.Join(dir, journalFiles(t, d)[0].name)
	}
	for _, tc := range []struct {
		name string
		edit func(t *testing.T, path string)
	}{
		{"bad CRC", func(t *testing.T, path string) { testutil.FlipByte(t, path, uint64(fileSize(t, path)-3)) }},
		{"bad CRC in the first record", func(t *testing.T, path string) { testutil.FlipByte(t, path, journalHeaderLen+20) }},
		{"torn tail", func(t *testing.T, path string) {
			if err := os.Truncate(path, fileSize(t, path)-1); err != nil {
				t.Fatal(err)
			}
		}},
		{"zeros after", func(t *testing.T, path string) {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.Write(make([]byte, 100))
			f.Close()
		}},
		{"bad magic", func(t *testing.T, path string) { testutil.FlipByte(t, path, 0) }},
		{"bad version", func(t *testing.T, path string) { testutil.FlipByte(t, path, 8) }},
		{"header cut short", func(t *testing.T, path string) {
			if err := os.Truncate(path, journalHeaderLen-1); err != nil {
				t.Fatal(err)
			}
		}},
		{"renamed", func(t *testing.T, path string) {
			if err := os.Rename(path, filepath.Join(filepath.Dir(path), journalName(2))); err != nil {
				t.Fatal(err)
			}
		}},
		{"overlapping files", func(t *testing.T, path string) {
			if err := os.Rename(path, filepath.Join(filepath.Dir(path), journalName(6))); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, path := setup(t)
			tc.edit(t, path)
			if _, err := replay(d, e, 0); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Replay: %v, want ErrCorrupt", err)
			}
			if _, err := d.Tail(e, 10, 1<<20); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Tail: %v, want ErrCorrupt", err)
			}
			if _, err := d.OpenJournal(e); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("OpenJournal: %v, want ErrCorrupt", err)
			}
		})
	}
}

func TestJournalWrongEpoch(t *testing.T) {
	d := openDir(t, t.TempDir(), Options{})
	e, other := NewEpoch(), NewEpoch()
	writeJournal(t, d, e, seqs(1, 3))
	if _, err := replay(d, other, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Replay under another epoch: %v, want ErrCorrupt", err)
	}
	if _, err := d.Tail(other, 10, 100); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Tail under another epoch: %v, want ErrCorrupt", err)
	}
	if _, err := d.OpenJournal(other); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("OpenJournal under another epoch: %v, want ErrCorrupt", err)
	}
	checkRecords(t, replayAll(t, d, e, 0), seqs(1, 3))
}

func TestJournalEmptyNewestFile(t *testing.T) {
	e := NewEpoch()
	for _, content := range [][]byte{nil, []byte("CRS"), appendJournalHeader(nil, e)} {
		dir := t.TempDir()
		d := openDir(t, dir, Options{})
		writeJournal(t, d, e, seqs(1, 3))
		// A crash between creating a file and writing its first record.
		empty := filepath.Join(dir, journalName(4))
		if err := os.WriteFile(empty, content, 0o640); err != nil {
			t.Fatal(err)
		}
		checkRecords(t, replayAll(t, d, e, 0), seqs(1, 3))
		if _, err := os.Stat(empty); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%d-byte newest file not removed: %v", len(content), err)
		}
		writeJournal(t, d, e, seqs(4, 5))
		checkRecords(t, replayAll(t, d, e, 0), seqs(1, 5))
	}
}

// TestOpenJournalVerifies: without Replay, OpenJournal truncates a torn
// tail itself before starting a new file after it.
func TestOpenJournalVerifies(t *testing.T) {
	dir := t.TempDir()
	e := NewEpoch()
	d := openDir(t, dir, Options{})
	writeJournal(t, d, e, seqs(1, 5))
	path := filepath.Join(dir, journalFiles(t, d)[0].name)
	if err := os.Truncate(path, fileSize(t, path)-3); err != nil {
		t.Fatal(err)
	}
	d.Close()
	d = openDir(t, dir, Options{})
	j, err := d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.Append(rec(5)); err != nil {
		t.Fatal(err)
	}
	j.Close()
	checkRecords(t, replayAll(t, d, e, 0), seqs(1, 5))
}

func TestTail(t *testing.T) {
	t.Parallel()
	d := openDir(t, t.TempDir(), Options{SyncInterval: time.Hour, MaxFileBytes: 500})
	e := NewEpoch()
	writeJournal(t, d, e, seqs(1, 100))
	payload := func(from, to uint64) int {
		n := 0
		for q := from; q <= to; q++ {
			n += len(rec(q).Payload)
		}
		return n
	}
	for _, tc := range []struct {
		name                 string
		maxRecords, maxBytes int
		want                 []uint64
	}{
		{"by records", 10, 1 << 20, seqs(91, 100)},
		{"all", 1000, 1 << 20, seqs(1, 100)},
		{"by bytes (80 is a heartbeat)", 1000, payload(81, 100), seqs(80, 100)},
		{"by bytes, one short", 1000, payload(81, 100) - 1, seqs(82, 100)},
		{"none", 0, 1 << 20, nil},
		{"heartbeats fit in no bytes", 10, 0, []uint64{100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := d.Tail(e, tc.maxRecords, tc.maxBytes)
			if err != nil {
				t.Fatal(err)
			}
			checkRecords(t, got, tc.want)
		})
	}
	// A record larger than maxBytes ends the ring: nothing before it.
	writeJournal(t, d, e, []uint64{101})
	j, err := d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.Append(Record{Seq: 102, Payload: make([]byte, 5000)}); err != nil {
		t.Fatal(err)
	}
	if err := j.Append(rec(103)); err != nil {
		t.Fatal(err)
	}
	j.Close()
	got, err := d.Tail(e, 10, 4000)
	if err != nil {
		t.Fatal(err)
	}
	checkRecords(t, got, []uint64{103})
}

func TestCompaction(t *testing.T) {
	t.Parallel()
	e := NewEpoch()
	for _, tc := range []struct {
		name     string
		ckptSeq  uint64
		keep     uint64
		minFirst uint64 // every record after this must remain
	}{
		{"ring reserve", 80, 10, 70},
		{"checkpoint behind the journal", 30, 1, 29},
		{"reserve larger than checkpoint", 50, 100, 0},
		{"checkpoint ahead of the journal", 1000, 10, 100},
		{"nothing", 0, 10, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := openDir(t, t.TempDir(), Options{SyncInterval: time.Hour, MaxFileBytes: 200, KeepSeqs: tc.keep})
			writeJournal(t, d, e, seqs(1, 100))
			before := journalFiles(t, d)
			if err := d.WriteCheckpoint(Header{PublisherEpoch: e, Seq: tc.ckptSeq}, nil); err != nil {
				t.Fatal(err)
			}
			after := journalFiles(t, d)
			got := replayAll(t, d, e, 0)
			first := got[0].Seq
			// Kept: everything after minFirst (and the newest file).
			if first > tc.minFirst+1 {
				t.Fatalf("first kept seq %d: records after %d were deleted", first, tc.minFirst)
			}
			checkRecords(t, got, seqs(first, 100))
			// Deleted: every file all of whose records are at most
			// minFirst, except the newest.
			for i, f := range before[:len(before)-1] {
				if before[i+1].first <= tc.minFirst+1 && slices.Contains(after, f) {
					t.Fatalf("%s (records up to %d) kept", f.name, before[i+1].first-1)
				}
			}
			if len(after) == 0 || after[len(after)-1] != before[len(before)-1] {
				t.Fatal("the newest file was deleted")
			}
		})
	}
}

func TestJournalWriteFailure(t *testing.T) {
	dir := t.TempDir()
	d := openDir(t, dir, Options{SyncInterval: time.Hour})
	e := NewEpoch()
	j, err := d.OpenJournal(e)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.Append(rec(1)); err != nil {
		t.Fatal(err)
	}
	// The disk goes away under the journal.
	j.mu.Lock()
	j.f.Close()
	j.mu.Unlock()
	err = j.Append(rec(2))
	if err == nil {
		t.Fatal("Append to a closed fd succeeded")
	}
	if err2 := j.Append(rec(3)); err2 != err {
		t.Fatalf("second Append: %v, want the same error %v", err2, err)
	}
	if err2 := j.Sync(); err2 != err {
		t.Fatalf("Sync: %v, want %v", err2, err)
	}
	if _, err := os.Stat(filepath.Join(dir, invalidName)); err != nil {
		t.Fatalf("no INVALID marker: %v", err)
	}
	if err2 := j.Close(); err2 != err {
		t.Fatalf("Close: %v, want %v", err2, err)
	}
	if _, _, err := d.LoadCheckpoint(nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("LoadCheckpoint: %v, want ErrCorrupt", err)
	}
	if _, err := replay(d, e, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Replay: %v, want ErrCorrupt", err)
	}
	d.Close()
	d = openDir(t, dir, Options{})
	if _, err := replay(d, e, 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Replay after restart: %v, want ErrCorrupt", err)
	}
	if err := d.Reset(err); err != nil {
		t.Fatal(err)
	}
	writeJournal(t, d, NewEpoch(), seqs(1, 2))
}

func TestJournalSyncFailure(t *testing.T) {
	dir := t.TempDir()
	d := openDir(t, dir, Options{SyncInterval: time.Hour})
	j, err := d.OpenJournal(NewEpoch())
	if err != nil {
		t.Fatal(err)
	}
	if err := j.Append(rec(1)); err != nil {
		t.Fatal(err)
	}
	j.mu.Lock()
	j.f.Close()
	j.mu.Unlock()
	if err := j.Sync(); err == nil {
		t.Fatal("Sync of a closed fd succeeded")
	}
	if err := j.Append(rec(2)); err == nil {
		t.Fatal("Append after a failed Sync succeeded")
	}
	if _, err := os.Stat(filepath.Join(dir, invalidName)); err != nil {
		t.Fatalf("no INVALID marker: %v", err)
	}
}

func TestJournalSyncInterval(t *testing.T) {
	for _, tc := range []struct {
		interval  time.Duration
		wantSyncs int
	}{
		{0, 10},
		{time.Hour, 0},
	} {
		d := openDir(t, t.TempDir(), Options{SyncInterval: tc.interval})
		j, err := d.OpenJournal(NewEpoch())
		if err != nil {
			t.Fatal(err)
		}
		for q := range uint64(10) {
			if err := j.Append(rec(q + 1)); err != nil {
				t.Fatal(err)
			}
		}
		if j.syncs != tc.wantSyncs {
			t.Fatalf("interval %v: %d fsyncs for 10 appends, want %d", tc.interval, j.syncs, tc.wantSyncs)
		}
		if err := j.Sync(); err != nil {
			t.Fatal(err)
		}
		if want := tc.wantSyncs + 1; tc.interval > 0 && j.syncs != want {
			t.Fatalf("after Sync: %d fsyncs, want %d", j.syncs, want)
		}
		j.Close()
	}
	// An elapsed interval is noticed by the next Append.
	d := openDir(t, t.TempDir(), Options{SyncInterval: time.Millisecond})
	j, err := d.OpenJournal(NewEpoch())
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	j.lastSync = time.Now().Add(-time.Second)
	if err := j.Append(rec(1)); err != nil {
		t.Fatal(err)
	}
	if j.syncs != 1 {
		t.Fatalf("%d fsyncs after the interval passed, want 1", j.syncs)
	}
}

func TestDecodeRecordShort(t *testing.T) {
	b := appendRecord(nil, rec(3))
	for n := range len(b) {
		if _, _, err := decodeRecord(b[:n]); err != errShort {
			t.Fatalf("cut to %d of %d: %v, want errShort", n, len(b), err)
		}
	}
	r, n, err := decodeRecord(append(b, 1, 2, 3))
	if err != nil || n != len(b) {
		t.Fatalf("decode: %d, %v", n, err)
	}
	checkRecords(t, []Record{r}, []uint64{3})
}

func TestListJournalIgnoresOtherNames(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"journal-1.log", "xjournal-00000000000000000001.log", "journal-0000000000000000000a.log",
		"journal-00000000000000000001.log.bak", "checkpoint", journalName(3)} {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, journalName(1)), 0o750); err != nil {
		t.Fatal(err)
	}
	fs, err := listJournal(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := []jfile{{journalName(3), 3}}; !slices.Equal(fs, want) {
		t.Fatalf("listJournal: %v, want %v", fs, want)
	}
}
