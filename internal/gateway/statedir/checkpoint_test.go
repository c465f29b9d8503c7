package statedir

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"iter"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

func loadAll(t testing.TB, d *Dir) (Header, bool, []kvevent.Event, error) {
	t.Helper()
	var got []kvevent.Event
	h, found, err := d.LoadCheckpoint(func(ev kvevent.Event) error {
		got = append(got, ev)
		return nil
	})
	return h, found, got, err
}

func TestCheckpointRoundTrip(t *testing.T) {
	t.Parallel()
	many := make([]kvevent.Event, 0, 3000)
	for i := range 1000 {
		for k := range 3 {
			many = append(many, kvevent.Event{Type: kvevent.Stored, Tenant: fmt.Sprintf("tenant-%d", i),
				Key: fmt.Sprintf("k%d", k), Medium: kvevent.MediumCPU, GroupID: "g"})
		}
	}
	maxLen := []kvevent.Event{
		{Type: kvevent.Stored, Tenant: strings.Repeat("t", MaxTenantLen), Key: strings.Repeat("k", MaxKeyLen),
			Medium: kvevent.MediumDisk, GroupID: strings.Repeat("g", MaxGroupLen)},
		{Type: kvevent.Stored, Tenant: strings.Repeat("t", MaxTenantLen), Key: strings.Repeat("\xff", MaxKeyLen),
			Medium: kvevent.MediumCPU, GroupID: strings.Repeat("\x00", MaxGroupLen)},
		{Type: kvevent.Stored, Tenant: "", Key: "", Medium: kvevent.MediumCPU},
	}
	// One tenant, more than one buffered run's worth, then another tenant
	// and the first again: runs of the same tenant.
	long := make([]kvevent.Event, 0, 70000)
	for i := range 60000 {
		long = append(long, kvevent.Event{Type: kvevent.Stored, Tenant: "big", Key: fmt.Sprintf("key/%08d/%s", i, strings.Repeat("z", 20)),
			Medium: kvevent.MediumDisk, GroupID: fmt.Sprintf("g%d", i%5)})
	}
	long = append(long, kvevent.Event{Type: kvevent.Stored, Tenant: "small", Key: "a", Medium: kvevent.MediumCPU},
		kvevent.Event{Type: kvevent.Stored, Tenant: "big", Key: "again", Medium: kvevent.MediumCPU})
	untyped := []kvevent.Event{{Tenant: "t", Key: "k", Medium: kvevent.MediumCPU}}

	for _, tc := range []struct {
		name   string
		events []kvevent.Event
	}{
		{"empty", nil},
		{"sample", sampleEvents(100)},
		{"many tenants", many},
		{"max lengths", maxLen},
		{"long runs", long},
		{"type unset", untyped},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := openDir(t, t.TempDir(), Options{})
			want := Header{
				PublisherEpoch:   NewEpoch(),
				Seq:              1<<63 + 5,
				Master:           Position{Epoch: 7, Revision: 1 << 40},
				LastEventID:      123456789,
				WrittenUnixMilli: -5,
				Subscribers:      3,
				Entries:          999, // ignored: counted
			}
			if err := d.WriteCheckpoint(want, slices.Values(tc.events)); err != nil {
				t.Fatal(err)
			}
			h, found, got, err := loadAll(t, d)
			if err != nil || !found {
				t.Fatalf("LoadCheckpoint: found %v, err %v", found, err)
			}
			want.Entries = uint64(len(tc.events))
			if h != want {
				t.Fatalf("header\n got %+v\nwant %+v", h, want)
			}
			if len(got) != len(tc.events) {
				t.Fatalf("got %d entries, want %d", len(got), len(tc.events))
			}
			for i, ev := range tc.events {
				ev.Type = kvevent.Stored
				if got[i] != ev {
					t.Fatalf("entry %d\n got %+v\nwant %+v", i, got[i], ev)
				}
			}
		})
	}
}

func TestCheckpointFromAnnouncedSet(t *testing.T) {
	t.Parallel()
	set := announced.New()
	want := map[kvevent.Event]bool{}
	for i := range 5000 {
		ev := kvevent.Event{Type: kvevent.Stored, Tenant: fmt.Sprintf("t%d", i%17), Key: fmt.Sprintf("key-%d", i),
			Medium: []kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}[i%2], GroupID: fmt.Sprintf("g%d", i%3)}
		set.Store(ev.Tenant, ev.Key, ev.Medium, ev.GroupID)
		want[ev] = true
	}
	d := openDir(t, t.TempDir(), Options{})
	if err := d.WriteCheckpoint(Header{Seq: 9}, set.All()); err != nil {
		t.Fatal(err)
	}
	h, _, got, err := loadAll(t, d)
	if err != nil {
		t.Fatal(err)
	}
	if h.Entries != uint64(len(want)) || len(got) != len(want) {
		t.Fatalf("entries %d (header %d), want %d", len(got), h.Entries, len(want))
	}
	for _, ev := range got {
		if !want[ev] {
			t.Fatalf("unexpected entry %+v", ev)
		}
	}
	// Tenants come in one run each.
	raw, err := os.ReadFile(filepath.Join(d.Path(), checkpointName))
	if err != nil {
		t.Fatal(err)
	}
	if _, runs, err := decodeCkptHeader(raw); err != nil || runs != 17 {
		t.Fatalf("runs %d (%v), want 17", runs, err)
	}
}

func TestCheckpointNotFound(t *testing.T) {
	d := openDir(t, t.TempDir(), Options{})
	h, found, err := d.LoadCheckpoint(func(kvevent.Event) error { t.Fatal("fn called"); return nil })
	if found || err != nil || h != (Header{}) {
		t.Fatalf("LoadCheckpoint of nothing: %+v, %v, %v", h, found, err)
	}
}

func TestCheckpointRejectsBadEntries(t *testing.T) {
	t.Parallel()
	d := openDir(t, t.TempDir(), Options{})
	good := sampleEvents(10)
	if err := d.WriteCheckpoint(Header{Seq: 1}, slices.Values(good)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		ev   kvevent.Event
	}{
		{"tenant too long", kvevent.Event{Tenant: strings.Repeat("t", MaxTenantLen+1), Key: "k", Medium: kvevent.MediumCPU}},
		{"key too long", kvevent.Event{Key: strings.Repeat("k", MaxKeyLen+1), Medium: kvevent.MediumCPU}},
		{"group too long", kvevent.Event{Key: "k", Medium: kvevent.MediumCPU, GroupID: strings.Repeat("g", MaxGroupLen+1)}},
		{"no medium", kvevent.Event{Key: "k"}},
		{"removed", kvevent.Event{Type: kvevent.Removed, Key: "k", Medium: kvevent.MediumCPU}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := d.WriteCheckpoint(Header{Seq: 2}, slices.Values(append(slices.Clone(good), tc.ev))); err == nil {
				t.Fatal("WriteCheckpoint succeeded")
			}
			h, _, got, err := loadAll(t, d)
			if err != nil || h.Seq != 1 || len(got) != len(good) {
				t.Fatalf("old checkpoint: seq %d, %d entries, %v", h.Seq, len(got), err)
			}
			if slices.Contains(names(t, d.Path()), checkpointTmp) {
				t.Fatal("checkpoint.tmp left behind")
			}
		})
	}
	if err := d.WriteCheckpoint(Header{Subscribers: -1}, nil); err == nil {
		t.Fatal("negative subscribers accepted")
	}
}

func TestCheckpointFnError(t *testing.T) {
	d := openDir(t, t.TempDir(), Options{})
	if err := d.WriteCheckpoint(Header{}, slices.Values(sampleEvents(10))); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	if _, _, err := d.LoadCheckpoint(func(kvevent.Event) error { return boom }); !errors.Is(err, boom) || errors.Is(err, ErrCorrupt) {
		t.Fatalf("LoadCheckpoint: %v, want fn's error", err)
	}
}

// smallCheckpoint writes a checkpoint of a few entries and returns its path
// and bytes.
func smallCheckpoint(t *testing.T, d *Dir) (string, []byte) {
	t.Helper()
	if err := d.WriteCheckpoint(Header{PublisherEpoch: NewEpoch(), Seq: 42, Subscribers: 2}, slices.Values(sampleEvents(6))); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(d.Path(), checkpointName)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return path, b
}

func TestCheckpointTorn(t *testing.T) {
	t.Parallel()
	d := openDir(t, t.TempDir(), Options{})
	path, b := smallCheckpoint(t, d)
	for n := range len(b) {
		if err := os.WriteFile(path, b[:n], 0o640); err != nil {
			t.Fatal(err)
		}
		if _, found, _, err := loadAll(t, d); !errors.Is(err, ErrCorrupt) || found {
			t.Fatalf("checkpoint cut to %d of %d bytes: found %v, err %v; want ErrCorrupt", n, len(b), found, err)
		}
	}
	if err := os.WriteFile(path, append(slices.Clone(b), 0), 0o640); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := loadAll(t, d); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("checkpoint with a trailing byte: %v, want ErrCorrupt", err)
	}
}

func TestCheckpointFlippedByte(t *testing.T) {
	t.Parallel()
	d := openDir(t, t.TempDir(), Options{})
	path, b := smallCheckpoint(t, d)
	for off := range len(b) {
		testutil.FlipByte(t, path, uint64(off))
		if _, _, got, err := loadAll(t, d); !errors.Is(err, ErrCorrupt) || len(got) != 0 {
			t.Fatalf("byte %d flipped: %d entries, err %v; want ErrCorrupt before any entry", off, len(got), err)
		}
		testutil.FlipByte(t, path, uint64(off))
	}
	if _, _, _, err := loadAll(t, d); err != nil {
		t.Fatal(err)
	}
}

// TestCheckpointDecodeChecks covers the structural checks behind the hash:
// each case is a well-hashed file with one thing wrong.
func TestCheckpointDecodeChecks(t *testing.T) {
	run := func(tenant string, count uint64, entries ...[]byte) []byte {
		b := appendUvarint(nil, uint64(len(tenant)))
		b = append(b, tenant...)
		b = appendUvarint(b, count)
		for _, e := range entries {
			b = append(b, e...)
		}
		return b
	}
	entry := func(m byte, key, group string) []byte {
		b := append([]byte{m}, appendUvarint(nil, uint64(len(key)))...)
		b = append(b, key...)
		b = append(b, appendUvarint(nil, uint64(len(group)))...)
		return append(b, group...)
	}
	ok := entry(1, "k", "g")
	for _, tc := range []struct {
		name          string
		entries, runs uint64
		body          []byte
		wantErr       bool
	}{
		{"valid", 2, 2, slices.Concat(run("a", 1, ok), run("a", 1, ok)), false},
		{"more entries than said", 1, 1, run("a", 2, ok, ok), true},
		{"fewer entries than said", 3, 1, run("a", 2, ok, ok), true},
		{"empty run", 1, 2, slices.Concat(run("a", 0), run("a", 1, ok)), true},
		{"more runs than entries", 1, 2, run("a", 1, ok), true},
		{"trailing bytes", 1, 1, append(run("a", 1, ok), 0), true},
		{"medium 0", 1, 1, run("a", 1, entry(0, "k", "")), true},
		{"medium 3", 1, 1, run("a", 1, entry(3, "k", "")), true},
		{"tenant too long", 1, 1, run(strings.Repeat("t", MaxTenantLen+1), 1, ok), true},
		{"key too long", 1, 1, run("a", 1, entry(1, strings.Repeat("k", MaxKeyLen+1), "")), true},
		{"group too long", 1, 1, run("a", 1, entry(1, "k", strings.Repeat("g", MaxGroupLen+1))), true},
		{"non-minimal uvarint", 1, 1, slices.Concat([]byte{0x81, 0x00, 'a'}, appendUvarint(nil, 1), ok), true},
		{"huge length", 1, 1, slices.Concat([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, ok), true},
		{"uvarint overflow", 1, 1, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := appendCkptHeader(nil, Header{Entries: tc.entries}, tc.runs)
			b := withTrailer(append(h, tc.body...))
			_, err := decodeCheckpoint(bytes.NewReader(b), int64(len(b)), nil)
			if tc.wantErr != (err != nil) || err != nil && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decode: %v, want error %v (ErrCorrupt)", err, tc.wantErr)
			}
		})
	}
	for _, tc := range []struct {
		name string
		edit func(h []byte)
	}{
		{"magic", func(h []byte) { h[0] = 'X' }},
		{"version", func(h []byte) { h[8] = 2 }},
		{"subscribers", func(h []byte) { h[12+EpochLen+40+7] = 0x80 }},
	} {
		t.Run("header "+tc.name, func(t *testing.T) {
			h := appendCkptHeader(nil, Header{}, 0)
			tc.edit(h)
			b := withTrailer(h)
			if _, err := decodeCheckpoint(bytes.NewReader(b), int64(len(b)), nil); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decode: %v, want ErrCorrupt", err)
			}
		})
	}
}

func appendUvarint(b []byte, v uint64) []byte { return binary.AppendUvarint(b, v) }

// withTrailer appends the xxhash64 trailer to b.
func withTrailer(b []byte) []byte {
	return binary.LittleEndian.AppendUint64(b, xxhash.Sum64(b))
}

// encodeCheckpoint is the checkpoint of h and evs, in memory.
func encodeCheckpoint(t testing.TB, h Header, evs iter.Seq[kvevent.Event]) []byte {
	t.Helper()
	var body bytes.Buffer
	enc := ckptEncoder{w: &body}
	if evs == nil {
		evs = slices.Values([]kvevent.Event(nil))
	}
	for ev := range evs {
		if err := enc.add(ev); err != nil {
			t.Fatal(err)
		}
	}
	if err := enc.flush(); err != nil {
		t.Fatal(err)
	}
	h.Entries = enc.entries
	return withTrailer(append(appendCkptHeader(nil, h, enc.runs), body.Bytes()...))
}

func TestEncodeCheckpointMatchesFile(t *testing.T) {
	d := openDir(t, t.TempDir(), Options{})
	h := Header{PublisherEpoch: NewEpoch(), Seq: 42, Subscribers: 2}
	if err := d.WriteCheckpoint(h, slices.Values(sampleEvents(6))); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(d.Path(), checkpointName))
	if err != nil {
		t.Fatal(err)
	}
	if want := encodeCheckpoint(t, h, slices.Values(sampleEvents(6))); !bytes.Equal(b, want) {
		t.Fatalf("file\n%x\nin memory\n%x", b, want)
	}
}
