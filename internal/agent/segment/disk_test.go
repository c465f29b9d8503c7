package segment

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
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
		if err := seal(s, a.GetAllocationId(), xxhash.Sum64(data)); err != nil {
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
		if !ok || got.GetKey() != o.alloc.GetKey() || got.GetChecksum() != xxhash.Sum64(o.data) || got.GetTenant() != "t" || got.GetGroupId() != "g" {
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
	if err := seal(s, a.GetAllocationId(), xxhash.Sum64(data)); err != nil {
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
		if err := seal(s, a.GetAllocationId(), xxhash.Sum64(make([]byte, 10))); err != nil {
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
