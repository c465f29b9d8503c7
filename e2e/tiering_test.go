package e2e

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// Tiering and migration under faults (issue 17, item 6): an agent killed
// while objects are copied to it, drained to it, or moved off it. None may
// lose an acknowledged object or leave a replica readable that the master
// does not list (a strict subscriber's index must equal the master's
// readable set afterwards).

// segmentOf is the id of host's segment of medium m ("" when none).
func (c *Cluster) segmentOf(host string, m masterv1.Medium) string {
	for _, s := range c.Segments() {
		if s.GetHostId() == host && s.GetInfo().GetMedium() == m &&
			s.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
			return s.GetInfo().GetSegmentId()
		}
	}
	return ""
}

// waitUnmounted waits until every segment of host is UNMOUNTED.
func (c *Cluster) waitUnmounted(t *testing.T, host string) {
	t.Helper()
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		for _, s := range c.Segments() {
			if s.GetHostId() == host && s.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED {
				return fmt.Errorf("%s segment %s still %v", host, s.GetInfo().GetSegmentId(), s.GetLifecycle())
			}
		}
		return nil
	})
}

// putAll stores n objects of size bytes under prefix with opts and returns
// them by key.
func putAll(t *testing.T, ctx context.Context, cl *client.Client, prefix string, n, size int, opts ...client.PutOption) map[string][]byte {
	t.Helper()
	payload := randBytes(t, n*size)
	out := make(map[string][]byte, n)
	items := make([]client.Item, n)
	for i := range items {
		k := fmt.Sprintf("%s/%04d", prefix, i)
		items[i] = client.Item{Key: k, Data: payload[i*size : (i+1)*size]}
		out[k] = items[i].Data
	}
	for i, err := range cl.BatchPut(ctx, items, opts...) {
		if err != nil {
			t.Fatalf("put %s: %v", items[i].Key, err)
		}
	}
	return out
}

// readBack reads every object of want and compares its bytes.
func readBack(ctx context.Context, cl *client.Client, want map[string][]byte) error {
	keys := make([]string, 0, len(want))
	for k := range want {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var errs []error
	for lo := 0; lo < len(keys); lo += 256 {
		chunk := keys[lo:min(lo+256, len(keys))]
		got, gerrs := cl.BatchGet(ctx, chunk)
		for i, k := range chunk {
			switch {
			case gerrs[i] != nil:
				errs = append(errs, fmt.Errorf("%s: %w", k, gerrs[i]))
			case string(got[i]) != string(want[k]):
				errs = append(errs, fmt.Errorf("%s: %d bytes differ from the %d put", k, len(got[i]), len(want[k])))
			}
		}
	}
	if len(errs) > 8 {
		errs = append(errs[:8], fmt.Errorf("and %d more", len(errs)-8))
	}
	return errors.Join(errs...)
}

// killWhen kills p once cond holds (polled), and returns when it did.
func killWhen(t *testing.T, p *Proc, cond func() bool) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		deadline := time.Now().Add(30 * time.Second)
		for !cond() && time.Now().Before(deadline) {
			time.Sleep(2 * time.Millisecond)
		}
		p.Kill()
	}()
	return done
}

// replicasOn counts the COMPLETE replicas the master lists on segment seg
// among keys.
func replicasOn(ctx context.Context, cl *client.Client, keys []string, seg string) int {
	n := 0
	for _, k := range keys {
		r, err := cl.Objects().QueryRoute(ctx, &masterv1.QueryRouteRequest{Tenant: "tier", Key: k})
		if err != nil {
			continue
		}
		for _, rep := range r.GetReplicas() {
			if rep.GetSegmentId() == seg && rep.GetStatus() == masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE {
				n++
			}
		}
	}
	return n
}

func sortedKeysOf(m map[string][]byte) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// TestTieringFaults kills an agent in the middle of a copy to it, of a
// drain that moves replicas to it, and of a move off it.
func TestTieringFaults(t *testing.T) {
	const n, size = 400, 64 << 10
	// The drain must outlast the kill: more, smaller objects.
	const drainN, drainSize = 4000, 4 << 10

	t.Run("target killed mid-copy", func(t *testing.T) {
		c := StartCluster(t, Options{Agents: 3, AgentMemory: "64MiB", Gateway: true,
			SuspectAfter: 400 * time.Millisecond, UnmountAfter: 1500 * time.Millisecond})
		sub := subscribe(t, c)
		ctx := ctxT(t, 2*time.Minute)
		cl := c.Client("tier")
		srcSeg, dstSeg := c.segmentOf(hostID(0), masterv1.Medium_MEDIUM_MEMORY), c.segmentOf(hostID(1), masterv1.Medium_MEDIUM_MEMORY)
		acked := putAll(t, ctx, cl, "copy", n, size, client.WithPreferredSegments(srcSeg))
		keys := sortedKeysOf(acked)

		// Copy one key per call, so the kill lands between copies and in
		// the middle of one.
		var copied, failed int
		var mu sync.Mutex
		killed := killWhen(t, c.Agents[1], func() bool { mu.Lock(); defer mu.Unlock(); return copied >= n/4 })
		for _, k := range keys {
			res, err := cl.Copy(ctx, []string{k}, client.Target{Segment: dstSeg})
			mu.Lock()
			if err == nil && res[0].Err == nil {
				copied++
			} else {
				failed++
			}
			mu.Unlock()
		}
		<-killed
		t.Logf("copies: %d done, %d failed after the target was killed", copied, failed)
		if copied == 0 || failed == 0 {
			t.Fatalf("copied %d, failed %d: the kill must land mid-copy", copied, failed)
		}
		c.waitUnmounted(t, hostID(1))
		if err := readBack(ctx, cl, acked); err != nil {
			t.Fatalf("after the target died: %v", err)
		}
		converge(t, c, sub)
	})

	t.Run("target killed mid-drain", func(t *testing.T) {
		c := StartCluster(t, Options{Agents: 3, AgentMemory: "64MiB", Gateway: true,
			SuspectAfter: 400 * time.Millisecond, UnmountAfter: 1500 * time.Millisecond})
		sub := subscribe(t, c)
		ctx := ctxT(t, 2*time.Minute)
		cl := c.Client("tier")
		drained := c.segmentOf(hostID(0), masterv1.Medium_MEDIUM_MEMORY)
		// Two replicas each, one on the drained segment: killing any one
		// other agent leaves every object a replica.
		acked := putAll(t, ctx, cl, "drain", drainN, drainSize, client.WithReplicas(2), client.WithPreferredSegments(drained))
		keys := sortedKeysOf(acked)
		target := c.segmentOf(hostID(1), masterv1.Medium_MEDIUM_MEMORY)
		var draining sync.Mutex // held while the drain runs
		draining.Lock()
		early := false
		killed := killWhen(t, c.Agents[1], func() bool {
			if replicasOn(ctx, cl, keys[:20], target) < 5 {
				return false
			}
			if draining.TryLock() {
				early = true // the drain ended first
			}
			return true
		})
		_, err := c.AdminClient("tier").Admin().DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: drained})
		draining.Unlock()
		<-killed
		t.Logf("drain: %v", err)
		if early {
			t.Fatal("the drain ended before its target was killed: the kill must land mid-drain")
		}
		c.waitUnmounted(t, hostID(1))
		if err := readBack(ctx, cl, acked); err != nil {
			t.Fatalf("after the drain's target died: %v", err)
		}
		converge(t, c, sub)
	})

	t.Run("source killed mid-move", func(t *testing.T) {
		c := StartCluster(t, Options{Agents: 2, AgentMemory: "64MiB", Disk: true, Gateway: true,
			SuspectAfter: 400 * time.Millisecond, UnmountAfter: 1500 * time.Millisecond})
		sub := subscribe(t, c)
		ctx := ctxT(t, 2*time.Minute)
		cl := c.Client("tier")
		// On host-a's disk segment, which survives its agent's restart.
		src := c.segmentOf(hostID(0), masterv1.Medium_MEDIUM_DISK)
		acked := putAll(t, ctx, cl, "move", n, size, client.WithMedium(masterv1.Medium_MEDIUM_DISK), client.WithPreferredSegments(src))
		keys := sortedKeysOf(acked)
		dst := c.segmentOf(hostID(1), masterv1.Medium_MEDIUM_MEMORY)
		var moved, failed int
		var mu sync.Mutex
		killed := killWhen(t, c.Agents[0], func() bool { mu.Lock(); defer mu.Unlock(); return moved >= n/4 })
		for lo := 0; lo < len(keys); lo += 8 {
			res, err := cl.Move(ctx, keys[lo:min(lo+8, len(keys))], client.Target{Segment: dst})
			mu.Lock()
			for _, r := range res {
				if err == nil && r.Err == nil {
					moved++
				} else {
					failed++
				}
			}
			if err != nil && len(res) == 0 {
				failed += min(8, len(keys)-lo)
			}
			mu.Unlock()
		}
		<-killed
		t.Logf("moves: %d done, %d failed after the source was killed", moved, failed)
		if moved == 0 || failed == 0 {
			t.Fatalf("moved %d, failed %d: the kill must land mid-move", moved, failed)
		}
		// The source's disk segment comes back with its agent: whatever was
		// not moved is adopted again.
		c.Agents[0].Restart()
		testutil.EventuallyNoError(t, 30*time.Second, func() error { return readBack(ctx, cl, acked) })
		converge(t, c, sub)
	})
}
