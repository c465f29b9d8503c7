package obs

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// TraceHandler wraps h so that every record logged with a context holding
// a valid span (the slog *Context methods, or Log with a context) carries
// the span's trace_id and span_id, the hex ids a tracing backend searches
// by. Records without one are passed on untouched. The ids are added at
// the level of the record's own attributes (inside any WithGroup group).
func TraceHandler(h slog.Handler) slog.Handler { return traceHandler{h} }

type traceHandler struct{ h slog.Handler }

func (t traceHandler) Enabled(ctx context.Context, l slog.Level) bool { return t.h.Enabled(ctx, l) }

func (t traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		// A copy of its own: r may be shared with other handlers.
		r = r.Clone()
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return t.h.Handle(ctx, r)
}

func (t traceHandler) WithAttrs(as []slog.Attr) slog.Handler { return traceHandler{t.h.WithAttrs(as)} }

func (t traceHandler) WithGroup(name string) slog.Handler { return traceHandler{t.h.WithGroup(name)} }
