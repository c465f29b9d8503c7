package meta

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// fillMemory puts n objects of size bytes on seg-0-0, k0 first (least
// recently used), a second apart.
func (e *env) fillMemory(t *testing.T, n int, size uint64, sp PutSpec) {
	t.Helper()
	for i := range n {
		sp.Key, sp.Size, sp.Preferred = fmt.Sprintf("k%d", i), size, []string{"seg-0-0"}
		e.put(t, sp)
		e.clk.Advance(time.Second)
	}
}

// keyRecords returns key's change records as "type:medium", in log order.
func (e *env) keyRecords(t *testing.T, key string) []string {
	t.Helper()
	var out []string
	for _, r := range e.mediumRecords(t) {
		if p := strings.SplitN(r, ":", 3); p[1] == key {
			out = append(out, p[0]+":"+p[2])
		}
	}
	return out
}

// TestOffloadOnEviction: a memory segment over the high watermark has its
// victims (least recently used first, never leased) moved to a disk
// segment on its own host although another disk has more room; per key the
// change log reads stored(cpu), stored(disk), removed(cpu); the soft pin
// travels with the object; the offload counters count them and nothing is
// counted as evicted.
func TestOffloadOnEviction(t *testing.T) {
	e := newEnv(t, 2, 1, 1000, Config{Shards: 4})
	e.withDisk(0, 1000)
	e.withDisk(1, 4000)
	e.fillMemory(t, 10, 95, PutSpec{SoftPin: true})                     // 950 bytes: over 90 %
	if _, err := e.s.Get(t.Context(), GetSpec{Key: "k0"}); err != nil { // leased: not a victim
		t.Fatal(err)
	}
	e.s.evictOverHigh(t.Context())
	// Need 150 bytes (down to 800): k1 and k2.
	for _, k := range []string{"k1", "k2"} {
		if got, want := replicaSegs(t, e.s, k), []string{"disk-0/complete"}; !slices.Equal(got, want) {
			t.Fatalf("%s: got %v, want %v (same host first)", k, got, want)
		}
		if got, want := e.keyRecords(t, k), []string{"stored:cpu", "stored:disk", "removed:cpu"}; !slices.Equal(got, want) {
			t.Fatalf("%s changes: got %v, want %v", k, got, want)
		}
	}
	for _, k := range []string{"k0", "k3", "k9"} {
		if got, want := replicaSegs(t, e.s, k), []string{"seg-0-0/complete"}; !slices.Equal(got, want) {
			t.Fatalf("%s: got %v, want %v", k, got, want)
		}
	}
	if got := e.c.Agents.Used("seg-0-0"); got != 760 {
		t.Fatalf("seg-0-0 use: got %d, want 760", got)
	}
	pins := 0
	for r, al := range e.c.Agents.Live() {
		if r.Segment == "disk-0" {
			if !al.Sealed || al.SoftPinMs == 0 || al.Checksum != 95*7 {
				t.Fatalf("disk allocation %v: %+v, want sealed, soft-pinned, checksum %d", r, al, 95*7)
			}
			pins++
		}
	}
	if pins != 2 {
		t.Fatalf("disk-0 allocations: got %d, want 2", pins)
	}
	if got := promtest.ToFloat64(e.s.offloaded); got != 2 {
		t.Fatalf("offloaded: got %v, want 2", got)
	}
	if got := promtest.ToFloat64(e.s.offloadedBytes); got != 190 {
		t.Fatalf("offloaded bytes: got %v, want 190", got)
	}
	if got := promtest.ToFloat64(e.s.evicted); got != 0 {
		t.Fatalf("evicted: got %v, want 0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestOffloadNeverEvictsDisk: an offload goes only where a disk segment
// has room below its high watermark; a victim that finds none is dropped,
// and no disk object is evicted to make room, now or at the disk's next
// check. A disk segment over its own high watermark evicts (drops) its own
// victims in the same check.
func TestOffloadNeverEvictsDisk(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	e.withDisk(0, 1000)
	for i := range 3 {
		e.put(t, PutSpec{Key: fmt.Sprintf("d%d", i), Size: 250, Medium: masterv1.Medium_MEDIUM_DISK})
		e.clk.Advance(time.Second)
	}
	e.fillMemory(t, 10, 95, PutSpec{})
	// disk-0 holds 750: k0 fits (845), k1 would pass 900 and is dropped.
	e.s.evictOverHigh(t.Context())
	if got, want := replicaSegs(t, e.s, "k0"), []string{"disk-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("k0: got %v, want %v", got, want)
	}
	if _, err := e.s.GetSize(t.Context(), "", "k1"); rpcerr.Reason(err) != "OBJECT_NOT_FOUND" {
		t.Fatalf("k1: got %v, want dropped", err)
	}
	if got, want := e.keyRecords(t, "k1"), []string{"stored:cpu", "removed:cpu"}; !slices.Equal(got, want) {
		t.Fatalf("k1 changes: got %v, want %v", got, want)
	}
	e.s.evictOverHigh(t.Context()) // the disk is below its high watermark
	for i := range 3 {
		if got, want := replicaSegs(t, e.s, fmt.Sprintf("d%d", i)), []string{"disk-0/complete"}; !slices.Equal(got, want) {
			t.Fatalf("d%d: got %v, want %v (never evicted for an offload)", i, got, want)
		}
	}
	if got := promtest.ToFloat64(e.s.offloaded); got != 1 {
		t.Fatalf("offloaded: got %v, want 1", got)
	}
	if got := promtest.ToFloat64(e.s.evicted); got != 1 {
		t.Fatalf("evicted: got %v, want 1", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	// The disk over its high watermark drops its least recent objects (d0
	// first), and memory (over high again) offloads into the room made.
	e.put(t, PutSpec{Key: "d3", Size: 100, Medium: masterv1.Medium_MEDIUM_DISK}) // 945 on disk
	e.clk.Advance(time.Second)
	for i := 10; i < 12; i++ { // 950 bytes
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 95, Preferred: []string{"seg-0-0"}})
	}
	e.s.evictOverHigh(t.Context())
	if _, err := e.s.GetSize(t.Context(), "", "d0"); rpcerr.Reason(err) != "OBJECT_NOT_FOUND" {
		t.Fatalf("d0: got %v, want evicted by the disk's own check", err)
	}
	if got, want := e.keyRecords(t, "d0"), []string{"stored:disk", "removed:disk"}; !slices.Equal(got, want) {
		t.Fatalf("d0 changes: got %v, want %v", got, want)
	}
	for _, k := range []string{"k2", "k3"} {
		if got, want := replicaSegs(t, e.s, k), []string{"disk-0/complete"}; !slices.Equal(got, want) {
			t.Fatalf("%s: got %v, want %v (offloaded into the room the disk made)", k, got, want)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestOffloadFailuresDrop: a victim whose copy or seal fails is dropped,
// as eviction drops it (its disk target never readable, released); the
// others are offloaded: one with a disk replica already just loses its
// memory replica, one with two memory replicas leaves memory altogether
// (a single removed(cpu), after stored(disk)).
func TestOffloadFailuresDrop(t *testing.T) {
	e := newEnv(t, 2, 1, 1000, Config{Shards: 4, LowWatermark: 0.55})
	e.withDisk(0, 4000)
	for _, k := range []string{"two", "ondisk", "copyfails", "sealfails"} {
		sp := PutSpec{Key: k, Size: 95, Preferred: []string{"seg-0-0"}}
		if k == "two" {
			sp.ReplicaNum, sp.Preferred = 2, []string{"seg-0-0", "seg-1-0"}
		}
		e.put(t, sp)
		e.clk.Advance(time.Second)
	}
	if res := migrate(t, e, MigrateSpec{Keys: []string{"ondisk"}, Target: MigrateTarget{SegmentID: "disk-0"}}); res[0].Err != nil {
		t.Fatal(res[0].Err)
	}
	for i := range 6 {
		e.put(t, PutSpec{Key: fmt.Sprintf("f%d", i), Size: 95, Preferred: []string{"seg-0-0"}})
		e.clk.Advance(time.Second)
	}
	e.c.Agents.BadChecksum("sealfails")
	failSrc := e.allocOf(t, "copyfails", "seg-0-0")
	e.c.Agents.FailCopy = func(it *masterv1.CopyItem) error {
		if it.GetSource().GetAllocationId() == failSrc {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "target stopped")
		}
		return nil
	}
	// Need 400 bytes (950 down to 550): the five least recent.
	e.s.evictOverHigh(t.Context())
	for k, want := range map[string][]string{
		"two":       {"stored:cpu", "stored:disk", "removed:cpu"},
		"ondisk":    {"stored:cpu", "stored:disk", "removed:cpu"},
		"f0":        {"stored:cpu", "stored:disk", "removed:cpu"},
		"copyfails": {"stored:cpu", "removed:cpu"},
		"sealfails": {"stored:cpu", "removed:cpu"},
		"f1":        {"stored:cpu"},
	} {
		if got := e.keyRecords(t, k); !slices.Equal(got, want) {
			t.Fatalf("%s changes: got %v, want %v", k, got, want)
		}
	}
	for _, k := range []string{"two", "ondisk", "f0"} {
		if got, want := replicaSegs(t, e.s, k), []string{"disk-0/complete"}; !slices.Equal(got, want) {
			t.Fatalf("%s: got %v, want %v", k, got, want)
		}
	}
	if got := e.c.Agents.Used("seg-1-0"); got != 0 {
		t.Fatalf("seg-1-0 use: got %d, want 0 (two's second memory replica went too)", got)
	}
	if got := promtest.ToFloat64(e.s.offloaded); got != 3 {
		t.Fatalf("offloaded: got %v, want 3", got)
	}
	if got := promtest.ToFloat64(e.s.evicted); got != 2 {
		t.Fatalf("evicted: got %v, want 2", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// offloadOnDisk returns a store whose memory segment seg-0-0 (1000 bytes)
// is over its high watermark: "ondisk", its least recently used object,
// has a disk replica too (mem is its memory allocation), then k0..k8.
func offloadOnDisk(t *testing.T) (e *env, mem metatest.Ref) {
	t.Helper()
	e = newEnv(t, 1, 1, 1000, Config{Shards: 4})
	e.withDisk(0, 4000)
	e.put(t, PutSpec{Key: "ondisk", Size: 95, Preferred: []string{"seg-0-0"}})
	e.clk.Advance(time.Second)
	if res := migrate(t, e, MigrateSpec{Keys: []string{"ondisk"}, Target: MigrateTarget{SegmentID: "disk-0"}}); res[0].Err != nil {
		t.Fatal(res[0].Err)
	}
	mem = metatest.Ref{Segment: "seg-0-0", ID: e.allocOf(t, "ondisk", "seg-0-0")}
	e.fillMemory(t, 9, 95, PutSpec{}) // 950 bytes: over 90 %
	return e, mem
}

// TestOffloadReleasesBeforeCopy: the memory a pass frees without a copy
// (a victim already on disk, a victim with no disk room) is released at
// its agent before the pass's copies start, not after them: the metadata
// shows those extents free from the moment it drops the replicas, and a
// PutStart short of room carves its hole there (makeHole). Released after
// the copies, which run at disk speed, a put's second round could meet an
// agent that still held them (NO_AVAILABLE_HANDLE, "largest free extent"
// below the hole).
func TestOffloadReleasesBeforeCopy(t *testing.T) {
	e, mem := offloadOnDisk(t)
	copies, heldAtCopy := 0, false
	e.c.Agents.BeforeCopy = func() {
		if copies++; copies == 1 {
			_, heldAtCopy = e.c.Agents.Live()[mem]
		}
	}
	e.s.evictOverHigh(t.Context())
	if copies == 0 {
		t.Fatal("the pass copied nothing; the test needs a victim to copy")
	}
	if heldAtCopy {
		t.Fatalf("ondisk's memory allocation %v was still held at its agent when the pass's copy began; want it released first", mem)
	}
	if got, want := replicaSegs(t, e.s, "ondisk"), []string{"disk-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("ondisk: got %v, want %v", got, want)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestOffloadReleasesUnderEvictMu: every release an offload pass sends
// (for a victim on disk already, then for the copied ones) goes out under
// evictMu, so makeHole, which judges free extents from the
// metadata under evictMu, never sees memory free that the agent still
// holds. Seen as e2e TestEventsMatchMaster's fill failing
// NO_AVAILABLE_HANDLE: the put's second round came 0.1 ms before an
// offload's last releases reached the agent.
func TestOffloadReleasesUnderEvictMu(t *testing.T) {
	e, _ := offloadOnDisk(t)
	var releases, unheld int
	e.c.Agents.BeforeRelease = func() {
		releases++
		if e.s.evictMu.TryLock() {
			unheld++
			e.s.evictMu.Unlock()
		}
	}
	e.s.evictOverHigh(t.Context())
	if releases < 2 {
		t.Fatalf("%d Release calls, want at least 2 (the victim on disk already, then the copied ones)", releases)
	}
	if unheld > 0 {
		t.Fatalf("%d of %d Release calls of the offload were sent without evictMu held", unheld, releases)
	}
	if got, want := replicaSegs(t, e.s, "k0"), []string{"disk-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("k0: got %v, want %v (offloaded)", got, want)
	}
}

// TestOffloadKeepsChangedVictim: a victim read while its copy runs is no
// longer one: its disk target is removed (never readable, released) and it
// stays in memory, not dropped.
func TestOffloadKeepsChangedVictim(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	e.withDisk(0, 4000)
	e.fillMemory(t, 10, 95, PutSpec{})
	var once sync.Once
	e.c.Agents.FailCopy = func(*masterv1.CopyItem) error {
		// Under the fake's lock, but the store holds no lock during a copy.
		once.Do(func() {
			if _, err := e.s.Get(t.Context(), GetSpec{Key: "k0"}); err != nil {
				t.Error(err)
			}
		})
		return nil
	}
	e.s.evictOverHigh(t.Context())
	if got, want := replicaSegs(t, e.s, "k0"), []string{"seg-0-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("k0: got %v, want %v (read during its offload)", got, want)
	}
	if got, want := e.keyRecords(t, "k0"), []string{"stored:cpu"}; !slices.Equal(got, want) {
		t.Fatalf("k0 changes: got %v, want %v", got, want)
	}
	if got, want := replicaSegs(t, e.s, "k1"), []string{"disk-0/complete"}; !slices.Equal(got, want) {
		t.Fatalf("k1: got %v, want %v", got, want)
	}
	if got := promtest.ToFloat64(e.s.evicted); got != 0 {
		t.Fatalf("evicted: got %v, want 0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestOffloadPassBounded: a pass offloads at most its bounds and asks for
// the next at once; that one carries on below the high watermark down to
// the low one, and then the segment is left alone.
func TestOffloadPassBounded(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4, LowWatermark: 0.3})
	e.withDisk(0, 4000)
	e.s.offloadObjects = 3
	e.fillMemory(t, 10, 95, PutSpec{})
	kicked := func() bool {
		select {
		case <-e.s.evictKick:
			return true
		default:
			return false
		}
	}
	// Need 650 bytes, 285 (3 objects) per pass: 950 → 665 → 380 → 285.
	for i, want := range []uint64{665, 380, 285, 285} {
		e.s.evictOverHigh(t.Context())
		if got := e.c.Agents.Used("seg-0-0"); got != want {
			t.Fatalf("pass %d: seg-0-0 use %d, want %d", i, got, want)
		}
		if got, want := kicked(), i < 2; got != want {
			t.Fatalf("pass %d: next check asked for: got %v, want %v", i, got, want)
		}
	}
	if got := promtest.ToFloat64(e.s.offloaded); got != 7 {
		t.Fatalf("offloaded: got %v, want 7", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestOffloadDropPolicy: with EvictDrop the victims are dropped as before
// issue 17, a disk segment notwithstanding; and a PutStart that finds no
// room drops (evictFor) whatever the policy.
func TestOffloadDropPolicy(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4, EvictPolicy: EvictDrop})
	e.withDisk(0, 4000)
	e.fillMemory(t, 10, 95, PutSpec{})
	e.s.evictOverHigh(t.Context())
	for _, k := range []string{"k0", "k1"} {
		if got, want := e.keyRecords(t, k), []string{"stored:cpu", "removed:cpu"}; !slices.Equal(got, want) {
			t.Fatalf("%s changes: got %v, want %v", k, got, want)
		}
	}
	if got := promtest.ToFloat64(e.s.offloaded); got != 0 {
		t.Fatalf("offloaded: got %v, want 0", got)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	e2 := newEnv(t, 1, 1, 1000, Config{Shards: 4})
	e2.withDisk(0, 4000)
	e2.fillMemory(t, 10, 100, PutSpec{}) // full, and no background check ran
	e2.put(t, PutSpec{Key: "new", Size: 100, Preferred: []string{"seg-0-0"}})
	if got, want := e2.keyRecords(t, "k0"), []string{"stored:cpu", "removed:cpu"}; !slices.Equal(got, want) {
		t.Fatalf("k0 changes after a put into a full segment: got %v, want %v (dropped)", got, want)
	}
	if got := e2.c.Agents.Used("disk-0"); got != 0 {
		t.Fatalf("disk-0 use: got %d, want 0 (a put's eviction drops)", got)
	}
	checkInvariants(t, e2, &follower{set: map[rkey]bool{}})
}
