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
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

// faultCluster starts a cluster for one of TestTieringFaults' cases, quick
// to unmount a killed agent's segments, with a subscriber attached, and
// returns it with a context for the case and a client of tenant "tier".
func faultCluster(t *testing.T, agents int, disk bool) (*Cluster, *kvevent.Subscriber, context.Context, *client.Client) {
	c := StartCluster(t, Options{Agents: agents, AgentMemory: "64MiB", Disk: disk, Gateway: true,
		SuspectAfter: 400 * time.Millisecond, UnmountAfter: 1500 * time.Millisecond})
	return c, subscribe(t, c), ctxT(t, 2*time.Minute), c.Client("tier")
}

// TestTieringFaults kills an agent in the middle of a copy to it, of a
// drain that moves replicas to it, and of a move off it.
func TestTieringFaults(t *testing.T) {
	const n, size = 400, 64 << 10
	// The drain must outlast the kill: more, smaller objects.
	const drainN, drainSize = 4000, 4 << 10

	t.Run("target killed mid-copy", func(t *testing.T) {
		c, sub, ctx, cl := faultCluster(t, 3, false)
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
		c, sub, ctx, cl := faultCluster(t, 3, false)
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
		c, sub, ctx, cl := faultCluster(t, 2, true)
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

// mediaOf is each key's readable media in the master's listing.
func mediaOf(ctx context.Context, cl *client.Client, prefix string) (map[string][]masterv1.Medium, error) {
	out := map[string][]masterv1.Medium{}
	for info, err := range cl.List(ctx, prefix) {
		if err != nil {
			return nil, err
		}
		out[info.GetKey()] = info.GetMedia()
	}
	return out, nil
}

// waitBelowHigh waits (5 s at most) until no memory segment's reported use
// is at its high watermark, so the next puts find room that the
// background offload made rather than evicting in the put's path.
func (c *Cluster) waitBelowHigh(high float64) {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		over := false
		for _, s := range c.Segments() {
			in := s.GetInfo()
			if in.GetMedium() == masterv1.Medium_MEDIUM_MEMORY && float64(in.GetUsed()) >= high*float64(in.GetCapacity()) {
				over = true
			}
		}
		if !over {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestTieringEventsMatchMaster (issue 17, item 6) runs a workload through
// every tiering path with a strict subscriber attached: memory filled past
// the high watermark with disk present (offload), a hot subset of what went
// to disk read until it is promoted and more prefetched, copies and moves
// by medium and host, and drains of a memory and a disk segment without
// evicting. After each phase the subscriber's index must equal the
// master's readable (tenant, key, medium) set, and every object
// acknowledged and not removed by the test must read back byte for byte.
func TestTieringEventsMatchMaster(t *testing.T) {
	const high = 0.7
	c := StartCluster(t, Options{Agents: 3, AgentMemory: "16MiB", Disk: true, Gateway: true,
		MasterFlags: []string{"--high-watermark", fmt.Sprint(high), "--low-watermark", "0.5",
			"--promote-threshold", "3"}})
	sub := subscribe(t, c)
	ctx := ctxT(t, 4*time.Minute)
	cl := c.Client("tier")
	acked := map[string][]byte{}
	check := func(phase string) map[string][]masterv1.Medium {
		t.Helper()
		converge(t, c, sub)
		if err := readBack(ctx, cl, acked); err != nil {
			t.Fatalf("after %s: %v", phase, err)
		}
		media, err := mediaOf(ctx, cl, "o/")
		if err != nil {
			t.Fatal(err)
		}
		if len(media) != len(acked) {
			t.Fatalf("after %s: the master lists %d objects, %d acknowledged and not removed", phase, len(media), len(acked))
		}
		st := sub.Stats()
		if st.Unrepaired != 0 || st.Resets != 0 || st.Malformed != 0 {
			t.Fatalf("after %s: subscriber stats %+v", phase, st)
		}
		return media
	}
	onlyOn := func(media map[string][]masterv1.Medium, m masterv1.Medium) []string {
		var keys []string
		for k, ms := range media {
			if len(ms) == 1 && ms[0] == m {
				keys = append(keys, k)
			}
		}
		slices.Sort(keys)
		return keys
	}

	// 1. Offload: 60 MiB of puts into 48 MiB of memory, paced so the
	// background pass (not the puts) makes the room.
	const size = 256 << 10
	payload := randBytes(t, 240*size)
	for lo := 0; lo < 240; lo += 12 {
		items := make([]client.Item, 12)
		for i := range items {
			items[i] = client.Item{Key: fmt.Sprintf("o/%04d", lo+i), Data: payload[(lo+i)*size : (lo+i+1)*size]}
		}
		for i, err := range cl.BatchPut(ctx, items) {
			if err != nil {
				t.Fatalf("put %s: %v", items[i].Key, err)
			}
			acked[items[i].Key] = items[i].Data
		}
		c.waitBelowHigh(high)
	}
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		if n := c.metric(t, c.Master, "crescent_master_offloaded_objects_total"); n == 0 {
			return errors.New("nothing offloaded yet")
		}
		return nil
	})
	media := check("offload")
	if dropped := c.metric(t, c.Master, "crescent_master_evicted_objects_total"); dropped != 0 {
		t.Fatalf("%v objects dropped: with disk room every victim must be offloaded", dropped)
	}
	disk := onlyOn(media, masterv1.Medium_MEDIUM_DISK)
	t.Logf("offloaded: %v objects; %d only on disk", c.metric(t, c.Master, "crescent_master_offloaded_objects_total"), len(disk))
	if len(disk) < 20 {
		t.Fatalf("%d objects only on disk after the fill, want at least 20", len(disk))
	}

	// 2. Make room in memory (the test's own removals), then promote: a hot
	// subset read past the threshold, and more prefetched with Wait.
	mem := onlyOn(media, masterv1.Medium_MEDIUM_MEMORY)
	for _, k := range mem[:len(mem)/2] {
		if err := cl.Remove(ctx, k, true); err != nil { // force: readBack leased it
			t.Fatalf("remove %s: %v", k, err)
		}
		delete(acked, k)
	}
	hot, pre := disk[:5], disk[5:10]
	for range 4 {
		if _, errs := cl.BatchGet(ctx, hot); errors.Join(errs...) != nil {
			t.Fatal(errors.Join(errs...))
		}
	}
	res, err := cl.Prefetch(ctx, pre, client.Wait())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res {
		if r.Err != nil || r.State != masterv1.PrefetchState_PREFETCH_STATE_COPIED {
			t.Fatalf("prefetch %s: %v %v", r.Key, r.State, r.Err)
		}
	}
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		media, err := mediaOf(ctx, cl, "o/")
		if err != nil {
			return err
		}
		for _, k := range append(slices.Clone(hot), pre...) {
			if !slices.Contains(media[k], masterv1.Medium_MEDIUM_MEMORY) || !slices.Contains(media[k], masterv1.Medium_MEDIUM_DISK) {
				return fmt.Errorf("%s is on %v, want memory and disk", k, media[k])
			}
		}
		return nil
	})
	media = check("promotion")

	// 3. Copy to disk what is only in memory; move to host-c what is only
	// on disk (it stays on disk there).
	mem = onlyOn(media, masterv1.Medium_MEDIUM_MEMORY)
	disk = onlyOn(media, masterv1.Medium_MEDIUM_DISK)
	for _, op := range []struct {
		name string
		keys []string
		to   client.Target
		move bool
	}{
		{"copy", mem[:min(10, len(mem))], client.Target{Medium: masterv1.Medium_MEDIUM_DISK}, false},
		{"move", disk[:min(10, len(disk))], client.Target{Host: hostID(2)}, true},
	} {
		f := cl.Copy
		if op.move {
			f = cl.Move
		}
		res, err := f(ctx, op.keys, op.to)
		if err != nil {
			t.Fatalf("%s: %v", op.name, err)
		}
		for _, r := range res {
			if r.Err != nil && !errors.Is(r.Err, client.ErrExists) {
				t.Fatalf("%s %s: %v", op.name, r.Key, r.Err)
			}
		}
	}
	check("copy and move")

	// 4. Drain host-a's memory and then disk segment without evicting
	// anything. When the other segments of the medium lack room below
	// their high watermark, the drain stops with RESOURCE_EXHAUSTED, the
	// segment stays DRAINING and nothing is lost; the test then removes
	// objects to make room and drains again, until it finishes.
	admin := c.AdminClient("tier").Admin()
	for _, m := range []masterv1.Medium{masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK} {
		seg := c.segmentOf(hostID(0), m)
		for attempt := 0; ; attempt++ {
			r, err := admin.DrainSegment(ctx, &masterv1.DrainSegmentRequest{SegmentId: seg, NoEvict: true})
			if err == nil {
				cn := r.GetCounts()
				t.Logf("drain of host-a's %v segment: %+v", m, cn)
				if cn.GetLeft() != 0 || cn.GetEvicted() != 0 || cn.GetDropped() != 0 {
					t.Fatalf("drain of the %v segment: %+v; want everything moved, nothing evicted or dropped", m, cn)
				}
				if got := r.GetSegment().GetLifecycle(); got != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED {
					t.Fatalf("drained %v segment is %v", m, got)
				}
				break
			}
			if status.Code(err) != codes.ResourceExhausted || attempt == 3 {
				t.Fatalf("drain %v segment (attempt %d): %v", m, attempt, err)
			}
			t.Logf("drain of host-a's %v segment stopped: %v", m, err)
			for _, sg := range c.Segments() {
				if sg.GetInfo().GetSegmentId() == seg && sg.GetLifecycle() != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINING {
					t.Fatalf("a drain stopped for room left its segment %v, want DRAINING", sg.GetLifecycle())
				}
			}
			media = check(fmt.Sprintf("a stopped drain of the %v segment", m))
			only := onlyOn(media, m)
			for _, k := range only[:len(only)/2] {
				if err := cl.Remove(ctx, k, true); err != nil {
					t.Fatalf("remove %s: %v", k, err)
				}
				delete(acked, k)
			}
		}
		check(fmt.Sprintf("drain of the %v segment", m))
	}
}
