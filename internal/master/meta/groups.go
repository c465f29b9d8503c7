package meta

// An object's group id and soft pin expiry live in its shard, not in the
// object (which stays 112 bytes, TestObjectSize): group ids are interned
// in the shard's counted table (one string per group, freed with its last
// object), and soft pin expiries, rare next to objects, in its pins map.

// groupOf is o's group id.
func (sh *shard) groupOf(o *object) string {
	return sh.groups.Name(o.group)
}

// setGroupLocked makes g o's group id.
func (sh *shard) setGroupLocked(o *object, g string) {
	old := o.group
	o.group = sh.groups.Intern(g)
	sh.groups.Release(old)
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
