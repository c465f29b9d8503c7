package ctl

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// The tests run crescentctl against a real cluster started in-process by
// internal/testcluster: the master, agents and gateway the binaries run,
// on loopback ports. One cluster per top-level test; its subtests share it.

func run(t *testing.T, addr string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(t.Context(), append([]string{"--master", addr}, args...), strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

// tenantClient is an SDK client of the cluster addressing tenant.
func tenantClient(t *testing.T, c *testcluster.Cluster, tenant string) *client.Client {
	t.Helper()
	return c.Client(t, func(cfg *client.Config) { cfg.Tenant = tenant })
}

// seed stores items in the default tenant through the SDK.
func seed(t *testing.T, c *testcluster.Cluster, items ...client.Item) {
	t.Helper()
	for i, err := range c.Client(t).BatchPut(t.Context(), items) {
		if err != nil {
			t.Fatalf("seed %s: %v", items[i].Key, err)
		}
	}
}

// segments lists the master's segments through the real AdminService.
func segments(t *testing.T, c *testcluster.Cluster) []*masterv1.Segment {
	t.Helper()
	resp, err := masterv1.NewAdminServiceClient(c.Conn()).ListSegments(t.Context(), &masterv1.ListSegmentsRequest{})
	if err != nil {
		t.Fatalf("ListSegments: %v", err)
	}
	return resp.GetSegments()
}

// segmentOf returns the id of agent's only segment.
func segmentOf(t *testing.T, c *testcluster.Cluster, agent string) string {
	t.Helper()
	var ids []string
	for _, s := range segments(t, c) {
		if s.GetAgentId() == agent {
			ids = append(ids, s.GetInfo().GetSegmentId())
		}
	}
	if len(ids) != 1 {
		t.Fatalf("%s has segments %v, want one", agent, ids)
	}
	return ids[0]
}

// waitLifecycle waits until the master reports segment id in lifecycle lc.
func waitLifecycle(t *testing.T, c *testcluster.Cluster, id string, lc masterv1.SegmentLifecycle) {
	t.Helper()
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		for _, s := range segments(t, c) {
			if s.GetInfo().GetSegmentId() == id {
				if s.GetLifecycle() != lc {
					return fmt.Errorf("segment %s is %v, want %v", id, s.GetLifecycle(), lc)
				}
				return nil
			}
		}
		return fmt.Errorf("segment %s is not listed", id)
	})
}

// TestDrainUndo drains a segment that holds a replica (the master moves it
// to the other agent's segment and the object stays readable), undrains it,
// and checks the refusals: a segment whose agent left (UNMOUNTED) and an
// unknown one.
func TestDrainUndo(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	addr := c.MasterAddr()
	seg0, seg1 := segmentOf(t, c, "agent-0"), segmentOf(t, c, "agent-1")

	// The drain needs a replica to move: put single-replica objects until
	// one lands on seg0 (the master places them; it spreads new objects).
	cl := c.Client(t)
	var onSeg0 string
	for i := 0; onSeg0 == "" && i < 64; i++ {
		k := fmt.Sprintf("d/%d", i)
		if err := cl.Put(t.Context(), k, []byte("drain me")); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
		info, err := cl.Stat(t.Context(), k)
		if err != nil {
			t.Fatalf("stat %s: %v", k, err)
		}
		if info.Replicas[0].GetSegmentId() == seg0 {
			onSeg0 = k
		}
	}
	if onSeg0 == "" {
		t.Fatalf("no put of 64 landed on %s", seg0)
	}

	for _, tc := range []struct {
		args     []string
		code     int
		out, err string
	}{
		{[]string{"drain", seg0}, ExitOK, "segment " + seg0 + ": DRAINED: moved 1 of 1, offloaded 0 and evicted 0 elsewhere, dropped 0, left 0\n", ""},
		{[]string{"drain", "--undo", seg0}, ExitOK, "segment " + seg0 + ": OK\n", ""},
		{[]string{"drain", "--undo", seg0}, ExitOK, "segment " + seg0 + ": OK\n", ""},
		{[]string{"-o", "json", "drain", "--undo", seg0}, ExitOK, `{"lifecycle":"OK","segment_id":"` + seg0 + `"}` + "\n", ""},
		{[]string{"drain", "--undo", "--wait", seg0}, ExitUsage, "", "--undo takes neither"},
		{[]string{"drain", "--wait", "--interval", "0s", seg0}, ExitUsage, "", "--interval must be positive"},
		{[]string{"drain", "--undo", "nope"}, ExitError, "", "SEGMENT_NOT_FOUND"},
		{[]string{"drain", "nope"}, ExitError, "", "SEGMENT_NOT_FOUND"},
	} {
		code, out, errOut := run(t, addr, tc.args...)
		if code != tc.code || out != tc.out || !strings.Contains(errOut, tc.err) {
			t.Errorf("crescentctl %v: got exit %d, stdout %q, stderr %q; want %d, %q, stderr containing %q", tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
	}
	// The drain moved the replica to agent-1's segment; the bytes followed.
	info, err := cl.Stat(t.Context(), onSeg0)
	if err != nil || len(info.Replicas) != 1 || info.Replicas[0].GetSegmentId() != seg1 {
		t.Fatalf("after the drain, %s: %+v, %v; want its one replica on %s", onSeg0, info, err, seg1)
	}
	if got, err := cl.Get(t.Context(), onSeg0); err != nil || string(got) != "drain me" {
		t.Fatalf("get %s after the drain: %q, %v", onSeg0, got, err)
	}

	// A segment whose agent left is past both drain and undrain.
	c.StopAgent(1)
	waitLifecycle(t, c, seg1, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED)
	for _, args := range [][]string{{"drain", "--undo", seg1}, {"drain", seg1}} {
		code, out, errOut := run(t, addr, args...)
		if code != ExitError || out != "" || !strings.Contains(errOut, "SEGMENT_UNAVAILABLE") {
			t.Errorf("crescentctl %v of an unmounted segment: got exit %d, stdout %q, stderr %q; want %d and SEGMENT_UNAVAILABLE", args, code, out, errOut, ExitError)
		}
	}
}

// TestRemovePrefixFollowsPages: the master answers a prefix removal in
// pages (at most its scan budget of matching keys each); crescentctl rm
// --prefix follows them and reports the total.
func TestRemovePrefixFollowsPages(t *testing.T) {
	const budget = 7
	c := testcluster.Start(t, testcluster.Options{Agents: 1, Master: func(cfg *masterapp.Config) { cfg.ScanBudget = budget }})
	var items []client.Item
	for i := range 50 {
		// The master refuses empty objects: a byte each.
		items = append(items, client.Item{Key: fmt.Sprintf("p/%04d", i), Data: []byte("p")}, client.Item{Key: fmt.Sprintf("q/%04d", i), Data: []byte("q")})
	}
	seed(t, c, items...)
	code, out, errOut := run(t, c.MasterAddr(), "-o", "json", "rm", "--prefix", "p/")
	if code != ExitOK || out != `{"removed":50,"skipped":0}`+"\n" {
		t.Fatalf("rm --prefix: exit %d, stdout %q, stderr %q; want 0 and 50 removed", code, out, errOut)
	}
	// A page examines at most budget matching keys, so 50 take at least
	// ceil(50/7) = 8 calls.
	keys := c.Keys("default")
	if calls := c.Calls("RemoveByPrefix"); calls < (50+budget-1)/budget || len(keys) != 50 {
		t.Fatalf("master saw %d calls and kept %d keys, want at least 8 pages and the 50 q/ keys", calls, len(keys))
	}
	for _, k := range keys {
		if !strings.HasPrefix(k, "q/") {
			t.Fatalf("rm --prefix p/ left %q", k)
		}
	}
}

// lockedBuffer is a bytes.Buffer safe for a writer and a reader at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestDrainWait: drain --wait shows the drain's progress while it runs.
// A write in progress on the segment holds the drain (it waits for it)
// after it moved the rest, so the progress line is seen mid-drain; stderr
// is not a terminal, so each change is a line of its own. Once the write
// ends (revoked here) the drain answers, with the counts on stdout.
func TestDrainWait(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	seg0 := segmentOf(t, c, "agent-0")
	const n = 300
	var items []client.Item
	for i := range n {
		items = append(items, client.Item{Key: fmt.Sprintf("w/%03d", i), Data: []byte("drain me")})
	}
	for i, err := range c.Client(t).BatchPut(t.Context(), items, client.WithPreferredSegments(seg0)) {
		if err != nil {
			t.Fatalf("put %s: %v", items[i].Key, err)
		}
	}
	objects := masterv1.NewObjectServiceClient(c.Conn())
	if _, err := objects.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "inflight", Size: 8, ClientId: "ctl-test",
		Config: &masterv1.ReplicateConfig{PreferredSegments: []string{seg0}}}); err != nil {
		t.Fatalf("PutStart: %v", err)
	}

	var stdout bytes.Buffer
	var stderr lockedBuffer
	code := make(chan int, 1)
	go func() {
		code <- Main(t.Context(), []string{"--master", c.MasterAddr(), "drain", "--wait", "--interval", "10ms", seg0}, strings.NewReader(""), &stdout, &stderr)
	}()
	mid := fmt.Sprintf("drain %s: moved %d/%d (99%%), offloaded 0, evicted 0, dropped 0, failed 0", seg0, n, n+1)
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		if !strings.Contains(stderr.String(), mid) {
			return fmt.Errorf("stderr %q lacks %q", stderr.String(), mid)
		}
		return nil
	})
	if _, err := objects.PutRevoke(t.Context(), &masterv1.PutRevokeRequest{Key: "inflight", ClientId: "ctl-test"}); err != nil {
		t.Fatalf("PutRevoke: %v", err)
	}
	if got := <-code; got != ExitOK {
		t.Fatalf("drain --wait: exit %d, stderr %q", got, stderr.String())
	}
	if want := fmt.Sprintf("segment %s: DRAINED: moved %d of %d, offloaded 0 and evicted 0 elsewhere, dropped 0, left 0\n", seg0, n, n+1); stdout.String() != want {
		t.Fatalf("stdout: got %q, want %q", stdout.String(), want)
	}
	lines := strings.Split(strings.TrimSuffix(stderr.String(), "\n"), "\n")
	for _, l := range lines {
		if !strings.HasPrefix(l, "drain "+seg0+": moved ") || strings.Contains(l, "\r") {
			t.Fatalf("stderr line %q: want progress lines alone, no carriage returns", l)
		}
	}
	// Only changes are shown: the line of the wait appears once.
	if got := strings.Count(stderr.String(), mid); got != 1 {
		t.Fatalf("the mid-drain line appears %d times, want once: %q", got, stderr.String())
	}
	// The segment's entry keeps the drain, done; the listing shows it.
	for _, s := range segments(t, c) {
		if s.GetInfo().GetSegmentId() == seg0 && (s.GetDrain().GetState() != masterv1.DrainState_DRAIN_STATE_DONE || s.GetDrain().GetCounts().GetMoved() != n) {
			t.Fatalf("segment entry after the drain: %v, want DONE with %d moved", s.GetDrain(), n)
		}
	}
	code2, out, errOut := run(t, c.MasterAddr(), "segments")
	if col := fmt.Sprintf(" DONE %d/%d\n", n, n+1); code2 != ExitOK || !strings.Contains(out, " DRAIN\n") || !strings.Contains(out, col) {
		t.Fatalf("segments: exit %d, stdout %q, stderr %q; want a DRAIN column with %q", code2, out, errOut, col)
	}
	code2, out, _ = run(t, c.MasterAddr(), "-o", "json", "segments")
	if want := fmt.Sprintf(`"moved":%d,"no_evict":false`, n); code2 != ExitOK || !strings.Contains(out, want) || !strings.Contains(out, `"drain":null`) {
		t.Fatalf("segments -o json: exit %d, stdout %q; want the drain of %s (%s) and null for the other", code2, out, seg0, want)
	}
}

// TestDrainLineRewrites: on a terminal the progress is one line rewritten
// in place (carriage return, clear to the end), ended by a newline.
func TestDrainLineRewrites(t *testing.T) {
	var w bytes.Buffer
	l := newDrainLine(&w, "s", true)
	l.show(&masterv1.DrainCounts{Total: 4, Moved: 1})
	l.show(&masterv1.DrainCounts{Total: 4, Moved: 1})
	l.show(&masterv1.DrainCounts{Total: 4, Moved: 3, Dropped: 1, Evicted: 2, Offloaded: 5})
	l.end()
	out := w.String()
	if strings.Count(out, "\r") != 3 || strings.Count(out, "\n") != 1 || !strings.HasSuffix(out, "\n") ||
		!strings.Contains(out, "\rdrain s: moved 3/4 (100%), offloaded 5, evicted 2, dropped 1, failed 0, ") {
		t.Fatalf("terminal progress: got %q", out)
	}
	w.Reset()
	off := newDrainLine(&w, "s", false)
	off.end()
	if w.Len() != 0 {
		t.Fatalf("nothing shown, yet end wrote %q", w.String())
	}
}
