package server

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// finishLog is the unary calls' "finished call" log line: the message,
// level and fields of go-grpc-middleware's logging interceptor (the
// streams' is finishLogStream), built only when the line will be written.
//
// The library builds the line's fields before each call and again after
// it (the peer's address as a string, the start time formatted, context
// lookups, de-duplicated field lists), whether or not the logger writes
// it, and at the default level an OK call's line is never written. That
// was about a sixth of an empty call's latency: a lone health check's p50
// fell from 60-64 to 52-54 µs, a lone Get over shared memory from 57-61 to
// 47-50 µs without it (issue 18, BENCHMARKS.md "The unary log line, built
// only when written"). Here an unwritten line costs a clock reading and
// the logger's Enabled check; TestFinishLogMatchesLibrary keeps the fields
// and levels equal to the library's.
//
// The level is level(err): by the call's code as the library's
// CodeToLevel would say, except where the server names an error reason it
// answers as a matter of course (Config.QuietReasons).
func finishLog(lg *slog.Logger, level func(error) slog.Level) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		logFinished(ctx, lg, level, info.FullMethod, nil, start, err)
		return resp, err
	}
}

// finishLogStream is finishLog for streams: the library's line, at
// level(err), once the stream's handler returned. It replaces the
// library's stream interceptor so that a stream refused for a reason the
// server names quiet (a recovering master's MASTER_RECOVERING, which a
// gateway's Watch meets at every start) is not a warning either.
func finishLogStream(lg *slog.Logger, level func(error) slog.Level) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		start := time.Now()
		err := handler(srv, ss)
		logFinished(ss.Context(), lg, level, info.FullMethod, info, start, err)
		return err
	}
}

// logFinished writes a call's "finished call" line at level(err), its
// fields built only when the logger writes it; stream is nil for a unary
// call.
func logFinished(ctx context.Context, lg *slog.Logger, level func(error) slog.Level, fullMethod string, stream *grpc.StreamServerInfo, start time.Time, err error) {
	lvl := level(err)
	if !lg.Enabled(ctx, lvl) {
		return
	}
	lg.Log(ctx, lvl, "finished call", finishFields(ctx, fullMethod, stream, start, status.Code(err), err)...)
}

// finishFields are the fields of the library's server-side "finished
// call" line, in its order.
func finishFields(ctx context.Context, fullMethod string, stream *grpc.StreamServerInfo, start time.Time, code codes.Code, err error) []any {
	m := interceptors.NewServerCallMeta(fullMethod, stream, nil)
	f := make([]any, 0, 24)
	f = append(f,
		logging.SystemTag[0], logging.SystemTag[1],
		logging.ComponentFieldKey, logging.KindServerFieldValue,
		logging.ServiceFieldKey, m.Service,
		logging.MethodFieldKey, m.Method,
		logging.MethodTypeFieldKey, string(m.Typ))
	if p, ok := peer.FromContext(ctx); ok {
		f = append(f, "peer.address", p.Addr.String())
	}
	f = append(f, "grpc.start_time", start.Format(time.RFC3339))
	if d, ok := ctx.Deadline(); ok {
		f = append(f, "grpc.request.deadline", d.Format(time.RFC3339))
	}
	f = append(f, "grpc.code", code.String())
	if err != nil {
		f = append(f, "grpc.error", fmt.Sprintf("%v", err))
	}
	return append(f, logging.DurationToTimeMillisFields(time.Since(start))...)
}
