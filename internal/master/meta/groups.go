package meta

// groupTable interns a shard's group ids (the clients' group_id strings):
// an object holds a uint32 instead of a 16-byte string header, and objects
// of one group share one string. Entry 0 is "" (no group) and is never
// counted; an entry whose last object leaves is freed for the next new
// group, so the table never holds more entries than the shard has objects.
// The shard lock guards it.
type groupTable struct {
	names []string
	refs  []uint32
	idx   map[string]uint32
	free  []uint32
}

func (g *groupTable) name(i uint32) string { return g.names[i] }

// intern returns name's index, counting one more object in it.
func (g *groupTable) intern(name string) uint32 {
	if name == "" {
		return 0
	}
	if g.idx == nil {
		g.names, g.refs, g.idx = []string{""}, []uint32{0}, make(map[string]uint32)
	}
	i, ok := g.idx[name]
	if !ok {
		if n := len(g.free); n > 0 {
			i, g.free = g.free[n-1], g.free[:n-1]
			g.names[i] = name
		} else {
			i = uint32(len(g.names))
			g.names = append(g.names, name)
			g.refs = append(g.refs, 0)
		}
		g.idx[name] = i
	}
	g.refs[i]++
	return i
}

// release counts one object fewer in index i.
func (g *groupTable) release(i uint32) {
	if i == 0 {
		return
	}
	if g.refs[i]--; g.refs[i] == 0 {
		delete(g.idx, g.names[i])
		g.names[i] = ""
		g.free = append(g.free, i)
	}
}

// len is the number of groups held (tests).
func (g *groupTable) len() int { return len(g.idx) }

// groupOf is o's group id.
func (sh *shard) groupOf(o *object) string {
	if o.group == 0 {
		return ""
	}
	return sh.groups.name(o.group)
}

// setGroupLocked makes g o's group id.
func (sh *shard) setGroupLocked(o *object, g string) {
	old := o.group
	o.group = sh.groups.intern(g)
	sh.groups.release(old)
}

// softPinLocked is o's soft pin expiry, Unix ms (0 when it has none).
// Soft pins are rare next to objects, so the expiry lives in the shard's
// pins map rather than in every object.
func (sh *shard) softPinLocked(o *object) int64 {
	if o.flags&flagSoftPin == 0 {
		return 0
	}
	return sh.pins[o]
}

// softPinnedLocked reports whether o is soft pinned at nowMs.
func (sh *shard) softPinnedLocked(o *object, nowMs int64) bool {
	return o.flags&flagSoftPin != 0 && nowMs < sh.pins[o]
}

// setSoftPinLocked soft pins o until untilMs.
func (sh *shard) setSoftPinLocked(o *object, untilMs int64) {
	if sh.pins == nil {
		sh.pins = make(map[*object]int64)
	}
	o.flags |= flagSoftPin
	sh.pins[o] = untilMs
}

// clearSoftPinLocked takes o's soft pin away.
func (sh *shard) clearSoftPinLocked(o *object) {
	if o.flags&flagSoftPin != 0 {
		delete(sh.pins, o)
		o.flags &^= flagSoftPin
	}
}
