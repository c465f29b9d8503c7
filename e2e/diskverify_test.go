package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// waitRemovedChange watches the master's change log from its oldest record
// until a REMOVED change of (tenant, key, medium) appears; cl must be an
// admin's (ChangeService is for gateways and admins). A master in its
// recovery grace answers UNAVAILABLE: retry.
func waitRemovedChange(t *testing.T, cl *client.Client, tenant, key string, medium masterv1.Medium) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		ws, err := cl.Changes().Watch(ctx, &masterv1.WatchRequest{})
		if err != nil {
			return err
		}
		for {
			resp, err := ws.Recv()
			if err != nil {
				return fmt.Errorf("no REMOVED change for %s/%s on %v in the change log: %w", tenant, key, medium, err)
			}
			for _, ch := range resp.GetChanges() {
				if ch.GetType() == masterv1.ChangeType_CHANGE_TYPE_REMOVED && ch.GetTenant() == tenant && ch.GetKey() == key && ch.GetMedium() == medium {
					return nil
				}
			}
		}
	})
}

// subscribeRemoved subscribes to the gateway; published is closed once a
// BlockRemoved of the default tenant's key on disk arrives.
func subscribeRemoved(t *testing.T, c *Cluster, key string) (sub *kvevent.Subscriber, published chan struct{}) {
	t.Helper()
	published = make(chan struct{})
	var once sync.Once
	sub = subscribe(t, c, func(b kvevent.Batch) {
		for _, ev := range b.Events {
			if ev.Type == kvevent.Removed && ev.Tenant == "default" && ev.Key == key && ev.Medium == kvevent.MediumDisk {
				once.Do(func() { close(published) })
			}
		}
	})
	return sub, published
}

type diskPut struct {
	key  string
	data []byte
	desc *masterv1.ReplicaDescriptor
}

// putOnDisk stores key with one replica on the disk medium and returns its
// replica descriptor (read token included).
func putOnDisk(t *testing.T, ctx context.Context, cl *client.Client, key string, size int) diskPut {
	t.Helper()
	p := diskPut{key: key, data: randBytes(t, size)}
	if err := cl.Put(ctx, key, p.data, client.WithMedium(masterv1.Medium_MEDIUM_DISK)); err != nil {
		t.Fatalf("Put %s: %v", key, err)
	}
	rl, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: key})
	if err != nil || len(rl.GetReplicas()) != 1 || rl.GetReplicas()[0].GetMedium() != masterv1.Medium_MEDIUM_DISK {
		t.Fatalf("GetReplicaList %s = %v, %v; want one disk replica", key, rl, err)
	}
	p.desc = rl.GetReplicas()[0]
	return p
}

// checkCorruptGone asserts what a cluster must show once the agent came
// back with bad's bytes corrupted: the master lists no replica of bad, the
// agent counted one corrupt allocation, good reads back byte-identical, and
// a normal put and get still work.
func checkCorruptGone(t *testing.T, ctx context.Context, c *Cluster, cl *client.Client, bad, good diskPut) {
	t.Helper()
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		rl, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: bad.key})
		switch {
		case err == nil:
			return fmt.Errorf("GetReplicaList %s = %d replicas, want NOT_FOUND", bad.key, len(rl.GetReplicas()))
		case status.Code(err) != codes.NotFound || rpcerr.Reason(err) != "OBJECT_NOT_FOUND":
			return fmt.Errorf("GetReplicaList %s = %v, want NOT_FOUND OBJECT_NOT_FOUND", bad.key, err)
		}
		return nil
	})
	if _, err := cl.Get(ctx, bad.key); status.Code(err) != codes.NotFound {
		t.Fatalf("Get %s = %v, want NOT_FOUND", bad.key, err)
	}
	if n := c.metric(t, c.Agents[0], "crescent_agent_disk_corrupt_allocations_total"); n != 1 {
		t.Fatalf("crescent_agent_disk_corrupt_allocations_total = %v, want 1", n)
	}
	if n := c.metric(t, c.Agents[0], "crescent_agent_disk_verify_bytes_total"); n != float64(len(bad.data)+len(good.data)) {
		t.Fatalf("crescent_agent_disk_verify_bytes_total = %v, want %d", n, len(bad.data)+len(good.data))
	}
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		got, err := cl.Get(ctx, good.key)
		if err != nil {
			return err
		}
		if !bytes.Equal(got, good.data) {
			return fmt.Errorf("Get %s: bytes differ", good.key)
		}
		return nil
	})
	after := randBytes(t, 100<<10)
	if err := cl.Put(ctx, "after-verify", after, client.WithMedium(masterv1.Medium_MEDIUM_DISK)); err != nil {
		t.Fatalf("Put after restart: %v", err)
	}
	if got, err := cl.Get(ctx, "after-verify"); err != nil || !bytes.Equal(got, after) {
		t.Fatalf("Get after restart: %v", err)
	}
}

// TestCorruptDiskObjectRemovedOnAgentRestart (issue 11, item 7): an agent
// crashes; while it is down a byte of one sealed object in its disk
// segment flips; it restarts within the master's unmount window. The agent
// verifies its disk segment before registering and leaves the corrupt
// allocation out of its table, so the master's Reconcile removes that
// replica — recording `removed` for (tenant, key, disk) in the change log,
// which the gateway publishes as a BlockRemoved event — while the intact
// object stays readable. A read
// of the corrupt allocation with a token obtained before the crash answers
// DATA_LOSS CHECKSUM_MISMATCH, never OK.
func TestCorruptDiskObjectRemovedOnAgentRestart(t *testing.T) {
	c := StartCluster(t, Options{Agents: 1, Disk: true, Gateway: true, UnmountAfter: time.Minute, MasterFlags: []string{"--lease-ttl", "1m"}})
	cl := c.GRPCDataClient("default")
	ctx := ctxT(t, 2*time.Minute)
	const badKey = "disk/corrupt"
	sub, published := subscribeRemoved(t, c, badKey)
	bad := putOnDisk(t, ctx, cl, badKey, 300<<10)
	good := putOnDisk(t, ctx, cl, "disk/intact", 200<<10)

	c.Agents[0].Kill()
	testutil.FlipByte(t, filepath.Join(c.dir, "agent-a-disk", "segment.data"), bad.desc.GetOffset()+150<<10)
	c.Agents[0].Restart()
	if lg := c.Agents[0].Logs(); !bytes.Contains([]byte(lg), []byte("corrupt disk allocation dropped")) {
		t.Fatalf("agent log has no WARN for the dropped allocation:\n%s", tail(lg, 30))
	}

	checkCorruptGone(t, ctx, c, cl, bad, good)
	waitRemovedChange(t, c.AdminClient("default"), "default", bad.key, masterv1.Medium_MEDIUM_DISK)
	select {
	case <-published:
	case <-time.After(20 * time.Second):
		t.Fatalf("the gateway published no BlockRemoved for %s on disk", bad.key)
	}
	converge(t, c, sub)

	// The old read token (still valid: one-minute lease) gets no bytes.
	conn := c.dialAgent(bad.desc.GetDataEndpoint(), "default")
	resp, err := agentv1.NewDataServiceClient(conn).BatchRead(ctx, &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{{
		SegmentId: bad.desc.GetSegmentId(), AllocationId: bad.desc.GetAllocationId(), Token: bad.desc.GetToken(),
	}}})
	if err != nil {
		t.Fatalf("BatchRead: %v", err)
	}
	if st := resp.GetResults()[0].GetStatus(); codes.Code(st.GetCode()) != codes.DataLoss || st.GetReason() != "CHECKSUM_MISMATCH" || len(resp.GetResults()[0].GetData()) != 0 {
		t.Fatalf("BatchRead of the corrupt allocation with its old token = %v, want DATA_LOSS CHECKSUM_MISMATCH and no bytes", st)
	}
}

// TestCorruptDiskObjectNotAdoptedByFreshMaster: the same corruption while
// both the agent and the master are down. The new master rebuilds its
// objects from the agent's registration, which no longer names the
// corrupt allocation: that object is never adopted, the intact one is.
func TestCorruptDiskObjectNotAdoptedByFreshMaster(t *testing.T) {
	c := StartCluster(t, Options{Agents: 1, Disk: true})
	cl := c.GRPCDataClient("default")
	ctx := ctxT(t, 2*time.Minute)
	bad := putOnDisk(t, ctx, cl, "disk/corrupt", 300<<10)
	good := putOnDisk(t, ctx, cl, "disk/intact", 200<<10)

	c.Agents[0].Kill()
	c.Master.Kill()
	testutil.FlipByte(t, filepath.Join(c.dir, "agent-a-disk", "segment.data"), bad.desc.GetOffset())
	c.Master.Restart()
	c.Agents[0].Restart()
	c.WaitSegments(2)

	checkCorruptGone(t, ctx, c, cl, bad, good)
}

// TestCorruptDiskObjectDroppedWhileServing: a byte of a sealed object
// flips in a running agent's disk segment (bit rot, a stray write). The
// first get of it fails its checksum at the client, as before; the agent,
// which hashed the bytes as it read them, drops the allocation and reports
// it lost, so the master removes the replica — the object, its only one —
// and the gateway publishes BlockRemoved. Before, the replica stayed
// listed and announced readable, and every get of it failed, for as long
// as the agent ran. The drop is journaled: after the agent's restart the
// object stays gone. Other objects on the same disk are not touched.
func TestCorruptDiskObjectDroppedWhileServing(t *testing.T) {
	c := StartCluster(t, Options{Agents: 1, Disk: true, Gateway: true})
	cl := c.Client("default")
	ctx := ctxT(t, 2*time.Minute)
	const badKey = "disk/rot"
	sub, published := subscribeRemoved(t, c, badKey)
	bad := putOnDisk(t, ctx, cl, badKey, 300<<10)
	good := putOnDisk(t, ctx, cl, "disk/intact", 200<<10)
	testutil.FlipByte(t, filepath.Join(c.dir, "agent-a-disk", "segment.data"), bad.desc.GetOffset()+100<<10)

	// The get reads the only replica, finds it bad and fetches the list
	// again, which may already say OBJECT_NOT_FOUND (the agent was quick
	// to report): either way it names the checksum failure.
	if _, err := cl.Get(ctx, bad.key); !errors.Is(err, client.ErrChecksum) {
		t.Fatalf("first Get of the corrupted object = %v, want ErrChecksum", err)
	}
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		_, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: bad.key})
		if status.Code(err) != codes.NotFound {
			return fmt.Errorf("GetReplicaList %s after a read found its bytes bad = %v, want NOT_FOUND", bad.key, err)
		}
		return nil
	})
	select {
	case <-published:
	case <-time.After(20 * time.Second):
		t.Fatalf("the gateway published no BlockRemoved for %s on disk", bad.key)
	}
	converge(t, c, sub)
	if n := c.metric(t, c.Agents[0], `crescent_agent_allocations_lost_total{cause="checksum",medium="disk"}`); n != 1 {
		t.Fatalf(`crescent_agent_allocations_lost_total{cause="checksum",medium="disk"} = %v, want 1`, n)
	}
	if n := c.metric(t, c.Master, "crescent_master_replicas_lost_total"); n != 1 {
		t.Fatalf("crescent_master_replicas_lost_total = %v, want 1", n)
	}
	if lg := c.Agents[0].Logs(); !strings.Contains(lg, "allocation lost while serving") {
		t.Fatalf("agent log has no WARN for the lost allocation:\n%s", tail(lg, 30))
	}
	if lg := c.Master.Logs(); !strings.Contains(lg, "agent reported lost allocations") {
		t.Fatalf("master log has no WARN for the report:\n%s", tail(lg, 30))
	}
	if got, err := cl.Get(ctx, good.key); err != nil || !bytes.Equal(got, good.data) {
		t.Fatalf("Get %s (intact, same disk) = %v", good.key, err)
	}

	c.Agents[0].Kill()
	c.Agents[0].Restart()
	c.WaitSegments(2)
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		got, err := cl.Get(ctx, good.key)
		if err == nil && !bytes.Equal(got, good.data) {
			err = fmt.Errorf("Get %s: bytes differ", good.key)
		}
		return err
	})
	if _, err := cl.Get(ctx, bad.key); status.Code(err) != codes.NotFound {
		t.Fatalf("Get %s after the agent's restart = %v, want NOT_FOUND (the drop journaled)", bad.key, err)
	}
}

// TestCorruptDiskObjectFoundByScrub: a byte flips in a running agent's
// disk segment under an object nobody reads. The agent's scrub
// (--scrub-interval, 1 s here) reads it again, drops it and reports it
// lost: the master removes the object and the gateway publishes
// BlockRemoved, before any client met the bad bytes. Other objects stay.
func TestCorruptDiskObjectFoundByScrub(t *testing.T) {
	c := StartCluster(t, Options{Agents: 1, Disk: true, Gateway: true, AgentFlags: []string{"--scrub-interval", "1s"}})
	cl := c.Client("default")
	ctx := ctxT(t, 2*time.Minute)
	const badKey = "disk/unread"
	sub, published := subscribeRemoved(t, c, badKey)
	bad := putOnDisk(t, ctx, cl, badKey, 300<<10)
	good := putOnDisk(t, ctx, cl, "disk/intact", 200<<10)
	testutil.FlipByte(t, filepath.Join(c.dir, "agent-a-disk", "segment.data"), bad.desc.GetOffset()+10)

	select {
	case <-published:
	case <-time.After(30 * time.Second):
		t.Fatalf("no BlockRemoved for %s: the scrub did not find it\n%s", bad.key, tail(c.Agents[0].Logs(), 30))
	}
	if _, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: bad.key}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetReplicaList %s after the scrub = %v, want NOT_FOUND", bad.key, err)
	}
	converge(t, c, sub)
	if n := c.metric(t, c.Agents[0], "crescent_agent_disk_scrub_passes_total"); n < 1 {
		t.Fatalf("crescent_agent_disk_scrub_passes_total = %v, want at least 1", n)
	}
	if lg := c.Agents[0].Logs(); !strings.Contains(lg, `"msg":"disk scrub pass finished"`) || !strings.Contains(lg, `"lost":1`) {
		t.Fatalf("agent log has no scrub pass that lost one:\n%s", tail(lg, 30))
	}
	if got, err := cl.Get(ctx, good.key); err != nil || !bytes.Equal(got, good.data) {
		t.Fatalf("Get %s (intact, same disk) = %v", good.key, err)
	}
}

// TestLostReplicaGoneAfterFailover: three masters on etcd; a disk object's
// only replica goes bad and a read drops it. The standbys, which follow
// the agent's table, drop it too (the agent's feed records the drop as a
// release): after the leader is killed, the new leader — which takes the
// agent's resumed registration without its table — does not bring the
// object back.
func TestLostReplicaGoneAfterFailover(t *testing.T) {
	c := StartCluster(t, Options{Masters: 3, Agents: 1, Disk: true,
		MasterFlags: []string{"--etcd-lease-ttl", "2s", "--recovery-grace", "500ms"}})
	cl := c.Client("default")
	ctx := ctxT(t, 2*time.Minute)
	bad := putOnDisk(t, ctx, cl, "disk/rot", 300<<10)
	good := putOnDisk(t, ctx, cl, "disk/intact", 200<<10)
	testutil.FlipByte(t, filepath.Join(c.dir, "agent-a-disk", "segment.data"), bad.desc.GetOffset()+7)
	if _, err := cl.Get(ctx, bad.key); !errors.Is(err, client.ErrChecksum) {
		t.Fatalf("Get of the corrupted object = %v, want ErrChecksum", err)
	}
	notFound := func(step string) {
		t.Helper()
		testutil.EventuallyNoError(t, 30*time.Second, func() error {
			_, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: bad.key})
			if status.Code(err) != codes.NotFound {
				return fmt.Errorf("%s: GetReplicaList %s = %v, want NOT_FOUND", step, bad.key, err)
			}
			return nil
		})
	}
	notFound("before the failover")
	old := c.WaitLeader()
	old.Kill()
	testutil.Eventually(t, 30*time.Second, func() bool { l := c.Leader(); return l != nil && l != old }, "a new leader")
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		got, err := cl.Get(ctx, good.key)
		if err == nil && !bytes.Equal(got, good.data) {
			err = fmt.Errorf("Get %s: bytes differ", good.key)
		}
		return err
	})
	if _, err := cl.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: "default", Key: bad.key}); status.Code(err) != codes.NotFound {
		t.Fatalf("after the failover: GetReplicaList %s = %v, want NOT_FOUND (the new leader brought it back)", bad.key, err)
	}
}
