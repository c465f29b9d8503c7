package meta

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// refEvict is the eviction pass spelled out the slow way: every candidate,
// sorted (unpinned first, then least recent access), taken while it has a
// replica on a target still in need. Access times must be distinct.
func refEvict(s *Store, targets []evictTarget) map[string]bool {
	type cand struct {
		key    string
		access int64
		size   uint64
		mask   uint64
		pinned bool
	}
	pos := map[uint32]int{}
	for i, t := range targets {
		pos[t.seg] = i
	}
	var cands []cand
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		now := s.nowMs()
		for t, objs := range sh.tenants {
			for k, o := range objs.all() {
				var mask uint64
				for _, r := range o.replicas {
					if p, ok := pos[r.seg]; ok {
						mask |= 1 << p
					}
				}
				if ok, pinned := s.evictableLocked(sh, o, now); ok && mask != 0 {
					cands = append(cands, cand{s.tenants.get(t).name + "/" + k, o.accessMs, o.size, mask, pinned})
				}
			}
		}
		sh.mu.Unlock()
	}
	slices.SortFunc(cands, func(a, b cand) int {
		if a.pinned != b.pinned {
			if a.pinned {
				return 1
			}
			return -1
		}
		return cmp.Compare(a.access, b.access)
	})
	need := make([]int64, len(targets))
	for i, t := range targets {
		need[i] = t.need
	}
	for i, t := range targets { // a segment named twice counts as its last entry
		if pos[t.seg] != i {
			need[i] = 0
		}
	}
	out := map[string]bool{}
	for _, c := range cands {
		useful := false
		for p := range targets {
			if c.mask&(1<<p) != 0 && need[p] > 0 {
				useful = true
				need[p] -= int64(c.size)
			}
		}
		if useful {
			out[c.key] = true
		}
	}
	return out
}

// liveKeys is every tenant/key in the store.
func liveKeys(s *Store) map[string]bool {
	out := map[string]bool{}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for t, objs := range sh.tenants {
			for k := range objs.all() {
				out[s.tenants.get(t).name+"/"+k] = true
			}
		}
		sh.mu.Unlock()
	}
	return out
}

// TestEvictSelectsLikeFullSort checks that an eviction pass evicts exactly
// what sorting every candidate would, over random stores: sizes of 100 to
// 1000 bytes (in hundreds, so that sizes often add up to a need exactly),
// one or two replicas over twelve segments, hard and soft pins (some
// expired), leases, and one to twelve targets with random needs (some not
// positive, some near or beyond everything, segments named twice), over
// 8, 16 and 64 shards. Over the larger ones each kind of pass must occur:
// one round short of the whole store, a second round up to the runs' end,
// and rounds with larger budgets.
func TestEvictSelectsLikeFullSort(t *testing.T) {
	var short, rounds, byLimit int // over the stores with more than 8 shards
	for _, cfg := range []struct{ shards, minObjects, moreObjects int }{{8, 300, 700}, {16, 2000, 2000}, {64, 2000, 2000}} {
		t.Run(fmt.Sprintf("shards=%d", cfg.shards), func(t *testing.T) {
			for seed := range uint64(20) {
				t.Run(fmt.Sprint(seed), func(t *testing.T) {
					s, r, l := evictSelectsLikeFullSort(t, seed, cfg.shards, cfg.minObjects+int(seed*97)%cfg.moreObjects)
					if cfg.shards > 8 {
						short, rounds, byLimit = short+s, rounds+r, byLimit+l
					}
				})
			}
		})
	}
	t.Logf("passes that stopped short after one round: %d; with more rounds: %d, of which up to the runs' end: %d", short, rounds, byLimit)
	if short == 0 || byLimit == 0 || rounds == byLimit {
		t.Fatalf("passes that stopped short after one round: %d; with more rounds: %d, of which up to the runs' end: %d; want each kind", short, rounds, byLimit)
	}
}

// evictSelectsLikeFullSort is one random store of TestEvictSelectsLikeFullSort
// with n objects. It returns how many of its passes stopped short of the
// whole store after one round, how many took more than one, and how many
// of those had a round up to the runs' end.
func evictSelectsLikeFullSort(t *testing.T, seed uint64, shards, n int) (short, rounds, byLimit int) {
	{
		{
			rng := rand.New(rand.NewPCG(seed, 7))
			e := newEnv(t, 3, 4, 1<<30, Config{Shards: shards})
			ctx := t.Context()
			var segIDs []string
			for h := range 3 {
				for sg := range 4 {
					segIDs = append(segIDs, fmt.Sprintf("seg-%d-%d", h, sg))
				}
			}
			keys := make([]string, n)
			for i := range keys {
				keys[i] = fmt.Sprintf("k%05d", i)
			}
			rng.Shuffle(n, func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
			tenantOf := map[string]string{}
			for _, k := range keys {
				sp := PutSpec{Key: k, Size: 100 * (1 + uint64(rng.IntN(10))), ReplicaNum: 1 + rng.IntN(2),
					Preferred: []string{segIDs[rng.IntN(len(segIDs))]}}
				if rng.IntN(4) == 0 {
					sp.Tenant = "t2"
				}
				tenantOf[k] = NormalizeTenant(sp.Tenant)
				switch rng.IntN(10) {
				case 0:
					sp.HardPin = true
				case 1, 2:
					sp.SoftPin, sp.SoftPinTTL = true, time.Minute
				case 3:
					sp.SoftPin, sp.SoftPinTTL = true, 5*time.Hour
				}
				e.put(t, sp)
				e.clk.Advance(time.Duration(1+rng.IntN(3)) * time.Millisecond)
			}
			// Distinct access times: objects completed 1-3 ms apart; reads
			// long ago (past their lease) move an object to the front of
			// the recency order, recent reads lease it.
			e.clk.Advance(10 * time.Minute)
			for _, k := range keys[:n/5] {
				e.clk.Advance(time.Millisecond)
				if _, err := e.s.Get(ctx, GetSpec{Tenant: tenantOf[k], Key: k}); err != nil {
					t.Fatal(err)
				}
				if k == keys[n/10] {
					e.clk.Advance(time.Hour) // reads so far are long over; soft pins of a minute expired
				}
			}
			for round := range 4 {
				var targets []evictTarget
				nt := 1 + rng.IntN(4)
				if round == 3 {
					nt = 9 + rng.IntN(4) // past the linear search
				}
				for range nt {
					idx, ok := e.s.segs.lookup(segIDs[rng.IntN(len(segIDs))])
					if !ok {
						t.Fatal("segment not interned")
					}
					need := 100 * (int64(rng.IntN(200)) - 20) // sums hit needs exactly, often
					switch rng.IntN(6) {
					case 0:
						need = 1 << 40
					case 1: // about what the segment holds: runs into soft pins, or all of it
						need = e.s.segs.get(idx).placed.Load() * int64(60+rng.IntN(50)) / 100
					}
					targets = append(targets, evictTarget{seg: idx, need: need})
				}
				before := liveKeys(e.s)
				want := refEvict(e.s, targets)
				got := e.s.evict(ctx, targets)
				after := liveKeys(e.s)
				gone := map[string]bool{}
				for k := range before {
					if !after[k] {
						gone[k] = true
					}
				}
				st := e.s.lastPass
				t.Logf("round %d: %d targets, %d of %d objects walked in %d rounds", round, len(targets), st.walked, len(before), st.rounds)
				if st.rounds == 1 && st.walked < len(before) {
					short++
				}
				if st.rounds > 1 {
					rounds++
				}
				if st.byLimit {
					byLimit++
				}
				if !maps.Equal(gone, want) || got != len(want) {
					t.Fatalf("round %d targets %v: evicted %d %v, want %d %v", round, targets, got, slices.Sorted(maps.Keys(gone)), len(want), slices.Sorted(maps.Keys(want)))
				}
			}
			checkInvariants(t, e, &follower{set: map[rkey]bool{}})
		}
	}
	return short, rounds, byLimit
}
