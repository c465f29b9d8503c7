package snapshot

import (
	"encoding/binary"
	"fmt"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// segmentBytes is the size of the buffers a reply's chunks are encoded
// into, one after another. A reply is handed to callers that send it
// after build returns, so its buffers are never reused; segments keep
// each allocation moderate and need no copying when the estimate is short.
const segmentBytes = 4 << 20

// chunkEventID is the event_id of every event in a chunk: chunks are not
// live events, and 0 is below every live event_id (they count from 1), so a
// consumer cannot mistake one for the other. Decoding a chunk takes a
// decoder that knows this: pkg/kvevent's DecodePayload, the live rules,
// requires event_ids to rise within a payload and rejects a chunk of two or
// more events (see TestChunkEventIDs).
const chunkEventID = 0

// build encodes the reply of the current set: the cut, the epoch, then the
// set in chunks of at most MaxEventsPerBatch stored events. It runs on
// Run's goroutine, which owns the set; Record keeps queueing meanwhile.
func (r *Recorder) build() ([][]byte, error) {
	n := r.set.Len()
	frames := make([][]byte, 2, 2+(n+kvevent.MaxEventsPerBatch-1)/kvevent.MaxEventsPerBatch)
	head := make([]byte, frameHeaderBytes)
	binary.BigEndian.PutUint64(head, uint64(r.cut))
	copy(head[8:], r.epoch[:])
	frames[0], frames[1] = head[:8:8], head[8:]
	total := frameHeaderBytes
	if n == 0 || !r.enc.Emits(kvevent.Stored) {
		r.stats.replyBytes.Store(int64(total))
		return frames, nil
	}

	ts := max(r.deps.Now().UnixMilli(), 0)
	// The first segment: the last reply's size, or an estimate, capped.
	hint := r.lastBytes
	if hint == 0 {
		hint = n * (r.evFixed + 48)
	}
	seg := make([]byte, 0, min(hint+hint/16+1024, segmentBytes))

	batch := r.batch[:0]
	var err error
	flush := func() bool {
		if bound := r.chunkBound(batch); cap(seg)-len(seg) < bound {
			seg = make([]byte, 0, max(bound, min(segmentBytes, r.cfg.MaxReplyBytes-total+1024)))
		}
		var out []byte
		out, err = r.enc.AppendBatch(seg, ts, batch)
		if err != nil {
			err = fmt.Errorf("snapshot: encode: %w", err)
			return false
		}
		chunk := out[len(seg):len(out):len(out)]
		seg = out
		total += len(chunk)
		if total > r.cfg.MaxReplyBytes {
			err = fmt.Errorf("%w: more than %d bytes for %d entries", ErrTooLarge, r.cfg.MaxReplyBytes, n)
			return false
		}
		frames = append(frames, chunk)
		clear(batch) // drop the strings
		batch = batch[:0]
		return true
	}
	for ev := range r.set.All() {
		ev.ID = chunkEventID
		batch = append(batch, ev)
		if len(batch) == kvevent.MaxEventsPerBatch && !flush() {
			break
		}
	}
	if err == nil && len(batch) > 0 {
		flush()
	}
	clear(batch)
	r.batch = batch[:0]
	if err != nil {
		return nil, err
	}
	r.lastBytes = total
	r.stats.replyBytes.Store(int64(total))
	return frames, nil
}

// chunkBound is at least the encoded size of a payload of evs: each event
// at most evFixed plus its strings and the largest headers of three
// strings.
func (r *Recorder) chunkBound(evs []kvevent.Event) int {
	n := 0
	for i := range evs {
		e := &evs[i]
		n += r.evFixed + 16 + len(e.Tenant) + len(e.Key) + len(e.GroupID)
	}
	return n
}
