package app

import (
	"bytes"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

type diskObj struct {
	seg  string
	id   uint64
	off  uint64
	data []byte
	key  string
}

// sealOnDisk leaves a 4 MiB disk segment in dir holding one sealed object
// per entry of datas, as an agent stopped after putting them would.
func sealOnDisk(t *testing.T, dir string, datas ...[]byte) []diskObj {
	t.Helper()
	s, _, err := segment.OpenDisk(dir, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var out []diskObj
	for i, d := range datas {
		a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: uint64(len(d)), Tenant: "t", Key: "obj-" + strconv.Itoa(i), ReplicaId: 1}, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		h, err := s.OpenWrite(a.GetAllocationId())
		if err != nil {
			t.Fatal(err)
		}
		if err := h.WriteAt(d, 0); err != nil {
			t.Fatal(err)
		}
		h.Close()
		if err := s.Seal([]segment.SealArg{{ID: a.GetAllocationId(), Checksum: checksum.Sum(d)}}, time.Now())[0]; err != nil {
			t.Fatal(err)
		}
		out = append(out, diskObj{s.ID(), a.GetAllocationId(), a.GetOffset(), d, "obj-" + strconv.Itoa(i)})
	}
	return out
}

func metricValue(t *testing.T, metrics, name string) string {
	t.Helper()
	for line := range strings.Lines(metrics) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+" "); ok {
			return v
		}
	}
	t.Fatalf("/metrics lacks %s", name)
	return ""
}

// TestCorruptDiskObjectNotRegistered: an agent restarted on a disk segment
// whose object was corrupted while it was down verifies the segment before
// registering, leaves the corrupt allocation out of Register (so the
// master removes that replica), counts it, refuses to serve it with
// DATA_LOSS CHECKSUM_MISMATCH on DataService, and serves the intact object.
func TestCorruptDiskObjectNotRegistered(t *testing.T) {
	m, addr := startMaster(t)
	dir := t.TempDir()
	objs := sealOnDisk(t, dir, bytes.Repeat([]byte("good"), 50_000), bytes.Repeat([]byte("lost"), 70_000))
	good, bad := objs[0], objs[1]
	testutil.FlipByte(t, filepath.Join(dir, "segment.data"), bad.off+123_456)

	r := startAgent(t, addr, dir)
	c := <-m.conns
	var seen []uint64
	for _, a := range c.reg.GetAllocations() {
		if a.GetSegmentId() == bad.seg {
			seen = append(seen, a.GetAllocationId())
		}
	}
	if len(seen) != 1 || seen[0] != good.id {
		t.Fatalf("registered disk allocations %v, want only the intact %d (not the corrupt %d)", seen, good.id, bad.id)
	}
	_, metrics := get(t, "http://"+r.agent.AdminAddr()+"/metrics")
	if v := metricValue(t, metrics, "crescent_agent_disk_corrupt_allocations_total"); v != "1" {
		t.Fatalf("crescent_agent_disk_corrupt_allocations_total = %s, want 1", v)
	}
	if v, want := metricValue(t, metrics, "crescent_agent_disk_verify_bytes_total"), strconv.Itoa(len(good.data)+len(bad.data)); v != want {
		t.Fatalf("crescent_agent_disk_verify_bytes_total = %s, want %s", v, want)
	}

	c.out <- settingsMsg()
	cc, err := grpc.NewClient(r.agent.DataEndpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	dc := agentv1.NewDataServiceClient(cc)
	tok := func(o diskObj) []byte {
		return token.Sign(key, token.Claims{Mode: token.Read, Tenant: "t", Key: o.key, SegmentID: o.seg, AllocationID: o.id, Expiry: time.Now().Add(time.Minute)})
	}
	var resp *agentv1.BatchReadResponse
	// Until Settings arrive the agent has no token key.
	testutil.Eventually(t, 5*time.Second, func() bool {
		resp, err = dc.BatchRead(t.Context(), &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{
			{SegmentId: bad.seg, AllocationId: bad.id, Token: tok(bad)},
			{SegmentId: good.seg, AllocationId: good.id, Token: tok(good)},
		}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetResults()[0].GetStatus().GetReason() != "INVALID_TOKEN"
	}, "the agent's token key")
	if st := resp.GetResults()[0].GetStatus(); codes.Code(st.GetCode()) != codes.DataLoss || st.GetReason() != "CHECKSUM_MISMATCH" || len(resp.GetResults()[0].GetData()) != 0 {
		t.Fatalf("BatchRead of the corrupt allocation = %v, want DATA_LOSS CHECKSUM_MISMATCH and no bytes", st)
	}
	if g := resp.GetResults()[1]; g.GetStatus().GetCode() != 0 || !bytes.Equal(g.GetData(), good.data) || g.GetChecksum() != checksum.Sum(good.data) {
		t.Fatalf("BatchRead of the intact allocation = %v, %d bytes", g.GetStatus(), len(g.GetData()))
	}
	rs, err := dc.Read(t.Context(), &agentv1.ReadRequest{SegmentId: bad.seg, AllocationId: bad.id, Token: tok(bad)})
	if err == nil {
		_, err = rs.Recv()
	}
	if status.Code(err) != codes.DataLoss {
		t.Fatalf("Read of the corrupt allocation = %v, want DATA_LOSS", err)
	}
	// Nor through the bulk transfer listener.
	pool := xfer.NewPool(xfer.Config{})
	defer pool.Close()
	res, err := pool.Read(t.Context(), c.reg.GetTransferEndpoint(), []*agentv1.TransferItem{
		{SegmentId: bad.seg, AllocationId: bad.id, Token: tok(bad)},
		{SegmentId: good.seg, AllocationId: good.id, Token: tok(good)},
	}, [][]byte{make([]byte, len(bad.data)), make([]byte, len(good.data))})
	if err != nil {
		t.Fatalf("transfer Read: %v", err)
	}
	if status.Code(res[0].Err) != codes.DataLoss || rpcerr.Reason(res[0].Err) != "CHECKSUM_MISMATCH" {
		t.Fatalf("transfer Read of the corrupt allocation = %v, want DATA_LOSS CHECKSUM_MISMATCH", res[0].Err)
	}
	if res[1].Err != nil || res[1].Checksum != checksum.Sum(good.data) {
		t.Fatalf("transfer Read of the intact allocation = %+v", res[1])
	}
	r.stop(t)
	<-c.done

	// The drop is durable, and a clean segment verifies clean.
	r2 := startAgent(t, addr, dir)
	c2 := <-m.conns
	_, metrics = get(t, "http://"+r2.agent.AdminAddr()+"/metrics")
	if v := metricValue(t, metrics, "crescent_agent_disk_corrupt_allocations_total"); v != "0" {
		t.Fatalf("second restart: crescent_agent_disk_corrupt_allocations_total = %s, want 0", v)
	}
	for _, a := range c2.reg.GetAllocations() {
		if a.GetSegmentId() == bad.seg && a.GetAllocationId() == bad.id {
			t.Fatal("the corrupt allocation came back after a second restart")
		}
	}
	r2.stop(t)
}

// TestVerifyDiskOff: with --verify-disk=false the segment is trusted as
// before (start-up does not read it).
func TestVerifyDiskOff(t *testing.T) {
	m, addr := startMaster(t)
	dir := t.TempDir()
	objs := sealOnDisk(t, dir, bytes.Repeat([]byte("x"), 10_000))
	testutil.FlipByte(t, filepath.Join(dir, "segment.data"), objs[0].off)
	r := startAgentWith(t, addr, dir, func(c *Config) { c.VerifyDisk = false })
	c := <-m.conns
	found := false
	for _, a := range c.reg.GetAllocations() {
		found = found || a.GetAllocationId() == objs[0].id && a.GetSegmentId() == objs[0].seg
	}
	if !found {
		t.Fatal("with verification off the allocation was not registered")
	}
	_, metrics := get(t, "http://"+r.agent.AdminAddr()+"/metrics")
	if v := metricValue(t, metrics, "crescent_agent_disk_verify_bytes_total"); v != "0" {
		t.Fatalf("crescent_agent_disk_verify_bytes_total = %s with verification off, want 0", v)
	}
	r.stop(t)
}
