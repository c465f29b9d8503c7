package publisher

import (
	"context"
	"sync"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// item is one queued event: only what varies per event (the envelope, id
// and timestamp are filled in when the batch is built). 56 bytes.
type item struct {
	tenant, key, group string
	typ                kvevent.EventType
	medium             kvevent.Medium
}

// queue is the bounded event queue between the source and the publishing
// goroutine. Pushing never blocks: when full, the oldest event is dropped
// and one sequence number is burned for it. A burned number is charged to
// the next batch taken, so the gap appears in the stream exactly where the
// dropped events were (after every batch already taken, before the events
// that outlived them).
type queue struct {
	notify chan struct{} // cap 1: "the queue changed"

	// mu guards every field below.
	mu      sync.Mutex
	buf     []item // ring of capacity len(buf)
	head, n int
	burned  uint64 // drops not yet charged to a batch
	dropped uint64 // drops ever
	pushed  uint64 // events ever queued
	room    chan struct{}
}

func newQueue(capacity int) *queue {
	return &queue{buf: make([]item, capacity), notify: make(chan struct{}, 1), room: make(chan struct{})}
}

// push appends items, dropping the oldest ones when full.
func (q *queue) push(items []item) {
	if len(items) == 0 {
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
	q.pushed += uint64(len(items))
	q.mu.Unlock()
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

// pushWait appends items without dropping: it waits, honouring ctx, until
// the queue has room for each chunk. Bulk producers (a resync diff) use it.
func (q *queue) pushWait(ctx context.Context, items []item) error {
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
		q.mu.Unlock()
		items = items[k:]
		select {
		case q.notify <- struct{}{}:
		default:
		}
	}
	return nil
}

// take moves up to max items into dst and returns the sequence numbers
// burned since the last take.
func (q *queue) take(dst []item, max int) ([]item, uint64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	k := min(q.n, max)
	for range k {
		dst = append(dst, q.buf[q.head])
		q.buf[q.head] = item{}
		q.head = (q.head + 1) % len(q.buf)
	}
	q.n -= k
	b := q.burned
	q.burned = 0
	if k > 0 {
		close(q.room)
		q.room = make(chan struct{})
	}
	return dst, b
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
