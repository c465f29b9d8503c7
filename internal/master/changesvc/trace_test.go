package changesvc

import (
	"context"
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"go.opentelemetry.io/otel/trace"
)

var testTracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/master/changesvc_test")

// TestWatchCarriesLinks: a WatchResponse names the sampled spans that
// recorded its changes (at most tracectx.MaxLinks), and none when nothing
// was traced.
func TestWatchCarriesLinks(t *testing.T) {
	tracectxtest.Install(t)
	h := start(t, 1024)
	put := func(ctx context.Context, key string) {
		t.Helper()
		if _, err := h.store.PutStart(ctx, meta.PutSpec{Key: key, Size: 10, ReplicaNum: 1, ClientID: "w"}); err != nil {
			t.Fatal(err)
		}
		if err := h.store.PutEnd(ctx, meta.PutEndSpec{Key: key, ClientID: "w", Checksum: 70}); err != nil {
			t.Fatal(err)
		}
	}
	put(t.Context(), "untraced")
	var spans []trace.SpanContext
	for i := range tracectx.MaxLinks + 2 {
		ctx, span := testTracer.Start(t.Context(), "PutEnd")
		put(ctx, fmt.Sprint("traced-", i))
		span.End()
		spans = append(spans, span.SpanContext())
	}
	stream, err := h.cli.Watch(t.Context(), &masterv1.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// Responses of at most 7 changes: the first holds the untraced one
	// and six traced ones.
	var got []trace.SpanContext
	for n := 0; n < tracectx.MaxLinks+3; {
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		links := tracectx.ParseLinks(resp.GetLinks())
		if len(resp.GetLinks()) > tracectx.MaxLinks || len(links) != len(resp.GetLinks()) {
			t.Fatalf("response links %v", resp.GetLinks())
		}
		got = append(got, links...)
		n += len(resp.GetChanges())
	}
	if len(got) != len(spans) {
		t.Fatalf("%d links over the stream, want %d", len(got), len(spans))
	}
	for i := range got {
		if got[i].SpanID() == (trace.SpanID{}) || got[i].TraceID() != spans[i].TraceID() {
			t.Fatalf("link %d = %v, want a span of trace %v", i, got[i], spans[i].TraceID())
		}
	}
}
