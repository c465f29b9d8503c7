package changelog

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func recs(n int, tenant string) []Record {
	out := make([]Record, n)
	for i := range out {
		out[i] = Record{Type: Stored, Tenant: tenant, Key: fmt.Sprintf("k%d", i), Medium: masterv1.Medium_MEDIUM_MEMORY}
	}
	return out
}

func TestReadWindow(t *testing.T) {
	tests := []struct {
		name      string
		retention int
		appended  int
		from      uint64
		wantFirst uint64
		wantN     int
		wantErr   string
	}{
		{"from zero, nothing dropped", 8, 5, 0, 1, 5, ""},
		{"from middle", 8, 5, 3, 4, 2, ""},
		{"caught up", 8, 5, 5, 0, 0, ""},
		{"beyond head", 8, 5, 6, 0, 0, "INVALID_PARAMS"},
		{"wrapped, from oldest-1", 4, 10, 6, 7, 4, ""},
		{"wrapped, compacted", 4, 10, 5, 0, 0, "REVISION_COMPACTED"},
		{"from zero after drop", 4, 10, 0, 0, 0, "REVISION_COMPACTED"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := New(tt.retention, 7)
			l.Append(recs(tt.appended, "t"))
			got, head, _, err := l.Read(tt.from, 0, nil)
			if gotR := rpcerr.Reason(err); gotR != tt.wantErr {
				t.Fatalf("reason: got %q, want %q (err %v)", gotR, tt.wantErr, err)
			}
			if err != nil {
				return
			}
			if head != uint64(tt.appended) {
				t.Fatalf("head: got %d, want %d", head, tt.appended)
			}
			if len(got) != tt.wantN {
				t.Fatalf("records: got %d, want %d", len(got), tt.wantN)
			}
			for i, r := range got {
				if want := tt.wantFirst + uint64(i); r.Revision != want {
					t.Fatalf("record %d revision: got %d, want %d", i, r.Revision, want)
				}
				if want := fmt.Sprintf("k%d", r.Revision-1); r.Key != want {
					t.Fatalf("record %d key: got %q, want %q", i, r.Key, want)
				}
			}
		})
	}
}

func TestCompactedMetadata(t *testing.T) {
	l := New(4, 1)
	l.Append(recs(10, "t"))
	_, _, _, err := l.Read(2, 0, nil)
	if got := rpcerr.Metadata(err)["compact_revision"]; got != "7" {
		t.Fatalf("compact_revision: got %q, want 7", got)
	}
	if got := l.Compact(); got != 7 {
		t.Fatalf("Compact: got %d, want 7", got)
	}
}

func TestReadMaxAndTenants(t *testing.T) {
	l := New(0, 1)
	l.Append(recs(3, "a"))
	l.Append(recs(3, "b"))
	got, _, _, err := l.Read(2, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Tenant != "a" || got[1].Tenant != "b" || got[1].Revision != 4 {
		t.Fatalf("got %+v, want revisions 3(a),4(b)", got)
	}
}

func TestWaitWakesAndHonoursContext(t *testing.T) {
	l := New(16, 1)
	done := make(chan error, 1)
	go func() { done <- l.Wait(t.Context(), 0) }()
	// Wait returns whether it registered before or after the append.
	l.Append(recs(1, "t"))
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Wait: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("waiter not woken")
	}
	ctx, cancel := context.WithCancel(t.Context())
	go func() { done <- l.Wait(ctx, 1) }()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait after cancel: got %v, want context.Canceled", err)
	}
}

func BenchmarkAppend(b *testing.B) {
	l := New(1<<16, 1)
	batch := recs(16, "t")
	b.ReportAllocs()
	for b.Loop() {
		l.Append(batch)
	}
	b.ReportMetric(float64(b.N*len(batch))/b.Elapsed().Seconds(), "records/s")
}
