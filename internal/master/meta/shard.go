package meta

import (
	"cmp"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
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
	tenants    map[uint32]map[string]*object
	head, tail *object // recency list: least and most recent access
	// puts lists the shard's puts in progress, oldest start first (see
	// expire.go), for the sweep that expires them.
	puts putList
	_    [16]byte // keep neighbouring shard locks off one cache line
}

func (sh *shard) getLocked(tenant uint32, key string) *object {
	return sh.tenants[tenant][key]
}

// insertLocked adds o to the maps and, at its accessMs, to the list.
func (sh *shard) insertLocked(o *object) {
	m := sh.tenants[o.tenant]
	if m == nil {
		m = make(map[string]*object)
		sh.tenants[o.tenant] = m
	}
	m[o.key] = o
	sh.linkLocked(o)
}

// deleteLocked removes o from the maps and the list.
func (sh *shard) deleteLocked(o *object) {
	m := sh.tenants[o.tenant]
	delete(m, o.key)
	if len(m) == 0 {
		delete(sh.tenants, o.tenant)
	}
	sh.unlinkLocked(o)
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
	for i := range s.shards {
		s.shards[i].mu.Lock()
	}
}
