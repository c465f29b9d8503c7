package publisher

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
)

// delimiter is the empty frame (with MORE) that starts every reply: a
// ROUTER addresses [identity, b"", ...]; the DEALER receives [b"", ...].
var delimiter = []byte{0x01, 0x00}

// endMarker ends every replay: seq 0xFFFFFFFFFFFFFFFF, empty payload.
var (
	endMarker       = zmtp.AppendMessage(nil, nil, nil, kvevent.PutSeq(kvevent.EndSeq), nil)
	endMarkerLegacy = zmtp.AppendMessage(nil, nil, kvevent.PutSeq(kvevent.EndSeq), nil)
)

// replaySocket is the ROUTER that serves retained batches (vLLM's replay
// protocol) on the shared router machinery.
type replaySocket struct {
	router
	ring   *ring
	legacy bool
	// seqSuffix is the bytes after the 8-byte sequence in the ring's
	// sequence frames (the epoch in FormatSnapshot). A replay answers the
	// 8-byte sequence alone in every format, as vLLM does.
	seqSuffix int
	// topicLen is the length of the ring's topic frames' bodies (Config.Topic,
	// FormatSnapshot only): a reply carries the topic frame as published,
	// the legacy dialect none.
	topicLen     int
	writeTimeout time.Duration

	requests atomic.Uint64
	invalid  atomic.Uint64
}

func newReplaySocket(lg *slog.Logger, l net.Listener, r *ring, cfg Config) *replaySocket {
	s := &replaySocket{ring: r, legacy: cfg.ReplayLegacy, seqSuffix: cfg.Format.seqSuffix(), topicLen: len(cfg.Topic), writeTimeout: cfg.ReplayWriteTimeout}
	s.router = newRouter("replay", lg, l, cfg, s.request)
	return s
}

// request answers one replay request; an invalid one is counted and ignored.
// A valid one is served in a gateway.replay span of its own (ZMQ carries
// no trace context): the sequence asked for and the batches sent.
func (s *replaySocket) request(ctx context.Context, c *zmtp.Conn, frames [][]byte) error {
	start, ok := parseRequest(frames)
	if !ok {
		s.invalid.Add(1)
		s.lg.Debug("invalid replay request", "frames", len(frames))
		return nil
	}
	s.requests.Add(1)
	_, span := tracer.Start(ctx, "gateway.replay", tracectx.ServerKind...)
	n, err := s.reply(c, start)
	if span.IsRecording() {
		span.SetAttributes(attrSeq.Int64(int64(start)), tracectx.Items.Int(n))
	}
	if err != nil {
		err = fmt.Errorf("replay from %d: %w", start, err)
	}
	tracectx.End(span, err)
	return err
}

// parseRequest accepts [b"", start_seq] or a single [start_seq] frame.
func parseRequest(frames [][]byte) (uint64, bool) {
	var f []byte
	switch {
	case len(frames) == 2 && len(frames[0]) == 0:
		f = frames[1]
	case len(frames) == 1:
		f = frames[0]
	default:
		return 0, false
	}
	seq, err := kvevent.DecodeSeq(f)
	return seq, err == nil
}

// replyChunk bounds the messages written per vectored write.
const replyChunk = 256

// reply sends the retained batches from start, then the end marker; n is
// how many batches it sent.
func (s *replaySocket) reply(c *zmtp.Conn, start uint64) (n int, err error) {
	w := newVecWriter(c, s.writeTimeout)
	var head [16]byte
	for _, e := range s.ring.from(start) {
		var err error
		switch {
		case s.seqSuffix == 0 && s.legacy:
			err = w.put(delimiter, e.wire[2:]) // skip the topic frame
		case s.seqSuffix == 0:
			err = w.put(delimiter, e.wire)
		default: // delimiter, [topic,] an 8-byte sequence frame, then the payload frame as published
			h := append(head[:0], delimiter...)
			switch {
			case s.legacy:
			case s.topicLen == 0:
				h = append(h, 0x01, 0)
			default: // the topic frame as published (referenced, not copied)
				if err = w.put(h, e.wire[:2+s.topicLen]); err != nil {
					return n, err
				}
				h = head[:0]
			}
			h = binary.BigEndian.AppendUint64(append(h, 0x01, 8), e.seq)
			err = w.put(h, e.wire[2+s.topicLen+2+8+s.seqSuffix:])
		}
		if err != nil {
			return n, err
		}
		n++
	}
	end := endMarker
	if s.legacy {
		end = endMarkerLegacy
	}
	if err := w.put(nil, end); err != nil {
		return n, err
	}
	return n, w.flush()
}
