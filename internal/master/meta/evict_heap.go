package meta

// candList is an append-only list of candidates in blocks (growing it
// copies nothing).
type candList struct {
	blocks [][]evictCand
	n      uint32
}

const candBlock = 4096

func (l *candList) add(c evictCand) {
	if l.n%candBlock == 0 {
		if len(l.blocks) < cap(l.blocks) { // a block of an earlier round
			l.blocks = l.blocks[:len(l.blocks)+1]
			l.blocks[len(l.blocks)-1] = l.blocks[len(l.blocks)-1][:0]
		} else {
			l.blocks = append(l.blocks, make([]evictCand, 0, candBlock))
		}
	}
	b := &l.blocks[len(l.blocks)-1]
	*b = append(*b, c)
	l.n++
}

// reset empties the list, keeping its blocks.
func (l *candList) reset() {
	for _, b := range l.blocks {
		clear(b) // drop the keys
	}
	l.blocks, l.n = l.blocks[:0], 0
}

func (l *candList) at(i uint32) *evictCand { return &l.blocks[i/candBlock][i%candBlock] }

// evictRank is a candidate's place in the eviction order, which is what a
// selection heap holds (24 bytes; the candidate is cands[idx]).
type evictRank struct {
	access int64
	size   uint64
	idx    uint32 // in scan order
	pinned bool
}

// after reports whether a comes after b in eviction order: soft-pinned
// after unpinned, then more recent access after less, then later in the
// scan after earlier.
func (a *evictRank) after(b *evictRank) bool {
	if a.pinned != b.pinned {
		return a.pinned
	}
	if a.access != b.access {
		return a.access > b.access
	}
	return a.idx > b.idx
}

// evictHeap is one target's selection: the shortest eviction-order prefix
// of the candidates offered so far whose sizes add up to need (all of them
// while they add up to less), as a max-heap: the last of them in eviction
// order is items[0].
type evictHeap struct {
	items []evictRank
	bytes int64 // total size of items
	need  int64 // > 0 for a heap in use
}

// offer adds r to the selection if it belongs to the prefix, and drops
// whatever that makes unnecessary. It reports whether it took r.
func (h *evictHeap) offer(r evictRank) bool {
	if h.bytes >= h.need && r.after(&h.items[0]) {
		return false // after every selected candidate, which suffice
	}
	h.items = append(h.items, r)
	h.bytes += int64(r.size)
	h.up(len(h.items) - 1)
	// Drop the last one while the others still meet the need (need > 0,
	// so one stays).
	for h.bytes-int64(h.items[0].size) >= h.need {
		h.bytes -= int64(h.items[0].size)
		last := len(h.items) - 1
		h.items[0] = h.items[last]
		h.items = h.items[:last]
		h.down(0)
	}
	return true
}

func (h *evictHeap) up(i int) {
	x := h.items[i]
	for i > 0 {
		parent := (i - 1) / 2
		if !x.after(&h.items[parent]) {
			break
		}
		h.items[i] = h.items[parent]
		i = parent
	}
	h.items[i] = x
}

func (h *evictHeap) down(i int) {
	n := len(h.items)
	if n == 0 {
		return
	}
	x := h.items[i]
	for {
		child := 2*i + 1
		if child >= n {
			break
		}
		if r := child + 1; r < n && h.items[r].after(&h.items[child]) {
			child = r
		}
		if !h.items[child].after(&x) {
			break
		}
		h.items[i] = h.items[child]
		i = child
	}
	h.items[i] = x
}
