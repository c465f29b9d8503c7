package app

import (
	"bytes"
	"encoding/binary"
	"io"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestAgentTransferLimits runs a whole agent with small transfer limits
// (the flags' fields) and plays hostile peers against its transfer
// listener: the limits hold, the refusals carry RESOURCE_EXHAUSTED
// LIMIT_EXCEEDED and are counted in /metrics, huge reservations are
// refused, and a normal write and read still work.
func TestAgentTransferLimits(t *testing.T) {
	m, addr := startMaster(t)
	r := startAgentWith(t, addr, "", func(c *Config) {
		c.DiskDir, c.DiskSize = "", 0
		c.TransferMaxConns, c.TransferMaxConnsPerIP = 4, 2
		c.TransferMaxHeaderBytes = config.ByteSize(4 << 10)
	})
	defer r.stop(t)
	c := <-m.conns
	c.out <- settingsMsg()
	ep := r.agent.TransferEndpoint()
	seg := c.reg.GetSegments()[0].GetSegmentId()

	dial := func(src string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		nc, err := d.Dial("tcp", ep)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = nc.Close() })
		_ = nc.SetDeadline(time.Now().Add(10 * time.Second))
		return nc
	}
	refused := func(nc net.Conn, wire []byte) error {
		t.Helper()
		if _, err := nc.Write(wire); err != nil {
			t.Fatal(err)
		}
		resp := &agentv1.TransferResponse{}
		if _, err := xfer.ReadFrame(nc, nil, resp); err != nil || resp.GetError() == nil {
			t.Fatalf("refusal = %v, %v", resp, err)
		}
		if n, err := io.Copy(io.Discard, nc); n != 0 || err != nil {
			t.Fatalf("after the refusal: %d bytes, %v; want EOF", n, err)
		}
		_ = nc.Close()
		return xfer.ItemError(resp.GetError())
	}
	wantLimit := func(err error) {
		t.Helper()
		if rpcerr.Reason(err) != "LIMIT_EXCEEDED" || status.Code(rpcerr.Status(err)) != codes.ResourceExhausted {
			t.Fatalf("refused with %v, want RESOURCE_EXHAUSTED LIMIT_EXCEEDED", err)
		}
	}
	pre := []byte(xfer.Preamble)

	// A header over --transfer-max-header-bytes.
	wantLimit(refused(dial("127.0.0.1"), append(append([]byte(nil), pre...), binary.LittleEndian.AppendUint32(nil, 5000)...)))
	// A third connection from one address.
	for range 2 {
		if _, err := dial("127.0.0.2").Write(pre); err != nil {
			t.Fatal(err)
		}
	}
	wantLimit(refused(dial("127.0.0.2"), pre))
	for _, want := range []string{`crescent_agent_transfer_connections_refused_total{limit="max_connections_per_ip"} 1`, "crescent_agent_transfer_connections 2\n"} {
		// The refused connections close as the agent sees the client go.
		testutil.Eventually(t, 5*time.Second, func() bool {
			_, metrics := get(t, "http://"+r.agent.AdminAddr()+"/metrics")
			return strings.Contains(metrics, want)
		}, "/metrics to hold %q", want)
	}

	// Reservations of sizes near 2^64 are refused, not wrapped.
	c.out <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 1, Epoch: 1, Items: []*masterv1.ReserveItem{
		{SegmentId: seg, Size: math.MaxUint64, Tenant: "t", Key: "huge", ReplicaId: 1},
		{SegmentId: seg, Size: 1 << 63, Tenant: "t", Key: "huge2", ReplicaId: 1},
		{SegmentId: seg, Size: 1000, Tenant: "t", Key: "obj", ReplicaId: 1},
	}}}}
	rr := c.next(t).GetReserveResult()
	for i, it := range rr.GetItems()[:2] {
		if it.GetStatus().GetCode() == 0 || it.GetAllocationId() != 0 {
			t.Fatalf("reserve item %d of a size near 2^64 = %v, want refused", i, it)
		}
		t.Logf("reserve item %d of a size near 2^64: %v", i, it.GetStatus())
	}
	if rr.GetItems()[2].GetStatus().GetCode() != 0 {
		t.Fatalf("reserve = %v", rr)
	}
	id := rr.GetItems()[2].GetAllocationId()

	// A normal client still writes and reads.
	pool := xfer.NewPool(xfer.Config{})
	defer pool.Close()
	exp := time.Now().Add(time.Minute)
	tok := func(mode token.Mode) []byte {
		return token.Sign(key, token.Claims{Mode: mode, Tenant: "t", Key: "obj", SegmentID: seg, AllocationID: id, Expiry: exp})
	}
	data := bytes.Repeat([]byte("x"), 1000)
	errs, err := pool.Write(t.Context(), ep, []*agentv1.TransferItem{{SegmentId: seg, AllocationId: id, Token: tok(token.Write)}}, [][]byte{data})
	if err != nil || errs[0] != nil {
		t.Fatalf("transfer Write = %v, %v", errs, err)
	}
	c.out <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 2, Epoch: 1, Items: []*masterv1.SealItem{
		{SegmentId: seg, AllocationId: id, Checksum: checksum.Sum(data)},
	}}}}
	if sr := c.next(t).GetSealResult(); sr.GetItems()[0].GetCode() != 0 {
		t.Fatalf("seal = %v", sr)
	}
	got := make([]byte, len(data))
	res, err := pool.Read(t.Context(), ep, []*agentv1.TransferItem{{SegmentId: seg, AllocationId: id, Token: tok(token.Read)}}, [][]byte{got})
	if err != nil || res[0].Err != nil || !bytes.Equal(got, data) {
		t.Fatalf("transfer Read = %+v, %v", res, err)
	}
}
