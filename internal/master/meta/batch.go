package meta

import (
	"slices"
)

// forShards groups items by shard and calls f once per shard, in shard
// order, with each shard's items in their original order.
func forShards[T any](items []T, shardOf func(T) int, f func(sh int, group []T)) {
	switch len(items) {
	case 0:
		return
	case 1:
		f(shardOf(items[0]), items)
		return
	}
	if len(items) >= 256 {
		forShardsCounting(items, shardOf, nil, f)
		return
	}
	type ent struct {
		sh, i int
	}
	ord := make([]ent, len(items))
	for i, it := range items {
		ord[i] = ent{shardOf(it), i}
	}
	slices.SortFunc(ord, func(a, b ent) int {
		if a.sh != b.sh {
			return a.sh - b.sh
		}
		return a.i - b.i
	})
	group := make([]T, 0, len(items))
	for i := 0; i < len(ord); {
		j := i
		group = group[:0]
		for ; j < len(ord) && ord[j].sh == ord[i].sh; j++ {
			group = append(group, items[ord[j].i])
		}
		f(ord[i].sh, group)
		i = j
	}
}

// forShardsCounting is forShards for a large batch (a registration's chunk
// of 16,384 allocations): a counting sort by shard, linear where the
// comparison sort was a sixth of a rebuild's reconcile. Each group keeps
// the items' order.
//
// sc, when not nil, lends the working arrays and keeps them for the next
// call: a rebuild applies hundreds of chunks one after the other, and
// fresh arrays for each were fresh pages (page faults) every time.
func forShardsCounting[T any](items []T, shardOf func(T) int, sc *shardScratch[T], f func(sh int, group []T)) {
	if sc == nil {
		sc = &shardScratch[T]{}
	}
	sc.shs = slices.Grow(sc.shs[:0], len(items))[:len(items)]
	shs := sc.shs
	top := 0
	for i, it := range items {
		shs[i] = shardOf(it)
		top = max(top, shs[i])
	}
	start := make([]int, top+2) // start[s]: where shard s's group begins
	for _, sh := range shs {
		start[sh+1]++
	}
	for k := 1; k < len(start); k++ {
		start[k] += start[k-1]
	}
	next := slices.Clone(start[:top+1])
	sc.grouped = slices.Grow(sc.grouped[:0], len(items))[:len(items)]
	grouped := sc.grouped
	for i, it := range items {
		grouped[next[shs[i]]] = it
		next[shs[i]]++
	}
	for sh := range top + 1 {
		if start[sh] < start[sh+1] {
			f(sh, grouped[start[sh]:start[sh+1]])
		}
	}
}

// slab hands out pointers to zeroed Ts from chunks of n: the per-agent
// Reserve and Seal messages of a batch take their items from one
// allocation instead of one per item.
type slab[T any] struct {
	buf []T
	n   int
}

func (s *slab[T]) next() *T {
	if len(s.buf) == 0 {
		s.buf = make([]T, max(s.n, 1))
	}
	p := &s.buf[0]
	s.buf = s.buf[1:]
	return p
}

// shardScratch holds forShardsCounting's working arrays between calls.
type shardScratch[T any] struct {
	shs     []int
	grouped []T
}
