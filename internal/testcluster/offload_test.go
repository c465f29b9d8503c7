package testcluster_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// diskSegment is agent i's disk segment id.
func diskSegment(t testing.TB, c *testcluster.Cluster, i int) string {
	t.Helper()
	for _, sg := range c.Agent(i).Segments().All() {
		if sg.Medium() == masterv1.Medium_MEDIUM_DISK {
			return sg.ID()
		}
	}
	t.Fatalf("agent %d has no disk segment", i)
	return ""
}

// keyChanges returns each key's change records as "type:medium", in log
// order.
func keyChanges(t testing.TB, c *testcluster.Cluster) map[string][]string {
	t.Helper()
	recs, _, _, err := c.Master().Store.Log().Read(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string][]string{}
	for _, r := range recs {
		seen[r.Key] = append(seen[r.Key], fmt.Sprintf("%v:%v", r.Type, r.Medium))
	}
	return seen
}

// TestOffloadOnEviction (issue 17 item 3): a real master and one agent
// with a memory and a disk segment. Puts fill the memory segment to the
// high watermark (never to full, so no put evicts), and the master's
// background check brings it down to the low watermark. With
// --evict-policy=offload (the default) the least recently used objects
// are moved to the disk segment by the agent: every object still reads
// back with the bytes put, straight from its segment and through the SDK,
// and per offloaded key the change log reads stored(memory),
// stored(disk), removed(memory). With --evict-policy=drop they are
// dropped: stored(memory), removed(memory), and nothing on disk.
func TestOffloadOnEviction(t *testing.T) {
	for _, policy := range []string{"offload", "drop"} {
		t.Run(policy, func(t *testing.T) {
			const mem, size = 8 << 20, 64 << 10
			n := (mem/size*9 + 9) / 10 // 116 objects: the first count at the high watermark (90 %)
			low := mem / size * 8 / 10 // 102
			c := testcluster.Start(t, testcluster.Options{Agents: 1, AgentMemory: mem, AgentDisk: 32 << 20,
				Master: func(cfg *masterapp.Config) { cfg.EvictPolicy = policy }})
			ctx := t.Context()
			cl := c.Client(t)
			src, disk := memSegment(c, 0), diskSegment(t, c, 0)
			putInto(ctx, t, cl, "o", n, size, 1, 1, client.WithPreferredSegments(src)) // in key order
			st := c.Master().Store
			testutil.Eventually(t, 20*time.Second, func() bool {
				counts := st.SegmentReplicaCounts()
				return counts[src] <= uint64(low) && (policy == "drop" || counts[src]+counts[disk] == uint64(n))
			}, "memory down to the low watermark (%d objects)", low)
			counts := st.SegmentReplicaCounts()
			changes := keyChanges(t, c)
			storedMem := fmt.Sprintf("%v:%v", changelog.Stored, masterv1.Medium_MEDIUM_MEMORY)
			storedDisk := fmt.Sprintf("%v:%v", changelog.Stored, masterv1.Medium_MEDIUM_DISK)
			removedMem := fmt.Sprintf("%v:%v", changelog.Removed, masterv1.Medium_MEDIUM_MEMORY)
			onDisk, inMem, gone := 0, 0, 0
			exp := make([]byte, size)
			for i := range n {
				key := drainKey("o", i)
				route, err := st.QueryRoute(ctx, "default", key)
				if rpcerr.Reason(err) == "OBJECT_NOT_FOUND" {
					if policy != "drop" {
						t.Fatalf("%s: dropped, want offloaded or in memory", key)
					}
					if got, want := changes[key], []string{storedMem, removedMem}; !slices.Equal(got, want) {
						t.Fatalf("%s: changes %v, want %v", key, got, want)
					}
					gone++
					continue
				}
				if err != nil {
					t.Fatalf("%s: %v", key, err)
				}
				reps := route.GetReplicas()
				if len(reps) != 1 {
					t.Fatalf("%s: %d replicas, want 1", key, len(reps))
				}
				want := []string{storedMem}
				if reps[0].GetMedium() == masterv1.Medium_MEDIUM_DISK {
					if reps[0].GetSegmentId() != disk {
						t.Fatalf("%s: on %s, want %s", key, reps[0].GetSegmentId(), disk)
					}
					want = []string{storedMem, storedDisk, removedMem}
					onDisk++
				} else {
					inMem++
				}
				if got := changes[key]; !slices.Equal(got, want) {
					t.Fatalf("%s: changes %v, want %v", key, got, want)
				}
				drainValue(exp, i)
				if b := c.Replicas("default", key); len(b) != 1 || string(b[0]) != string(exp) {
					t.Fatalf("%s: the replica's bytes are not the ones put", key)
				}
			}
			t.Logf("%s: %d in memory, %d on disk, %d dropped", policy, inMem, onDisk, gone)
			if uint64(inMem) != counts[src] || uint64(onDisk) != counts[disk] {
				t.Fatalf("in memory %d, on disk %d; the master counts %v", inMem, onDisk, counts)
			}
			if moved := onDisk + gone; moved < n-low || inMem > low {
				t.Fatalf("%d objects left memory, want at least %d", moved, n-low)
			}
			// The least recently used went, the most recent stayed.
			if first, _ := st.QueryRoute(ctx, "default", drainKey("o", 0)); first.GetReplicas() != nil &&
				first.GetReplicas()[0].GetMedium() == masterv1.Medium_MEDIUM_MEMORY {
				t.Fatalf("%s is still in memory, want it gone first", drainKey("o", 0))
			}
			if last, err := st.QueryRoute(ctx, "default", drainKey("o", n-1)); err != nil ||
				last.GetReplicas()[0].GetMedium() != masterv1.Medium_MEDIUM_MEMORY {
				t.Fatalf("%s: %v, %v; want it still in memory", drainKey("o", n-1), last, err)
			}
			if policy == "drop" {
				if onDisk != 0 || gone == 0 {
					t.Fatalf("drop: %d on disk, %d dropped; want none on disk", onDisk, gone)
				}
				return
			}
			if onDisk == 0 || gone != 0 {
				t.Fatalf("offload: %d on disk, %d dropped; want all offloaded", onDisk, gone)
			}
			// And through the SDK, which reads the disk replica the master
			// names.
			vals, errs := cl.BatchGet(ctx, keysOf("o", n))
			for i, err := range errs {
				drainValue(exp, i)
				if err != nil || string(vals[i]) != string(exp) {
					t.Fatalf("get %s: %d bytes, %v; want the bytes put", drainKey("o", i), len(vals[i]), err)
				}
			}
		})
	}
}
