package meta

import (
	"fmt"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// wantReason checks err's gRPC code and ErrorInfo reason.
func wantReason(t testing.TB, err error, code codes.Code, reason string) {
	t.Helper()
	if got := rpcerr.Reason(err); got != reason {
		t.Fatalf("reason: got %q (err %v), want %q", got, err, reason)
	}
	if got := status.Code(rpcerr.Status(err)); got != code {
		t.Fatalf("code: got %v (err %v), want %v", got, err, code)
	}
}

// listedPuts counts the puts in every shard's put list (checking the links).
func listedPuts(t fataler, s *Store) int {
	t.Helper()
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		err := putListErr(sh)
		for ps := sh.puts.head; ps != nil; ps = ps.next {
			n++
		}
		sh.mu.Unlock()
		if err != "" {
			t.Fatalf("shard %d put list: %s", i, err)
		}
	}
	return n
}

// putListErr describes what is wrong with sh's put list ("" when nothing):
// it must hold exactly the puts in progress of the shard's objects, each
// once, linked both ways. sh must be locked.
func putListErr(sh *shard) string {
	want := map[*putState]bool{}
	for _, objs := range sh.tenants {
		for _, o := range objs.all() {
			if o.put != nil {
				want[o.put] = true
			}
		}
	}
	seen := map[*putState]bool{}
	var prev *putState
	for ps := sh.puts.head; ps != nil; prev, ps = ps, ps.next {
		switch {
		case seen[ps]:
			return "a put listed twice (a cycle)"
		case ps.prev != prev:
			return "prev link broken"
		case !want[ps]:
			return fmt.Sprintf("put %d listed but no object's put in progress", ps.seq)
		}
		seen[ps] = true
	}
	if sh.puts.tail != prev {
		return "tail is not the last put"
	}
	if len(seen) != len(want) {
		return fmt.Sprintf("%d puts listed, %d in progress", len(seen), len(want))
	}
	return ""
}

// TestExpireAbandonedPut: a PutStart never ended is expired once the put
// timeout passes on the store's clock — its allocation released, its quota
// refunded, its placed bytes freed, nothing published — and its PutEnd and
// PutRevoke then answer PUT_EXPIRED.
func TestExpireAbandonedPut(t *testing.T) {
	e := newEnv(t, 1, 1, 1000, Config{Shards: 4, PutPreemptAfter: 30 * time.Second})
	ctx := t.Context()
	if _, err := e.s.SetTenantQuota(ctx, "t", 1000, 10); err != nil {
		t.Fatal(err)
	}
	// Hard-pinned, so that the failing put below cannot evict it.
	e.put(t, PutSpec{Tenant: "t", Key: "kept", Size: 100, HardPin: true})
	if _, err := e.s.PutStart(ctx, PutSpec{Tenant: "t", Key: "gone", Size: 700, ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	// The abandoned put holds the room: a put that needs it finds none.
	if _, err := e.s.PutStart(ctx, PutSpec{Tenant: "t", Key: "big", Size: 800, ClientID: "w"}); rpcerr.Reason(err) != "NO_AVAILABLE_HANDLE" {
		t.Fatalf("PutStart while the room is held: got %v, want NO_AVAILABLE_HANDLE", err)
	}
	recs := len(e.records(t))

	e.clk.Advance(29 * time.Second)
	if n := e.s.expirePuts(ctx); n != 0 {
		t.Fatalf("expired %d puts before the timeout", n)
	}
	e.clk.Advance(time.Second)
	if n := e.s.expirePuts(ctx); n != 1 {
		t.Fatalf("expired %d puts at the timeout, want 1", n)
	}
	if got := testutil.ToFloat64(e.s.expired); got != 1 {
		t.Fatalf("expired puts counter: got %v, want 1", got)
	}
	if got := e.records(t); len(got) != recs {
		t.Fatalf("expiry published change records: %v", got[recs:])
	}
	q, err := e.s.TenantQuota(ctx, "t")
	if err != nil {
		t.Fatal(err)
	}
	if q.GetUsedBytes() != 100 || q.GetUsedObjects() != 1 {
		t.Fatalf("quota after expiry: %d bytes %d objects, want 100 and 1", q.GetUsedBytes(), q.GetUsedObjects())
	}
	if got := e.c.Agents.Used("seg-0-0"); got != 100 {
		t.Fatalf("agent bytes after expiry: got %d, want 100 (the reservation released)", got)
	}
	if n := listedPuts(t, e.s); n != 0 {
		t.Fatalf("%d puts still listed", n)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})

	wantReason(t, e.s.PutEnd(ctx, PutEndSpec{Tenant: "t", Key: "gone", ClientID: "w", Checksum: 1}), codes.NotFound, "PUT_EXPIRED")
	wantReason(t, e.s.PutRevoke(ctx, PutRevokeSpec{Tenant: "t", Key: "gone", ClientID: "w"}), codes.NotFound, "PUT_EXPIRED")
	wantReason(t, e.s.PutEnd(ctx, PutEndSpec{Tenant: "t", Key: "never", ClientID: "w"}), codes.NotFound, "OBJECT_NOT_FOUND")

	// The room is back without evicting anything.
	e.put(t, PutSpec{Tenant: "t", Key: "big", Size: 800})
	if got := testutil.ToFloat64(e.s.evicted); got != 0 {
		t.Fatalf("evicted %v objects, want 0", got)
	}
	if _, err := e.s.Get(ctx, GetSpec{Tenant: "t", Key: "kept"}); err != nil {
		t.Fatalf("Get kept: %v", err)
	}
}

// TestExpireSkipsEndedAndBusyPuts: ended, revoked and preempted puts leave
// the list at once; a put being sealed is left to its PutEnd.
func TestExpireSkipsEndedAndBusyPuts(t *testing.T) {
	e := newEnv(t, 2, 2, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	for i := range 20 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), ReplicaNum: 2})
	}
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "revoked", Size: 5, ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	if err := e.s.PutRevoke(ctx, PutRevokeSpec{Key: "revoked", ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	if n := listedPuts(t, e.s); n != 0 {
		t.Fatalf("%d puts listed after ends and revokes", n)
	}
	// Preemption replaces the listed put.
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "p", Size: 5, ClientID: "a"}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(31 * time.Second)
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "p", Size: 6, ClientID: "b"}); err != nil {
		t.Fatalf("preempting PutStart: %v", err)
	}
	if n := listedPuts(t, e.s); n != 1 {
		t.Fatalf("%d puts listed after a preemption, want 1", n)
	}
	if n := e.s.expirePuts(ctx); n != 0 {
		t.Fatalf("expired %d puts: the preempting one is new", n)
	}
	// A put being sealed is not expired under its PutEnd.
	sh := &e.s.shards[e.s.shardIndex(0, "p")]
	sh.mu.Lock()
	sh.puts.head.phase = phaseSealing
	sh.mu.Unlock()
	e.clk.Advance(31 * time.Second)
	if n := e.s.expirePuts(ctx); n != 0 {
		t.Fatalf("expired %d puts being sealed", n)
	}
	sh.mu.Lock()
	sh.puts.head.phase = phaseOpen
	sh.mu.Unlock()
	if n := e.s.expirePuts(ctx); n != 1 {
		t.Fatalf("expired %d puts, want 1", n)
	}
	for i := range 20 {
		if _, err := e.s.Get(ctx, GetSpec{Key: fmt.Sprintf("k%d", i)}); err != nil {
			t.Fatalf("Get k%d: %v", i, err)
		}
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
}

// TestExpireUpsert: an upsert's PutStart removes (and publishes the
// removal of) the old version as it always did; when the upsert is then
// abandoned, its expiry publishes nothing more and leaves no object.
func TestExpireUpsert(t *testing.T) {
	e := newEnv(t, 1, 2, 1<<20, Config{Shards: 4, PutPreemptAfter: time.Second})
	ctx := t.Context()
	e.put(t, PutSpec{Key: "k", Size: 10})
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "k", Size: 20, ClientID: "w", Upsert: true}); err != nil {
		t.Fatal(err)
	}
	if got, want := fmt.Sprint(e.records(t)), "[stored:default/k removed:default/k]"; got != want {
		t.Fatalf("records after the upsert's start: got %s, want %s", got, want)
	}
	e.clk.Advance(time.Second)
	if n := e.s.expirePuts(ctx); n != 1 {
		t.Fatalf("expired %d puts, want 1", n)
	}
	if got, want := fmt.Sprint(e.records(t)), "[stored:default/k removed:default/k]"; got != want {
		t.Fatalf("records after expiry: got %s, want %s", got, want)
	}
	wantReason(t, e.s.PutEnd(ctx, PutEndSpec{Key: "k", ClientID: "w"}), codes.NotFound, "PUT_EXPIRED")
	f := &follower{set: map[rkey]bool{}}
	checkInvariants(t, e, f)
	e.put(t, PutSpec{Key: "k", Size: 30})
	checkInvariants(t, e, f)
}

// TestObjectTooLarge: sizes above the limit (the largest segment by
// default, Config.MaxObjectSize when set, never above MaxObjectSizeCap)
// fail with OBJECT_TOO_LARGE before placement: nothing is evicted, no
// agent is asked, and a batch's other items proceed.
func TestObjectTooLarge(t *testing.T) {
	for _, tc := range []struct {
		name     string
		capacity uint64
		max      uint64
		limit    uint64
	}{
		{"default is the largest segment", 4096, 0, 4096},
		{"flag overrides", 4096, 1000, 1000},
		{"default capped", 1 << 40, 0, MaxObjectSizeCap},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 2, 1, tc.capacity, Config{Shards: 4, MaxObjectSize: tc.max})
			ctx := t.Context()
			// Fill both segments with evictable objects, to 85-95 %.
			n := 0
			for e.c.Agents.Used("seg-0-0") < tc.capacity*85/100 && n < 100 {
				e.put(t, PutSpec{Key: fmt.Sprintf("k%d", n), Size: min(tc.capacity, 1<<20) / 10, ReplicaNum: 2})
				n++
			}
			reserves, _, _ := e.c.Agents.Calls()
			for _, size := range []uint64{tc.limit + 1, 1 << 62, 1 << 63, 1<<64 - 1} {
				_, err := e.s.PutStart(ctx, PutSpec{Key: "huge", Size: size, ClientID: "w", ReplicaNum: MaxReplicaNum})
				wantReason(t, err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
				_, err = e.s.PutStart(ctx, PutSpec{Key: "huge", Size: size, ClientID: "w", Upsert: true})
				wantReason(t, err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
			}
			_, err := e.s.PutStart(ctx, PutSpec{Key: "zero", Size: 0, ClientID: "w"})
			wantReason(t, err, codes.InvalidArgument, "INVALID_PARAMS")
			res := e.s.BatchPutStart(ctx, []PutSpec{
				{Key: "b1", Size: 1 << 63, ClientID: "w"},
				{Key: "b2", Size: 10, ClientID: "w"},
				{Key: "b3", Size: 1<<64 - 1, ClientID: "w"},
			})
			wantReason(t, res[0].Err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
			wantReason(t, res[2].Err, codes.InvalidArgument, "OBJECT_TOO_LARGE")
			if res[1].Err != nil {
				t.Fatalf("the batch's good item: %v", res[1].Err)
			}
			if got := testutil.ToFloat64(e.s.evicted); got != 0 {
				t.Fatalf("evicted %v objects, want 0", got)
			}
			if r, _, _ := e.c.Agents.Calls(); r != reserves+1 {
				t.Fatalf("agents saw %d reserves, want only the good item's", r-reserves)
			}
			for i := range n {
				if _, err := e.s.Get(ctx, GetSpec{Key: fmt.Sprintf("k%d", i)}); err != nil {
					t.Fatalf("Get k%d: %v", i, err)
				}
			}
			if q, _ := e.s.TenantQuota(ctx, ""); q.GetUsedObjects() != uint64(n)+1 {
				t.Fatalf("quota objects: got %d, want %d", q.GetUsedObjects(), n+1)
			}
		})
	}
}

// TestTooLargeForEverySegmentDoesNotEvict: with the limit raised above
// every segment, a put no segment could hold even empty fails with
// NO_AVAILABLE_HANDLE without evicting anything.
func TestTooLargeForEverySegmentDoesNotEvict(t *testing.T) {
	e := newEnv(t, 2, 1, 4096, Config{Shards: 4, MaxObjectSize: 1 << 20})
	ctx := t.Context()
	for i := range 8 {
		e.put(t, PutSpec{Key: fmt.Sprintf("k%d", i), Size: 500})
	}
	_, err := e.s.PutStart(ctx, PutSpec{Key: "big", Size: 8192, ClientID: "w"})
	wantReason(t, err, codes.ResourceExhausted, "NO_AVAILABLE_HANDLE")
	if got := testutil.ToFloat64(e.s.evicted); got != 0 {
		t.Fatalf("evicted %v objects, want 0", got)
	}
}

func TestConfigValidateMaxObjectSize(t *testing.T) {
	if err := (Config{MaxObjectSize: MaxObjectSizeCap}).Validate(); err != nil {
		t.Fatalf("at the cap: %v", err)
	}
	if err := (Config{MaxObjectSize: MaxObjectSizeCap + 1}).Validate(); err == nil {
		t.Fatal("above the cap: no error")
	}
}

// TestRunExpiresPuts: Run's sweep expires on its own.
func TestRunExpiresPuts(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 4, PutSweepInterval: time.Millisecond})
	ctx := t.Context()
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "k", Size: 10, ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(time.Minute)
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	defer func() { _ = e.s.Close(); <-done }()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for testutil.ToFloat64(e.s.expired) < 1 {
		select {
		case <-ctx.Done():
			t.Fatal("put not expired")
		case <-tick.C:
		}
	}
	wantReason(t, e.s.PutEnd(ctx, PutEndSpec{Key: "k", ClientID: "w"}), codes.NotFound, "PUT_EXPIRED")
}

// TestExpireBudget: one sweep expires at most expireBudget puts per shard;
// the next sweeps take the rest.
func TestExpireBudget(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<30, Config{Shards: 1})
	ctx := t.Context()
	specs := make([]PutSpec, expireBudget+10)
	for i := range specs {
		specs[i] = PutSpec{Key: fmt.Sprintf("k%d", i), Size: 1, ClientID: "w"}
	}
	for _, r := range e.s.BatchPutStart(ctx, specs) {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	e.clk.Advance(time.Minute)
	if n := e.s.expirePuts(ctx); n != expireBudget {
		t.Fatalf("first sweep expired %d, want %d", n, expireBudget)
	}
	if n := e.s.expirePuts(ctx); n != 10 {
		t.Fatalf("second sweep expired %d, want 10", n)
	}
	checkInvariants(t, e, &follower{set: map[rkey]bool{}})
	if len(e.c.Agents.Live()) != 0 {
		t.Fatalf("%d allocations live after every put expired", len(e.c.Agents.Live()))
	}
}

func TestExpiredSetForgetsOldest(t *testing.T) {
	var s expiredSet
	for i := range expiredRemembered + 10 {
		s.add(uint64(i))
	}
	if s.has(5) || !s.has(10) || !s.has(expiredRemembered+9) {
		t.Fatalf("ring: has(5)=%v has(10)=%v has(last)=%v", s.has(5), s.has(10), s.has(expiredRemembered+9))
	}
	if len(s.n) != expiredRemembered {
		t.Fatalf("map holds %d hashes, want %d", len(s.n), expiredRemembered)
	}
}

// TestPutLostMidWriteExpired: a put in progress whose every replica went
// with its segment (its agent lost or cut off past the unmount window while
// the client wrote) is gone; its PutEnd and PutRevoke answer PUT_EXPIRED,
// which the SDKs put again, not OBJECT_NOT_FOUND, which says nothing
// about the put. A put that keeps a replica elsewhere is not affected.
func TestPutLostMidWriteExpired(t *testing.T) {
	e := newEnv(t, 2, 1, 1<<20, Config{Shards: 4})
	ctx := t.Context()
	for _, k := range []string{"lost", "revoked", "kept"} {
		sp := PutSpec{Key: k, Size: 10, ClientID: "w", Preferred: []string{"seg-0-0"}}
		if k == "kept" {
			sp.ReplicaNum, sp.Preferred = 2, []string{"seg-0-0", "seg-1-0"}
		}
		if _, err := e.s.PutStart(ctx, sp); err != nil {
			t.Fatal(err)
		}
	}
	e.s.DropSegments(ctx, []string{"seg-0-0"})
	wantReason(t, e.s.PutEnd(ctx, PutEndSpec{Key: "lost", ClientID: "w"}), codes.NotFound, "PUT_EXPIRED")
	wantReason(t, e.s.PutRevoke(ctx, PutRevokeSpec{Key: "revoked", ClientID: "w"}), codes.NotFound, "PUT_EXPIRED")
	if err := e.s.PutEnd(ctx, PutEndSpec{Key: "kept", ClientID: "w", Checksum: 10 * 7}); err != nil {
		t.Fatalf("PutEnd of a put that kept a replica: %v", err)
	}
	wantReason(t, e.s.PutEnd(ctx, PutEndSpec{Key: "never", ClientID: "w"}), codes.NotFound, "OBJECT_NOT_FOUND")
}
