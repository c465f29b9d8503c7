package meta

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
	"unsafe"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// TestSketchBoundedAndHalving: the sketch is a fixed 256 KiB whatever is
// counted; a key's estimate is its count (no collisions among a few
// keys), never below it, saturates at 255, and halves every halveEvery
// adds.
func TestSketchBoundedAndHalving(t *testing.T) {
	sk := newSketch(1 << 30)
	if got := unsafe.Sizeof(sk.rows); got != SketchBytes || SketchBytes != 256<<10 {
		t.Fatalf("sketch rows: %d bytes, want %d (256 KiB)", got, SketchBytes)
	}
	for i := range 5 {
		if got := sk.add(sketchHash(1, "hot")); got != i+1 {
			t.Fatalf("add %d of hot: estimate %d, want %d", i+1, got, i+1)
		}
	}
	// A million other keys once each: the sketch does not grow, and every
	// estimate is at least the true count.
	for i := range 1 << 20 {
		sk.add(sketchHash(2, fmt.Sprint(i)))
	}
	if got := sk.estimate(sketchHash(1, "hot")); got < 5 {
		t.Fatalf("hot after a million other keys: estimate %d, want >= 5", got)
	}
	if got := unsafe.Sizeof(*sk); got > SketchBytes+64 {
		t.Fatalf("sketch is %d bytes, want about %d", got, SketchBytes)
	}
	sat := newSketch(1 << 30)
	for range 300 {
		sat.add(sketchHash(1, "k"))
	}
	if got := sat.estimate(sketchHash(1, "k")); got != sketchMax {
		t.Fatalf("after 300 adds: estimate %d, want saturated at %d", got, sketchMax)
	}

	// Halving: every 10 adds, every counter halves (rounding down).
	h := newSketch(10)
	for range 9 {
		h.add(sketchHash(1, "a"))
	}
	if got := h.estimate(sketchHash(1, "a")); got != 9 || h.halvings != 0 {
		t.Fatalf("9 adds: estimate %d halvings %d, want 9 and 0", got, h.halvings)
	}
	if got := h.add(sketchHash(1, "a")); got != 10 {
		t.Fatalf("10th add returned %d, want 10 (the halving comes after)", got)
	}
	if got := h.estimate(sketchHash(1, "a")); got != 5 || h.halvings != 1 {
		t.Fatalf("after the halving: estimate %d halvings %d, want 5 and 1", got, h.halvings)
	}
	// Saturated counters halve to 127 (no bit leaks from the next byte).
	sat.mu.Lock()
	sat.halveLocked()
	sat.mu.Unlock()
	if got := sat.estimate(sketchHash(1, "k")); got != sketchMax/2 {
		t.Fatalf("saturated then halved: %d, want %d", got, sketchMax/2)
	}
}

// promoEnv is two memory hosts of 1000 bytes and a disk segment on host 1.
func promoEnv(t *testing.T, cfg Config) *env {
	t.Helper()
	cfg.Shards = 4
	e := newEnv(t, 2, 1, 1000, cfg)
	e.withDisk(1, 10000)
	return e
}

func (e *env) putDisk(t *testing.T, key string, size uint64) {
	t.Helper()
	e.put(t, PutSpec{Key: key, Size: size, Medium: masterv1.Medium_MEDIUM_DISK})
}

func (e *env) read(t *testing.T, key string) {
	t.Helper()
	if _, err := e.s.Get(t.Context(), GetSpec{Key: key}); err != nil {
		t.Fatalf("Get %s: %v", key, err)
	}
}

func (e *env) batchRead(t *testing.T, keys ...string) {
	t.Helper()
	specs := make([]GetSpec, len(keys))
	for i, k := range keys {
		specs[i] = GetSpec{Key: k}
	}
	for i, r := range e.s.BatchGet(t.Context(), specs) {
		if r.Err != nil {
			t.Fatalf("BatchGet %s: %v", keys[i], r.Err)
		}
	}
}

// queued drains the promotion queue.
func (e *env) queued() []string {
	var out []string
	for {
		select {
		case it := <-e.s.promo.queue:
			out = append(out, it.tenant+"/"+it.key)
		default:
			return out
		}
	}
}

// TestPromoteOnThreshold: reads of a disk-only object are counted, by Get
// and BatchGet alike, and the read that reaches the threshold queues it
// (once); reads of an object with a memory replica are not counted. The
// worker's step copies it to memory: the disk replica stays, the change
// log reads stored(disk) then stored(cpu) and nothing removed, and the
// invariants hold.
func TestPromoteOnThreshold(t *testing.T) {
	e := promoEnv(t, Config{})
	e.putDisk(t, "cold", 50)
	e.put(t, PutSpec{Key: "hot", Size: 50})
	for range 10 {
		e.read(t, "hot")
	}
	if got := e.s.promo.sk.estimate(sketchHash(e.tenantID(t, "default"), "hot")); got != 0 {
		t.Fatalf("reads of a memory object were counted: estimate %d", got)
	}
	e.read(t, "cold")
	e.batchRead(t, "cold", "hot")
	if q := e.queued(); len(q) != 0 {
		t.Fatalf("queued after 2 reads: %v", q)
	}
	e.read(t, "cold") // the third: DefaultPromoteThreshold
	for range 3 {
		e.batchRead(t, "cold")
	}
	q := e.queued()
	if !slices.Equal(q, []string{"default/cold"}) {
		t.Fatalf("queued: got %v, want cold once", q)
	}
	if left := e.s.promoteStep(t.Context(), []promoteItem{{"default", "cold"}}); len(left) != 0 {
		t.Fatalf("step held back %v", left)
	}
	if got, want := replicaSegs(t, e.s, "cold"), []string{"disk-1/complete", "seg-1-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("cold: got %v, want the disk replica and a memory one on the disk's host", got)
	}
	want := []string{"stored:cold:disk", "stored:hot:cpu", "stored:cold:cpu"}
	if got := e.mediumRecords(t); !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	if got := promtest.ToFloat64(e.s.promo.promoted); got != 1 {
		t.Fatalf("promotions: %v, want 1", got)
	}
	// Now in memory: reads are no longer counted.
	before := e.s.promo.sk.estimate(sketchHash(e.tenantID(t, "default"), "cold"))
	e.read(t, "cold")
	if got := e.s.promo.sk.estimate(sketchHash(e.tenantID(t, "default"), "cold")); got != before {
		t.Fatalf("read of a promoted object counted: %d -> %d", before, got)
	}
	for r, al := range e.c.Agents.Live() {
		if !al.Sealed {
			t.Fatalf("allocation %v left unsealed", r)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

func (e *env) tenantID(t *testing.T, name string) uint32 {
	t.Helper()
	id, ok := e.s.tenants.lookup(name)
	if !ok {
		t.Fatalf("no tenant %q", name)
	}
	return id
}

// TestPromoteDisabled: a negative threshold counts nothing.
func TestPromoteDisabled(t *testing.T) {
	e := promoEnv(t, Config{PromoteThreshold: -1})
	e.putDisk(t, "cold", 50)
	for range 5 {
		e.read(t, "cold")
	}
	if e.s.promo.sk != nil || len(e.queued()) != 0 {
		t.Fatal("promotion disabled but reads were counted")
	}
}

// TestPromoteQueueBound: the queue holds PromoteQueue keys; the rest are
// dropped and counted.
func TestPromoteQueueBound(t *testing.T) {
	e := promoEnv(t, Config{PromoteQueue: 2, PromoteThreshold: 1})
	for i := range 5 {
		e.putDisk(t, fmt.Sprint("k", i), 10)
		e.read(t, fmt.Sprint("k", i))
	}
	if got := len(e.s.promo.queue); got != 2 {
		t.Fatalf("queue holds %d, want 2", got)
	}
	if got := promtest.ToFloat64(e.s.promo.drops); got != 3 {
		t.Fatalf("drops: %v, want 3", got)
	}
	res, err := e.s.Prefetch(t.Context(), "", []string{"k4"}, false)
	if err != nil {
		t.Fatal(err)
	}
	wantItemReason(t, res[0].Err, "LIMIT_EXCEEDED")
	if got := promtest.ToFloat64(e.s.promo.drops); got != 4 {
		t.Fatalf("drops after a refused Prefetch: %v, want 4", got)
	}
}

// TestPromoteBudget: the worker admits keys while the byte-rate bucket
// holds tokens (a second's worth to start; the last admitted may overdraw
// it) and holds the rest back until the clock refills it.
func TestPromoteBudget(t *testing.T) {
	e := promoEnv(t, Config{PromoteBytesPerSec: 100})
	var items []promoteItem
	for i := range 4 {
		k := fmt.Sprint("k", i)
		e.putDisk(t, k, 60)
		items = append(items, promoteItem{"default", k})
	}
	left := e.s.promoteStep(t.Context(), items)
	if got := keysOfItems(left); !slices.Equal(got, []string{"k2", "k3"}) {
		t.Fatalf("held back: got %v, want k2 k3 (100 tokens: k0 leaves 40, k1 overdraws to -20)", got)
	}
	if left = e.s.promoteStep(t.Context(), left); len(left) != 2 {
		t.Fatalf("no time passed, still overdrawn: held back %v, want both", keysOfItems(left))
	}
	e.clk.Advance(time.Second) // -20 + 100 = 80: k2 (20 left), k3 (-40)
	if left = e.s.promoteStep(t.Context(), left); len(left) != 0 {
		t.Fatalf("after a second: held back %v", keysOfItems(left))
	}
	for _, it := range items {
		if !slices.Contains(replicaSegs(t, e.s, it.key), "seg-1-0/complete") {
			t.Fatalf("%s not promoted: %v", it.key, replicaSegs(t, e.s, it.key))
		}
	}
	if got := promtest.ToFloat64(e.s.promo.promoted); got != 4 {
		t.Fatalf("promotions: %v, want 4", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

func keysOfItems(items []promoteItem) []string {
	var out []string
	for _, it := range items {
		out = append(out, it.key)
	}
	return out
}

// TestPromoteLowWatermark: promotion places only on a memory segment that
// stays at or under the low watermark with the object (the disk's host
// first), never evicts, and refuses (counted as gated) when no memory
// segment can take it that way; the watermark check then finds nothing to
// evict.
func TestPromoteLowWatermark(t *testing.T) {
	e := promoEnv(t, Config{})
	// seg-1-0 (the disk's host) at 750 of 1000, seg-0-0 at 790: low is 800.
	e.put(t, PutSpec{Key: "fill1", Size: 750, Preferred: []string{"seg-1-0"}})
	e.put(t, PutSpec{Key: "fill0", Size: 790, Preferred: []string{"seg-0-0"}})
	e.putDisk(t, "small", 50)
	e.putDisk(t, "big", 60)
	res, err := e.s.Prefetch(t.Context(), "", []string{"small", "big"}, true)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Err != nil || res[0].State != masterv1.PrefetchState_PREFETCH_STATE_COPIED || res[0].Replica.GetSegmentId() != "seg-1-0" {
		t.Fatalf("small: got %+v, want copied to seg-1-0 (800 of 1000 after)", res[0])
	}
	wantItemReason(t, res[1].Err, "NO_AVAILABLE_HANDLE") // 860 or 850: over the low watermark
	if got, want := replicaSegs(t, e.s, "big"), []string{"disk-1/complete"}; !slices.Equal(got, want) {
		t.Fatalf("big: got %v, want only the disk replica", got)
	}
	// Through the worker it is counted as gated and dropped.
	if left := e.s.promoteStep(t.Context(), []promoteItem{{"default", "big"}}); len(left) != 0 {
		t.Fatalf("gated key held back: %v", left)
	}
	if got := promtest.ToFloat64(e.s.promo.gated); got != 1 {
		t.Fatalf("gated: %v, want 1", got)
	}
	e.s.evictOverHigh(t.Context())
	if got := promtest.ToFloat64(e.s.evicted); got != 0 {
		t.Fatalf("evicted %v objects, want none", got)
	}
	for _, k := range []string{"fill0", "fill1"} {
		if got := replicaSegs(t, e.s, k); len(got) != 1 {
			t.Fatalf("%s: %v", k, got)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestPrefetch: without wait, per key QUEUED, IN_MEMORY or the reason it
// cannot be (not found, not readable); with wait, COPIED at once with the
// new replica, then IN_MEMORY; an invalid envelope fails whole; an
// unknown tenant is not created.
func TestPrefetch(t *testing.T) {
	e := promoEnv(t, Config{})
	e.putDisk(t, "cold", 50)
	e.put(t, PutSpec{Key: "hot", Size: 50})
	if _, err := e.s.PutStart(t.Context(), PutSpec{Key: "writing", Size: 10, ClientID: "w", Medium: masterv1.Medium_MEDIUM_DISK}); err != nil {
		t.Fatal(err)
	}
	res, err := e.s.Prefetch(t.Context(), "", []string{"cold", "hot", "missing", "writing"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Err != nil || res[0].State != masterv1.PrefetchState_PREFETCH_STATE_QUEUED {
		t.Fatalf("cold: %+v, want QUEUED", res[0])
	}
	if res[1].Err != nil || res[1].State != masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY {
		t.Fatalf("hot: %+v, want IN_MEMORY", res[1])
	}
	wantItemReason(t, res[2].Err, "OBJECT_NOT_FOUND")
	wantItemReason(t, res[3].Err, "REPLICA_IS_NOT_READY")
	if q := e.queued(); !slices.Equal(q, []string{"default/cold"}) {
		t.Fatalf("queue: %v", q)
	}
	res, err = e.s.Prefetch(t.Context(), "", []string{"cold", "hot", "missing", "writing"}, true)
	if err != nil {
		t.Fatal(err)
	}
	if r := res[0]; r.Err != nil || r.State != masterv1.PrefetchState_PREFETCH_STATE_COPIED ||
		r.Replica.GetMedium() != masterv1.Medium_MEDIUM_MEMORY || r.Replica.GetSize() != 50 || len(r.Replica.GetToken()) != 0 {
		t.Fatalf("cold with wait: %+v, want COPIED to memory", r)
	}
	if res[1].State != masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY {
		t.Fatalf("hot with wait: %+v", res[1])
	}
	wantItemReason(t, res[2].Err, "OBJECT_NOT_FOUND")
	wantItemReason(t, res[3].Err, "OBJECT_BUSY")
	res, err = e.s.Prefetch(t.Context(), "", []string{"cold"}, true)
	if err != nil || res[0].State != masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY {
		t.Fatalf("cold again: %+v, %v; want IN_MEMORY", res, err)
	}
	for _, bad := range [][]string{nil, {"a", "a"}, {""}, make([]string, MaxMigrateKeys+1)} {
		if _, err := e.s.Prefetch(t.Context(), "", bad, false); err == nil {
			t.Fatalf("Prefetch %d keys %q: no error", len(bad), bad[:min(len(bad), 2)])
		} else {
			wantItemReason(t, err, "INVALID_PARAMS")
		}
	}
	res, err = e.s.Prefetch(t.Context(), "ghost", []string{"k"}, true)
	if err != nil {
		t.Fatal(err)
	}
	wantItemReason(t, res[0].Err, "OBJECT_NOT_FOUND")
	if _, ok := e.s.tenants.lookup("ghost"); ok {
		t.Fatal("Prefetch created the tenant it was asked about")
	}
	if got := promtest.ToFloat64(e.s.promo.prefetches); got != 4 {
		t.Fatalf("prefetch requests: %v, want 4 (invalid ones not counted)", got)
	}
	want := []string{"stored:cold:disk", "stored:hot:cpu", "stored:cold:cpu"}
	if got := e.mediumRecords(t); !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestPromoteCopyFails: a failed copy leaves no memory replica (nothing
// recorded, the target released) and the disk replica in place.
func TestPromoteCopyFails(t *testing.T) {
	e := promoEnv(t, Config{})
	e.putDisk(t, "cold", 50)
	e.c.Agents.BadChecksum("cold")
	res, err := e.s.Prefetch(t.Context(), "", []string{"cold"}, true)
	if err != nil {
		t.Fatal(err)
	}
	wantItemReason(t, res[0].Err, "CHECKSUM_MISMATCH")
	if got, want := replicaSegs(t, e.s, "cold"), []string{"disk-1/complete"}; !slices.Equal(got, want) {
		t.Fatalf("cold: got %v, want only the disk replica", got)
	}
	if got := promtest.ToFloat64(e.s.promo.promoted); got != 0 {
		t.Fatalf("promotions: %v, want 0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestPromotionWorker: Run's worker promotes a key that crossed the
// threshold, and stops with Run (goleak checks the package).
func TestPromotionWorker(t *testing.T) {
	e := promoEnv(t, Config{})
	e.putDisk(t, "cold", 50)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	for range DefaultPromoteThreshold {
		e.read(t, "cold")
	}
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Contains(replicaSegs(t, e.s, "cold"), "seg-1-0/complete") {
		if time.Now().After(deadline) {
			t.Fatalf("cold not promoted: %v", replicaSegs(t, e.s, "cold"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestPromoteUnreadableMemoryReplica: a memory replica on a segment that
// cannot serve reads does not make the object IN_MEMORY; it gets another
// memory replica, on another segment.
func TestPromoteUnreadableMemoryReplica(t *testing.T) {
	e := promoEnv(t, Config{})
	e.putDisk(t, "k", 50)
	if res := migrate(t, e, MigrateSpec{Keys: []string{"k"}, Target: MigrateTarget{SegmentID: "seg-0-0"}}); res[0].Err != nil {
		t.Fatal(res[0].Err)
	}
	e.c.Reg.SetHealth("seg-0-0", masterv1.SegmentHealth_SEGMENT_HEALTH_SUSPECTED)
	res, err := e.s.Prefetch(t.Context(), "", []string{"k"}, true)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Err != nil || res[0].State != masterv1.PrefetchState_PREFETCH_STATE_COPIED || res[0].Replica.GetSegmentId() != "seg-1-0" {
		t.Fatalf("got %+v, want COPIED to seg-1-0", res[0])
	}
	e.c.Reg.SetHealth("seg-0-0", masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY)
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}
