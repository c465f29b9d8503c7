package meta

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// TestReleaseRefusedIsOwed: an agent that answers a Release but cannot
// release some allocations (a disk segment whose journal cannot be
// written) keeps them sealed. The master owes them: a reconcile of the
// agent's table returns them instead of adopting the removed object back,
// and they are sent again (retryOwed, every put sweep) until the agent
// takes them. Before, the item's failure was ignored: the allocation
// stayed at the agent, its space leaked, and the agent's next
// registration brought the removed object back.
func TestReleaseRefusedIsOwed(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{})
	ctx := context.Background()
	e.put(t, PutSpec{Key: "gone", Size: 100})
	e.put(t, PutSpec{Key: "kept", Size: 100})
	refuse := true
	e.c.Agents.FailRelease = func(*masterv1.AllocationRef) error {
		if refuse {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "disk segment journal: no space left on device")
		}
		return nil
	}
	if err := e.s.Remove(ctx, RemoveSpec{Key: "gone"}); err != nil {
		t.Fatal(err)
	}
	if n := len(e.c.Agents.Live()); n != 2 {
		t.Fatalf("the agent holds %d allocations, want 2 (the release was refused)", n)
	}
	// The agent registers again (it restarted) with the allocation
	// still in its table: returned, not adopted.
	back := e.s.Reconcile(ctx, "agent-0", segsOf(e.c, "agent-0"), e.c.Agents.Table("agent-0"))
	if len(back) != 1 {
		t.Fatalf("reconcile returned %d allocations, want the removed object's", len(back))
	}
	if ok, err := e.s.Exist(ctx, DefaultTenant, "gone"); err != nil || ok {
		t.Fatalf("Exist of the removed object after the reconcile = %v, %v; want false (not adopted back)", ok, err)
	}

	// Without a registration: sent again until the agent takes it.
	if err := e.s.Remove(ctx, RemoveSpec{Key: "kept"}); err != nil {
		t.Fatal(err)
	}
	e.s.retryOwed(ctx)
	live := len(e.c.Agents.Live())
	refuse = false
	e.s.retryOwed(ctx)
	if got := len(e.c.Agents.Live()); live < 1 || got != live-1 {
		t.Fatalf("the agent held %d allocations while refusing and %d after the retry; want one fewer", live, got)
	}
	e.s.retryOwed(ctx) // nothing owed: nothing sent twice
	if p := e.c.Agents.Problems(); len(p) != 0 {
		t.Fatalf("agent problems: %v", p)
	}
}
