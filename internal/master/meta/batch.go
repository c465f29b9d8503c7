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
