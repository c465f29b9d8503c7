package testcluster_test

import (
	"fmt"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestDrainMovesEveryObject (issue 17): a real master drains one agent's
// memory segment of a few thousand objects into the other agent over the
// batched agent-to-agent copy (the bulk transfer path), with mTLS on every
// link in the second run; every object is then read back with the bytes
// that were put, none is left on the drained segment, and the segment is
// DRAINED.
func TestDrainMovesEveryObject(t *testing.T) {
	for _, tls := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tls), func(t *testing.T) {
			n, size := 3000, 4<<10
			if tls {
				n = 1000
			}
			c := testcluster.Start(t, testcluster.Options{AgentMemory: 64 << 20, TLS: tls})
			ctx := t.Context()
			cl := c.Client(t)
			src := memSegment(c, 0)
			putInto(ctx, t, cl, "d", n, size, 128, 4, client.WithPreferredSegments(src))
			// A few larger objects, sent in ranges across transfer requests.
			putInto(ctx, t, cl, "big", 3, 9<<20, 1, 1, client.WithPreferredSegments(src))
			if got := c.Master().Store.SegmentReplicaCounts()[src]; got != uint64(n+3) {
				t.Fatalf("replicas on %s before the drain: got %d, want %d", src, got, n+3)
			}
			if err := c.Master().Store.DrainSegment(ctx, src); err != nil {
				t.Fatalf("drain: %v", err)
			}
			checkDrained(ctx, t, c, cl, "d", src, n, size)
			checkDrained(ctx, t, c, cl, "big", src, 3, 9<<20)
			if got := c.Master().Store.SegmentReplicaCounts()[memSegment(c, 1)]; got != uint64(n+3) {
				t.Fatalf("replicas on the target: got %d, want %d", got, n+3)
			}
			sg, _ := c.Master().Registry.Segment(src)
			if sg.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
				t.Fatalf("lifecycle: got %v, want DRAINED", sg.Lifecycle)
			}
		})
	}
}

// TestDrainTargetStopsMidCopy (issue 17): objects have two replicas, on
// agents 0 and 2; draining agent 0 can only move its replicas to agent 1,
// which stops while the drain copies into it. The copies in flight fail
// item by item, and every failed move is settled as before: its target is
// released, never published. Afterwards no acknowledged object is lost
// (each reads back with its bytes) and every replica the master lists
// holds exactly those bytes: nothing half-copied is visible.
func TestDrainTargetStopsMidCopy(t *testing.T) {
	const n, size = 3000, 4 << 10
	c := testcluster.Start(t, testcluster.Options{Agents: 3, AgentMemory: 64 << 20, Agent: func(i int, cfg *agentapp.Config) {
		if i == 1 {
			cfg.ShutdownGrace = 0 // stop at once, mid-copy
		}
	}})
	ctx := t.Context()
	cl := c.Client(t)
	src, tgt, keep := memSegment(c, 0), memSegment(c, 1), memSegment(c, 2)
	putInto(ctx, t, cl, "d", n, size, 128, 4, client.WithReplicas(2), client.WithPreferredSegments(src, keep))
	counts := c.Master().Store.SegmentReplicaCounts()
	if counts[src] != n || counts[keep] != n || counts[tgt] != 0 {
		t.Fatalf("replicas before the drain: got %v, want %d on %s and %s", counts, n, src, keep)
	}

	drained := make(chan error, 1)
	go func() { drained <- c.Master().Store.DrainSegment(ctx, src) }()
	target, _ := c.Agent(1).Segments().Get(tgt)
	testutil.Eventually(t, time.Minute, func() bool {
		_, reserved, sealed := target.Stats()
		return reserved+sealed >= n/4
	}, "the drain to copy into agent 1")
	select {
	case err := <-drained:
		t.Fatalf("the drain ended (%v) before agent 1 stopped: too fast to test a copy the stop interrupts", err)
	default:
	}
	c.StopAgent(1)
	var err error
	select {
	case err = <-drained:
	case <-time.After(time.Minute):
		t.Fatal("the drain did not end after its target stopped")
	}
	if err != nil {
		t.Fatalf("drain: %v", err)
	}
	// Agent 1's replicas go with its graceful unmount.
	testutil.Eventually(t, 30*time.Second, func() bool { return c.Master().Store.SegmentReplicaCounts()[tgt] == 0 },
		"the stopped agent's replicas to be unmounted")
	counts = c.Master().Store.SegmentReplicaCounts()
	if counts[src] != 0 || counts[keep] != n {
		t.Fatalf("replicas after the drain: got %v, want none on %s and %d on %s", counts, src, n, keep)
	}
	checkDrained(ctx, t, c, cl, "d", src, n, size)
	want := make([]byte, size)
	for i := range n {
		drainValue(want, i)
		for j, b := range c.Replicas("default", drainKey("d", i)) {
			if string(b) != string(want) {
				t.Fatalf("object %d replica %d: %d bytes, not the ones put", i, j, len(b))
			}
		}
	}
}
