package snapshot

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// segmentBytes is the size of the buffers a reply's chunks are encoded
// into, one after another: segments keep each allocation moderate, need
// no copying when the estimate is short, and are reused by later builds
// once released (reply.go).
const segmentBytes = 4 << 20

// A build encodes yieldChunks chunks (64 events each, about 10-20 µs of
// work per chunk) at a time, then yields (runtime.Gosched), so it never
// holds a P for Go's 10 ms preemption slice. While live traffic flows
// (events were recorded since the build last checked), it also rests
// buildRest after each buildSlice of work, taking at most a quarter of
// a core from the live path; a build with no live traffic to protect
// (a lone late joiner on a quiet gateway) runs at full speed.
//
// Measured with BenchmarkGatewayStateLive (two back-to-back fetchers of a
// 1M-entry set, interleaved runs on a shared 2-core VM): yielding alone
// left the live p99 at 5.7-12 ms (fetchers at nice 19) and 12-16 ms (nice
// 0); resting 1 ms in 3 at 4.5-8.4 and 4.9-8.5 ms; 1 ms in 2 at 3.9-7.0
// and 4.7-5.5 ms (BENCHMARKS.md, issue 13, for what followed). The price
// is the build's wall time under traffic (about four times its CPU time).
const (
	yieldChunks = 8
	buildSlice  = time.Millisecond
	buildRest   = 3 * time.Millisecond
)

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
func (r *Recorder) build() ([][]byte, *replyBufs, error) {
	r.retireLast() // it cannot be served again: its buffers may serve this one
	bufs := &replyBufs{}
	n := r.set.Len()
	frames := make([][]byte, 2, 2+(n+kvevent.MaxEventsPerBatch-1)/kvevent.MaxEventsPerBatch)
	head := make([]byte, frameHeaderBytes)
	binary.BigEndian.PutUint64(head, uint64(r.cut))
	copy(head[8:], r.epoch[:])
	frames[0], frames[1] = head[:8:8], head[8:]
	total := frameHeaderBytes
	if n == 0 || !r.enc.Emits(kvevent.Stored) {
		r.stats.replyBytes.Store(int64(total))
		return frames, bufs, nil
	}

	ts := max(r.deps.Now().UnixMilli(), 0)
	ce := &r.chunkEnc
	if err := ce.reset(r.enc, ts); err != nil {
		return nil, nil, err
	}
	// The first segment: the last reply's size, or an estimate, capped.
	hint := r.lastBytes
	if hint == 0 {
		hint = n * (r.evFixed + 48)
	}
	first := min(hint+hint/16+1024, segmentBytes)
	seg, err := r.segment(first, first)
	if err != nil {
		return nil, nil, err
	}
	bufs.segs = append(bufs.segs, seg)

	// Chunks are written into seg one event at a time; a chunk that does
	// not fit moves (what it has so far) to a new segment. Every chunk has
	// MaxEventsPerBatch events but the last: its size is known up front.
	var (
		left     = n // entries not yet written
		start    int // of the current chunk in seg
		inChunk  int // events written of the current chunk
		chunkN   int // events of the current chunk
		chunks   int
		ran      = time.Now() // since the build last rested or checked for traffic
		seen     = r.recordedEvents.Load()
		tooLarge = func() error {
			return fmt.Errorf("%w: more than %d bytes for %d entries", ErrTooLarge, r.cfg.MaxReplyBytes, n)
		}
		fitSegment = func(need int) error {
			if cap(seg)-len(seg) >= need {
				return nil
			}
			part := len(seg) - start
			next, err := r.segment(part+need, min(segmentBytes, r.cfg.MaxReplyBytes-total+1024))
			if err != nil {
				return err
			}
			bufs.segs = append(bufs.segs, next)
			seg, start = append(next, seg[start:]...), 0
			return nil
		}
	)
	r.set.Range(func(tenant string, m kvevent.Medium, key, group []byte) bool {
		if left == 0 {
			err = fmt.Errorf("snapshot: the set holds more than its %d entries", n)
			return false
		}
		if err = ce.use(tenant, m); err != nil {
			return false
		}
		if inChunk == 0 {
			chunkN = min(left, kvevent.MaxEventsPerBatch)
			if err = fitSegment(ce.chunkHeadSize(chunkN)); err != nil {
				return false
			}
			start = len(seg)
			seg = ce.appendChunkHead(seg, chunkN)
		}
		size := ce.eventSize(key, group)
		if inChunk == chunkN-1 {
			size += len(ce.dp)
		}
		if err = fitSegment(size); err != nil {
			return false
		}
		seg = ce.appendEvent(seg, group, key)
		left--
		if inChunk++; inChunk < chunkN {
			return true
		}
		seg = append(seg, ce.dp...)
		chunk := seg[start:len(seg):len(seg)]
		inChunk = 0
		if total += len(chunk); total > r.cfg.MaxReplyBytes {
			err = tooLarge()
			return false
		}
		frames = append(frames, chunk)
		// See yieldChunks.
		if chunks++; chunks%yieldChunks == 0 {
			if time.Since(ran) < buildSlice {
				runtime.Gosched()
			} else if ev := r.recordedEvents.Load(); ev != seen {
				seen = ev
				time.Sleep(buildRest)
				ran = time.Now()
			} else {
				runtime.Gosched()
				ran = time.Now()
			}
		}
		return true
	})
	if err == nil && left != 0 {
		err = fmt.Errorf("snapshot: the set yielded %d of its %d entries", n-left, n)
	}
	if err != nil {
		if !errors.Is(err, ErrTooLarge) && !errors.Is(err, ErrEncoding) {
			err = fmt.Errorf("snapshot: encode: %w", err)
		}
		r.pmu.Lock()
		bufs.stale = true
		r.recycleLocked(bufs)
		r.pmu.Unlock()
		return nil, nil, err
	}
	r.lastBytes = total
	r.pmu.Lock()
	r.freeLimit = total/segmentBytes + 3
	r.pmu.Unlock()
	r.stats.replyBytes.Store(int64(total))
	return frames, bufs, nil
}
