// Package announced holds the set of objects the gateway has announced to
// subscribers: (tenant, key, medium) → group, built for millions of
// entries (see Set). The source keeps one to turn the master's changes into
// events and to diff a resync; the snapshot recorder keeps one of what was
// published, to serve snapshots and to persist.
package announced

import (
	"cmp"
	"encoding/binary"
	"hash/maphash"
	"maps"
	"slices"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// Set is what the source has announced to subscribers: tenant →
// (key, medium) → group. Owned by one goroutine.
//
// It grows to millions of entries, and its layout is most of what a
// stored event costs: each tenant holds one table per wire medium
// (objects), from a seeded 64-bit hash of the key to the place of the key
// and group in an arena of byte chunks. Neither the tables nor the arena
// hold pointers, so the garbage collector does not scan them (a map of
// strings made every collection visit every key), growing a table moves
// hashes without reading keys (a string-keyed map reads each key again
// from wherever it lies in the heap, a cache miss each), and an entry
// takes 16 bytes of table plus its record (24 for a 21-byte key) instead of
// 40 plus a 24-byte string. The source prefetches the slots of a whole
// watch response before applying it (see table). The arena keeps copies,
// so nothing it is given is held alive: a decoded watch response's strings
// share one buffer (watchCodec).
//
// Changes arrive in long runs of one tenant, so the last tenant's tables
// are kept at hand instead of hashing its name for every change.
type Set struct {
	tenants map[string]*tenantSet
	n       int // entries over all tenants
	ar      arena

	last *tenantSet // the last tenant looked up (tenants[last.name]), or nil
	sink uint64     // prefetch's loads go here, so they are not optimised away
}

// tenantSet is one tenant's objects: byMedium[m-1] for m = MediumCPU, MediumDisk.
type tenantSet struct {
	name     string // the set's own copy
	byMedium [2]objects
}

func (ts *tenantSet) len() int { return ts.byMedium[0].len() + ts.byMedium[1].len() }

func New() *Set {
	return &Set{tenants: map[string]*tenantSet{}}
}

// mediumIndex is the byMedium index of a wire medium (MediumCPU or MediumDisk).
func mediumIndex(m kvevent.Medium) int {
	if m == kvevent.MediumDisk {
		return 1
	}
	return 0
}

// tenant returns t's set, creating it when create is set (else nil if absent).
func (a *Set) tenant(t string, create bool) *tenantSet {
	if a.last != nil && a.last.name == t {
		return a.last
	}
	ts := a.tenants[t]
	if ts == nil {
		if !create {
			return nil
		}
		ts = &tenantSet{name: strings.Clone(t)}
		a.tenants[ts.name] = ts
	}
	a.last = ts
	return ts
}

// Prefetch touches the table slots (and, where the hash matches, the
// records) that applying chs will read, one change after another without
// waiting for each: the loads are independent, so the processor overlaps
// their cache misses, and applying the changes then finds them cached.
// It changes nothing.
func (a *Set) Prefetch(chs []*masterv1.Change) {
	var sum uint64
	for _, ch := range chs {
		if t := ch.GetType(); t != masterv1.ChangeType_CHANGE_TYPE_STORED && t != masterv1.ChangeType_CHANGE_TYPE_REMOVED {
			continue
		}
		ts := a.tenant(ch.GetTenant(), false)
		if ts == nil {
			continue
		}
		sum += ts.byMedium[mediumIndex(Medium(ch.GetMedium()))].byHash.peek(&a.ar, slotHash(hashKey(ch.GetKey())))
	}
	a.sink = sum
}

// Store announces (t, key, m) in group.
func (a *Set) Store(t, key string, m kvevent.Medium, group string) {
	if a.tenant(t, true).byMedium[mediumIndex(m)].set(&a.ar, hashKey(key), key, group) {
		a.n++
	}
}

// Remove forgets (t, key, m) and returns its group ("" if it was not announced).
func (a *Set) Remove(t, key string, m kvevent.Medium) string {
	ts := a.tenant(t, false)
	if ts == nil {
		return ""
	}
	group, ok := ts.byMedium[mediumIndex(m)].del(&a.ar, hashKey(key), key)
	if !ok {
		return ""
	}
	a.n--
	if ts.len() == 0 {
		a.Clear(t)
	}
	return group
}

// Clear forgets every object of t.
func (a *Set) Clear(t string) {
	if ts := a.tenants[t]; ts != nil {
		a.n -= ts.len()
		for i := range ts.byMedium {
			for ref := range ts.byMedium[i].byHash.all {
				a.ar.release(ref)
			}
		}
		delete(a.tenants, t)
	}
	if a.last != nil && a.last.name == t {
		a.last = nil
	}
}

func (a *Set) Len() int { return a.n }

// get returns the group of (key, m) in ts and whether it is announced.
func (a *Set) get(ts *tenantSet, key string, m kvevent.Medium) (string, bool) {
	if ts == nil {
		return "", false
	}
	return ts.byMedium[mediumIndex(m)].get(&a.ar, hashKey(key), key)
}

var seed = maphash.MakeSeed()

func hashKey(key string) uint64 { return maphash.String(seed, key) }

// objects maps object keys to groups: byHash from the key's hash to its
// record in the arena. A key whose record would be too large for the arena
// lives in overflow instead.
type objects struct {
	byHash   table
	overflow map[string]string
}

func (o *objects) len() int { return o.byHash.len() + len(o.overflow) }

func (o *objects) get(ar *arena, h uint64, key string) (string, bool) {
	if s, i := o.byHash.find(ar, slotHash(h), key); i >= 0 {
		_, g := ar.record(s.slots[i].ref)
		return ar.group(g), true
	}
	if len(o.overflow) > 0 {
		g, ok := o.overflow[key]
		return g, ok
	}
	return "", false
}

// set maps key (of hash h) to group and reports whether key is new.
func (o *objects) set(ar *arena, h uint64, key, group string) bool {
	h = slotHash(h)
	if s, i := o.byHash.find(ar, h, key); i >= 0 {
		ref := s.slots[i].ref
		switch _, g := ar.record(ref); {
		case string(g) == group:
		case fits(key, group):
			s.slots[i].ref = ar.replace(ref, key, group)
		default:
			ar.release(ref)
			o.byHash.delete(s, i)
			o.overflowSet(key, group)
		}
		return false
	}
	if len(o.overflow) > 0 {
		if _, ok := o.overflow[key]; ok {
			o.overflowSet(key, group)
			return false
		}
	}
	if !fits(key, group) {
		o.overflowSet(key, group)
		return true
	}
	o.byHash.insert(h, ar.put(key, group))
	return true
}

// overflowSet stores copies: nothing given is kept (and an assignment
// replaces the map's key too).
func (o *objects) overflowSet(key, group string) {
	if o.overflow == nil {
		o.overflow = map[string]string{}
	}
	o.overflow[strings.Clone(key)] = strings.Clone(group)
}

// del removes key (of hash h) and returns its group.
func (o *objects) del(ar *arena, h uint64, key string) (string, bool) {
	if s, i := o.byHash.find(ar, slotHash(h), key); i >= 0 {
		ref := s.slots[i].ref
		_, g := ar.record(ref)
		group := ar.group(g) // before release reuses the record
		ar.release(ref)
		o.byHash.delete(s, i)
		return group, true
	}
	if len(o.overflow) > 0 {
		if g, ok := o.overflow[key]; ok {
			delete(o.overflow, key)
			return g, true
		}
	}
	return "", false
}

// all yields every key and group (as new strings).
func (o *objects) all(ar *arena) func(yield func(key, group string) bool) {
	return func(yield func(key, group string) bool) {
		for ref := range o.byHash.all {
			k, g := ar.record(ref)
			if !yield(string(k), ar.group(g)) {
				return
			}
		}
		for k, g := range o.overflow {
			if !yield(k, g) {
				return
			}
		}
	}
}

// arena holds the records of an announced set, each key and group after
// their lengths (uvarints), in chunks of chunkSize bytes; a record takes a
// multiple of 8 bytes (at most maxRecord) and never spans chunks. A ref is a record's offset
// (chunk index × chunkSize + offset in the chunk). A released record goes
// on the free list of its size, whose next ref it holds in its first 8
// bytes, and the next record of that size reuses it: keys of a workload
// have a few sizes, so the arena stays about as large as the most it held.
// Nothing outside the arena refers to its bytes (get, del and all return
// copies), so a record can be reused at once.
type arena struct {
	chunks [][]byte
	used   int      // bytes used in the last chunk
	free   []uint64 // free[size/8]: 1 + ref of the first free record of that size, or 0

	lastGroup string // groups repeat: the last one returned, not copied again
}

const (
	chunkShift = 18
	chunkSize  = 1 << chunkShift
	maxRecord  = chunkSize / 16 // larger records live in objects.overflow
)

func recordSize(klen, glen int) int {
	n := uvarintLen(klen) + uvarintLen(glen) + klen + glen
	return (n + 7) &^ 7
}

func uvarintLen(v int) int {
	n := 1
	for ; v >= 0x80; v >>= 7 {
		n++
	}
	return n
}

// fits reports whether a record of key and group fits the arena.
func fits(key, group string) bool { return recordSize(len(key), len(group)) <= maxRecord }

// bytes returns the size bytes at ref.
func (ar *arena) bytes(ref uint64, size int) []byte {
	off := int(ref & (chunkSize - 1))
	return ar.chunks[ref>>chunkShift][off : off+size : off+size]
}

// record returns the key and group bytes at ref, valid until the record is
// released or replaced.
func (ar *arena) record(ref uint64) (key, group []byte) {
	b := ar.chunks[ref>>chunkShift][ref&(chunkSize-1):]
	kl, n := binary.Uvarint(b)
	gl, m := binary.Uvarint(b[n:])
	b = b[n+m:]
	return b[:kl], b[kl : kl+gl]
}

// group returns g as a string, sharing the last one when equal.
func (ar *arena) group(g []byte) string {
	if string(g) != ar.lastGroup {
		ar.lastGroup = string(g)
	}
	return ar.lastGroup
}

// put stores a record of key and group (fits) and returns its ref.
func (ar *arena) put(key, group string) uint64 {
	size := recordSize(len(key), len(group))
	ref := ar.alloc(size)
	ar.write(ref, size, key, group)
	return ref
}

// replace stores key and group in place of ref's record (the same key, a
// new group) and returns the new ref.
func (ar *arena) replace(ref uint64, key, group string) uint64 {
	k, g := ar.record(ref)
	old, size := recordSize(len(k), len(g)), recordSize(len(key), len(group))
	if old == size {
		ar.write(ref, size, key, group)
		return ref
	}
	ar.push(ref, old) // release, without reading the record again
	return ar.put(key, group)
}

// write encodes a record of key and group into the size bytes at ref.
func (ar *arena) write(ref uint64, size int, key, group string) {
	b := ar.bytes(ref, size)
	n := binary.PutUvarint(b, uint64(len(key)))
	n += binary.PutUvarint(b[n:], uint64(len(group)))
	n += copy(b[n:], key)
	copy(b[n:], group)
}

func (ar *arena) alloc(size int) uint64 {
	class := size / 8
	if class < len(ar.free) && ar.free[class] != 0 {
		ref := ar.free[class] - 1
		ar.free[class] = binary.LittleEndian.Uint64(ar.bytes(ref, 8))
		return ref
	}
	if len(ar.chunks) == 0 || ar.used+size > chunkSize {
		// The rest of the last chunk (less than maxRecord, mostly a few
		// bytes) is left unused.
		ar.chunks = append(ar.chunks, make([]byte, chunkSize))
		ar.used = 0
	}
	ref := uint64(len(ar.chunks)-1)<<chunkShift | uint64(ar.used)
	ar.used += size
	return ref
}

// release puts ref's record on its free list.
func (ar *arena) release(ref uint64) {
	k, g := ar.record(ref)
	ar.push(ref, recordSize(len(k), len(g)))
}

func (ar *arena) push(ref uint64, size int) {
	class := size / 8
	if class >= len(ar.free) {
		ar.free = append(ar.free, make([]uint64, class+1-len(ar.free))...)
	}
	binary.LittleEndian.PutUint64(ar.bytes(ref, 8), ar.free[class])
	ar.free[class] = ref + 1
}

var media = [2]kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}

// Diff returns removed events for what old has and next lacks, then
// stored events for what next has new or with another group, each sorted.
func Diff(old, next *Set) []kvevent.Event {
	var removed, stored []kvevent.Event
	for t, ts := range old.tenants {
		nts := next.tenants[t]
		for i := range ts.byMedium {
			for k, g := range ts.byMedium[i].all(&old.ar) {
				if _, ok := next.get(nts, k, media[i]); !ok {
					removed = append(removed, kvevent.Event{Type: kvevent.Removed, Tenant: t, Key: k, Medium: media[i], GroupID: g})
				}
			}
		}
	}
	for t, nts := range next.tenants {
		ts := old.tenants[t]
		for i := range nts.byMedium {
			for k, g := range nts.byMedium[i].all(&next.ar) {
				if og, ok := old.get(ts, k, media[i]); !ok || og != g {
					stored = append(stored, kvevent.Event{Type: kvevent.Stored, Tenant: t, Key: k, Medium: media[i], GroupID: g})
				}
			}
		}
	}
	byKey := func(a, b kvevent.Event) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Medium, b.Medium))
	}
	slices.SortFunc(removed, byKey)
	slices.SortFunc(stored, byKey)
	return append(removed, stored...)
}

// Medium maps a master medium to the wire's two tiers: memory is cpu, every
// other class is disk.
func Medium(m masterv1.Medium) kvevent.Medium {
	switch m {
	case masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_UNSPECIFIED:
		return kvevent.MediumCPU
	default:
		return kvevent.MediumDisk
	}
}

// Get returns the group of (t, key, m) and whether it is announced.
func (a *Set) Get(t, key string, m kvevent.Medium) (string, bool) {
	return a.get(a.tenant(t, false), key, m)
}

// All yields every entry as a stored event (ID and timestamp unset), tenant
// by tenant in no particular order. The set must not change while All runs.
func (a *Set) All() func(yield func(kvevent.Event) bool) {
	return func(yield func(kvevent.Event) bool) {
		for t, ts := range a.tenants {
			for i := range ts.byMedium {
				for k, g := range ts.byMedium[i].all(&a.ar) {
					if !yield(kvevent.Event{Type: kvevent.Stored, Tenant: t, Key: k, Medium: media[i], GroupID: g}) {
						return
					}
				}
			}
		}
	}
}

// rangeAhead is how many records Range loads before reading the first of
// them: the loads are independent, so their cache misses overlap.
const rangeAhead = 32

// Range calls fn for every entry, tenant by tenant in no particular order,
// without allocating: tenant is the set's own copy of the name, key and
// group are views of the set's bytes, valid until the set next changes,
// which fn must not modify. fn returning false stops Range. The set must
// not change while Range runs.
//
// Records are read in table order, which is not their order in memory
// (a set of millions misses the cache on each one); Range therefore loads
// the records of the next rangeAhead entries one after another before
// reading them, so the processor overlaps those misses.
func (a *Set) Range(fn func(tenant string, m kvevent.Medium, key, group []byte) bool) {
	var refs [rangeAhead]uint64
	for _, ts := range a.tenants {
		for i := range ts.byMedium {
			o := &ts.byMedium[i]
			m := media[i]
			n := 0
			flush := func() bool {
				var sum byte
				for _, ref := range refs[:n] {
					sum += a.ar.chunks[ref>>chunkShift][ref&(chunkSize-1)]
				}
				a.sink += uint64(sum)
				for _, ref := range refs[:n] {
					k, g := a.ar.record(ref)
					if !fn(ts.name, m, k, g) {
						return false
					}
				}
				n = 0
				return true
			}
			ok := true
			for ref := range o.byHash.all {
				refs[n] = ref
				if n++; n == len(refs) {
					if ok = flush(); !ok {
						break
					}
				}
			}
			if !ok || !flush() {
				return
			}
			for k, g := range o.overflow {
				if !fn(ts.name, m, []byte(k), []byte(g)) {
					return
				}
			}
		}
	}
}

// Clone returns an independent copy of the set. It copies the tables and
// the arena as they are (no key is hashed or re-inserted), so it costs a
// memory copy: a restarted gateway loads its checkpoint once and clones it
// for the second owner.
func (a *Set) Clone() *Set {
	c := &Set{tenants: make(map[string]*tenantSet, len(a.tenants)), n: a.n, ar: a.ar.clone()}
	for name, ts := range a.tenants {
		cts := &tenantSet{name: ts.name}
		for i := range ts.byMedium {
			cts.byMedium[i] = objects{byHash: ts.byMedium[i].byHash.clone(), overflow: maps.Clone(ts.byMedium[i].overflow)}
		}
		c.tenants[name] = cts
	}
	return c
}

func (ar *arena) clone() arena {
	chunks := make([][]byte, len(ar.chunks))
	for i, ch := range ar.chunks {
		chunks[i] = slices.Clone(ch)
	}
	return arena{chunks: chunks, used: ar.used, free: slices.Clone(ar.free), lastGroup: ar.lastGroup}
}

// clone copies t, keeping the directory's sharing: directory entries that
// point to one subtable point to one copy.
func (t *table) clone() table {
	c := table{dir: make([]*subtable, len(t.dir)), depth: t.depth, n: t.n}
	copies := make(map[*subtable]*subtable)
	for i, s := range t.dir {
		if s == nil {
			continue
		}
		cs, ok := copies[s]
		if !ok {
			cs = &subtable{slots: slices.Clone(s.slots), n: s.n, depth: s.depth}
			copies[s] = cs
		}
		c.dir[i] = cs
	}
	return c
}
