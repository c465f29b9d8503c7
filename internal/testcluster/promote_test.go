package testcluster_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// media lists the media of key's replicas, sorted, as the master has them.
func media(t *testing.T, c *testcluster.Cluster, key string) []masterv1.Medium {
	t.Helper()
	r, err := c.Master().Store.QueryRoute(t.Context(), "default", key)
	if err != nil {
		t.Fatalf("QueryRoute %s: %v", key, err)
	}
	var out []masterv1.Medium
	for _, rep := range r.GetReplicas() {
		if rep.GetStatus() == masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE {
			out = append(out, rep.GetMedium())
		}
	}
	slices.Sort(out)
	return out
}

var diskAndMemory = []masterv1.Medium{masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK}

// checkPromotedLog: per key, the change log reads stored(disk) then
// stored(memory), and nothing removed.
func checkPromotedLog(t *testing.T, c *testcluster.Cluster, keys []string) {
	t.Helper()
	seen := keyChanges(t, c)
	want := []string{
		fmt.Sprintf("%v:%v", changelog.Stored, masterv1.Medium_MEDIUM_DISK),
		fmt.Sprintf("%v:%v", changelog.Stored, masterv1.Medium_MEDIUM_MEMORY),
	}
	for _, k := range keys {
		if got := seen[k]; !slices.Equal(got, want) {
			t.Fatalf("%s: changes %v, want %v", k, got, want)
		}
	}
}

// TestPromoteOnReads (issue 17 item 3): a real master and an agent with a
// memory and a disk segment. Objects put on disk and read through the SDK
// as often as the promotion threshold get a memory replica from the
// master's background worker, over the agent's copy path; the disk
// replica stays, both hold the bytes put, and the change log reads
// stored(disk), stored(memory) and nothing removed.
func TestPromoteOnReads(t *testing.T) {
	const n, size = 40, 4 << 10
	c := testcluster.Start(t, testcluster.Options{Agents: 1, AgentMemory: 32 << 20, AgentDisk: 32 << 20})
	ctx := t.Context()
	cl := c.Client(t)
	putInto(ctx, t, cl, "p", n, size, 20, 2, client.WithMedium(masterv1.Medium_MEDIUM_DISK))
	keys := keysOf("p", n)
	for _, k := range keys {
		if got := media(t, c, k); !slices.Equal(got, []masterv1.Medium{masterv1.Medium_MEDIUM_DISK}) {
			t.Fatalf("%s put on %v, want disk only", k, got)
		}
	}
	exp := make([]byte, size)
	for range meta.DefaultPromoteThreshold {
		vals, errs := cl.BatchGet(ctx, keys)
		for i, err := range errs {
			drainValue(exp, i)
			if err != nil || string(vals[i]) != string(exp) {
				t.Fatalf("get %s: %d bytes, %v", keys[i], len(vals[i]), err)
			}
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, k := range keys {
		for !slices.Equal(media(t, c, k), diskAndMemory) {
			if time.Now().After(deadline) {
				t.Fatalf("%s not promoted: replicas on %v", k, media(t, c, k))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	checkReplicas(t, c, "p", n, size, 2)
	checkPromotedLog(t, c, keys)
}

// TestPrefetchWait: Prefetch with Wait copies disk-only objects to memory
// before it returns (every key COPIED, the new replica in memory, the
// bytes intact); a second Prefetch finds them IN_MEMORY; without Wait a
// key is QUEUED and promoted in the background.
func TestPrefetchWait(t *testing.T) {
	const n, size = 30, 8 << 10
	c := testcluster.Start(t, testcluster.Options{Agents: 1, AgentMemory: 32 << 20, AgentDisk: 32 << 20})
	ctx := t.Context()
	cl := c.Client(t)
	putInto(ctx, t, cl, "w", n, size, 10, 1, client.WithMedium(masterv1.Medium_MEDIUM_DISK))
	keys := keysOf("w", n)
	res, err := cl.Prefetch(ctx, keys[:n-1], client.Wait())
	if err != nil {
		t.Fatalf("prefetch: %v", err)
	}
	for _, r := range res {
		if r.Err != nil || r.State != masterv1.PrefetchState_PREFETCH_STATE_COPIED || r.Replica.GetMedium() != masterv1.Medium_MEDIUM_MEMORY {
			t.Fatalf("%s: got %+v, want COPIED to memory", r.Key, r)
		}
	}
	for _, k := range keys[:n-1] {
		if got := media(t, c, k); !slices.Equal(got, diskAndMemory) {
			t.Fatalf("%s after Prefetch with wait: replicas on %v", k, got)
		}
	}
	res, err = cl.Prefetch(ctx, keys)
	if err != nil {
		t.Fatalf("prefetch: %v", err)
	}
	for i, r := range res {
		want := masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY
		if i == n-1 {
			want = masterv1.PrefetchState_PREFETCH_STATE_QUEUED
		}
		if r.Err != nil || r.State != want {
			t.Fatalf("%s: got %+v, want %v", r.Key, r, want)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for !slices.Equal(media(t, c, keys[n-1]), diskAndMemory) {
		if time.Now().After(deadline) {
			t.Fatalf("%s queued but not promoted: %v", keys[n-1], media(t, c, keys[n-1]))
		}
		time.Sleep(10 * time.Millisecond)
	}
	checkReplicas(t, c, "w", n, size, 2)
	checkPromotedLog(t, c, keys)
}
