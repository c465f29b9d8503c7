package testcluster_test

import (
	"fmt"
	"slices"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"

	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestCopyMoveAcrossAgents (issue 17 item 2): a real master and two
// agents; objects on agent 0's memory segment are copied (to agent 1's
// host) and moved (to agent 1's segment) over the agent-to-agent path,
// memory to memory, through the SDK. Every result names the new replica,
// and every replica the master then lists holds the bytes that were put:
// copies on both segments, moves on the target only.
func TestCopyMoveAcrossAgents(t *testing.T) {
	const n, size = 1500, 4 << 10 // more than one request (1024 keys) and master chunk (256)
	c := testcluster.Start(t, testcluster.Options{AgentMemory: 64 << 20})
	ctx := t.Context()
	cl := c.Client(t)
	src, tgt := memSegment(c, 0), memSegment(c, 1)
	tgtSeg, ok := c.Master().Registry.Segment(tgt)
	if !ok {
		t.Fatalf("segment %s unknown to the master", tgt)
	}
	putInto(ctx, t, cl, "c", n, size, 128, 4, client.WithPreferredSegments(src))
	putInto(ctx, t, cl, "m", n, size, 128, 4, client.WithPreferredSegments(src))
	putInto(ctx, t, cl, "big", 2, 9<<20, 1, 1, client.WithPreferredSegments(src))

	res, err := cl.Copy(ctx, keysOf("c", n), client.Target{Host: tgtSeg.HostID})
	if err != nil {
		t.Fatalf("copy: %v", err)
	}
	checkMigrated(t, res, src, tgt)
	res, err = cl.Move(ctx, append(keysOf("m", n), keysOf("big", 2)...), client.Target{Segment: tgt})
	if err != nil {
		t.Fatalf("move: %v", err)
	}
	checkMigrated(t, res, src, tgt)

	counts := c.Master().Store.SegmentReplicaCounts()
	if counts[src] != n || counts[tgt] != 2*n+2 {
		t.Fatalf("replicas: got %v, want %d on %s and %d on %s", counts, n, src, 2*n+2, tgt)
	}
	checkReplicas(t, c, "c", n, size, 2)
	checkReplicas(t, c, "m", n, size, 1)
	checkReplicas(t, c, "big", 2, 9<<20, 1)
	// And through the SDK, which reads the replica the master names.
	for _, prefix := range []string{"c", "m"} {
		vals, errs := cl.BatchGet(ctx, keysOf(prefix, n))
		exp := make([]byte, size)
		for i, err := range errs {
			drainValue(exp, i)
			if err != nil || string(vals[i]) != string(exp) {
				t.Fatalf("get %s: %d bytes, %v; want the bytes put", drainKey(prefix, i), len(vals[i]), err)
			}
		}
	}
}

func keysOf(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = drainKey(prefix, i)
	}
	return keys
}

// checkMigrated: every key succeeded, from src, with its new replica on tgt.
func checkMigrated(t *testing.T, res []client.MigrateResult, src, tgt string) {
	t.Helper()
	for _, r := range res {
		if r.Err != nil {
			t.Fatalf("%s: %v", r.Key, r.Err)
		}
		if r.Source != src || r.Replica.GetSegmentId() != tgt {
			t.Fatalf("%s: from %s to %s, want from %s to %s", r.Key, r.Source, r.Replica.GetSegmentId(), src, tgt)
		}
	}
}

// checkReplicas reads every replica the master lists for objects [0, n) of
// prefix, straight from its agent's segment: want of them, each holding
// the bytes put.
func checkReplicas(t *testing.T, c *testcluster.Cluster, prefix string, n, size, want int) {
	t.Helper()
	exp := make([]byte, size)
	for i := range n {
		drainValue(exp, i)
		reps := c.Replicas("default", drainKey(prefix, i))
		if len(reps) != want {
			t.Fatalf("%s: %d readable replicas, want %d", drainKey(prefix, i), len(reps), want)
		}
		for j, b := range reps {
			if string(b) != string(exp) {
				t.Fatalf("%s replica %d: %d bytes, not the ones put", drainKey(prefix, i), j, len(b))
			}
		}
	}
}

// TestMoveToDisk: objects in agent 0's memory move to a disk segment (the
// medium as target); each reads back, and the change log says, per key,
// stored(memory), then stored(disk), then removed(memory): the target was
// readable before the source went.
func TestMoveToDisk(t *testing.T) {
	const n, size = 200, 4 << 10
	c := testcluster.Start(t, testcluster.Options{AgentMemory: 32 << 20, AgentDisk: 32 << 20})
	ctx := t.Context()
	cl := c.Client(t)
	src := memSegment(c, 0)
	if sg, _ := c.Master().Registry.Segment(src); sg.Medium != masterv1.Medium_MEDIUM_MEMORY {
		t.Fatalf("segment %s is %v, want memory", src, sg.Medium)
	}
	putInto(ctx, t, cl, "t", n, size, 50, 2, client.WithPreferredSegments(src))
	res, err := cl.Move(ctx, keysOf("t", n), client.Target{Medium: masterv1.Medium_MEDIUM_DISK})
	if err != nil {
		t.Fatalf("move: %v", err)
	}
	for _, r := range res {
		if r.Err != nil || r.Source != src || r.Replica.GetMedium() != masterv1.Medium_MEDIUM_DISK {
			t.Fatalf("%s: got %+v, want moved from %s to disk", r.Key, r, src)
		}
	}
	checkReplicas(t, c, "t", n, size, 1)
	seen := keyChanges(t, c)
	want := []string{
		fmt.Sprintf("%v:%v", changelog.Stored, masterv1.Medium_MEDIUM_MEMORY),
		fmt.Sprintf("%v:%v", changelog.Stored, masterv1.Medium_MEDIUM_DISK),
		fmt.Sprintf("%v:%v", changelog.Removed, masterv1.Medium_MEDIUM_MEMORY),
	}
	for i := range n {
		if got := seen[drainKey("t", i)]; !slices.Equal(got, want) {
			t.Fatalf("%s: changes %v, want %v", drainKey("t", i), got, want)
		}
	}
}
