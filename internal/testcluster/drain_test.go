package testcluster_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

// TestDrainCountsAndNoEvict (issue 17 item 5): the target agent is 78 %
// full and the drained one holds about a third of a segment. A drain with
// no_evict through the AdminService moves what fits below the target's
// high watermark, then stops with RESOURCE_EXHAUSTED, the counts in the
// error: nothing evicted or dropped, every object still readable, the
// segment DRAINING. A drain without it then evicts other objects to make
// room, says how many, and finishes: moved + the earlier moved is every
// replica, none dropped, and exactly the evicted objects are gone.
func TestDrainCountsAndNoEvict(t *testing.T) {
	const size, onTarget, onSource = 64 << 10, 200, 80
	c := testcluster.Start(t, testcluster.Options{AgentMemory: 16 << 20})
	ctx := t.Context()
	cl := c.Client(t)
	admin := masterv1.NewAdminServiceClient(c.Conn())
	src, tgt := memSegment(c, 0), memSegment(c, 1)
	putInto(ctx, t, cl, "dst", onTarget, size, 32, 2, client.WithPreferredSegments(tgt))
	putInto(ctx, t, cl, "src", onSource, size, 32, 2, client.WithPreferredSegments(src))

	_, err := admin.DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: src, NoEvict: true})
	if status.Code(err) != codes.ResourceExhausted || rpcerr.Reason(err) != "NO_AVAILABLE_HANDLE" {
		t.Fatalf("drain with no_evict into a full cluster: got %v, want RESOURCE_EXHAUSTED / NO_AVAILABLE_HANDLE", err)
	}
	md := rpcerr.Metadata(err)
	moved, _ := strconv.Atoi(md["moved"])
	left, _ := strconv.Atoi(md["left"])
	if md["total"] != strconv.Itoa(onSource) || moved == 0 || left == 0 || moved+left != onSource || md["evicted"] != "0" || md["dropped"] != "0" {
		t.Fatalf("counts in the error: %v; want %d in all, some moved, some left, none evicted or dropped", md, onSource)
	}
	seg, err := admin.GetSegment(ctx, &masterv1.GetSegmentRequest{SegmentId: src})
	if err != nil {
		t.Fatal(err)
	}
	if d := seg.GetSegment().GetDrain(); seg.GetSegment().GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING ||
		d.GetState() != masterv1.DrainState_DRAIN_STATE_STOPPED || !d.GetNoEvict() || d.GetCounts().GetLeft() != uint64(left) || !strings.Contains(d.GetError(), "NO_AVAILABLE_HANDLE") {
		t.Fatalf("segment after the stopped drain: %v; want DRAINING, its drain STOPPED with %d left", seg.GetSegment(), left)
	}
	if got := len(c.Keys("default")); got != onTarget+onSource {
		t.Fatalf("objects after a drain with no_evict: got %d, want all %d", got, onTarget+onSource)
	}
	if got := c.Master().Store.SegmentReplicaCounts()[src]; got != uint64(left) {
		t.Fatalf("replicas on %s: got %d, want %d", src, got, left)
	}

	r, err := admin.DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: src})
	if err != nil {
		t.Fatalf("drain: %v", err)
	}
	n := r.GetCounts()
	if n.GetTotal() != uint64(left) || n.GetMoved() != uint64(left) || n.GetEvicted() == 0 || n.GetDropped() != 0 || n.GetLeft() != 0 {
		t.Fatalf("counts: %v; want the %d left moved, some evicted, none dropped", n, left)
	}
	if r.GetSegment().GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED || r.GetSegment().GetDrain().GetState() != masterv1.DrainState_DRAIN_STATE_DONE {
		t.Fatalf("segment: %v, want DRAINED and its drain DONE", r.GetSegment())
	}
	if got, want := len(c.Keys("default")), onTarget+onSource-int(n.GetEvicted()); got != want {
		t.Fatalf("objects after the drain: got %d, want %d (all but the %d evicted)", got, want, n.GetEvicted())
	}
	if got := c.Master().Store.SegmentReplicaCounts()[src]; got != 0 {
		t.Fatalf("replicas left on %s: %d", src, got)
	}
}
