package meta

import (
	"context"

	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Tracing (issue 16): the store's spans are the work users wait on inside
// the master's RPCs — master.put_start (with master.place per placement
// round), master.put_end, master.evict and master.make_hole — and the
// background work that changes what is readable: master.evict and
// master.offload passes of their own and master.reconcile per agent
// registration. A span under an
// RPC is made only when the RPC's span records (tracectx.Tracer.Child);
// attributes are built only then. The change records a traced task
// commits carry its span (mut.under, changelog.AppendTraced), so the
// gateway's publish span can link to it.

var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/master/meta")

// Attribute keys of the store's own spans.
const (
	attrRounds    = attribute.Key("crescent.put.rounds")
	attrEvictWhy  = attribute.Key("crescent.evict.reason")
	attrSegments  = attribute.Key("crescent.segments")
	attrWalked    = attribute.Key("crescent.evict.walked")
	attrAdopted   = attribute.Key("crescent.reconcile.adopted")
	attrRemoved   = attribute.Key("crescent.reconcile.removed")
	attrReturned  = attribute.Key("crescent.reconcile.returned")
	attrRebuild   = attribute.Key("crescent.reconcile.rebuild")
	attrEvicted   = attribute.Key("crescent.evicted")
	attrOffloaded = attribute.Key("crescent.offloaded")
	attrNeedBytes = attribute.Key("crescent.evict.need_bytes")
)

// sampled is ctx's span context when it is sampled (what change records
// are worth tagging with), else the zero one.
func sampled(ctx context.Context) trace.SpanContext {
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		return sc
	}
	return trace.SpanContext{}
}

// recorded is span's context when it records, else the zero one: the
// span a task's change records name.
func recorded(span trace.Span) trace.SpanContext {
	if span.IsRecording() {
		return span.SpanContext()
	}
	return trace.SpanContext{}
}

// uniformTenant is the tenant every item names, "" when they differ.
func uniformTenant[T any](items []T, tenant func(*T) string) string {
	if len(items) == 0 {
		return ""
	}
	t := tenant(&items[0])
	for i := range items[1:] {
		if tenant(&items[i+1]) != t {
			return ""
		}
	}
	return t
}

// batchOutcome sets a batch span's failure count and first reason.
func batchOutcome(span trace.Span, errs func(yield func(error) bool)) {
	if !span.IsRecording() {
		return
	}
	failed, first := 0, ""
	for err := range errs {
		if err != nil {
			if failed++; first == "" {
				first = tracectx.ReasonOf(err)
			}
		}
	}
	tracectx.Outcome(span, failed, first)
}
