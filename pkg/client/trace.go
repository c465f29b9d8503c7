package client

import (
	"context"

	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
)

// Tracing (issue 16): each call a user waits on — Put, PutFrom, Get,
// GetInto, GetTo, BatchPut, BatchGet, BatchGetInto — runs in one span,
// client.put, client.get, client.batch_put or client.batch_get, a child of
// the span in the caller's context or else the root of a trace of its own,
// so one call is one trace: its RPCs (otelgrpc), its transfers
// (transfer.write and transfer.read, one per agent request, internal/xfer)
// and, through them, the master's and the agents' spans. A batch is one
// span however many items it has. Spans go to the global TracerProvider:
// with none installed there is no span, and a sampled trace context in the
// caller's context still goes on to the cluster.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/pkg/client")

// startCall starts the span of one call of n items and size bytes; key is
// added only when the process traces keys (--trace-keys).
func (c *Client) startCall(ctx context.Context, name string, n int, size int64, key string) (context.Context, trace.Span) {
	ctx, span := tracer.Start(ctx, name)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Tenant.String(c.tenant), tracectx.Items.Int(n))
		if size >= 0 {
			span.SetAttributes(tracectx.Bytes.Int64(size))
		}
		if key != "" && tracing.Keys() {
			span.SetAttributes(tracectx.Key.String(key))
		}
	}
	return ctx, span
}

// endBatch ends a batch call's span with its items' outcome.
func endBatch(span trace.Span, errs []error) {
	if span.IsRecording() {
		failed, first := 0, ""
		for _, err := range errs {
			if err != nil {
				if failed++; first == "" {
					first = tracectx.ReasonOf(err)
				}
			}
		}
		tracectx.Outcome(span, failed, first)
	}
	span.End()
}

// itemBytes is the payload of a batch: its items' lengths added up.
func itemBytes(items []Item) int64 {
	var n int64
	for _, it := range items {
		n += int64(len(it.Data))
	}
	return n
}
