package app

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/master/meta"
)

// TestFileLedger: records written and forgotten are what the next open
// reads; a file that does not decode fails the open (the master must not
// start without knowing what to distrust), and says how to start anyway.
func TestFileLedger(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	l, recs, err := openFileLedger(dir)
	if err != nil || len(recs) != 0 {
		t.Fatalf("open of an empty state dir = %v, %v", recs, err)
	}
	a := meta.UnsettledSegment{ID: "seg-a", Agent: "agent-a", Memory: true}
	b := meta.UnsettledSegment{ID: "seg-b", Agent: "agent-b"}
	c := meta.UnsettledSegment{ID: "seg-c \"quoted\"\n", Agent: "agent-c"}
	if err := l.Record(t.Context(), []meta.UnsettledSegment{a, b}); err != nil {
		t.Fatal(err)
	}
	if err := l.Record(t.Context(), []meta.UnsettledSegment{c}); err != nil {
		t.Fatal(err)
	}
	if err := l.Forget(t.Context(), []string{"seg-b"}); err != nil {
		t.Fatal(err)
	}
	_, recs, err = openFileLedger(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := []meta.UnsettledSegment{a, c}; !slices.Equal(recs, want) {
		t.Fatalf("reopened: %+v, want %+v", recs, want)
	}
	if _, err := os.Stat(filepath.Join(dir, unsettledFile+".tmp")); !os.IsNotExist(err) {
		t.Fatalf("temporary file left behind: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, unsettledFile), []byte(`{"version":1,"segments":[{"id":""}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := openFileLedger(dir); err == nil || !strings.Contains(err.Error(), "move it away") {
		t.Fatalf("open of a bad file = %v, want an error that says what to do", err)
	}
}

func FuzzDecodeUnsettled(f *testing.F) {
	f.Add([]byte(`{"version":1,"segments":[{"id":"seg-a","agent":"agent-a","memory":true}]}`))
	f.Add([]byte(`{"version":1,"segments":[]}`))
	f.Add([]byte(`{"version":2}`))
	f.Add([]byte(`{"version":1,"segments":[{"id":"x"}]} {}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		segs, err := decodeUnsettled(b)
		if err != nil {
			return
		}
		if len(segs) > maxUnsettledRecords {
			t.Fatalf("%d records", len(segs))
		}
		for _, s := range segs {
			if s.ID == "" || len(s.ID) > maxUnsettledID || len(s.Agent) > maxUnsettledID {
				t.Fatalf("record %+v past the bounds", s)
			}
		}
	})
}
