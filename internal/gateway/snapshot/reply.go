package snapshot

import (
	"github.com/crescent-kv/crescent/internal/prefault"
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
//     go to the free list, which holds at most about one reply's worth;
//   - when no request came for replyIdle, the recorder drops its free list
//     and its last reply, and buffers released afterwards are left to the
//     collector, so an idle gateway does not keep 300 MB for nobody.

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
				break
			}
			r.freeSegs = append(r.freeSegs, s[:0])
		}
	}
	clear(bufs.segs)
	bufs.segs = nil
}

// maxFreeLocked bounds the free list: the segments of the last reply built
// and two more (at least four).
func (r *Recorder) maxFreeLocked() int { return max(r.freeLimit, 4) }

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
// segment if n fits it (one too small is dropped), else a new one of
// max(n, want) bytes.
func (r *Recorder) segment(n, want int) []byte {
	r.pmu.Lock()
	if k := len(r.freeSegs); k > 0 {
		s := r.freeSegs[k-1]
		r.freeSegs[k-1] = nil
		r.freeSegs = r.freeSegs[:k-1]
		if cap(s) >= n {
			r.pmu.Unlock()
			return s
		}
	}
	r.pmu.Unlock()
	b := make([]byte, 0, max(n, want))
	// A new segment's pages are mapped in one system call rather than by
	// one fault each as the build writes them: see package prefault (a
	// first 1M-entry build from about 1.1 s to 0.55 s on the VM of
	// BENCHMARKS.md).
	prefault.Buffer(b)
	return b
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
	clear(r.freeSegs)
	r.freeSegs = nil
	if b != nil && !b.stale {
		b.stale = true
		if b.refs == 0 {
			r.recycleLocked(b)
		}
	}
}
