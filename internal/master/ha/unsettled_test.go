package ha

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
)

// TestUnsettledRecords: a leader records unsettled segments (more than one
// transaction's worth) and removes some; the next term reads what is left;
// a term that ended can no longer write; a record that does not decode
// fails the read.
func TestUnsettledRecords(t *testing.T) {
	etcd := etcdtest.Start(t)
	a := newElector(t, etcd.Endpoint, "a:1")
	ta, err := a.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var put []UnsettledSegment
	var del []string
	for i := range 300 {
		s := UnsettledSegment{ID: fmt.Sprintf("seg-%03d", i), Agent: fmt.Sprintf("agent-%d", i%3), Memory: i%2 == 0}
		put = append(put, s)
		if i%100 != 7 {
			del = append(del, s.ID)
		}
	}
	if err := ta.SetUnsettled(t.Context(), put, nil); err != nil {
		t.Fatal(err)
	}
	if err := ta.SetUnsettled(t.Context(), nil, del); err != nil {
		t.Fatal(err)
	}
	if err := ta.SetUnsettled(t.Context(), []UnsettledSegment{{ID: strings.Repeat("x", 257), Agent: "a"}}, nil); err == nil {
		t.Fatal("a segment id of 257 bytes was recorded")
	}
	ta.Resign(t.Context())
	if err := ta.SetUnsettled(t.Context(), []UnsettledSegment{{ID: "late", Agent: "agent-z"}}, nil); err == nil {
		t.Fatal("a resigned term recorded an unsettled segment")
	}
	tb, err := a.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Resign(context.Background())
	got, err := tb.Unsettled(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := []UnsettledSegment{put[7], put[107], put[207]}
	if !slices.Equal(got, want) {
		t.Fatalf("unsettled %+v, want %+v", got, want)
	}
	if _, err := a.cli.Put(t.Context(), a.unsettledPrefix()+"bad", "x agent"); err != nil {
		t.Fatal(err)
	}
	if got, err := tb.Unsettled(t.Context()); err == nil {
		t.Fatalf("unsettled %+v with a record that does not decode: want an error", got)
	}
}

func FuzzParseUnsettled(f *testing.F) {
	f.Add("seg-1", []byte("m agent-a"))
	f.Add("seg-2", []byte("d agent-b"))
	f.Add("", []byte("m "))
	f.Add("s", []byte("x"))
	f.Fuzz(func(t *testing.T, id string, value []byte) {
		s, err := parseUnsettled(id, value)
		if err != nil {
			return
		}
		if s.ID != id || len(s.ID) == 0 || len(s.ID) > maxRecordID || len(s.Agent) == 0 || len(s.Agent) > maxRecordID {
			t.Fatalf("parsed %+v from %q %q", s, id, value)
		}
		if back := encodeUnsettled(s); back != string(value) {
			t.Fatalf("%q encodes back as %q", value, back)
		}
	})
}
