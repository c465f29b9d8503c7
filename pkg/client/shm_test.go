package client_test

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/xfer/shm"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// shmSocket is a short socket path (Unix socket paths are limited to about
// 100 bytes: not under t.TempDir's long names).
func shmSocket(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "crescent-shm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return filepath.Join(dir, "agent.sock")
}

// TestSharedMemoryPath: agent 0 shares its memory over a Unix socket, agent
// 1 does not (a "remote" agent as far as the client can tell). Puts and gets
// of replicas on agent 0 move through shared memory, those on agent 1 over
// TCP, single and batch calls alike, and every byte comes back.
func TestSharedMemoryPath(t *testing.T) {
	sock := shmSocket(t)
	h := start(t, testcluster.Options{Agents: 2, AgentMemory: 64 << 20, Agent: func(i int, c *agentapp.Config) {
		if i == 0 {
			c.ShmSocket = sock
		}
	}})
	// Every read asks the agent: the requests are counted below
	// (TestSharedMemoryMappedReads covers the reads that do not).
	c := h.client(t, client.Config{SharedMemorySockets: []string{sock}, DisableMappedReads: true})
	ctx := t.Context()
	want := map[string][]byte{}
	for i := range 16 {
		key := fmt.Sprintf("shm/single-%d", i)
		want[key] = bytes.Repeat([]byte{byte(i)}, 1<<20+i)
		if err := c.Put(ctx, key, want[key]); err != nil {
			t.Fatalf("Put %s: %v", key, err)
		}
	}
	var items []client.Item
	var keys []string
	for i := range 32 {
		key := fmt.Sprintf("shm/batch-%d", i)
		want[key] = bytes.Repeat([]byte{byte(i + 100)}, 4096+i)
		items = append(items, client.Item{Key: key, Data: want[key]})
		keys = append(keys, key)
	}
	for i, err := range c.BatchPut(ctx, items) {
		if err != nil {
			t.Fatalf("BatchPut %d: %v", i, err)
		}
	}
	for key, data := range want {
		got, err := c.Get(ctx, key)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("Get %s: %d bytes, %v", key, len(got), err)
		}
	}
	got, errs := c.BatchGet(ctx, keys)
	for i, err := range errs {
		if err != nil || !bytes.Equal(got[i], want[keys[i]]) {
			t.Fatalf("BatchGet %s: %v", keys[i], err)
		}
	}
	// The large objects of a batch on the local agent go over shared
	// memory too, grouped into a few requests, the others over TCP.
	var large []string
	var bufs [][]byte
	for i := range 16 {
		large = append(large, fmt.Sprintf("shm/single-%d", i))
		bufs = append(bufs, make([]byte, 1<<20+16))
	}
	before, _ := client.ShmServed(c)
	reqs := client.ShmReadRequests(c)
	sizes, errs := c.BatchGetInto(ctx, large, bufs)
	for i, err := range errs {
		if err != nil || !bytes.Equal(bufs[i][:sizes[i]], want[large[i]]) {
			t.Fatalf("BatchGetInto %s: %d bytes, %v", large[i], sizes[i], err)
		}
	}
	after, _ := client.ShmServed(c)
	n, r := after-before, client.ShmReadRequests(c)-reqs
	// Three objects of 1 MiB and a few bytes fit a 4 MiB request.
	if want := (n + 2) / 3; n < 2 || r != want {
		t.Fatalf("a batch get read %d large objects through shared memory in %d requests, want at least 2 in %d", n, r, want)
	}
	reads, writes := client.ShmServed(c)
	if reads == 0 || writes == 0 {
		t.Fatalf("shared memory served %d reads and %d writes: the local agent's replicas did not use it", reads, writes)
	}
	// Agent 1's replicas went over TCP: fewer items than all of them
	// moved through shared memory (the master spreads 48 objects over two
	// agents).
	if reads >= uint64(2*len(want)) {
		t.Fatalf("shared memory served %d reads of %d: agent 1's replicas too?", reads, 2*len(want))
	}
	if m, _ := client.ShmMapped(c); m != 0 {
		t.Fatalf("%d reads copied from the mapping with DisableMappedReads", m)
	}
	t.Logf("shared memory: %d reads, %d writes of %d objects (read twice)", reads, writes, len(want))
}

// TestSharedMemoryMappedReads: by default a read of a replica in a mapped
// segment copies the bytes at the master's offset with no request to the
// agent, single and batch gets alike; a copy that does not hold the
// object (a lookup older than a forced removal whose extent now holds
// another object) is not returned: it counts as a miss and the read goes
// to the agent, which no longer holds the allocation.
func TestSharedMemoryMappedReads(t *testing.T) {
	sock := shmSocket(t)
	h := start(t, testcluster.Options{Agents: 1, AgentMemory: 64 << 20, Agent: func(_ int, c *agentapp.Config) { c.ShmSocket = sock }})
	c := h.client(t, client.Config{SharedMemorySockets: []string{sock}})
	ctx := t.Context()
	var keys []string
	want := map[string][]byte{}
	for i := range 8 {
		key := fmt.Sprintf("mapped/%d", i)
		want[key] = bytes.Repeat([]byte{byte(i + 1)}, 4096<<(i%4)+i)
		if err := c.Put(ctx, key, want[key]); err != nil {
			t.Fatalf("Put %s: %v", key, err)
		}
		keys = append(keys, key)
	}
	for _, key := range keys {
		if got, err := c.Get(ctx, key); err != nil || !bytes.Equal(got, want[key]) {
			t.Fatalf("Get %s: %d bytes, %v", key, len(got), err)
		}
	}
	got, errs := c.BatchGet(ctx, keys)
	for i, err := range errs {
		if err != nil || !bytes.Equal(got[i], want[keys[i]]) {
			t.Fatalf("BatchGet %s: %v", keys[i], err)
		}
	}
	mapped, misses := client.ShmMapped(c)
	if mapped != uint64(2*len(keys)) || misses != 0 || client.ShmReadRequests(c) != 0 {
		t.Fatalf("%d reads copied from the mapping (%d misses) and %d read requests, want %d, 0 and 0",
			mapped, misses, client.ShmReadRequests(c), 2*len(keys))
	}

	// A lookup made before a forced removal, read after another object of
	// the same size took the extent.
	old := bytes.Repeat([]byte("o"), 64<<10)
	if err := c.Put(ctx, "mapped/old", old); err != nil {
		t.Fatal(err)
	}
	seg, off, err := client.FirstReplica(c, ctx, "mapped/old")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(old))
	// Ranges outside the mapping are refused, not copied.
	for _, off := range []uint64{1 << 62, ^uint64(0), ^uint64(0) - 1} {
		if client.CopyMapped(c, seg, off, buf[:2]) {
			t.Fatalf("CopyMapped copied 2 bytes at offset %d", off)
		}
	}
	if client.CopyMapped(c, "no-such-segment", 0, buf) {
		t.Fatal("CopyMapped copied from a segment nobody shared")
	}
	read, err := client.ReadPath(c, ctx, "mapped/old", buf)
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range c.BatchRemove(ctx, []string{"mapped/old"}, true) {
		if err != nil {
			t.Fatal(err)
		}
	}
	newer := bytes.Repeat([]byte("n"), len(old))
	// The agent frees the extent when the master's release reaches it; a
	// put that comes first lands elsewhere and is removed again.
	for try := 0; ; try++ {
		if err := c.Put(ctx, "mapped/new", newer); err != nil {
			t.Fatal(err)
		}
		s, o, err := client.FirstReplica(c, ctx, "mapped/new")
		if err != nil {
			t.Fatal(err)
		}
		if s == seg && o == off {
			break
		}
		if try == 100 {
			t.Fatalf("no put took the removed object's extent (%s at %d) in %d tries", seg, off, try)
		}
		for _, err := range c.BatchRemove(ctx, []string{"mapped/new"}, true) {
			if err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, before := client.ShmMapped(c)
	if err := read(); err == nil {
		t.Fatalf("a read of the removed object succeeded; its buffer holds %q...", buf[:8])
	}
	if _, misses := client.ShmMapped(c); misses != before+1 {
		t.Fatalf("%d mapped-read misses, want %d", misses, before+1)
	}
	if got, err := c.Get(ctx, "mapped/new"); err != nil || !bytes.Equal(got, newer) {
		t.Fatalf("Get mapped/new: %d bytes, %v", len(got), err)
	}
}

// TestSharedMemoryFallback: a socket that is absent, or whose agent is
// gone, leaves every byte on the bulk TCP path.
func TestSharedMemoryFallback(t *testing.T) {
	h := start(t, testcluster.Options{Agents: 1})
	absent := filepath.Join(os.TempDir(), "crescent-no-such-agent.sock")
	c := h.client(t, client.Config{SharedMemorySockets: []string{absent}})
	ctx := t.Context()
	data := bytes.Repeat([]byte("x"), 1<<20)
	if err := c.Put(ctx, "fallback", data); err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(ctx, "fallback")
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get: %v", err)
	}
	if r, w := client.ShmServed(c); r != 0 || w != 0 {
		t.Fatalf("shared memory served %d reads, %d writes through an absent socket", r, w)
	}
}

// TestSharedMemoryRefusedPeer: a socket whose agent refuses this process
// (its peer check: another uid) leaves every byte on the bulk TCP path.
// The refusing side here is a stand-in that answers every connection the
// way the agent answers a peer of another uid.
func TestSharedMemoryRefusedPeer(t *testing.T) {
	sock := shmSocket(t)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	refusal, err := shm.AppendRefusal(nil, status.Errorf(codes.PermissionDenied, "shm: uid %d may not map this agent's segments", os.Getuid()))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write(refusal)
			_ = c.Close()
		}
	})
	defer wg.Wait()
	defer lis.Close()
	h := start(t, testcluster.Options{Agents: 1})
	c := h.client(t, client.Config{SharedMemorySockets: []string{sock}})
	ctx := t.Context()
	data := bytes.Repeat([]byte("r"), 1<<20)
	if err := c.Put(ctx, "refused", data); err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(ctx, "refused")
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get: %v", err)
	}
	if r, w := client.ShmServed(c); r != 0 || w != 0 {
		t.Fatalf("shared memory served %d reads, %d writes through a refusing socket", r, w)
	}
}

// TestSharedMemorySealOnRelease: a single put over shared memory asks the
// agent to seal on the release of its grant and commits by the seal
// receipt, no Seal sent (as a put on the bulk path does); a checksum that
// does not match the bytes in the mapping fails the item, and the
// allocation stays unsealed.
func TestSharedMemorySealOnRelease(t *testing.T) {
	sock := shmSocket(t)
	h := start(t, testcluster.Options{Agents: 1, AgentMemory: 64 << 20, Agent: func(_ int, c *agentapp.Config) { c.ShmSocket = sock }})
	c := h.client(t, client.Config{SharedMemorySockets: []string{sock}})
	ctx := t.Context()
	store := h.Master().Store
	r0, s0 := store.PutSeals()
	want := map[string][]byte{}
	for i := range 4 {
		key := fmt.Sprintf("sealed/%d", i)
		want[key] = bytes.Repeat([]byte{byte(i + 1)}, 1000<<(2*i)+i)
		if err := c.Put(ctx, key, want[key]); err != nil {
			t.Fatalf("Put %s: %v", key, err)
		}
	}
	if _, writes := client.ShmServed(c); writes != 4 {
		t.Fatalf("shared memory served %d writes, want 4", writes)
	}
	if r, s := store.PutSeals(); r-r0 != 4 || s-s0 != 0 {
		t.Fatalf("puts committed by receipt, by Seal: +%d, +%d; want +4, +0", r-r0, s-s0)
	}
	for key, data := range want {
		if got, err := c.Get(ctx, key); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("Get %s: %d bytes, %v", key, len(got), err)
		}
	}

	// A raw put whose release carries the wrong checksum.
	data := bytes.Repeat([]byte("w"), 4096)
	resp, err := masterv1.NewObjectServiceClient(h.Conn()).PutStart(ctx, &masterv1.PutStartRequest{Key: "sealed/wrong", Size: uint64(len(data)), ClientId: "raw"})
	if err != nil {
		t.Fatal(err)
	}
	d := resp.GetReplicas()[0]
	sc := shm.New(shm.Config{Path: sock})
	defer sc.Close()
	wrong := checksum.Sum(data) + 1
	it := &agentv1.TransferItem{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(), SealChecksum: &wrong}
	res, err := sc.WriteSealed(ctx, []*agentv1.TransferItem{it}, [][]byte{data})
	if err != nil {
		t.Fatal(err)
	}
	if rpcerr.Reason(res[0].Err) != "CHECKSUM_MISMATCH" || res[0].Receipt != nil {
		t.Fatalf("a release with the wrong checksum: %v, receipt %x; want CHECKSUM_MISMATCH and none", res[0].Err, res[0].Receipt)
	}
	sg, ok := h.Agent(0).Segments().Get(d.GetSegmentId())
	if !ok {
		t.Fatalf("segment %s not found", d.GetSegmentId())
	}
	if a, ok := sg.Lookup(d.GetAllocationId()); !ok || a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
		t.Fatalf("allocation after a failed seal: %v, %v; want RESERVED", a.GetState(), ok)
	}
}
