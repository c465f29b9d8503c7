package meta

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/adminsvc"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
)

// The store is what AdminService and the agent side consume.
var (
	_ adminsvc.Meta    = (*Store)(nil)
	_ cluster.Metadata = (*Store)(nil)
)

func (e *env) put(t testing.TB, sp PutSpec) {
	t.Helper()
	if sp.ClientID == "" {
		sp.ClientID = "w"
	}
	if sp.Size == 0 {
		sp.Size = 10
	}
	ctx := context.Background()
	descs, err := e.s.PutStart(ctx, sp)
	if err != nil {
		t.Fatalf("PutStart %s/%s: %v", sp.Tenant, sp.Key, err)
	}
	e.writeAs(t, descs)
	if err := e.s.PutEnd(ctx, PutEndSpec{Tenant: sp.Tenant, Key: sp.Key, ClientID: sp.ClientID, Checksum: sp.Size * 7}); err != nil {
		t.Fatalf("PutEnd %s/%s: %v", sp.Tenant, sp.Key, err)
	}
}

func (e *env) records(t testing.TB) []string {
	t.Helper()
	recs, _, _, err := e.s.log.Read(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range recs {
		out = append(out, fmt.Sprintf("%s:%s/%s", map[changelog.Type]string{changelog.Stored: "stored", changelog.Removed: "removed", changelog.Cleared: "cleared"}[r.Type], r.Tenant, r.Key))
	}
	return out
}

// objectView is what a restarted master must rebuild.
type objectView struct {
	size, checksum  uint64
	group           string
	hard, soft      bool
	replicas        int
	readableOnSegs  string
	softPinDeadline int64
}

func views(s *Store) map[ObjectRef]objectView {
	out := map[ObjectRef]objectView{}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for t, objs := range sh.tenants {
			for k, o := range objs.all() {
				var segs []string
				for _, r := range o.replicas {
					if r.status == stComplete {
						segs = append(segs, s.segs.get(r.seg).id)
					}
				}
				slices.Sort(segs)
				out[ObjectRef{s.tenants.get(t).name, k}] = objectView{
					size: o.size, checksum: o.checksum, group: sh.groupOf(o),
					hard: o.flags&flagHardPin != 0, soft: o.flags&flagSoftPin != 0,
					replicas: len(o.replicas), readableOnSegs: fmt.Sprint(segs), softPinDeadline: sh.softPinLocked(o),
				}
			}
		}
		sh.mu.Unlock()
	}
	return out
}

func TestSoftPinTTL(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	e.put(t, PutSpec{Key: "k", SoftPin: true, SoftPinTTL: time.Minute})
	_ = e.s.withObject(DefaultTenant, "k", func(sh *shard, o *object) error {
		if !sh.softPinnedLocked(o, e.clk.Now().UnixMilli()) {
			t.Fatal("want soft-pinned right after PutEnd")
		}
		if !sh.softPinnedLocked(o, e.clk.Now().UnixMilli()+59_000) || sh.softPinnedLocked(o, e.clk.Now().UnixMilli()+61_000) {
			t.Fatal("soft pin must last one minute from completion")
		}
		return nil
	})
	_, err := e.s.PutStart(t.Context(), PutSpec{Key: "x", Size: 1, SoftPin: true, SoftPinTTL: 25 * time.Hour, ClientID: "w"})
	if rpcerr.Reason(err) != "INVALID_PARAMS" {
		t.Fatalf("25h soft pin: got %v, want INVALID_PARAMS", err)
	}
}

func TestQuotaShrunkBelowUsageRejectsOnlyGrowth(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	e.put(t, PutSpec{Tenant: "q", Key: "a", Size: 100})
	e.put(t, PutSpec{Tenant: "q", Key: "b", Size: 100})
	if _, err := e.s.SetTenantQuota(ctx, "q", 150, 0); err != nil {
		t.Fatal(err)
	}
	_, err := e.s.PutStart(ctx, PutSpec{Tenant: "q", Key: "c", Size: 1, ClientID: "w"})
	if rpcerr.Reason(err) != "TENANT_QUOTA_EXCEEDED" {
		t.Fatalf("growth over quota: got %v", err)
	}
	// Shrinking an object by upsert is allowed; growing it is not.
	if _, err := e.s.PutStart(ctx, PutSpec{Tenant: "q", Key: "a", Size: 200, ClientID: "w", Upsert: true}); rpcerr.Reason(err) != "TENANT_QUOTA_EXCEEDED" {
		t.Fatalf("upsert growth: got %v", err)
	}
	if _, err := e.s.GetSize(ctx, "q", "a"); err != nil {
		t.Fatalf("a failed upsert must keep the old object: %v", err)
	}
	e.put(t, PutSpec{Tenant: "q", Key: "a", Size: 10, Upsert: true})
	if err := e.s.Remove(ctx, RemoveSpec{Tenant: "q", Key: "b"}); err != nil {
		t.Fatal(err)
	}
	q, _ := e.s.TenantQuota(ctx, "q")
	if q.UsedBytes != 10 || q.UsedObjects != 1 || q.MaxBytes != 150 {
		t.Fatalf("quota: got %v", q)
	}
	if l := e.s.ListTenants(ctx); len(l) != 1 || l[0].Tenant != "q" {
		t.Fatalf("tenants: got %v", l)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestConcurrentOverlappingKeys runs many goroutines on a few keys with
// every operation, then checks the invariants once the dust settles.
func TestConcurrentOverlappingKeys(t *testing.T) {
	e := newEnv(t, 3, 2, 4000, Config{Shards: 8})
	ctx := t.Context()
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	tenants := []string{"x", "y"}
	var wg sync.WaitGroup
	wg.Go(func() {
		// Drains race with everything else.
		for _, seg := range []string{"seg-0-0", "seg-1-1"} {
			// Not a failure if the others finish first: drain anyway.
			_ = testutil.Poll(t, 10*time.Second, func() error {
				if e.s.log.Head() < 100 {
					return errors.New("fewer than 100 changes yet")
				}
				return nil
			})
			if err := e.s.DrainSegment(ctx, seg); err != nil {
				t.Errorf("drain %s: %v", seg, err)
			}
		}
	})
	for g := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			client := fmt.Sprintf("c%d", g)
			for range 300 {
				tn, k := tenants[rng.IntN(2)], keys[rng.IntN(len(keys))]
				switch rng.IntN(9) {
				case 0, 1:
					if _, err := e.s.PutStart(ctx, PutSpec{Tenant: tn, Key: k, Size: uint64(1 + rng.IntN(300)), ReplicaNum: 1 + rng.IntN(3), ClientID: client, Upsert: rng.IntN(2) == 0}); err == nil {
						if rng.IntN(4) == 0 {
							_ = e.s.PutRevoke(ctx, PutRevokeSpec{Tenant: tn, Key: k, ClientID: client})
						} else {
							_ = e.s.PutEnd(ctx, PutEndSpec{Tenant: tn, Key: k, ClientID: client, Checksum: 1})
						}
					}
				case 2:
					specs := []PutSpec{{Tenant: tn, Key: k, Size: 50, ClientID: client}, {Tenant: tn, Key: keys[rng.IntN(len(keys))], Size: 70, ClientID: client}}
					var ends []PutEndSpec
					for i, r := range e.s.BatchPutStart(ctx, specs) {
						if r.Err == nil {
							ends = append(ends, PutEndSpec{Tenant: tn, Key: specs[i].Key, ClientID: client})
						}
					}
					e.s.BatchPutEnd(ctx, ends)
				case 3:
					_, _ = e.s.Get(ctx, GetSpec{Tenant: tn, Key: k})
				case 4:
					e.s.BatchGet(ctx, []GetSpec{{Tenant: tn, Key: k}, {Tenant: tn, Key: keys[rng.IntN(len(keys))]}})
				case 5:
					_ = e.s.Remove(ctx, RemoveSpec{Tenant: tn, Key: k, Force: rng.IntN(2) == 0})
				case 6:
					e.s.BatchRemove(ctx, []RemoveSpec{{Tenant: tn, Key: k, Force: true}, {Tenant: tn, Key: keys[rng.IntN(len(keys))]}})
				case 7:
					if rng.IntN(10) == 0 {
						_, _, _ = e.s.RemoveAll(ctx, tn, true)
					} else {
						_, _ = e.s.Exist(ctx, tn, k)
					}
				case 8:
					if rng.IntN(10) == 0 {
						e.s.evictFor(ctx, masterv1.Medium_MEDIUM_MEMORY, 500, 300)
					} else {
						_, _, _ = e.s.Snapshot(ctx, tn)
					}
				}
			}
		})
	}
	wg.Wait()
	// Puts left open by a racing writer are revoked so the check sees no
	// pending work; the invariants must hold either way.
	for _, tn := range tenants {
		for _, k := range keys {
			_ = e.s.withObject(tn, k, func(_ *shard, o *object) error {
				if o.put != nil {
					t.Logf("open put left on %s/%s", tn, k)
				}
				return nil
			})
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestListObjectsPages lists a tenant of a few thousand keys spread over
// every shard in pages of several sizes, with and without a prefix, and
// gets every matching key exactly once, in order.
func TestListObjectsPages(t *testing.T) {
	e := newEnv(t, 2, 2, 1<<40, Config{})
	rng := rand.New(rand.NewPCG(1, 2))
	var all []string
	seen := map[string]bool{}
	for len(all) < 3000 {
		k := fmt.Sprintf("%s/%x", []string{"a", "b", "ab"}[rng.IntN(3)], rng.Uint64()%1_000_000)
		if seen[k] {
			continue
		}
		seen[k] = true
		all = append(all, k)
		e.put(t, PutSpec{Tenant: "t", Key: k, Size: 1, ReplicaNum: 1, ClientID: "w"})
	}
	e.put(t, PutSpec{Tenant: "other", Key: "a/0", Size: 1, ReplicaNum: 1, ClientID: "w"})
	slices.Sort(all)
	for _, prefix := range []string{"", "a", "ab/", "zz"} {
		var want []string
		for _, k := range all {
			if strings.HasPrefix(k, prefix) {
				want = append(want, k)
			}
		}
		for _, size := range []int{1, 7, 1000, 5000} {
			var got []string
			tok := ""
			for pages := 0; ; pages++ {
				infos, next, err := e.s.ListObjects(t.Context(), "t", prefix, size, tok)
				if err != nil {
					t.Fatal(err)
				}
				if len(infos) > size {
					t.Fatalf("prefix %q size %d: page of %d", prefix, size, len(infos))
				}
				for _, in := range infos {
					got = append(got, in.GetKey())
				}
				if tok = next; tok == "" {
					break
				}
				if pages > len(all) {
					t.Fatalf("prefix %q size %d: listing does not end", prefix, size)
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("prefix %q page size %d: got %d keys, want %d (first difference near %v)", prefix, size, len(got), len(want), firstDiff(got, want))
			}
		}
	}
}

func firstDiff(a, b []string) string {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Sprintf("index %d: %q vs %q", i, a[i], b[i])
		}
	}
	return fmt.Sprintf("lengths %d vs %d", len(a), len(b))
}
