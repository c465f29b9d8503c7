package segment

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

func TestDiskSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	s, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatalf("OpenDisk: %v", err)
	}
	if rec.Existing {
		t.Fatal("fresh directory reported as existing")
	}
	id := s.ID()
	type obj struct {
		alloc *masterv1.Allocation
		data  []byte
	}
	var kept []obj
	for i := range 5 {
		data := randBytes(5000+i*1000, uint64(i))
		a := reserve(t, s, "k"+string(rune('a'+i)), uint64(len(data)))
		write(t, s, a.GetAllocationId(), data)
		if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
			t.Fatalf("Seal: %v", err)
		}
		kept = append(kept, obj{a, data})
	}
	// One released, one left RESERVED.
	if err := s.Release(kept[1].alloc.GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncJournal(); err != nil {
		t.Fatal(err)
	}
	kept = append(kept[:1], kept[2:]...)
	pending := reserve(t, s, "pending", 100)
	usedBefore := s.Info().GetUsed() - 4096
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s2, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer s2.Close()
	if !rec.Existing || rec.Sealed != 4 || rec.TruncatedBytes != 0 {
		t.Fatalf("Recovery = %+v, want existing with 4 sealed", rec)
	}
	if s2.ID() != id {
		t.Fatalf("reopened id %s, want %s", s2.ID(), id)
	}
	if _, ok := s2.Lookup(pending.GetAllocationId()); ok {
		t.Fatal("RESERVED allocation survived the restart")
	}
	if got := s2.Info().GetUsed(); got != usedBefore {
		t.Fatalf("used after restart = %d, want %d", got, usedBefore)
	}
	for _, o := range kept {
		got, ok := s2.Lookup(o.alloc.GetAllocationId())
		if !ok || got.GetKey() != o.alloc.GetKey() || got.GetChecksum() != checksum.Sum(o.data) || got.GetTenant() != "t" || got.GetGroupId() != "g" {
			t.Fatalf("row after restart = %v", got)
		}
		if b := read(t, s2, o.alloc.GetAllocationId()); !bytes.Equal(b, o.data) {
			t.Fatalf("object %s bytes differ after restart", o.alloc.GetKey())
		}
	}
	// Ids are never reused, even those of dropped reservations.
	a := reserve(t, s2, "new", 10)
	if a.GetAllocationId() <= pending.GetAllocationId() {
		t.Fatalf("new id %d reuses an id at or below %d", a.GetAllocationId(), pending.GetAllocationId())
	}
}

func TestDiskRejectsResize(t *testing.T) {
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	if _, _, err := OpenDisk(dir, 2<<20); err == nil {
		t.Fatal("OpenDisk with another size = nil error, want error")
	}
}

func TestDiskTornTail(t *testing.T) {
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	data := randBytes(100, 9)
	a := reserve(t, s, "k", 100)
	write(t, s, a.GetAllocationId(), data)
	if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	// A crash mid-append leaves half a record.
	jp := filepath.Join(dir, journalName)
	f, err := os.OpenFile(jp, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	torn := encodeSeal(&entry{id: 99, size: 1, tenant: "x"})
	if _, err := f.Write(torn[:len(torn)-3]); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()

	s2, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if rec.TruncatedBytes != len(torn)-3 || rec.Sealed != 1 {
		t.Fatalf("Recovery = %+v, want 1 sealed and %d truncated", rec, len(torn)-3)
	}
	if b := read(t, s2, a.GetAllocationId()); !bytes.Equal(b, data) {
		t.Fatal("sealed object lost with a torn tail")
	}
}

func TestJournalCompaction(t *testing.T) {
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<24)
	if err != nil {
		t.Fatal(err)
	}
	s.jrn.slack = 20
	var keep *masterv1.Allocation
	for i := range 60 {
		a := reserve(t, s, "k", 10)
		if err := seal(s, a.GetAllocationId(), checksum.Sum(make([]byte, 10))); err != nil {
			t.Fatal(err)
		}
		if i == 5 {
			keep = a
			continue
		}
		if err := s.Release(a.GetAllocationId()); err != nil {
			t.Fatal(err)
		}
	}
	if r := s.jrn.records; r > 40 {
		t.Fatalf("journal holds %d records after churn, want compaction", r)
	}
	_ = s.Close()
	s2, rec, err := OpenDisk(dir, 1<<24)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if rec.Sealed != 1 {
		t.Fatalf("after compaction %d sealed, want 1", rec.Sealed)
	}
	if _, ok := s2.Lookup(keep.GetAllocationId()); !ok {
		t.Fatal("kept allocation lost in compaction")
	}
}

func TestJournalRoundTrip(t *testing.T) {
	e := &entry{id: 7, offset: 4096, size: 100, replica: 3, checksum: 0xdead, hardPin: true, softPin: -1, created: 5, sealed: 6, tenant: "ten", key: "a/b\x00c", group: ""}
	buf := append(encodeSeal(e), encodeU64(recRelease, 9)...)
	buf = append(buf, encodeU64(recIDLimit, 1<<40)...)
	recs, n := decodeRecords(buf)
	if n != len(buf) || len(recs) != 3 {
		t.Fatalf("decoded %d records of %d bytes, want 3 of %d", len(recs), n, len(buf))
	}
	got := recs[0].entry
	e.state = masterv1.AllocationState_ALLOCATION_STATE_SEALED
	if *got != *e {
		t.Fatalf("round trip = %+v, want %+v", got, e)
	}
	if recs[1].typ != recRelease || recs[1].id != 9 || recs[2].typ != recIDLimit || recs[2].id != 1<<40 {
		t.Fatalf("records = %+v", recs[1:])
	}
}

// FuzzJournal feeds arbitrary bytes to the journal decoders: they never
// panic, the valid prefix re-encodes to the same bytes, and replay accepts it.
func FuzzJournal(f *testing.F) {
	e := &entry{id: 1, offset: 0, size: 10, tenant: "t", key: "k"}
	f.Add(append(encodeSeal(e), encodeU64(recRelease, 1)...))
	f.Add(encodeU64(recIDLimit, 5))
	f.Add(journalHeader{capacity: 1 << 20, alignment: 4096}.encode())
	f.Add([]byte{0, 0, 0, 1, 0, 0, 0, 0, 9})
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = decodeHeader(b)
		recs, n := decodeRecords(b)
		if n < 0 || n > len(b) {
			t.Fatalf("valid prefix %d of %d bytes", n, len(b))
		}
		var re []byte
		for _, r := range recs {
			switch r.typ {
			case recSeal:
				re = append(re, encodeSeal(r.entry)...)
			default:
				re = append(re, encodeU64(r.typ, r.id)...)
			}
		}
		if !bytes.Equal(re, b[:n]) {
			t.Fatalf("re-encoding the valid prefix differs")
		}
		live, _ := replay(recs)
		for id, e := range live {
			if id != e.id {
				t.Fatalf("live[%d] holds id %d", id, e.id)
			}
		}
	})
}

// TestDiskRehashesOldJournal: a journal written before issue 18 holds
// xxhash64 checksums and no flagXXH3. OpenDisk rehashes each object once,
// keeps the old checksum of one whose bytes no longer match it (so
// verification still finds it corrupt), and rewrites the journal with the
// flag, so the next open does not rehash again.
func TestDiskRehashesOldJournal(t *testing.T) {
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	datas := make([][]byte, 3)
	ids := make([]uint64, 3)
	for i := range datas {
		datas[i] = randBytes(7000+i, uint64(i+40))
		a := reserve(t, s, "old"+string(rune('a'+i)), uint64(len(datas[i])))
		write(t, s, a.GetAllocationId(), datas[i])
		if err := seal(s, a.GetAllocationId(), checksum.Sum(datas[i])); err != nil {
			t.Fatal(err)
		}
		ids[i] = a.GetAllocationId()
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// Turn it into a journal of the old format: xxhash64 checksums, no
	// flag; object 2's checksum is of other bytes (it went bad on disk).
	raw, err := os.ReadFile(filepath.Join(dir, journalName))
	if err != nil {
		t.Fatal(err)
	}
	hdr, err := decodeHeader(raw)
	if err != nil || hdr.flags != flagXXH3 {
		t.Fatalf("new journal header %+v, %v: want flagXXH3", hdr, err)
	}
	recs, _ := decodeRecords(raw[headerLen:])
	live, limit := replay(recs)
	var entries []*entry
	for i, id := range ids {
		e := live[id]
		e.checksum = xxhash.Sum64(datas[i])
		if i == 2 {
			e.checksum = xxhash.Sum64([]byte("other bytes"))
		}
		entries = append(entries, e)
	}
	hdr.flags = 0
	f, _, err := writeJournal(dir, hdr, limit, entries)
	if err != nil {
		t.Fatal(err)
	}
	_ = f.Close()

	s2, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Sealed != 3 || rec.Rehashed != 3 || rec.Mismatched != 1 {
		t.Fatalf("Recovery = %+v, want 3 sealed, 3 rehashed, 1 mismatched", rec)
	}
	for i, id := range ids {
		got, _ := s2.Lookup(id)
		want := checksum.Sum(datas[i])
		if i == 2 {
			want = xxhash.Sum64([]byte("other bytes"))
		}
		if got.GetChecksum() != want {
			t.Errorf("object %d: checksum %#x after the rehash, want %#x", i, got.GetChecksum(), want)
		}
	}
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
	s3, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	if rec.Sealed != 3 || rec.Rehashed != 0 {
		t.Fatalf("second open: Recovery = %+v, want 3 sealed and nothing rehashed", rec)
	}
	if got, _ := s3.Lookup(ids[0]); got.GetChecksum() != checksum.Sum(datas[0]) {
		t.Fatalf("second open: checksum %#x, want %#x", got.GetChecksum(), checksum.Sum(datas[0]))
	}
}
