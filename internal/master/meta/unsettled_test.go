package meta

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// memLedger is a Ledger in memory: the etcd side is ha's (TestUnsettledRecords)
// and e2e's (TestRemovedWhileAgentAwayAcrossFailover).
type memLedger struct {
	mu     sync.Mutex
	recs   map[string]UnsettledSegment
	writes int
	fail   error
}

func (l *memLedger) Record(_ context.Context, segs []UnsettledSegment) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.writes++
	if l.fail != nil {
		return l.fail
	}
	if l.recs == nil {
		l.recs = map[string]UnsettledSegment{}
	}
	for _, s := range segs {
		l.recs[s.ID] = s
	}
	return nil
}

func (l *memLedger) Forget(_ context.Context, ids []string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.writes++
	if l.fail != nil {
		return l.fail
	}
	for _, id := range ids {
		delete(l.recs, id)
	}
	return nil
}

func (l *memLedger) ids() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Sorted(maps.Keys(l.recs))
}

func (l *memLedger) setFail(err error) {
	l.mu.Lock()
	l.fail = err
	l.mu.Unlock()
}

// TestRemovalRecordsUnsettledSegment: a removal whose release the agent
// refuses answers only once the segment is recorded in the ledger; the
// next removal on that segment writes nothing; once the agent takes the
// release the sweep removes the record. A removal whose record cannot be
// written answers NOT_LEADER, and the sweep writes it later. A release
// owed for anything but a client's removal (an expired put's) records
// nothing.
func TestRemovalRecordsUnsettledSegment(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c"} {
		e.put(t, PutSpec{Key: k, Size: 100})
	}
	l := &memLedger{}
	e.s.SetLedger(l, nil)
	refuse := true
	e.c.Agents.FailRelease = func(*masterv1.AllocationRef) error {
		if refuse {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "disk segment journal: no space left on device")
		}
		return nil
	}
	if _, err := e.s.PutStart(ctx, PutSpec{Key: "abandoned", Size: 100, ClientID: "w"}); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(time.Minute)
	if n := e.s.expirePuts(ctx); n != 1 || e.s.OwedReleases() != 1 {
		t.Fatalf("expired %d puts, %d releases owed; want 1, 1", n, e.s.OwedReleases())
	}
	e.s.syncUnsettled(ctx)
	if got := l.ids(); len(got) != 0 {
		t.Fatalf("ledger %q after an expired put's release was owed, want none", got)
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "a"}); err != nil {
		t.Fatal(err)
	}
	if got := l.ids(); !slices.Equal(got, []string{"seg-0-0"}) {
		t.Fatalf("ledger %q after a removal left a release owed, want [seg-0-0]", got)
	}
	if rec := l.recs["seg-0-0"]; rec.Agent != "agent-0" || !rec.Memory {
		t.Fatalf("record %+v, want agent-0's memory segment", rec)
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "b"}); err != nil {
		t.Fatal(err)
	}
	if l.writes != 1 {
		t.Fatalf("%d ledger writes after two removals on one recorded segment, want 1", l.writes)
	}
	refuse = false
	e.s.retryOwed(ctx)
	e.s.syncUnsettled(ctx)
	if got := l.ids(); len(got) != 0 || e.s.OwedReleases() != 0 {
		t.Fatalf("ledger %q, %d owed once the agent took the releases; want none", got, e.s.OwedReleases())
	}
	refuse = true

	l.setFail(errors.New("etcd: context deadline exceeded"))
	if err := e.s.Remove(ctx, RemoveSpec{Key: "c"}); rpcerr.Reason(err) != "NOT_LEADER" {
		t.Fatalf("Remove with the ledger failing = %v, want NOT_LEADER", err)
	}
	// Not found here, but not recorded either: answered the same.
	if err := e.s.Remove(ctx, RemoveSpec{Key: "c"}); rpcerr.Reason(err) != "NOT_LEADER" {
		t.Fatalf("Remove again with the ledger failing = %v, want NOT_LEADER", err)
	}
	l.setFail(nil)
	e.s.syncUnsettled(ctx)
	if got := l.ids(); !slices.Equal(got, []string{"seg-0-0"}) {
		t.Fatalf("ledger %q after the sweep, want [seg-0-0] (owed, unrecorded until now)", got)
	}
}

// TestDetachedSegmentRecorded: a segment dropped (its agent lost) is not
// recorded for that alone (nothing removed would come back), but before a
// removal answers while it is detached, even one that found nothing (its
// tombstone is what keeps the segment's copy from coming back); the record
// goes once the agent registered again.
func TestDetachedSegmentRecorded(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "a", Size: 100})
	l := &memLedger{}
	e.s.SetLedger(l, nil)
	table := e.c.Agents.Table("agent-0")
	e.s.DropSegments(ctx, []string{"seg-0-0"})
	e.s.syncUnsettled(ctx)
	if got := l.ids(); len(got) != 0 {
		t.Fatalf("ledger %q after a detachment alone, want none", got)
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "a"}); rpcerr.Reason(err) != "OBJECT_NOT_FOUND" {
		t.Fatalf("Remove = %v, want OBJECT_NOT_FOUND", err)
	}
	if got := l.ids(); !slices.Equal(got, []string{"seg-0-0"}) {
		t.Fatalf("ledger %q after a removal while a segment is detached, want [seg-0-0]", got)
	}
	if back := e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), table); len(back) != 1 {
		t.Fatalf("reconcile returned %d allocations, want the removed object's", len(back))
	}
	e.s.syncUnsettled(ctx)
	if got := l.ids(); len(got) != 0 {
		t.Fatalf("ledger %q after the segment came back, want none", got)
	}
}

// TestDistrustedSegment: a new leader distrusts the segments an earlier
// leader recorded: the replicas it followed there are dropped and their
// releases owed, and the agent's table adopts nothing there, whether the
// agent registers in full or resumes (TakeOwed), whether the segment was
// detached meanwhile, and whether the standby held nothing there (it had
// found the agent lost: the table's allocations are all new to it); what
// is on other segments stays. Once the agent
// has registered the segment is settled, and its record goes.
func TestDistrustedSegment(t *testing.T) {
	for _, how := range []string{"full", "resume", "detached", "lost before"} {
		t.Run(how, func(t *testing.T) {
			e := newEnv(t, 2, 1, 1<<20, Config{})
			ctx := context.Background()
			for _, k := range []string{"both", "one", "other"} {
				n := 2
				if k != "both" {
					n = 1
				}
				e.put(t, PutSpec{Key: k, Size: 100, ReplicaNum: n})
			}
			onA := e.c.Agents.Table("agent-0")
			rec := UnsettledSegment{ID: "seg-0-0", Agent: "agent-0", Memory: true}
			owed := len(onA)
			if how == "lost before" {
				e.s.DropSegments(ctx, []string{"seg-0-0"})
				owed = 0
			}
			e.s.Distrust([]UnsettledSegment{rec})
			l := &memLedger{recs: map[string]UnsettledSegment{rec.ID: rec}}
			e.s.SetLedger(l, []UnsettledSegment{rec})
			if n := e.s.OwedReleases(); n != owed {
				t.Fatalf("%d releases owed after distrusting seg-0-0, want %d (every replica it held)", n, owed)
			}
			var back int
			switch how {
			case "full":
				back = len(e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), onA))
			case "resume":
				back = len(e.s.TakeOwed("agent-0", []string{"seg-0-0"}))
			case "detached":
				e.s.DropSegments(ctx, []string{"seg-0-0"})
				back = len(e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), onA))
			case "lost before":
				back = len(e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), onA))
			}
			if back != len(onA) {
				t.Fatalf("the registration returned %d allocations, want all %d on the distrusted segment", back, len(onA))
			}
			for _, r := range readableKeysOn(e, "seg-0-0") {
				t.Fatalf("%s has a replica on the distrusted segment after its agent registered", r)
			}
			for _, k := range []string{"both", "one", "other"} {
				ok, _ := e.s.Exist(ctx, DefaultTenant, k)
				if want := k == "both" || !slices.ContainsFunc(onA, func(a *masterv1.Allocation) bool { return a.GetKey() == k }); ok != want {
					t.Fatalf("%s exists %v, want %v", k, ok, want)
				}
			}
			// Registered again: nothing owed or detached, the record goes.
			e.s.syncUnsettled(ctx)
			if got := l.ids(); len(got) != 0 || e.s.OwedReleases() != 0 {
				t.Fatalf("ledger %q, %d owed after the agent registered; want none", got, e.s.OwedReleases())
			}
		})
	}
}

// readableKeysOn lists the keys with a replica on segment id.
func readableKeysOn(e *env, id string) []string {
	idx, ok := e.s.segs.lookup(id)
	if !ok {
		return nil
	}
	var out []string
	for i := range e.s.shards {
		sh := &e.s.shards[i]
		sh.mu.Lock()
		for _, objs := range sh.tenants {
			for k, o := range objs.all() {
				if o.hasReplicaOn(idx) {
					out = append(out, k)
				}
			}
		}
		sh.mu.Unlock()
	}
	return out
}
