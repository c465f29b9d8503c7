package source

import (
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.opentelemetry.io/otel/trace"
)

// linkSink is a sink that takes links too.
type linkSink struct {
	*sink
	links [][]trace.SpanContext
}

func (s *linkSink) EnqueueLinkedAt(pos statedir.Position, links []trace.SpanContext, evs ...kvevent.Event) {
	s.links = append(s.links, links)
	s.EnqueueAt(pos, evs...)
}

// TestFlushPassesLinks: a response's links reach a LinkSink parsed,
// bounded and without the invalid ones; a plain Sink gets the events
// alone.
func TestFlushPassesLinks(t *testing.T) {
	tracectxtest.Install(t)
	ls := &linkSink{sink: newSink()}
	s := New(Config{}, nil, ls, testutil.Logger())
	evs := []kvevent.Event{{Type: kvevent.Stored, Tenant: "t", Key: "k", Medium: kvevent.MediumCPU}}
	valid := &masterv1.TraceContext{Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	links := []*masterv1.TraceContext{{Traceparent: "garbage"}, valid, {Traceparent: strings.Repeat("0", 500)}}
	for range 20 {
		links = append(links, valid)
	}
	s.flush(evs, links)
	s.flush(evs, nil)
	if len(ls.links) != 1 || len(ls.links[0]) == 0 || len(ls.links[0]) > tracectx.MaxLinks || !ls.links[0][0].Equal(tracectx.Parse(valid.GetTraceparent(), "")) {
		t.Fatalf("links passed %v", ls.links)
	}
	if got := len(ls.events()); got != 2 {
		t.Fatalf("%d events, want 2", got)
	}
	plain := newSink()
	New(Config{}, nil, plain, testutil.Logger()).flush(evs, links)
	if got := len(plain.events()); got != 1 {
		t.Fatalf("plain sink got %d events", got)
	}
}
