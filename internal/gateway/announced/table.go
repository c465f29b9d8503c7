package announced

// table maps a key's 64-bit hash to the arena ref of its record: an
// extendible hash table of linear-probing subtables, without pointers in
// the slots.
//
// Why not a Go map: in a set of millions of entries each insert misses the
// cache, and a Go map's lookup is a chain of dependent loads (directory,
// table, groups, control word), so one lookup's misses cannot overlap the
// next one's. Here a lookup is the directory (small, cached) and then one
// slot, so the source can touch the slots of a whole watch response first
// (prefetch), letting the processor overlap those misses, and then apply the
// response against a warm cache. A subtable of subSlots slots that fills
// splits in two by the next bit of the hash, so growing never moves more
// than one subtable (64 KiB) at a time.
//
// Measured against Go maps (issue 12; interleaved runs in one sitting,
// benchstat medians ± their 95% interval): the announced set as
// tenant → medium → map[key]group, keys cloned, costs
// BenchmarkPipeline/resp=1024/subs=0 1,473 ± 12% against 723 ± 13% cpu-ns
// per event here (+104%, n=8; +92% in a second sitting), live50k/subs=1
// 3.58µs ± 13% against 2.78µs ± 22% (n=6), and one allocation per event
// against none. So the tables and the arena stay.
//
// Several keys may share a hash (slots with equal h); lookups compare the
// key in the arena.
type table struct {
	dir   []*subtable // by the hash's top depth bits; a subtable covers 1<<(depth-its depth) entries in a row
	depth uint8
	n     int
}

type subtable struct {
	slots []slot // power of two; h == 0 is an empty slot
	n     int
	depth uint8 // the hash bits its keys share (local depth)
}

type slot struct{ h, ref uint64 }

const (
	subSlots   = 1 << 12 // a subtable's size beyond which it splits instead of doubling
	firstSlots = 8
	maxDepth   = 24 // beyond it (thousands of keys of one hash) subtables double instead
)

// slotHash makes 0, the empty slot, a valid hash of a key.
func slotHash(h uint64) uint64 {
	if h == 0 {
		return 1
	}
	return h
}

func (t *table) len() int { return t.n }

func (t *table) sub(h uint64) *subtable { return t.dir[h>>(64-uint(t.depth))&(1<<t.depth-1)] }

// find returns the subtable and slot index of key's entry (h from
// slotHash), or i < 0.
func (t *table) find(ar *arena, h uint64, key string) (s *subtable, i int) {
	if t.dir == nil {
		return nil, -1
	}
	s = t.sub(h)
	mask := len(s.slots) - 1
	for i = int(h) & mask; s.slots[i].h != 0; i = (i + 1) & mask {
		if s.slots[i].h == h {
			if k, _ := ar.record(s.slots[i].ref); string(k) == key {
				return s, i
			}
		}
	}
	return s, -1
}

// peek loads the slot where a lookup of h starts, and the record it names
// if its hash is h, and returns something of them so the loads are kept.
func (t *table) peek(ar *arena, h uint64) uint64 {
	if t.dir == nil {
		return 0
	}
	s := t.sub(h)
	sl := s.slots[int(h)&(len(s.slots)-1)]
	if sl.h == h {
		return uint64(ar.chunks[sl.ref>>chunkShift][sl.ref&(chunkSize-1)])
	}
	return sl.h
}

// insert adds an entry for a key that has none.
func (t *table) insert(h, ref uint64) {
	if t.dir == nil {
		t.dir = []*subtable{{slots: make([]slot, firstSlots)}}
	}
	s := t.sub(h)
	for (s.n+1)*4 > len(s.slots)*3 {
		if len(s.slots) < subSlots || s.depth >= maxDepth {
			s.grow()
		} else {
			t.split(s, h)
			s = t.sub(h)
		}
	}
	s.put(h, ref)
	t.n++
}

// delete removes the entry at s.slots[i], shifting back the entries after
// it that probed past it.
func (t *table) delete(s *subtable, i int) {
	mask := len(s.slots) - 1
	for j := (i + 1) & mask; s.slots[j].h != 0; j = (j + 1) & mask {
		home := int(s.slots[j].h) & mask
		// The entry at j may move to i unless its home lies cyclically in (i, j].
		if (i <= j && (home <= i || home > j)) || (i > j && home <= i && home > j) {
			s.slots[i] = s.slots[j]
			i = j
		}
	}
	s.slots[i] = slot{}
	s.n--
	t.n--
}

func (s *subtable) put(h, ref uint64) {
	mask := len(s.slots) - 1
	i := int(h) & mask
	for s.slots[i].h != 0 {
		i = (i + 1) & mask
	}
	s.slots[i] = slot{h, ref}
	s.n++
}

func (s *subtable) grow() {
	old := s.slots
	s.slots, s.n = make([]slot, 2*len(old)), 0
	for _, sl := range old {
		if sl.h != 0 {
			s.put(sl.h, sl.ref)
		}
	}
}

// split replaces s (full, subSlots slots) by two subtables that tell its
// keys apart by hash bit s.depth (from the top), doubling the directory
// first if s's keys already use all of its bits. h is one of s's hashes.
func (t *table) split(s *subtable, h uint64) {
	if s.depth == t.depth {
		dir := make([]*subtable, 2*len(t.dir))
		for i, p := range t.dir {
			dir[2*i], dir[2*i+1] = p, p
		}
		t.dir, t.depth = dir, t.depth+1
	}
	lo := &subtable{slots: make([]slot, subSlots), depth: s.depth + 1}
	hi := &subtable{slots: make([]slot, subSlots), depth: s.depth + 1}
	bit := 63 - uint(s.depth)
	for _, sl := range s.slots {
		if sl.h == 0 {
			continue
		}
		if sl.h>>bit&1 == 0 {
			lo.put(sl.h, sl.ref)
		} else {
			hi.put(sl.h, sl.ref)
		}
	}
	// s covers the directory entries whose top s.depth bits are h's.
	width := 1 << (t.depth - s.depth)
	start := 0
	if s.depth > 0 {
		start = int(h>>(64-uint(s.depth))) * width
	}
	for i := range width {
		if i < width/2 {
			t.dir[start+i] = lo
		} else {
			t.dir[start+i] = hi
		}
	}
}

// all yields every entry's ref.
func (t *table) all(yield func(ref uint64) bool) {
	var prev *subtable
	for _, s := range t.dir {
		if s == prev {
			continue // a subtable's directory entries are consecutive
		}
		prev = s
		for _, sl := range s.slots {
			if sl.h != 0 && !yield(sl.ref) {
				return
			}
		}
	}
}
