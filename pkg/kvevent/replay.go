package kvevent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// ReplayOptions tunes a replay request.
type ReplayOptions struct {
	// Timeout bounds the whole exchange (default 10s) on top of ctx.
	Timeout time.Duration
	// MaxFrame bounds one received frame (default 64 MiB).
	MaxFrame int
	// MaxMessage bounds one received message, its frames together (default
	// 64 MiB). A larger one ends the exchange with an error wrapping
	// zmtp.ErrFrameTooLarge or zmtp.ErrMessageTooLarge, before it is allocated.
	MaxMessage int
	// Decoder decodes the replayed payloads (strict by default).
	Decoder Decoder
}

// ErrStopReplay may be returned by a Replay callback to end the exchange early
// without error.
var ErrStopReplay = errors.New("kvevent: stop replay")

// Replay asks the replay ROUTER at endpoint for every retained batch from
// sequence from, as a DEALER sending [b"", from (8 bytes BE)], and calls fn
// with each decoded batch in order until the end marker (sequence
// 0xFFFFFFFFFFFFFFFF, empty payload). Both reply dialects are understood:
// [b"", topic, seq, payload] and the older [b"", seq, payload]. The first
// batch may start after from when the publisher no longer retains it.
//
// In the snapshot stream format the ring holds heartbeats too: a sequence
// frame of 24 bytes (sequence and epoch, which the batch's Epoch carries)
// admits an empty event array, and so does ReplayOptions.Decoder with
// AllowEmpty for 8-byte frames (vLLM's replay socket sends those in
// either format).
func Replay(ctx context.Context, endpoint string, from uint64, opts ReplayOptions, fn func(Batch) error) error {
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	if opts.MaxFrame <= 0 {
		opts.MaxFrame = 64 << 20
	}
	if opts.MaxMessage <= 0 {
		opts.MaxMessage = 64 << 20
	}
	ctx, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	c, err := zmtp.Dial(ctx, endpoint, zmq4.Dealer, opts.Timeout, zmtp.Limits{MaxFrame: opts.MaxFrame, MaxFrames: 8, MaxMessage: opts.MaxMessage})
	if err != nil {
		return fmt.Errorf("kvevent: replay dial %s: %w", endpoint, err)
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if err := c.Write(zmtp.AppendMessage(nil, nil, PutSeq(from)), opts.Timeout); err != nil {
		return ctxOr(ctx, fmt.Errorf("kvevent: replay request: %w", err))
	}
	dec := opts.Decoder
	var (
		last uint64
		seen bool // last is set
	)
	for {
		m, err := c.ReadMessage()
		if err != nil {
			return ctxOr(ctx, fmt.Errorf("kvevent: replay read: %w", err))
		}
		if m.Command != "" {
			continue
		}
		var seqF, payload []byte
		switch {
		case len(m.Frames) == 4 && len(m.Frames[0]) == 0 && string(m.Frames[1]) == dec.Topic:
			seqF, payload = m.Frames[2], m.Frames[3]
		case len(m.Frames) == 4 && len(m.Frames[0]) == 0 && len(m.Frames[1]) == 0 && isEndSeq(m.Frames[2]):
			// The end marker's topic is empty whatever the stream's (vLLM).
			seqF, payload = m.Frames[2], m.Frames[3]
		case len(m.Frames) == 3 && len(m.Frames[0]) == 0:
			seqF, payload = m.Frames[1], m.Frames[2]
		default:
			return malformed("replay reply with %d frames (or another topic than %q), want [b\"\", topic, seq, payload] or [b\"\", seq, payload]", len(m.Frames), dec.Topic)
		}
		seq, epoch, err := DecodeSeqFrame(seqF)
		if err != nil {
			return err
		}
		if seq == EndSeq {
			if len(payload) != 0 {
				return malformed("replay end marker with a %d-byte payload", len(payload))
			}
			return nil
		}
		// Sequences increase; 0 is a sequence only in the snapshot format.
		if (seq == 0 && epoch == nil) || (seen && seq <= last) {
			return malformed("replay sequence %d after %d", seq, last)
		}
		last, seen = seq, true
		kind := kindLive
		if epoch != nil || dec.AllowEmpty {
			kind = kindHeartbeatOK
		}
		b, err := dec.decodePayload(seq, payload, kind)
		if err != nil {
			return err
		}
		if epoch != nil {
			b.Epoch = dec.internEpoch(epoch)
		}
		b.Replayed = true
		if err := fn(b); err != nil {
			if errors.Is(err, ErrStopReplay) {
				return nil
			}
			return err
		}
	}
}

func ctxOr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	return err
}

// isEndSeq reports whether a sequence frame holds the replay end marker.
func isEndSeq(f []byte) bool {
	seq, _, err := DecodeSeqFrame(f)
	return err == nil && seq == EndSeq
}
