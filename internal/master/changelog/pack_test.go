package changelog

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// TestEntrySize holds the ring slot to 32 bytes: with the default
// retention it is a cost per object of a million-object cache.
func TestEntrySize(t *testing.T) {
	if n := unsafe.Sizeof(entry{}); n != 32 {
		t.Fatalf("entry is %d bytes, want 32", n)
	}
}

// TestRecordsSurviveThePacking appends records with groups and times that
// jump by more than an int32 of milliseconds, wrapping small rings many
// times (several chunks, and a last chunk shorter than the others), and
// reads back exactly what was appended, while the interned groups and the
// far times never outgrow the retained records.
func TestRecordsSurviveThePacking(t *testing.T) {
	for _, retention := range []int{1, 7, chunkSize + 5, 3 * chunkSize} {
		t.Run(fmt.Sprint(retention), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(retention)))
			l := New(retention, 1)
			var all []Record
			now := int64(1_700_000_000_000)
			for range 10 {
				batch := make([]Record, rng.IntN(2*retention)+1)
				for i := range batch {
					switch rng.IntN(20) {
					case 0:
						now += 30 * 24 * 3600 * 1000 // a month later
					case 1:
						now -= 40 * 24 * 3600 * 1000 // the clock stepped back
					default:
						now += rng.Int64N(1000)
					}
					g := ""
					if rng.IntN(3) > 0 {
						g = fmt.Sprintf("g%d", rng.IntN(50))
					}
					batch[i] = Record{Type: Type(1 + rng.IntN(2)), Tenant: fmt.Sprintf("t%d", rng.IntN(3)),
						Key: fmt.Sprintf("k%d", len(all)+i), Medium: masterv1.Medium(1 + rng.IntN(2)), Group: g, TimeMs: now}
				}
				l.Append(batch)
				all = append(all, batch...)

				from := uint64(max(0, len(all)-retention))
				got, head, _, err := l.Read(from, 0, nil)
				if err != nil {
					t.Fatal(err)
				}
				if head != uint64(len(all)) || len(got) != len(all)-int(from) {
					t.Fatalf("head %d, %d records; want %d, %d", head, len(got), len(all), len(all)-int(from))
				}
				for i, r := range got {
					if want := all[int(from)+i]; r != want {
						t.Fatalf("revision %d: got %+v, want %+v", r.Revision, r, want)
					}
				}
				l.mu.Lock()
				groups, far := l.groups.Len(), len(l.far)
				l.mu.Unlock()
				if groups > retention || far > retention {
					t.Fatalf("%d interned groups and %d far times for %d retained records", groups, far, retention)
				}
			}
		})
	}
}
