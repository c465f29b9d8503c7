package source

import (
	"cmp"
	"hash/maphash"
	"slices"
	"strings"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// announcedSet is what the source has announced to subscribers: tenant →
// (key, medium) → group. Owned by one goroutine. It keeps its own copies
// of the strings it is given: a decoded watch response's strings share one
// buffer (watchCodec), which a kept string would hold alive.
//
// Each tenant holds one table per wire medium (objects), keyed by a 64-bit
// hash of the object key. Changes arrive in long runs of one tenant, so
// the last tenant's tables are kept at hand instead of hashing its name
// for every change.
type announcedSet struct {
	tenants map[string]*tenantSet
	n       int // entries over all tenants

	lastName string
	last     *tenantSet // tenants[lastName], or nil

	lastGroup string // the last group stored: groups repeat
}

// tenantSet is one tenant's objects: byMedium[m-1] for m = MediumCPU, MediumDisk.
type tenantSet struct {
	byMedium [2]objects
}

func (ts *tenantSet) len() int { return ts.byMedium[0].len() + ts.byMedium[1].len() }

// objects maps object keys to groups. It is keyed by a seeded 64-bit hash
// of the key rather than by the key: the set grows to millions of
// entries, and when a map keyed by strings grows, rehashing every entry
// reads every key's bytes from wherever they lie in the heap, a cache miss
// each (the larger part of the cost of a stored event in a profile of a
// growing set). A uint64 key is rehashed in place. A key whose hash another
// key already holds (about one pair in 2^64/n) lives in overflow.
type objects struct {
	byHash   map[uint64]object
	overflow map[string]string
}

type object struct{ key, group string }

var seed = maphash.MakeSeed()

func hashKey(key string) uint64 { return maphash.String(seed, key) }

func (o *objects) len() int { return len(o.byHash) + len(o.overflow) }

func (o *objects) get(h uint64, key string) (string, bool) {
	if ob, ok := o.byHash[h]; ok && ob.key == key {
		return ob.group, true
	}
	if len(o.overflow) > 0 {
		g, ok := o.overflow[key]
		return g, ok
	}
	return "", false
}

// set maps key (of hash h) to group and reports whether key is new. It
// keeps a copy of key, not key.
func (o *objects) set(h uint64, key, group string) bool {
	if o.byHash == nil {
		o.byHash = map[uint64]object{}
	}
	if len(o.overflow) > 0 {
		if _, ok := o.overflow[key]; ok {
			o.overflow[strings.Clone(key)] = group // an assignment replaces the map's key too
			return false
		}
	}
	ob, ok := o.byHash[h]
	switch {
	case !ok:
		o.byHash[h] = object{strings.Clone(key), group}
		return true
	case ob.key == key:
		o.byHash[h] = object{ob.key, group}
		return false
	default:
		if o.overflow == nil {
			o.overflow = map[string]string{}
		}
		o.overflow[strings.Clone(key)] = group
		return true
	}
}

// del removes key (of hash h) and returns its group.
func (o *objects) del(h uint64, key string) (string, bool) {
	if ob, ok := o.byHash[h]; ok && ob.key == key {
		delete(o.byHash, h)
		return ob.group, true
	}
	if len(o.overflow) > 0 {
		if g, ok := o.overflow[key]; ok {
			delete(o.overflow, key)
			return g, true
		}
	}
	return "", false
}

// all yields every key and group.
func (o *objects) all(yield func(key, group string) bool) {
	for _, ob := range o.byHash {
		if !yield(ob.key, ob.group) {
			return
		}
	}
	for k, g := range o.overflow {
		if !yield(k, g) {
			return
		}
	}
}

func newAnnouncedSet() *announcedSet {
	return &announcedSet{tenants: map[string]*tenantSet{}}
}

// mediumIndex is the byMedium index of a wire medium (MediumCPU or MediumDisk).
func mediumIndex(m kvevent.Medium) int {
	if m == kvevent.MediumDisk {
		return 1
	}
	return 0
}

// tenant returns t's set, creating it when create is set (else nil if absent).
func (a *announcedSet) tenant(t string, create bool) *tenantSet {
	if a.last != nil && a.lastName == t {
		return a.last
	}
	ts := a.tenants[t]
	if ts == nil {
		if !create {
			return nil
		}
		t = strings.Clone(t)
		ts = &tenantSet{}
		a.tenants[t] = ts
	}
	a.lastName, a.last = t, ts
	return ts
}

// store announces (t, key, m) in group.
func (a *announcedSet) store(t, key string, m kvevent.Medium, group string) {
	if group != a.lastGroup {
		a.lastGroup = strings.Clone(group)
	}
	group = a.lastGroup
	if a.tenant(t, true).byMedium[mediumIndex(m)].set(hashKey(key), key, group) {
		a.n++
	}
}

// remove forgets (t, key, m) and returns its group ("" if it was not announced).
func (a *announcedSet) remove(t, key string, m kvevent.Medium) string {
	ts := a.tenant(t, false)
	if ts == nil {
		return ""
	}
	group, ok := ts.byMedium[mediumIndex(m)].del(hashKey(key), key)
	if !ok {
		return ""
	}
	a.n--
	if ts.len() == 0 {
		a.clear(t)
	}
	return group
}

// clear forgets every object of t.
func (a *announcedSet) clear(t string) {
	if ts := a.tenants[t]; ts != nil {
		a.n -= ts.len()
		delete(a.tenants, t)
	}
	if a.lastName == t {
		a.lastName, a.last = "", nil
	}
}

func (a *announcedSet) size() int { return a.n }

// get returns the group of (t, key, m) and whether it is announced.
func (ts *tenantSet) get(key string, m kvevent.Medium) (string, bool) {
	if ts == nil {
		return "", false
	}
	return ts.byMedium[mediumIndex(m)].get(hashKey(key), key)
}

var media = [2]kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}

// diffSets returns removed events for what old has and next lacks, then
// stored events for what next has new or with another group, each sorted.
func diffSets(old, next *announcedSet) []kvevent.Event {
	var removed, stored []kvevent.Event
	for t, ts := range old.tenants {
		nts := next.tenants[t]
		for i := range ts.byMedium {
			for k, g := range ts.byMedium[i].all {
				if _, ok := nts.get(k, media[i]); !ok {
					removed = append(removed, kvevent.Event{Type: kvevent.Removed, Tenant: t, Key: k, Medium: media[i], GroupID: g})
				}
			}
		}
	}
	for t, nts := range next.tenants {
		ts := old.tenants[t]
		for i := range nts.byMedium {
			for k, g := range nts.byMedium[i].all {
				if og, ok := ts.get(k, media[i]); !ok || og != g {
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
