package meta

import (
	"cmp"
	"iter"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
	"github.com/crescent-kv/crescent/internal/intern"
)

// shard owns a slice of the keyspace.
//
// Besides the maps, a shard keeps its objects in a recency list: doubly
// linked through object.prev/next, ordered by accessMs, least recent at
// head (ties in any order). An object is in the list exactly while it is
// in the maps (insertLocked, deleteLocked), and every write of accessMs
// repositions it (touchLocked): the common case, a new access not older
// than the tail's, is an O(1) move to the tail; an older one (a rebuild
// from the agents' sealed times, a clock stepping back) walks from the tail
// to its place. An eviction pass reads list prefixes instead of scanning
// every object (see evict).
type shard struct {
	// mu guards tenants, the recency list and every object reachable from
	// them, including the objects' replicas and put states. Lock order:
	// shard → registry → tenant table → tenant → change log. Never held
	// across agent I/O.
	mu         sync.Mutex
	tenants    map[uint32]*objMap
	head, tail *object // recency list: least and most recent access
	// puts lists the shard's puts in progress, oldest start first (see
	// expire.go), for the sweep that expires them.
	puts putList
	// groups interns the objects' group ids; pins holds the soft pin
	// expiry of the objects with flagSoftPin (see groups.go).
	groups intern.Table
	pins   map[*object]int64
	_      [16]byte // keep neighbouring shard locks off one cache line
}

func (sh *shard) getLocked(tenant uint32, key string) *object {
	return sh.tenants[tenant].get(key)
}

// insertLocked adds o to the maps and, at its accessMs, to the list.
func (sh *shard) insertLocked(o *object) {
	m := sh.tenants[o.tenant]
	if m == nil {
		m = newObjMap(0)
		sh.tenants[o.tenant] = m
	}
	m.put(o)
	sh.linkLocked(o)
}

// deleteLocked removes o from the maps and the list.
func (sh *shard) deleteLocked(o *object) {
	m := sh.tenants[o.tenant]
	m.del(o)
	if m.len() == 0 {
		delete(sh.tenants, o.tenant)
	}
	sh.unlinkLocked(o)
	sh.clearSoftPinLocked(o)
	sh.groups.Release(o.group)
	o.group = 0
}

// objMap is one tenant's objects in a shard, by key. It is keyed by the
// key's 64-bit hash, not by the key string: a map slot is then 16 bytes
// instead of 24 (about 17 bytes less per object), and a probe compares
// integers instead of following a key pointer. The key itself is in the
// object. A key whose hash another key holds (never by chance in practice,
// but xxhash is not seeded, so a client could make them) goes to spill, an
// ordinary map by string: lookups try byHash, then spill when it is not
// empty, so nothing ever scans spill and crafted collisions cost only the
// wider slots.
type objMap struct {
	byHash map[uint64]*object
	spill  map[string]*object
}

func newObjMap(size int) *objMap { return &objMap{byHash: make(map[uint64]*object, size)} }

// keyHash is the objMap key of key (a variable so tests can make keys
// collide).
var keyHash = xxhash.Sum64String

func (m *objMap) get(key string) *object {
	if m == nil {
		return nil
	}
	if o := m.byHash[keyHash(key)]; o != nil && o.key == key {
		return o
	}
	if len(m.spill) == 0 {
		return nil
	}
	return m.spill[key]
}

// put adds o, whose key must not be in m.
func (m *objMap) put(o *object) {
	h := keyHash(o.key)
	if _, taken := m.byHash[h]; !taken {
		m.byHash[h] = o
		return
	}
	if m.spill == nil {
		m.spill = make(map[string]*object)
	}
	m.spill[o.key] = o
}

// del removes o (a no-op when o is not in m).
func (m *objMap) del(o *object) {
	if h := keyHash(o.key); m.byHash[h] == o {
		delete(m.byHash, h)
	} else if m.spill[o.key] == o {
		delete(m.spill, o.key)
	}
}

func (m *objMap) len() int {
	if m == nil {
		return 0
	}
	return len(m.byHash) + len(m.spill)
}

// all yields every object with its key, in no order. Deleting the object
// yielded (del) during the range is allowed, as for a Go map.
func (m *objMap) all() iter.Seq2[string, *object] {
	return func(yield func(string, *object) bool) {
		if m == nil {
			return
		}
		for _, o := range m.byHash {
			if !yield(o.key, o) {
				return
			}
		}
		for k, o := range m.spill {
			if !yield(k, o) {
				return
			}
		}
	}
}

// linkedLocked reports whether o is in the list.
func (sh *shard) linkedLocked(o *object) bool { return o.prev != nil || sh.head == o }

// touchLocked sets o's access clock and moves it to its place in the list.
// An object that is not linked (gone from the maps, or waiting for
// relinkLocked) only gets the new clock.
func (sh *shard) touchLocked(o *object, ms int64) {
	o.accessMs = ms
	if !sh.linkedLocked(o) || (o.next == nil || ms <= o.next.accessMs) && (o.prev == nil || o.prev.accessMs <= ms) {
		return // not listed, or still in order where it is (the tail, say)
	}
	sh.unlinkLocked(o)
	sh.linkLocked(o)
}

// linkLocked inserts an unlinked o at its place by accessMs: at the tail or
// the head in O(1), elsewhere after a walk from the tail (past every object
// with a later access).
func (sh *shard) linkLocked(o *object) {
	switch {
	case sh.tail == nil || sh.tail.accessMs <= o.accessMs:
		sh.insertAfterLocked(o, sh.tail)
	case o.accessMs <= sh.head.accessMs:
		sh.insertAfterLocked(o, nil)
	default:
		c := sh.tail
		for c.accessMs > o.accessMs {
			c = c.prev // stops at the head at the latest (o.accessMs > head's)
		}
		sh.insertAfterLocked(o, c)
	}
}

// insertAfterLocked links o right after c (at the head when c is nil).
func (sh *shard) insertAfterLocked(o, c *object) {
	o.prev = c
	if c == nil {
		o.next = sh.head
		sh.head = o
	} else {
		o.next = c.next
		c.next = o
	}
	if o.next == nil {
		sh.tail = o
	} else {
		o.next.prev = o
	}
}

// unlinkLocked takes o out of the list (a no-op when it is not in it).
func (sh *shard) unlinkLocked(o *object) {
	if !sh.linkedLocked(o) {
		return
	}
	if o.prev == nil {
		sh.head = o.next
	} else {
		o.prev.next = o.next
	}
	if o.next == nil {
		sh.tail = o.prev
	} else {
		o.next.prev = o.prev
	}
	o.prev, o.next = nil, nil
}

// relinkLocked links the objects of xs that are in the maps but not in the
// list (mut.touchLater unlinked them), in one merge from the tail: sorted
// newest first, each is placed after a walk that resumes where the previous
// one stopped, so k objects cost O(k log k) plus the list walked once at
// most, where placing them one by one could walk it k times. xs is
// reordered.
func (sh *shard) relinkLocked(xs []*object) {
	slices.SortFunc(xs, func(a, b *object) int { return cmp.Compare(b.accessMs, a.accessMs) })
	c := sh.tail
	for _, o := range xs {
		if sh.linkedLocked(o) || sh.getLocked(o.tenant, o.key) != o {
			continue // a duplicate already placed, or dropped meanwhile
		}
		for c != nil && c.accessMs > o.accessMs {
			c = c.prev
		}
		sh.insertAfterLocked(o, c)
	}
}

func (s *Store) shardIndex(tenant uint32, key string) int {
	var d xxhash.Digest
	d.Reset()
	var tb [4]byte
	tb[0], tb[1], tb[2], tb[3] = byte(tenant), byte(tenant>>8), byte(tenant>>16), byte(tenant>>24)
	_, _ = d.Write(tb[:])
	_, _ = d.WriteString(key)
	return int(d.Sum64() & s.shardMask)
}

// lockAll locks every shard in index order (snapshot, RemoveAll's final
// check). Nobody else holds two shard locks, so this cannot deadlock.
func (s *Store) lockAll() {
	if h := s.hooks.beforeLockAll; h != nil {
		h()
	}
	for i := range s.shards {
		s.shards[i].mu.Lock()
	}
}

// unlockAll unlocks every shard lockAll locked.
func (s *Store) unlockAll() {
	for i := range s.shards {
		s.shards[i].mu.Unlock()
	}
}
