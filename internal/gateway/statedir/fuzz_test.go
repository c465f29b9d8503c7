package statedir

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"slices"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// fixCRCs rewrites the CRC of every whole record in b (a sequence of
// records), so the fuzzer can reach the checks behind the CRC.
func fixCRCs(b []byte) {
	for len(b) >= recPrefixLen {
		n, err := recordLen(b)
		if err != nil || n > len(b) {
			return
		}
		binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b[recPrefixLen:n], castagnoli))
		b = b[n:]
	}
}

// FuzzRecordDecode feeds arbitrary bytes to the record decoder and, as the
// records of a journal file (newest and not), to the file verifier Replay
// runs. Neither may panic; every failure is errShort or ErrCorrupt;
// whatever is accepted re-encodes to the same bytes; a torn tail is
// accepted only in the newest file, and exactly after the records kept.
func FuzzRecordDecode(f *testing.F) {
	var valid []byte
	for _, q := range []uint64{1, 2, 3, 4, 7} {
		valid = appendRecord(valid, rec(q))
	}
	f.Add(appendRecord(nil, rec(1)), false)
	f.Add(appendRecord(nil, Record{Seq: 1}), false)
	f.Add(valid, false)
	f.Add(valid[:len(valid)-5], false)
	f.Add(append(slices.Clone(valid), make([]byte, 64)...), false)
	f.Add(append(slices.Clone(valid), appendRecord(nil, rec(2))...), true)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 1}, false)
	f.Add([]byte{39, 0, 0, 0, 0, 0, 0, 0}, true)

	e := Epoch{1, 2, 3}
	f.Fuzz(func(t *testing.T, data []byte, fix bool) {
		if fix {
			data = slices.Clone(data)
			fixCRCs(data)
		}
		r, n, err := decodeRecord(data)
		switch {
		case err == nil:
			if n < recPrefixLen+recFixedLen || n > len(data) {
				t.Fatalf("decoded length %d of %d bytes", n, len(data))
			}
			if re := appendRecord(nil, r); !bytes.Equal(re, data[:n]) {
				t.Fatalf("re-encoded\n%x\nwant\n%x", re, data[:n])
			}
		case err != errShort && !errors.Is(err, ErrCorrupt):
			t.Fatalf("decode: %v, want errShort or ErrCorrupt", err)
		}

		// The same bytes as a journal file named after the first
		// record's seq (so the name check is not all it reaches).
		var first uint64 = 1
		if len(data) >= recPrefixLen+8 {
			first = binary.LittleEndian.Uint64(data[recPrefixLen:])
		}
		file := append(appendJournalHeader(nil, e), data...)
		scan := func(newest bool) ([]byte, *tornTail, error) {
			var got []byte
			var last uint64
			_, torn, err := scanRecords(bytes.NewReader(file), int64(len(file)), first, e, newest, &last, func(r Record) error {
				got = appendRecord(got, r)
				return nil
			})
			if err != nil && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("scan (newest %v): %v, want ErrCorrupt", newest, err)
			}
			if err == nil && !bytes.HasPrefix(data, got) {
				t.Fatalf("scan (newest %v): records are not a prefix of the file", newest)
			}
			return got, torn, err
		}
		got, torn, err := scan(true)
		if err == nil {
			switch {
			case torn == nil && len(got) != len(data):
				t.Fatalf("%d of %d bytes of records accepted, no torn tail", len(got), len(data))
			case torn != nil && torn.off != int64(journalHeaderLen+len(got)):
				t.Fatalf("torn tail at %d, after %d bytes of records", torn.off, len(got))
			}
		}
		got2, torn2, err2 := scan(false)
		if torn2 != nil {
			t.Fatal("a torn tail accepted in an older file")
		}
		if (err2 == nil) != (err == nil && torn == nil) || err2 == nil && !bytes.Equal(got, got2) {
			t.Fatalf("older file: %v; as the newest: %v, torn %v", err2, err, torn)
		}
	})
}

// FuzzCheckpointDecode feeds arbitrary bytes to the checkpoint decoder;
// with fix, the trailer is recomputed so the structure behind the hash is
// reached. It must never panic; every failure is ErrCorrupt; whatever is
// accepted has exactly the header's number of entries and survives an
// encode/decode round trip unchanged.
func FuzzCheckpointDecode(f *testing.F) {
	h := Header{PublisherEpoch: Epoch{9}, Seq: 77, Master: Position{2, 3}, LastEventID: 4, WrittenUnixMilli: 5, Subscribers: 6}
	f.Add(encodeCheckpoint(f, h, nil), false)
	f.Add(encodeCheckpoint(f, h, slices.Values(sampleEvents(12))), false)
	f.Add(encodeCheckpoint(f, h, slices.Values([]kvevent.Event{
		{Tenant: strings.Repeat("t", MaxTenantLen), Key: strings.Repeat("k", MaxKeyLen), Medium: kvevent.MediumDisk, GroupID: strings.Repeat("g", MaxGroupLen)},
	})), false)
	b := encodeCheckpoint(f, h, slices.Values(sampleEvents(3)))
	f.Add(b[:len(b)-10], true)
	f.Add(append(slices.Clone(b), 1), true)

	f.Fuzz(func(t *testing.T, data []byte, fix bool) {
		if fix && len(data) >= ckptTrailerLen {
			data = withTrailer(slices.Clone(data[:len(data)-ckptTrailerLen]))
		}
		var evs []kvevent.Event
		h, err := decodeCheckpoint(bytes.NewReader(data), int64(len(data)), func(ev kvevent.Event) error {
			evs = append(evs, ev)
			return nil
		})
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decode: %v, want ErrCorrupt", err)
			}
			return
		}
		if uint64(len(evs)) != h.Entries {
			t.Fatalf("%d entries, header says %d", len(evs), h.Entries)
		}
		re := encodeCheckpoint(t, h, slices.Values(evs))
		var evs2 []kvevent.Event
		h2, err := decodeCheckpoint(bytes.NewReader(re), int64(len(re)), func(ev kvevent.Event) error {
			evs2 = append(evs2, ev)
			return nil
		})
		if err != nil {
			t.Fatalf("re-decode: %v", err)
		}
		if h2 != h || !slices.Equal(evs2, evs) {
			t.Fatalf("round trip changed the checkpoint\n got %+v %v\nwant %+v %v", h2, evs2, h, evs)
		}
	})
}
