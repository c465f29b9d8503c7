package server

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"net"
	"slices"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// TestFinishLogMatchesLibrary: for every outcome, finishLog writes a line
// exactly when go-grpc-middleware's logging interceptor does, at the same
// level, with the same fields and values (the start time and duration
// aside, which differ by the calls' timing).
func TestFinishLogMatchesLibrary(t *testing.T) {
	levels := func(c codes.Code) logging.Level {
		switch c {
		case codes.OK, codes.NotFound:
			return logging.LevelDebug
		case codes.Internal:
			return logging.LevelError
		default:
			return logging.LevelWarn
		}
	}
	info := &grpc.UnaryServerInfo{FullMethod: "/crescent.master.v1.ObjectService/GetReplicaList"}
	withPeer := func(ctx context.Context) context.Context {
		return peer.NewContext(ctx, &peer.Peer{Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 40123}})
	}
	withDeadline := func(ctx context.Context) context.Context {
		ctx, cancel := context.WithDeadline(ctx, time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
		t.Cleanup(cancel)
		return ctx
	}
	for _, tc := range []struct {
		name  string
		level slog.Level
		err   error
		ctx   func(context.Context) context.Context
		lines int
	}{
		{"ok at info", slog.LevelInfo, nil, withPeer, 0},
		{"ok at debug", slog.LevelDebug, nil, withPeer, 1},
		{"not found at info", slog.LevelInfo, status.Error(codes.NotFound, "no such object"), withPeer, 0},
		{"unavailable", slog.LevelInfo, status.Error(codes.Unavailable, "agent gone"), withPeer, 1},
		{"internal with a deadline", slog.LevelInfo, status.Error(codes.Internal, "boom"), func(ctx context.Context) context.Context { return withDeadline(withPeer(ctx)) }, 1},
		{"no peer", slog.LevelInfo, status.Error(codes.Unavailable, "agent gone"), func(ctx context.Context) context.Context { return ctx }, 1},
		{"plain error", slog.LevelInfo, context.DeadlineExceeded, withPeer, 1},
		{"error level only", slog.LevelError, status.Error(codes.Unavailable, "agent gone"), withPeer, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			handler := func(context.Context, any) (any, error) { return "answer", tc.err }
			run := func(ic grpc.UnaryServerInterceptor) {
				t.Helper()
				resp, err := ic(tc.ctx(t.Context()), "request", info, handler)
				if resp != "answer" || err != tc.err {
					t.Fatalf("interceptor returned %v, %v; want the handler's answer, %v", resp, err, tc.err)
				}
			}
			var ours, theirs bytes.Buffer
			opts := &slog.HandlerOptions{Level: tc.level}
			run(finishLog(slog.New(slog.NewJSONHandler(&ours, opts)), byCode(levels)))
			run(logging.UnaryServerInterceptor(slogAdapter(slog.New(slog.NewJSONHandler(&theirs, opts))),
				logging.WithLogOnEvents(logging.FinishCall), logging.WithLevels(levels)))
			got, want := logLines(t, ours.Bytes()), logLines(t, theirs.Bytes())
			if len(got) != tc.lines || len(want) != tc.lines {
				t.Fatalf("lines: ours %d, the library's %d, want %d\nours: %s\nthe library's: %s", len(got), len(want), tc.lines, ours.String(), theirs.String())
			}
			for i := range got {
				for _, k := range []string{"time", "grpc.start_time", "grpc.time_ms"} {
					if _, ok := want[i][k]; !ok {
						t.Fatalf("the library's line lacks %s: %v", k, want[i])
					}
					if _, ok := got[i][k]; !ok {
						t.Fatalf("our line lacks %s: %v", k, got[i])
					}
					delete(got[i], k)
					delete(want[i], k)
				}
				if !maps.Equal(got[i], want[i]) {
					t.Errorf("ours:          %v\nthe library's: %v\nkeys only in one: %v", got[i], want[i], symmetricDiff(got[i], want[i]))
				}
			}
		})
	}
}

// slogAdapter hands the library's interceptors a slog logger, the line
// logged with the call's context as finishLog does.
func slogAdapter(l *slog.Logger) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		l.Log(ctx, slog.Level(lvl), msg, fields...)
	})
}

// byCode is a finishLog level that looks at the code only, as the
// library's does.
func byCode(levels logging.CodeToLevel) func(error) slog.Level {
	return func(err error) slog.Level { return slog.Level(levels(status.Code(err))) }
}

// serverStream is a stream whose only behaviour is its context.
type serverStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s serverStream) Context() context.Context { return s.ctx }

// TestFinishLogStreamMatchesLibrary: the streams' line is the library's
// stream interceptor's, for a server stream and a bidirectional one, OK
// and failed; and a reason the server names quiet drops it to debug.
func TestFinishLogStreamMatchesLibrary(t *testing.T) {
	levels := func(c codes.Code) logging.Level {
		if c == codes.OK {
			return logging.LevelDebug
		}
		return logging.LevelWarn
	}
	ctx := peer.NewContext(t.Context(), &peer.Peer{Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 40123}})
	recovering := rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING, "master started moments ago"))
	for _, tc := range []struct {
		name  string
		info  *grpc.StreamServerInfo
		err   error
		level slog.Level
		lines int
	}{
		{"server stream ok at debug", &grpc.StreamServerInfo{FullMethod: "/crescent.master.v1.ChangeService/Watch", IsServerStream: true}, nil, slog.LevelDebug, 1},
		{"server stream unavailable", &grpc.StreamServerInfo{FullMethod: "/crescent.master.v1.ChangeService/Watch", IsServerStream: true}, status.Error(codes.Unavailable, "gone"), slog.LevelInfo, 1},
		{"bidi internal", &grpc.StreamServerInfo{FullMethod: "/crescent.master.v1.SegmentService/Connect", IsClientStream: true, IsServerStream: true}, status.Error(codes.Internal, "boom"), slog.LevelInfo, 1},
		{"recovering", &grpc.StreamServerInfo{FullMethod: "/crescent.master.v1.ChangeService/Watch", IsServerStream: true}, recovering, slog.LevelInfo, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			handler := func(any, grpc.ServerStream) error { return tc.err }
			var ours, theirs, quiet bytes.Buffer
			opts := &slog.HandlerOptions{Level: tc.level}
			ss := serverStream{ctx: ctx}
			if err := finishLogStream(slog.New(slog.NewJSONHandler(&ours, opts)), byCode(levels))(nil, ss, tc.info, handler); err != tc.err {
				t.Fatalf("returned %v, want %v", err, tc.err)
			}
			_ = logging.StreamServerInterceptor(slogAdapter(slog.New(slog.NewJSONHandler(&theirs, opts))),
				logging.WithLogOnEvents(logging.FinishCall), logging.WithLevels(levels))(nil, ss, tc.info, handler)
			got, want := logLines(t, ours.Bytes()), logLines(t, theirs.Bytes())
			if len(got) != tc.lines || len(want) != tc.lines {
				t.Fatalf("lines: ours %d, the library's %d, want %d\nours: %s\nthe library's: %s", len(got), len(want), tc.lines, ours.String(), theirs.String())
			}
			for i := range got {
				for _, k := range []string{"time", "grpc.start_time", "grpc.time_ms"} {
					delete(got[i], k)
					delete(want[i], k)
				}
				if !maps.Equal(got[i], want[i]) {
					t.Errorf("ours:          %v\nthe library's: %v\nkeys only in one: %v", got[i], want[i], symmetricDiff(got[i], want[i]))
				}
			}
			// The server's level with MASTER_RECOVERING named quiet: that
			// refusal is not written at info, the others are as before.
			_ = finishLogStream(slog.New(slog.NewJSONHandler(&quiet, &slog.HandlerOptions{Level: slog.LevelInfo})),
				callLevel(nil, []string{"MASTER_RECOVERING"}))(nil, ss, tc.info, handler)
			if n, want := len(logLines(t, quiet.Bytes())), btoi(tc.err != nil && tc.err != recovering); n != want {
				t.Errorf("with MASTER_RECOVERING quiet, at info: %d lines, want %d", n, want)
			}
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func logLines(t *testing.T, b []byte) []map[string]any {
	t.Helper()
	var out []map[string]any
	for l := range bytes.SplitSeq(bytes.TrimSpace(b), []byte("\n")) {
		if len(l) == 0 {
			continue
		}
		m := map[string]any{}
		if err := json.Unmarshal(l, &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

func symmetricDiff(a, b map[string]any) []string {
	var d []string
	for k := range a {
		if _, ok := b[k]; !ok {
			d = append(d, k)
		}
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			d = append(d, k)
		}
	}
	slices.Sort(d)
	return d
}
