package snapshot

import (
	"sync/atomic"
	"time"
)

// Reply buffers. A build encodes its chunks into segments of segmentBytes;
// a reply of a million entries is about 75 of them (300 MB). Without reuse
// every build is 300 MB of garbage, and with two consumers fetching back
// to back the collector runs about once a second, each cycle taking CPU
// and pauses from the live path (BENCHMARKS.md, issue 13). So the
// segments of a build go back to a free list once no request still sends
// them, and the next build takes them from there:
//
//   - every reply served from a build (its chunks, under this or a later
//     cut) holds a reference on the build's replyBufs until the caller of
//     Reply releases it (Snapshot's callers never do: those buffers are
//     theirs);
//   - a build's buffers are stale once a newer build (or idleness)
//     replaced it as the last reply; stale buffers with no reference left
//     go to the free list, which holds at most about two replies' worth
//     (a build while two consumers' replies are still being written);
//   - when no request came for replyIdle, the recorder drops its free list
//     and its last reply, and buffers released afterwards are freed, so an
//     idle gateway does not keep 300 MB for nobody.
//
// Segments live outside the Go heap (newSegment) and are freed explicitly
// (freeSegment): every segment a build took is, at any moment, in exactly
// one place: a replyBufs with references or still the last reply, the
// free list, or freed. Stats.BufferBytes is what is mapped.

// replyIdle is how long the recorder keeps reply buffers after the last
// request (a variable for tests).
var replyIdle = 10 * time.Second

// replyBufs are the segments one build's chunks live in, shared by every
// reply served from it. refs and stale are guarded by Recorder.pmu.
type replyBufs struct {
	segs  [][]byte
	refs  int  // replies handed out and not released
	stale bool // no longer the last reply: recycle at refs 0
}

// releaser returns the release func of a reply of bufs: it drops the
// reference once, however often it is called.
func (r *Recorder) releaser(bufs *replyBufs) func() {
	var done atomic.Bool
	return func() {
		if done.Swap(true) {
			return
		}
		r.pmu.Lock()
		defer r.pmu.Unlock()
		if bufs.refs--; bufs.refs < 0 {
			panic("snapshot: reply released more often than served")
		}
		if bufs.refs == 0 && bufs.stale {
			r.recycleLocked(bufs)
		}
	}
}

// recycleLocked puts the segments of bufs (stale, unreferenced) on the
// free list, as many as fit (see maxFreeLocked), if the recorder is
// pooling; the rest are left to the collector.
func (r *Recorder) recycleLocked(bufs *replyBufs) {
	if r.pooling {
		limit := r.maxFreeLocked()
		for _, s := range bufs.segs {
			if len(r.freeSegs) >= limit {
				r.freeSegmentLocked(s)
				continue
			}
			r.freeSegs = append(r.freeSegs, s[:0])
		}
	} else {
		for _, s := range bufs.segs {
			r.freeSegmentLocked(s)
		}
	}
	clear(bufs.segs)
	bufs.segs = nil
}

// maxFreeLocked bounds the free list: twice the segments of the last reply
// built, and three more (at least four). One reply's worth was not
// enough: with two consumers fetching back to back a build runs while
// both of their replies are still being written, so it found a part of
// the segments it needed gone to the collector, allocated them again and
// faulted their pages in again (BenchmarkGatewayStateLive's faults/s).
// Peak memory is the same (those replies were in flight anyway); the
// buffers are only kept until replyIdle instead of being collected.
func (r *Recorder) maxFreeLocked() int { return max(2*r.freeLimit-3, 4) }

// retireLast marks the last reply's buffers stale (recycled now if no
// reply of them is still being sent) and forgets it: called before a new
// build, which could never reuse it, so that the build can take them.
func (r *Recorder) retireLast() {
	b := r.last.bufs
	r.last = lastReply{}
	r.pmu.Lock()
	defer r.pmu.Unlock()
	r.pooling = true
	if b != nil && !b.stale {
		b.stale = true
		if b.refs == 0 {
			r.recycleLocked(b)
		}
	}
}

// segment returns an empty buffer of at least n bytes: the last free
// segment if n fits it (one too small is freed), else a new one of
// max(n, want) bytes (newSegment).
func (r *Recorder) segment(n, want int) ([]byte, error) {
	r.pmu.Lock()
	if k := len(r.freeSegs); k > 0 {
		s := r.freeSegs[k-1]
		r.freeSegs[k-1] = nil
		r.freeSegs = r.freeSegs[:k-1]
		if cap(s) >= n {
			r.pmu.Unlock()
			return s, nil
		}
		r.freeSegmentLocked(s)
	}
	r.pmu.Unlock()
	b, err := newSegment(max(n, want))
	if err != nil {
		return nil, err
	}
	r.stats.bufferBytes.Add(int64(cap(b)))
	return b, nil
}

// freeSegmentLocked gives a segment back (freeSegment) and counts it.
func (r *Recorder) freeSegmentLocked(s []byte) {
	r.stats.bufferBytes.Add(-int64(cap(s)))
	freeSegment(s)
}

// dropReplies forgets the last reply and the free list and stops pooling:
// no request came for replyIdle (or the recorder stopped). Replies still
// being sent keep their buffers until released, then leave them to the
// collector.
func (r *Recorder) dropReplies() {
	b := r.last.bufs
	r.last = lastReply{}
	r.pmu.Lock()
	defer r.pmu.Unlock()
	r.pooling = false
	for _, s := range r.freeSegs {
		r.freeSegmentLocked(s)
	}
	clear(r.freeSegs)
	r.freeSegs = nil
	if b != nil && !b.stale {
		b.stale = true
		if b.refs == 0 {
			r.recycleLocked(b)
		}
	}
}
