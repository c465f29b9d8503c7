package snapshot

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// segmentBytes is the size of the buffers a reply's chunks are encoded
// into, one after another. A reply is handed to callers that send it
// after build returns, so its buffers are never reused; segments keep
// each allocation moderate and need no copying when the estimate is short.
const segmentBytes = 4 << 20

// yieldChunks is how many chunks a build encodes between runtime.Gosched
// calls (64 events each, about 20-40 µs of work per chunk).
const yieldChunks = 8

// bytesView is b as a string without copying it: valid while b is
// unchanged. Only for the encoder's input within a build.
func bytesView(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

// build encodes the reply of the current set: the cut, the epoch, then the
// set in chunks of at most MaxEventsPerBatch stored events. It runs on
// Run's goroutine, which owns the set; Record keeps queueing meanwhile.
//
// Every event of a chunk has event_id 0 (ID is never set): chunks are not
// live events, and 0 is below every live event_id (they count from 1), so a
// consumer cannot mistake one for the other. Decoding a chunk takes a
// decoder that knows this: pkg/kvevent's DecodePayload, the live rules,
// requires event_ids to rise within a payload and rejects a chunk of two or
// more events (see TestChunkEventIDs).
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

	// batch's events hold only what the encoder reads of them (and
	// event_id 0): filled field by field, not copied whole.
	batch := r.batch[:kvevent.MaxEventsPerBatch]
	nb, chunks := 0, 0
	var err error
	flush := func() bool {
		evs := batch[:nb]
		nb = 0
		if bound := r.chunkBound(evs); cap(seg)-len(seg) < bound {
			seg = make([]byte, 0, max(bound, min(segmentBytes, r.cfg.MaxReplyBytes-total+1024)))
		}
		var out []byte
		out, err = r.enc.AppendBatch(seg, ts, evs)
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
		return true
	}
	r.set.Range(func(tenant string, m kvevent.Medium, key, group []byte) bool {
		// Views of the set's bytes, not copies: the set does not change
		// during the build (Run's goroutine owns it) and AppendBatch copies
		// them into the chunk; batch is cleared before build returns.
		e := &batch[nb]
		e.Type, e.Tenant, e.Key, e.Medium, e.GroupID = kvevent.Stored, tenant, bytesView(key), m, bytesView(group)
		if nb++; nb == kvevent.MaxEventsPerBatch {
			if !flush() {
				return false
			}
			// A build takes about half a second per million entries:
			// let the publisher's goroutines run every yieldChunks chunks
			// instead of holding a P for Go's 10 ms preemption slice.
			if chunks++; chunks%yieldChunks == 0 {
				runtime.Gosched()
			}
		}
		return true
	})
	if err == nil && nb > 0 {
		flush()
	}
	clear(batch) // drop the strings
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
