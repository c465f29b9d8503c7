package changelog

import (
	"testing"

	"go.opentelemetry.io/otel/trace"
)

func span(i byte, sampled bool) trace.SpanContext {
	cfg := trace.SpanContextConfig{TraceID: trace.TraceID{i}, SpanID: trace.SpanID{i}}
	if sampled {
		cfg.TraceFlags = trace.FlagsSampled
	}
	return trace.NewSpanContext(cfg)
}

// TestLinks: the spans that recorded a range of revisions, distinct, in
// order, bounded; unsampled and untraced appends leave no mark.
func TestLinks(t *testing.T) {
	l := New(100, 1)
	l.AppendTraced(recs(3, "t"), span(1, true))  // 1-3
	l.Append(recs(2, "t"))                       // 4-5
	l.AppendTraced(recs(2, "t"), span(2, false)) // 6-7: not sampled
	l.AppendTraced(recs(1, "t"), span(3, true))  // 8
	l.AppendTraced(recs(1, "t"), span(1, true))  // 9: span 1 again
	l.AppendTraced(recs(1, "t"), span(3, true))  // 10: span 3 again, a mark of its own (9 came between)
	for _, tc := range []struct {
		from, to uint64
		max      int
		want     []byte
	}{
		{0, 10, 8, []byte{1, 3}},
		{3, 7, 8, nil},
		{2, 3, 8, []byte{1}},
		{7, 8, 8, []byte{3}},
		{8, 10, 8, []byte{1, 3}},
		{0, 10, 1, []byte{1}},
		{10, 10, 8, nil},
	} {
		got := l.Links(tc.from, tc.to, tc.max, nil)
		if len(got) != len(tc.want) {
			t.Fatalf("Links(%d, %d, %d) = %v, want spans %v", tc.from, tc.to, tc.max, got, tc.want)
		}
		for i, sc := range got {
			if sc.TraceID()[0] != tc.want[i] {
				t.Fatalf("Links(%d, %d, %d) = %v, want spans %v", tc.from, tc.to, tc.max, got, tc.want)
			}
		}
	}
}

// TestLinksBounded: the log remembers at most maxSpans traced appends, and
// merges one span's consecutive appends into one mark.
func TestLinksBounded(t *testing.T) {
	l := New(1<<16, 1)
	for i := range 3 * maxSpans {
		l.AppendTraced(recs(2, "t"), span(byte(i%250)+1, true))
		l.AppendTraced(recs(1, "t"), span(byte(i%250)+1, true)) // merged
	}
	if len(l.spans) != maxSpans {
		t.Fatalf("%d marks kept, max %d", len(l.spans), maxSpans)
	}
	head := l.Head()
	if got := l.Links(0, head, 1000, nil); len(got) != 250 {
		t.Fatalf("%d distinct links over the whole log, want 250", len(got))
	}
	if got := l.Links(head-3, head, 8, nil); len(got) != 1 || got[0].TraceID()[0] != byte((3*maxSpans-1)%250)+1 {
		t.Fatalf("links of the last append = %v", got)
	}
	if got := l.Links(0, 3, 8, nil); len(got) != 0 {
		t.Fatalf("links of forgotten appends = %v", got)
	}
}
