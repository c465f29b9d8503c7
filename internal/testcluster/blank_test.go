package testcluster_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestPutsOnBlankReservations (issue 18 item 2): with real agents, puts of
// one size land on blank reservations the master made ahead (no Reserve in
// their PutStart) on the bulk path and on gRPC; each allocation then holds
// the object and replica its write token named, the bytes read back, and a
// master rebuilt from the agents' tables holds every object and none of the
// blanks.
func TestPutsOnBlankReservations(t *testing.T) {
	const size = 64 << 10 // 8 blanks per 32 MiB segment
	c := testcluster.Start(t, testcluster.Options{})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	data := func(key string) []byte { return bytes.Repeat([]byte(key+" "), size/(len(key)+1)+1)[:size] }

	// A segment gets blanks of a size from its second put of it on: put
	// until one has (placement spreads the first puts over both agents).
	cl := c.Client(t)
	warm := 0
	testutil.Eventually(t, 10*time.Second, func() bool {
		if n, _ := c.Master().Store.BlankStats(); n > 0 {
			return true
		}
		key := fmt.Sprintf("warm/%d", warm)
		if err := cl.Put(ctx, key, data(key)); err != nil {
			t.Fatal(err)
		}
		warm++
		return false
	}, "the master to fill a blank pool once a size was put twice on a segment")

	var keys []string
	for _, path := range []struct {
		name string
		mod  func(*client.Config)
	}{
		{"transfer", func(*client.Config) {}},
		{"grpc", func(cfg *client.Config) { cfg.DisableTransfer = true }},
	} {
		cl := c.Client(t, path.mod)
		b0, _ := c.Master().Store.PutReservations()
		for i := range 6 {
			key := fmt.Sprintf("%s/%d", path.name, i)
			if err := cl.Put(ctx, key, data(key)); err != nil {
				t.Fatalf("put %s: %v", key, err)
			}
			keys = append(keys, key)
		}
		if b, _ := c.Master().Store.PutReservations(); b == b0 {
			t.Fatalf("%s: no put of 6 took a blank reservation", path.name)
		}
	}

	// Every object's allocations hold its identity, sealed, and its bytes.
	objects := masterv1.NewObjectServiceClient(c.Conn())
	for _, key := range keys {
		r, err := objects.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: key})
		if err != nil {
			t.Fatalf("GetReplicaList %s: %v", key, err)
		}
		for _, d := range r.GetReplicas() {
			a := lookupAllocation(c, d.GetSegmentId(), d.GetAllocationId())
			if a == nil || a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED || a.GetKey() != key ||
				a.GetTenant() != "default" || a.GetReplicaId() != d.GetReplicaId() {
				t.Fatalf("%s replica %d: the agent holds %v", key, d.GetReplicaId(), a)
			}
		}
		got, err := cl.Get(ctx, key)
		if err != nil || !bytes.Equal(got, data(key)) {
			t.Fatalf("get %s: %d bytes, %v", key, len(got), err)
		}
	}

	// A master rebuilt from the agents holds every object and no blank:
	// the agents' tables list their unbound blanks flagged, and nothing
	// adopts one.
	c.RestartMaster()
	testutil.Eventually(t, 30*time.Second, func() bool { o, _, _ := c.Master().Store.Stats(); return o == uint64(len(keys)+warm) },
		"the new master to rebuild the %d objects", len(keys)+warm)
	if n, _ := c.Master().Store.BlankStats(); n != 0 {
		t.Fatalf("the rebuilt master holds %d blanks before any put", n)
	}
	cl = c.Client(t)
	for _, key := range keys {
		if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, data(key)) {
			t.Fatalf("get %s after the restart: %d bytes, %v", key, len(got), err)
		}
	}
}

// lookupAllocation finds an allocation at whichever agent holds its
// segment.
func lookupAllocation(c *testcluster.Cluster, seg string, id uint64) *masterv1.Allocation {
	for i := range c.Agents() {
		if sg, ok := c.Agent(i).Segments().Get(seg); ok {
			if a, ok := sg.Lookup(id); ok {
				return a
			}
		}
	}
	return nil
}
