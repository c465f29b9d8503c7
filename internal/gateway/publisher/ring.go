package publisher

import (
	"sort"
	"sync"
)

// ringEntry is one published batch as the PUB socket framed it: the ZMTP
// wire bytes of [topic, seq, payload]. A replay reply is a 2-byte empty
// delimiter frame followed by these bytes (vLLM's current dialect) or by
// wire[2:], which skips the topic frame (the older dialect).
type ringEntry struct {
	seq  uint64
	wire []byte
}

// ring retains the most recent batches for replay, bounded by count and bytes.
type ring struct {
	maxBatches, maxBytes int

	// mu guards every field below.
	mu      sync.Mutex
	entries []ringEntry // circular, capacity maxBatches
	head, n int
	bytes   int
}

func newRing(maxBatches, maxBytes int) *ring {
	return &ring{maxBatches: maxBatches, maxBytes: maxBytes, entries: make([]ringEntry, maxBatches)}
}

func (r *ring) add(seq uint64, wire []byte) {
	if r.maxBatches == 0 || len(wire) > r.maxBytes {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for r.n > 0 && (r.n == r.maxBatches || r.bytes+len(wire) > r.maxBytes) {
		r.bytes -= len(r.entries[r.head].wire)
		r.entries[r.head] = ringEntry{}
		r.head = (r.head + 1) % r.maxBatches
		r.n--
	}
	r.entries[(r.head+r.n)%r.maxBatches] = ringEntry{seq: seq, wire: wire}
	r.n++
	r.bytes += len(wire)
}

// from returns every retained batch with seq >= start, oldest first. The
// wire slices are immutable and shared.
func (r *ring) from(start uint64) []ringEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	at := func(i int) ringEntry { return r.entries[(r.head+i)%r.maxBatches] }
	i := sort.Search(r.n, func(i int) bool { return at(i).seq >= start })
	out := make([]ringEntry, 0, r.n-i)
	for ; i < r.n; i++ {
		out = append(out, at(i))
	}
	return out
}

func (r *ring) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}
