package kvevent

import (
	"cmp"
	"slices"
	"sync"
)

// Key names one readable (tenant, key, medium).
type Key struct {
	Tenant string
	Key    string
	Medium Medium
}

func (k Key) compare(o Key) int {
	return cmp.Or(cmp.Compare(k.Tenant, o.Tenant), cmp.Compare(k.Key, o.Key), cmp.Compare(k.Medium, o.Medium))
}

type objKey struct {
	key    string
	medium Medium
}

// Index is the set of readable (tenant, key, medium) a stream describes,
// with each entry's group. Applying every event of a gap-free stream in
// order yields the publisher's readable set. Safe for concurrent use.
type Index struct {
	// mu guards tenants and n.
	mu      sync.RWMutex
	tenants map[string]map[objKey]string
	n       int
}

// NewIndex returns an empty index.
func NewIndex() *Index { return &Index{tenants: map[string]map[objKey]string{}} }

// Apply applies one event: stored adds (idempotent), removed deletes
// (idempotent), cleared drops the tenant.
func (x *Index) Apply(ev Event) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.applyLocked(ev)
}

// ApplyBatch applies every event of b in order under one lock.
func (x *Index) ApplyBatch(b Batch) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, ev := range b.Events {
		x.applyLocked(ev)
	}
}

func (x *Index) applyLocked(ev Event) {
	switch ev.Type {
	case Stored:
		m := x.tenants[ev.Tenant]
		if m == nil {
			m = map[objKey]string{}
			x.tenants[ev.Tenant] = m
		}
		k := objKey{ev.Key, ev.Medium}
		if _, ok := m[k]; !ok {
			x.n++
		}
		m[k] = ev.GroupID
	case Removed:
		m := x.tenants[ev.Tenant]
		k := objKey{ev.Key, ev.Medium}
		if _, ok := m[k]; ok {
			delete(m, k)
			x.n--
			if len(m) == 0 {
				delete(x.tenants, ev.Tenant)
			}
		}
	case Cleared:
		x.n -= len(x.tenants[ev.Tenant])
		delete(x.tenants, ev.Tenant)
	}
}

// Clear empties the index.
func (x *Index) Clear() {
	x.mu.Lock()
	defer x.mu.Unlock()
	clear(x.tenants)
	x.n = 0
}

// Len is the number of entries.
func (x *Index) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.n
}

// Has reports whether k is readable, and its group.
func (x *Index) Has(k Key) (group string, ok bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	group, ok = x.tenants[k.Tenant][objKey{k.Key, k.Medium}]
	return group, ok
}

// Keys returns every entry, sorted by tenant, key, medium.
func (x *Index) Keys() []Key {
	x.mu.RLock()
	out := make([]Key, 0, x.n)
	for t, m := range x.tenants {
		for k := range m {
			out = append(out, Key{Tenant: t, Key: k.key, Medium: k.medium})
		}
	}
	x.mu.RUnlock()
	slices.SortFunc(out, Key.compare)
	return out
}
