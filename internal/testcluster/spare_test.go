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

// TestPutsOnSpares (issue 18 item 2): with real agents, a client's puts of
// one size go on spares the master leased it — written over the bulk path
// with their key, committed by one PutEnd, no PutStart — and each
// allocation then holds the object and replica id the master records,
// sealed, with its bytes; a client with spares off puts as before; a master
// rebuilt from the agents holds every object; and a client's spares from
// the old master fall back to PutStart.
func TestPutsOnSpares(t *testing.T) {
	const size = 64 << 10 // 8 blanks per 32 MiB segment
	c := testcluster.Start(t, testcluster.Options{})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	data := func(key string) []byte { return bytes.Repeat([]byte(key+" "), size/(len(key)+1)+1)[:size] }
	st := c.Master().Store

	cl := c.Client(t)
	var keys []string
	put := func(cl *client.Client, key string) {
		t.Helper()
		if err := cl.Put(ctx, key, data(key)); err != nil {
			t.Fatalf("put %s: %v", key, err)
		}
		keys = append(keys, key)
	}
	// Pools fill from a size's second put on a segment; spares come with
	// the PutStarts after that.
	testutil.Eventually(t, 10*time.Second, func() bool {
		put(cl, fmt.Sprintf("warm/%d", len(keys)))
		_, leased, _, _ := st.SpareStats()
		return leased > 0
	}, "the master to lease the client spares")
	_, _, committed0, _ := st.SpareStats()
	for i := range 12 {
		put(cl, fmt.Sprintf("spare/%d", i))
	}
	held, leased, committed, lapsed := st.SpareStats()
	if committed-committed0 < 6 {
		t.Fatalf("12 puts committed %d spares (leased %d, held %d, lapsed %d), want most of them", committed-committed0, leased, held, lapsed)
	}

	// Spares off: every put through PutStart, none committed.
	off := c.Client(t, func(cfg *client.Config) { cfg.DisableSpares = true })
	for i := range 4 {
		put(off, fmt.Sprintf("off/%d", i))
	}
	if _, _, n, _ := st.SpareStats(); n != committed {
		t.Fatalf("a client with spares off committed %d spares", n-committed)
	}

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
		if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, data(key)) {
			t.Fatalf("get %s: %d bytes, %v", key, len(got), err)
		}
	}

	// A put that exists is refused on a spare as through PutStart; an
	// upsert (of an object nobody reads: a read's lease holds it)
	// replaces it.
	put(cl, "up")
	if err := cl.Put(ctx, "up", data("x")); err == nil {
		t.Fatal("put of an existing key on a spare: no error")
	}
	if err := cl.Put(ctx, "up", data("up again"), client.WithUpsert()); err != nil {
		t.Fatalf("upsert: %v", err)
	}
	if got, err := cl.Get(ctx, "up"); err != nil || !bytes.Equal(got, data("up again")) {
		t.Fatalf("get after the upsert: %d bytes, %v", len(got), err)
	}

	c.RestartMaster()
	testutil.Eventually(t, 30*time.Second, func() bool { o, _, _ := c.Master().Store.Stats(); return o == uint64(len(keys)) },
		"the new master to rebuild the %d objects", len(keys))
	// The first client still holds spares the old master leased: its puts
	// write into them, the new master knows no such lease (PUT_EXPIRED),
	// and they go through PutStart.
	// The new master leases spares once its blank reservations are
	// refilled, which a loaded machine may take a while to do: the puts
	// go on (through PutStart meanwhile) until one commits a spare of its.
	st = c.Master().Store
	i := 0
	testutil.Eventually(t, 10*time.Second, func() bool {
		put(cl, fmt.Sprintf("after/%d", i))
		i++
		_, _, n, _ := st.SpareStats()
		return n > 0
	}, "a put after the restart to commit a spare of the new master's")
	cl = c.Client(t)
	for _, key := range keys {
		want := data(key)
		if key == "up" {
			want = data("up again")
		}
		if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("get %s after the restart: %d bytes, %v", key, len(got), err)
		}
	}
}
