package publisher

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
)

// SnapshotSource builds snapshot replies (the recorder,
// internal/gateway/snapshot).
type SnapshotSource interface {
	// Reply returns the reply's frames: the cut (int64 big-endian: the
	// last sequence folded in, -1 before any), the 16-byte publisher epoch,
	// then the chunks (payloads of the contract). The frames are shared and
	// immutable. It may block while a snapshot is built, until ctx ends.
	// Unless err is set, the socket calls release exactly once, when it no
	// longer reads the frames (the reply was written or its write failed):
	// the source may reuse their buffers from then on.
	Reply(ctx context.Context) (frames [][]byte, release func(), err error)
}

// unavailableCut is the cut of a failed snapshot, int64(-2) big-endian:
// no chunks follow.
var unavailableCut = binary.BigEndian.AppendUint64(nil, ^uint64(1))

// errNoSource answers requests when no SnapshotSource was set.
var errNoSource = errors.New("no snapshot source")

// snapshotSocket is the ROUTER that serves snapshots (the reply of vLLM's
// snapshot dialect) on the shared router machinery. Any request is
// answered; its routing envelope (up to the empty delimiter) is echoed.
type snapshotSocket struct {
	router
	src          SnapshotSource // set before serve
	unavailable  [][]byte       // [-2, epoch]
	timeout      time.Duration
	writeTimeout time.Duration

	requests, served, errors atomic.Uint64
}

func newSnapshotSocket(lg *slog.Logger, l net.Listener, epoch statedir.Epoch, cfg Config) *snapshotSocket {
	s := &snapshotSocket{unavailable: [][]byte{unavailableCut, epoch[:]}, timeout: cfg.SnapshotTimeout, writeTimeout: cfg.ReplayWriteTimeout}
	s.router = newRouter("snapshot", lg, l, cfg, s.request)
	return s
}

// request answers one snapshot request with one multipart message:
// envelope, then the source's frames or [-2, epoch].
//
// It is served in a gateway.snapshot span of its own (ZMQ carries no trace
// context): the bytes sent, and why none were when the source had no
// snapshot to give.
func (s *snapshotSocket) request(ctx context.Context, c *zmtp.Conn, frames [][]byte) error {
	s.requests.Add(1)
	ctx, span := tracer.Start(ctx, "gateway.snapshot", tracectx.ServerKind...)
	reply, release, err := s.build(ctx)
	if err != nil {
		s.errors.Add(1)
		s.lg.Debug("snapshot unavailable", "remote", c.RemoteAddr().String(), "err", err)
		reply, release = s.unavailable, func() {}
		if span.IsRecording() {
			span.SetAttributes(tracectx.Reason.String("SNAPSHOT_UNAVAILABLE"))
		}
	}
	if span.IsRecording() {
		n := 0
		for _, f := range reply {
			n += len(f)
		}
		span.SetAttributes(tracectx.Bytes.Int(n))
	}
	werr := writeMultipart(c, s.writeTimeout, envelope(frames), reply)
	release() // nothing reads reply's buffers after the write returned
	if werr != nil {
		werr = fmt.Errorf("snapshot reply: %w", werr)
		tracectx.End(span, werr)
		return werr
	}
	if err == nil {
		s.served.Add(1)
	}
	span.End()
	return nil
}

// build returns the source's reply and its release func (never nil
// without an error).
func (s *snapshotSocket) build(ctx context.Context) ([][]byte, func(), error) {
	if s.src == nil {
		return nil, nil, errNoSource
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	frames, release, err := s.src.Reply(ctx)
	if err != nil {
		return nil, nil, err
	}
	if release == nil {
		release = func() {}
	}
	if len(frames) < 2 || len(frames[0]) != 8 || len(frames[1]) != statedir.EpochLen {
		release()
		return nil, nil, fmt.Errorf("malformed snapshot from the source: %d frames", len(frames))
	}
	return frames, release, nil
}

// envelope is a request's routing envelope: its frames up to and including
// the first empty one (a REQ sends [b"", body]; a broker prepends
// identities). A request without a delimiter is answered [b"", ...].
func envelope(frames [][]byte) [][]byte {
	for i, f := range frames {
		if len(f) == 0 {
			return frames[:i+1]
		}
	}
	return [][]byte{nil}
}

// writeMultipart writes the frames of head, then of tail, as one ZMTP
// message (bodies referenced, not copied: a snapshot may be large).
func writeMultipart(c *zmtp.Conn, timeout time.Duration, head, tail [][]byte) error {
	w := newVecWriter(c, timeout)
	var h [9]byte
	n := len(head) + len(tail)
	for i := range n {
		var f []byte
		if i < len(head) {
			f = head[i]
		} else {
			f = tail[i-len(head)]
		}
		if err := w.put(appendFrameHeader(h[:0], i < n-1, len(f)), f); err != nil {
			return err
		}
	}
	return w.flush()
}
