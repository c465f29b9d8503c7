package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"golang.org/x/sys/unix"
)

// mountTmpfs mounts a tmpfs of size bytes on dir until the test ends, or
// skips the test where that is not allowed (not root, no CAP_SYS_ADMIN).
func mountTmpfs(t *testing.T, dir string, size int64) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
		t.Skipf("cannot mount a tmpfs to fill (needs root): %v", err)
	}
	// Lazily: the agent may still hold files there when cleanups run.
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
}

// fill writes a file into dir until its filesystem has no room left, and
// returns its path.
func fill(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill %s: %v", dir, err)
			}
			return path
		}
	}
}

// TestDiskFull: the filesystem under one agent's disk segment fills up
// (another process's file took the room). The segment's data file is
// preallocated, but its journal grows with every seal. Disk puts go on
// succeeding: the agent refuses the segment's reservations while its
// journal cannot be written, so the master places them on the other
// agent's disk, and the SDK puts again a put whose seal failed. The agent
// says why (a warning, crescent_agent_segment_journal_failing 1). Once
// there is room again the segment takes puts again, and after the agent
// restarts every acknowledged object reads back.
//
// Before, each of those seals failed INTERNAL, the agent logged nothing,
// and a record the full disk had cut short stayed in the journal: the
// seals acknowledged once there was room again were appended after it,
// and the agent's next restart dropped them all as a torn tail (by hand:
// 11 of 59 acknowledged objects gone).
func TestDiskFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	var full string // agent-a's disk directory, on a tmpfs
	c := StartCluster(t, Options{Agents: 2, Disk: true, DiskSize: "4MiB", DiskMount: func(agent int, dir string) {
		if agent == 0 {
			mountTmpfs(t, dir, 8<<20)
			full = dir
		}
	}})
	cl := c.Client("default")
	ctx := ctxT(t, 3*time.Minute)
	disk := client.WithMedium(masterv1.Medium_MEDIUM_DISK)
	acked := map[string][]byte{}
	put := func(key string) {
		t.Helper()
		data := randBytes(t, 1000)
		if err := cl.Put(ctx, key, data, disk); err != nil {
			t.Fatalf("Put %s: %v", key, err)
		}
		acked[key] = data
	}
	for i := range 10 {
		put(fmt.Sprintf("before-%d", i))
	}

	filler := fill(t, full)
	// The journal's last page still has room for a few dozen seal
	// records; put until agent-a's journal has failed, and then more.
	agentA := c.Agents[0]
	n := 0
	for ; c.metric(t, agentA, "crescent_agent_segment_journal_failures_total") == 0; n++ {
		if n == 1000 {
			t.Fatal("1000 disk puts and agent-a's journal never failed on a full filesystem")
		}
		put(fmt.Sprintf("full-%d", n))
	}
	items := make([]client.Item, 50)
	for i := range items {
		items[i] = client.Item{Key: fmt.Sprintf("full-batch-%d", i), Data: randBytes(t, 1000)}
	}
	for i, err := range cl.BatchPut(ctx, items, disk) {
		if err != nil {
			t.Fatalf("BatchPut %s on a full disk: %v", items[i].Key, err)
		}
		acked[items[i].Key] = items[i].Data
	}
	for i := range 50 {
		put(fmt.Sprintf("full-more-%d", i))
	}
	if v := c.metric(t, agentA, "crescent_agent_segment_journal_failing"); v != 1 {
		t.Fatalf("crescent_agent_segment_journal_failing = %v on a full filesystem, want 1", v)
	}
	// Remove the objects on agent-a's disk: the agent cannot journal the
	// releases and keeps them; the master owes them and sends them again
	// once it can (before, they stayed, and agent-a's restart below
	// brought the removed objects back).
	var removed []string
	for key := range acked {
		rl, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if r := rl.GetReplicas()[0]; r.GetAgentId() == "agent-a" && r.GetMedium() == masterv1.Medium_MEDIUM_DISK {
			if err := cl.Remove(ctx, key, true); err != nil { // GetReplicaList leased it
				t.Fatalf("Remove %s: %v", key, err)
			}
			removed = append(removed, key)
			delete(acked, key)
		}
		if len(removed) == 10 {
			break
		}
	}
	if len(removed) == 0 {
		t.Fatal("no acknowledged object on agent-a's disk to remove")
	}

	if !strings.Contains(agentA.Logs(), "disk segment journal cannot be written") {
		t.Fatal("agent-a did not warn of its journal's failure")
	}
	t.Logf("%d puts until agent-a's journal failed; %.0f journal failures after 100 more",
		n, c.metric(t, agentA, "crescent_agent_segment_journal_failures_total"))

	// Room again: agent-a's segment takes puts again within a retry.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		put(fmt.Sprintf("after-%d", len(acked)))
		if v := c.metric(t, agentA, "crescent_agent_segment_journal_failing"); v != 0 {
			return fmt.Errorf("crescent_agent_segment_journal_failing = %v with room again", v)
		}
		return nil
	})
	for i := range 40 {
		put(fmt.Sprintf("after-more-%d", i))
	}

	// Every acknowledged object survives agent-a's restart.
	agentA.Stop()
	agentA.Restart()
	c.WaitSegments(4)
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		for key, data := range acked {
			got, err := cl.Get(ctx, key)
			if err != nil {
				return fmt.Errorf("Get %s after agent-a's restart: %w", key, err)
			}
			if !bytes.Equal(got, data) {
				return fmt.Errorf("Get %s after agent-a's restart: bytes differ", key)
			}
		}
		return nil
	})
	for _, key := range removed {
		if _, err := cl.Get(ctx, key); rpcerr.Reason(err) != "OBJECT_NOT_FOUND" {
			t.Fatalf("Get of %s, removed while agent-a's disk was full, after agent-a's restart = %v; want OBJECT_NOT_FOUND", key, err)
		}
	}
	if logs := agentA.Logs(); strings.Contains(logs, `"truncated_journal_bytes":`) && !strings.Contains(logs, `"truncated_journal_bytes":0`) {
		t.Fatal("agent-a's restart cut its journal short")
	}
	t.Logf("%d acknowledged disk objects read back after agent-a's restart", len(acked))
}

// TestGatewayStateDirFull: the gateway's --state-dir fills up. Its journal
// fails, which costs only the next start its state (a reset, a new
// epoch): the gateway goes on publishing, and a subscriber stays exact.
// Before, the journal's periodic fsync failing ended one of the gateway's
// parts, which stops them all: the gateway stopped within a second, with
// exit status 0 and "stopped" as its last line.
func TestGatewayStateDirFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	c := StartCluster(t, Options{Agents: 1, Gateway: true, GatewayStateMount: func(dir string) { mountTmpfs(t, dir, 256<<10) }})
	sub := subscribe(t, c)
	cl := c.Client("default")
	ctx := ctxT(t, 2*time.Minute)
	filler := fill(t, c.GatewayState)
	n := 0
	put := func() {
		t.Helper()
		if err := cl.Put(ctx, fmt.Sprintf("k/%d", n), []byte("v")); err != nil {
			t.Fatal(err)
		}
		n++
	}
	for c.metric(t, c.Gateway, "crescent_gateway_state_journal_errors_total") == 0 {
		if n == 5000 {
			t.Fatal("5000 puts and the gateway's journal never failed on a full --state-dir")
		}
		put()
	}
	failedAt := n
	// Past the journal's fsync interval (1 s), with events flowing.
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); {
		put()
	}
	if resp, err := c.Gateway.get("/readyz"); err != nil {
		t.Fatalf("the gateway stopped after its state directory filled up: %v\n%s", err, tail(c.Gateway.Logs(), 10))
	} else {
		resp.Body.Close()
	}
	converge(t, c, sub)
	t.Logf("the journal failed at put %d; %d puts in all, and the subscriber holds the master's readable set", failedAt, n)

	// Room again; the restart resets the state (the journal failed).
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	before := c.gatewayStatus(t)
	c.Gateway.Stop()
	c.Gateway.Restart()
	if st := c.gatewayStatus(t); st.State != "reset" || st.PublisherEpoch == before.PublisherEpoch {
		t.Fatalf("status after a run whose journal failed = %+v; want state reset and a new epoch", st)
	}
}
