package publisher

import (
	"context"
	"slices"
	"sync"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.opentelemetry.io/otel/trace"
)

// item is one queued event: only what varies per event (the envelope, id
// and timestamp are filled in when the batch is built). 56 bytes: marked
// fits in the padding, and the master position it announces is kept aside
// (queue.pos), since only the last item of an EnqueueAt call has one.
type item struct {
	tenant, key, group string
	typ                kvevent.EventType
	medium             kvevent.Medium
	// marked: queue.pos holds the master position after this item (it
	// ends an EnqueueAt call); unmarked items inherit the previous one.
	marked bool
}

// queue is the bounded event queue between the source and the publishing
// goroutine. Pushing never blocks: when full, the oldest event is dropped
// and one sequence number is burned for it. A burned number is charged to
// the next batch taken, so the gap appears in the stream exactly where the
// dropped events were (after every batch already taken, before the events
// that outlived them).
//
// Master positions: a push with a non-zero position marks its last item
// with it; a take returns the last position among the items it takes. A
// push with no items marks the last queued item or, when the queue is
// empty, becomes the pending position the next take returns (a heartbeat
// takes no items and still picks it up). A dropped item's position is
// dropped with it: the whole call it ended was dropped, and the positions
// of the events that survive are later ones.
type queue struct {
	notify chan struct{} // cap 1: "the queue changed"

	// mu guards every field below.
	mu      sync.Mutex
	buf     []item              // ring of capacity len(buf)
	pos     []statedir.Position // pos[i] is buf[i]'s position when buf[i].marked; allocated at the first mark
	pending statedir.Position   // a position with no queued item to mark (zero: none)
	head, n int
	burned  uint64 // drops not yet charged to a batch
	dropped uint64 // drops ever
	pushed  uint64 // events ever queued
	room    chan struct{}
	// marks are the trace links of the latest linked pushes, oldest first,
	// at most maxLinkMarks (empty with tracing off); taken holds those of
	// the items the last take took (linksTaken).
	marks []linkMark
	taken []trace.SpanContext
}

// linkMark is one linked push: the spans behind its events, and end, the
// number of events ever queued once it was (its last item's index + 1).
type linkMark struct {
	end   uint64
	links []trace.SpanContext
}

// maxLinkMarks bounds the linked pushes the queue remembers.
const maxLinkMarks = 64

func newQueue(capacity int) *queue {
	return &queue{buf: make([]item, capacity), notify: make(chan struct{}, 1), room: make(chan struct{})}
}

// mark attaches pos to the last queued item, or makes it pending. q.mu is held.
func (q *queue) mark(pos statedir.Position) {
	if pos == (statedir.Position{}) {
		return
	}
	if q.n == 0 {
		q.pending = pos
		return
	}
	if q.pos == nil {
		q.pos = make([]statedir.Position, len(q.buf))
	}
	i := (q.head + q.n - 1) % len(q.buf)
	q.buf[i].marked = true
	q.pos[i] = pos
}

// push appends items, dropping the oldest ones when full; pos (if not
// zero) is the master position after them.
func (q *queue) push(items []item, pos statedir.Position) { q.pushLinked(items, pos, nil) }

// pushLinked is push, with links: the spans behind these items, which the
// batch publishing the last of them links to.
func (q *queue) pushLinked(items []item, pos statedir.Position, links []trace.SpanContext) {
	if len(items) == 0 && pos == (statedir.Position{}) {
		return
	}
	q.mu.Lock()
	for _, it := range items {
		if q.n == len(q.buf) {
			q.buf[q.head] = item{}
			q.head = (q.head + 1) % len(q.buf)
			q.n--
			q.burned++
			q.dropped++
		}
		q.buf[(q.head+q.n)%len(q.buf)] = it
		q.n++
	}
	q.mark(pos)
	q.pushed += uint64(len(items))
	if len(links) > 0 && len(items) > 0 {
		q.markLinksLocked(links)
	}
	q.mu.Unlock()
	if len(items) > 0 {
		q.signal()
	}
}

// markLinksLocked remembers links for the items just pushed (a copy, at
// most tracectx.MaxLinks), forgetting the oldest mark when full.
func (q *queue) markLinksLocked(links []trace.SpanContext) {
	if len(q.marks) == maxLinkMarks {
		copy(q.marks, q.marks[1:])
		q.marks = q.marks[:maxLinkMarks-1]
	}
	q.marks = append(q.marks, linkMark{end: q.pushed, links: slices.Clone(links[:min(len(links), tracectx.MaxLinks)])})
}

// takeLinksLocked moves to q.taken the links of the pushes whose last
// item the take that just ended took (at most tracectx.MaxLinks, distinct),
// and forgets those of pushes that were dropped.
func (q *queue) takeLinksLocked(k int) {
	q.taken = q.taken[:0]
	if len(q.marks) == 0 {
		return
	}
	next := q.pushed - uint64(q.n) // index of the first item still queued
	start := next - uint64(k)      // of the first item taken
	i := 0
	for ; i < len(q.marks) && q.marks[i].end <= next; i++ {
		if q.marks[i].end <= start {
			continue // its items were dropped, or taken with no link room
		}
		for _, sc := range q.marks[i].links {
			if len(q.taken) < tracectx.MaxLinks && !slices.ContainsFunc(q.taken, sc.Equal) {
				q.taken = append(q.taken, sc)
			}
		}
	}
	q.marks = q.marks[:copy(q.marks, q.marks[i:])]
}

// linksTaken appends to dst the links of the items the last take took.
func (q *queue) linksTaken(dst []trace.SpanContext) []trace.SpanContext {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append(dst, q.taken...)
}

func (q *queue) signal() {
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

// pushWait appends items without dropping: it waits, honouring ctx, until
// the queue has room for each chunk. Bulk producers (a resync diff) use
// it. pos (if not zero) marks the last item, once it is queued.
func (q *queue) pushWait(ctx context.Context, items []item, pos statedir.Position) error {
	if len(items) == 0 {
		q.push(nil, pos)
		return nil
	}
	for len(items) > 0 {
		q.mu.Lock()
		free := len(q.buf) - q.n
		if free == 0 {
			room := q.room
			q.mu.Unlock()
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-room:
			}
			continue
		}
		k := min(free, len(items))
		for _, it := range items[:k] {
			q.buf[(q.head+q.n)%len(q.buf)] = it
			q.n++
		}
		q.pushed += uint64(k)
		items = items[k:]
		if len(items) == 0 {
			q.mark(pos)
		}
		q.mu.Unlock()
		q.signal()
	}
	return nil
}

// take moves up to max items into dst and returns the sequence numbers
// burned since the last take and the last master position among the
// items taken (or pending), zero when there is none.
func (q *queue) take(dst []item, max int) ([]item, uint64, statedir.Position) {
	q.mu.Lock()
	defer q.mu.Unlock()
	pos := q.pending
	q.pending = statedir.Position{}
	k := min(q.n, max)
	for range k {
		if q.buf[q.head].marked {
			pos = q.pos[q.head]
		}
		dst = append(dst, q.buf[q.head])
		q.buf[q.head] = item{}
		q.head = (q.head + 1) % len(q.buf)
	}
	q.n -= k
	q.takeLinksLocked(k)
	b := q.burned
	q.burned = 0
	if k > 0 {
		close(q.room)
		q.room = make(chan struct{})
	}
	return dst, b, pos
}

func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n
}

// counts returns events ever queued, ever dropped, and queued now.
func (q *queue) counts() (pushed, dropped uint64, depth int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.pushed, q.dropped, q.n
}
