package kvevent

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// Cut values of a snapshot reply that are not sequence numbers.
const (
	// CutNone: nothing has been published yet (the snapshot is empty).
	CutNone int64 = -1
	// CutUnavailable: the publisher cannot serve a snapshot (no chunks follow).
	CutUnavailable int64 = -2
)

// ErrSnapshotUnavailable is returned for a reply whose cut is -2: the
// publisher is up but cannot serve a snapshot (for the gateway: its
// recorder fell behind or the reply would exceed its size limit).
var ErrSnapshotUnavailable = errors.New("kvevent: snapshot unavailable")

// Snapshot is the publisher's state at a sequence number: applying Batches
// in order to an empty index yields the index of a subscriber that applied
// every batch up to and including Cut.
type Snapshot struct {
	// Cut is the last sequence number folded into the snapshot; CutNone
	// (-1) when nothing had been published (then Batches is empty). Live
	// batches above Cut follow it, from Cut+1 (from 0 or 1 after CutNone).
	Cut int64
	// Epoch is the publisher epoch (EpochLen bytes): in the snapshot stream
	// format, every live sequence frame of the same publisher carries it.
	Epoch []byte
	// Batches are the decoded chunks: stored events with event_id 0, each
	// batch with Seq set to the cut and Snapshot set.
	Batches []Batch
}

// Events is the number of events in the snapshot.
func (s *Snapshot) Events() int {
	n := 0
	for _, b := range s.Batches {
		n += len(b.Events)
	}
	return n
}

// SnapshotOptions tunes a snapshot request.
type SnapshotOptions struct {
	// Timeout bounds the whole exchange (default 10s) on top of ctx.
	Timeout time.Duration
	// MaxReplyBytes bounds the reply, all its frames together (default 256
	// MiB). A larger reply ends the exchange with an error wrapping
	// zmtp.ErrMessageTooLarge before it is allocated.
	MaxReplyBytes int
	// MaxFrame bounds one frame, a chunk (default 64 MiB, at most
	// MaxReplyBytes); a larger one fails with zmtp.ErrFrameTooLarge.
	MaxFrame int
	// MaxChunks bounds the number of chunks (default 1<<20); a reply with
	// more fails with zmtp.ErrProtocol.
	MaxChunks int
	// Decoder decodes the chunks (strict by default).
	Decoder Decoder
}

// snapshotRequest is the request body; the publisher does not read it
// (llm-d sends the same word).
var snapshotRequest = []byte("snapshot")

// FetchSnapshot asks the snapshot ROUTER at endpoint (e.g.
// tcp://gateway:5559) for the publisher's state. It connects as a REQ
// socket, sends [b"", "snapshot"] and reads one reply [b"", cut, epoch,
// chunk...] (see DecodeSnapshotReply). A cut of -2 returns an error
// wrapping ErrSnapshotUnavailable; a malformed reply one wrapping
// ErrMalformed.
func FetchSnapshot(ctx context.Context, endpoint string, opts SnapshotOptions) (*Snapshot, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	if opts.MaxReplyBytes <= 0 {
		opts.MaxReplyBytes = 256 << 20
	}
	if opts.MaxFrame <= 0 {
		opts.MaxFrame = 64 << 20
	}
	opts.MaxFrame = min(opts.MaxFrame, opts.MaxReplyBytes)
	if opts.MaxChunks <= 0 {
		opts.MaxChunks = 1 << 20
	}
	lim := zmtp.Limits{
		MaxFrame:   opts.MaxFrame,
		MaxFrames:  min(opts.MaxChunks, math.MaxInt-3) + 3, // delimiter, cut, epoch
		MaxMessage: opts.MaxReplyBytes,
	}
	ctx, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	c, err := zmtp.Dial(ctx, endpoint, zmq4.Req, opts.Timeout, lim)
	if err != nil {
		return nil, fmt.Errorf("kvevent: snapshot dial %s: %w", endpoint, err)
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if err := c.Write(zmtp.AppendMessage(nil, nil, snapshotRequest), opts.Timeout); err != nil {
		return nil, ctxOr(ctx, fmt.Errorf("kvevent: snapshot request: %w", err))
	}
	for {
		m, err := c.ReadMessage()
		if err != nil {
			return nil, ctxOr(ctx, fmt.Errorf("kvevent: snapshot read: %w", err))
		}
		if m.Command != "" {
			continue
		}
		if len(m.Frames) == 0 || len(m.Frames[0]) != 0 {
			return nil, malformed("snapshot reply without the empty delimiter frame of a REQ reply")
		}
		dec := opts.Decoder
		return dec.DecodeSnapshotReply(m.Frames[1:])
	}
}

// DecodeSnapshotReply decodes a snapshot reply with the package's strict
// Decoder (see Decoder.DecodeSnapshotReply).
func DecodeSnapshotReply(frames [][]byte) (*Snapshot, error) {
	var d Decoder
	return d.DecodeSnapshotReply(frames)
}

// DecodeSnapshotReply decodes the frames of a snapshot reply after the REQ
// envelope:
//
//	0   cut    int64 big-endian, signed: the last sequence folded in;
//	           -1 nothing published yet (no chunks), -2 unavailable (no chunks)
//	1   epoch  the EpochLen-byte publisher epoch
//	2…  chunk  a payload [timestamp_ms, [1..64 stored events], dp_rank]
//	           whose events carry event_id 0
//
// A cut of -2 returns an error wrapping ErrSnapshotUnavailable; anything
// else outside these rules is malformed.
func (d *Decoder) DecodeSnapshotReply(frames [][]byte) (*Snapshot, error) {
	if len(frames) < 2 {
		return nil, malformed("snapshot reply has %d frames, want at least 2 (cut, epoch)", len(frames))
	}
	if len(frames[0]) != 8 {
		return nil, malformed("snapshot cut frame has %d bytes, want 8", len(frames[0]))
	}
	if len(frames[1]) != EpochLen {
		return nil, malformed("snapshot epoch frame has %d bytes, want %d", len(frames[1]), EpochLen)
	}
	cut := int64(binary.BigEndian.Uint64(frames[0]))
	chunks := frames[2:]
	switch {
	case cut == CutUnavailable && len(chunks) == 0:
		return nil, fmt.Errorf("%w (publisher epoch %s)", ErrSnapshotUnavailable, hex.EncodeToString(frames[1]))
	case cut < CutNone:
		return nil, malformed("snapshot cut %d (with %d chunks)", cut, len(chunks))
	case cut == CutNone && len(chunks) != 0:
		return nil, malformed("snapshot cut -1 (nothing published) with %d chunks", len(chunks))
	}
	s := &Snapshot{Cut: cut, Epoch: bytes.Clone(frames[1])}
	if len(chunks) > 0 {
		s.Batches = make([]Batch, 0, len(chunks))
	}
	for i, c := range chunks {
		b, err := d.decodePayload(uint64(cut), c, kindChunk)
		if err != nil {
			return nil, malformed("snapshot chunk %d: %s", i, trimErr(err))
		}
		b.Epoch, b.Snapshot = s.Epoch, true
		s.Batches = append(s.Batches, b)
	}
	return s, nil
}
