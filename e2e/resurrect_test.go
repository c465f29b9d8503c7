package e2e

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestRemovedWhileDiskAgentAway: objects with a disk replica on agent-a
// are removed while agent-a is down, one before its segments are unmounted
// (--unmount-after, 3 s here) and one after; agent-a comes back with its
// disk segment and the sealed allocations in it. Both stay removed. Before,
// both came back: the first because the unmount forgot the release owed
// to agent-a, the second because nothing remembered the removal
// (tombstones, internal/master/meta/tombstone.go).
func TestRemovedWhileDiskAgentAway(t *testing.T) {
	removedWhileAway(t, StartCluster(t, Options{Agents: 2, Disk: true}), nil)
}

// TestRemovedWhileAgentAwayAcrossFailover: as TestRemovedWhileDiskAgentAway,
// with three masters on etcd, and the leader killed before agent-a comes
// back. The standbys follow the agents' tables, not the leader's
// removals: they still held both objects on agent-a's disk segment, and the
// new leader adopted them back when agent-a registered. The leader now
// records agent-a's segment in etcd as unsettled before it answers either
// removal, and the new leader distrusts it (meta/unsettled.go).
func TestRemovedWhileAgentAwayAcrossFailover(t *testing.T) {
	c := StartCluster(t, Options{Masters: 3, Agents: 2, Disk: true,
		MasterFlags: []string{"--etcd-lease-ttl", "2s", "--recovery-grace", "500ms"}})
	removedWhileAway(t, c, func() {
		old := c.WaitLeader()
		old.Kill()
		testutil.Eventually(t, 30*time.Second, func() bool { l := c.Leader(); return l != nil && l != old }, "a new leader")
	})
}

// TestRemovedWhileAgentAwayAcrossMasterRestart: the same with a single
// master killed and started again: it rebuilt its objects from the agents'
// tables, both removed objects included. With --state-dir it keeps the
// unsettled segments in a file (app/statefile.go).
func TestRemovedWhileAgentAwayAcrossMasterRestart(t *testing.T) {
	c := StartCluster(t, Options{Agents: 2, Disk: true,
		MasterFlags: []string{"--state-dir", filepath.Join(t.TempDir(), "master"), "--recovery-grace", "500ms"}})
	removedWhileAway(t, c, func() {
		c.Master.Kill()
		c.Master.Restart()
	})
}

// removedWhileAway puts three objects with two disk replicas, removes one
// while agent-a is down (its release owed) and one after agent-a's
// segments were detached (a tombstone), then calls restart (the master's
// state goes; nil: it stays), brings agent-a back, and checks that both
// stay removed; after a restart, that the master distrusted agent-a's
// segments, then settled them.
func removedWhileAway(t *testing.T, c *Cluster, restart func()) {
	t.Helper()
	cl := c.Client("default")
	ctx := ctxT(t, 2*time.Minute)
	disk := client.WithMedium(masterv1.Medium_MEDIUM_DISK)
	for _, k := range []string{"early", "late", "kept"} {
		if err := cl.Put(ctx, k, randBytes(t, 1000), disk, client.WithReplicas(2)); err != nil {
			t.Fatal(err)
		}
	}
	agentA := c.Agents[0]
	agentA.Kill()
	if err := cl.Remove(ctx, "early", true); err != nil { // its release at agent-a owed
		t.Fatal(err)
	}
	// Past --unmount-after (3 s): agent-a's segments are detached, and
	// this removal is a tombstone.
	time.Sleep(5 * time.Second)
	if err := cl.Remove(ctx, "late", true); err != nil {
		t.Fatal(err)
	}
	if restart != nil {
		restart()
	}
	agentA.Restart()
	c.WaitSegments(4)
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		_, err := cl.Get(ctx, "kept")
		return err
	})
	time.Sleep(time.Second)
	for _, k := range []string{"early", "late"} {
		if _, err := cl.Get(ctx, k); rpcerr.Reason(err) != "OBJECT_NOT_FOUND" {
			t.Errorf("Get %s, removed while agent-a was away, after the master's state went and agent-a came back = %v; want OBJECT_NOT_FOUND", k, err)
		}
	}
	if restart == nil {
		return
	}
	lead := c.Master
	if len(c.Masters) > 0 {
		lead = c.WaitLeader()
	}
	if n := c.metric(t, lead, "crescent_master_distrusted_segments_total"); n < 1 {
		t.Errorf("the master distrusted %v segments, want agent-a's", n)
	}
	// Agent-a registered: nothing of it is unsettled any more.
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		if n := c.metric(t, lead, "crescent_master_unsettled_segments"); n != 0 {
			return fmt.Errorf("%v unsettled segments after agent-a registered, want 0", n)
		}
		return nil
	})
}
