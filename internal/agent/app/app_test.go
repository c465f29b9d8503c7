package app

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestMain(m *testing.M) {
	if master := os.Getenv(benchAgentEnv); master != "" {
		os.Exit(benchAgentChild(master)) // the agent process of BenchmarkPutCycle
	}
	goleak.VerifyTestMain(m)
}

// master is a minimal hand-written SegmentService: each Connect is handed
// to the test as a conn it drives.
type master struct {
	masterv1.UnimplementedSegmentServiceServer
	conns chan *conn
}

type conn struct {
	reg  *masterv1.Register
	in   chan *masterv1.ConnectRequest
	out  chan *masterv1.ConnectResponse
	done chan struct{}
}

func (m *master) Connect(stream masterv1.SegmentService_ConnectServer) error {
	reg, err := recvRegister(stream)
	if err != nil {
		return err
	}
	c := &conn{reg: reg, in: make(chan *masterv1.ConnectRequest, 1024), out: make(chan *masterv1.ConnectResponse, 16), done: make(chan struct{})}
	defer close(c.done)
	select {
	case m.conns <- c:
	case <-stream.Context().Done():
		return nil
	}
	errc := make(chan error, 1)
	go func() {
		for {
			msg, err := stream.Recv()
			if err != nil {
				errc <- err
				return
			}
			if msg.GetHeartbeat() == nil && msg.GetSettingsApplied() == nil {
				c.in <- msg
			}
		}
	}()
	for {
		select {
		case msg := <-c.out:
			if err := stream.Send(msg); err != nil {
				return err
			}
		case err := <-errc:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

func (c *conn) next(t *testing.T) *masterv1.ConnectRequest {
	t.Helper()
	select {
	case m := <-c.in:
		return m
	case <-time.After(5 * time.Second):
		t.Fatal("no message from the agent")
		return nil
	}
}

func startMaster(t *testing.T) (*master, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := &master{conns: make(chan *conn, 4)}
	gs := grpc.NewServer()
	masterv1.RegisterSegmentServiceServer(gs, m)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return m, lis.Addr().String()
}

type running struct {
	agent  *Agent
	cancel context.CancelFunc
	done   chan error
}

func startAgent(t *testing.T, masterAddr, diskDir string) *running {
	t.Helper()
	return startAgentWith(t, masterAddr, diskDir, func(*Config) {})
}

func startAgentWith(t *testing.T, masterAddr, diskDir string, mutate func(*Config)) *running {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Master, cfg.GRPCAddr, cfg.AdminAddr, cfg.HostID = masterAddr, "127.0.0.1:0", "127.0.0.1:0", "host-t"
	cfg.Memory, cfg.MemorySegments = config.ByteSize(8<<20), 2
	cfg.DiskDir, cfg.DiskSize = diskDir, config.ByteSize(4<<20)
	cfg.ShutdownGrace, cfg.ShutdownTimeout = 100*time.Millisecond, time.Second
	mutate(&cfg)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	a := New(cfg, testutil.Logger(), obs.NewRegistry())
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{agent: a, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- a.Run(ctx) }()
	select {
	case <-a.Ready():
	case err := <-r.done:
		t.Fatalf("agent Run = %v before ready", err)
	case <-time.After(5 * time.Second):
		t.Fatal("agent not ready")
	}
	return r
}

func (r *running) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("agent Run = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("agent did not stop")
	}
}

var key = token.SigningKey{ID: 1, Secret: []byte("0123456789abcdef0123456789abcdef")}

func settingsMsg() *masterv1.ConnectResponse {
	return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: &masterv1.Settings{
		Epoch: 1, HeartbeatInterval: durationpb.New(50 * time.Millisecond), ReservedGrace: durationpb.New(time.Minute),
		TokenKeys: []*masterv1.TokenKey{{Id: key.ID, Key: key.Secret}},
	}}}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestAgentEndToEnd(t *testing.T) {
	m, addr := startMaster(t)
	dir := t.TempDir()
	r := startAgent(t, addr, dir)
	c := <-m.conns
	if len(c.reg.GetSegments()) != 3 || c.reg.GetDataEndpoint() != r.agent.DataEndpoint() || c.reg.GetHostId() != "host-t" {
		t.Fatalf("Register = %v", c.reg)
	}
	// One master: nothing to follow, so no feed and no position.
	if p := c.reg.GetTablePosition(); p != nil || c.reg.GetResume() {
		t.Fatalf("Register table_position %v, resume %v; want neither with one master", p, c.reg.GetResume())
	}
	if ep := c.reg.GetTransferEndpoint(); ep == "" || ep != r.agent.TransferEndpoint() || ep == r.agent.DataEndpoint() {
		t.Fatalf("Register.transfer_endpoint = %q, want the agent's own transfer listener (%q)", ep, r.agent.TransferEndpoint())
	}
	if code, _ := get(t, "http://"+r.agent.AdminAddr()+"/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz before Settings = %d, want 503", code)
	}
	c.out <- settingsMsg()
	testutil.Eventually(t, 5*time.Second, func() bool {
		code, _ := get(t, "http://"+r.agent.AdminAddr()+"/readyz")
		return code == http.StatusOK
	}, "/readyz to answer 200")

	var disk *masterv1.SegmentInfo
	for _, s := range c.reg.GetSegments() {
		if s.GetMedium() == masterv1.Medium_MEDIUM_DISK {
			disk = s
		}
	}
	data := bytes.Repeat([]byte("crescent"), 100_000)
	c.out <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 1, Epoch: 1, Items: []*masterv1.ReserveItem{
		{SegmentId: disk.GetSegmentId(), Size: uint64(len(data)), Tenant: "t", Key: "obj", ReplicaId: 1},
	}}}}
	rr := c.next(t).GetReserveResult()
	if rr.GetItems()[0].GetStatus().GetCode() != 0 {
		t.Fatalf("reserve = %v", rr)
	}
	id := rr.GetItems()[0].GetAllocationId()

	// A client writes through DataService over TCP with a write token.
	cc, err := grpc.NewClient(r.agent.DataEndpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	dc := agentv1.NewDataServiceClient(cc)
	exp := time.Now().Add(time.Minute)
	ws, err := dc.Write(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := ws.Send(&agentv1.WriteRequest{Header: &agentv1.WriteHeader{SegmentId: disk.GetSegmentId(), AllocationId: id,
		Token: token.Sign(key, token.Claims{Mode: token.Write, Tenant: "t", Key: "obj", SegmentID: disk.GetSegmentId(), AllocationID: id, Expiry: exp})}, Data: data}); err != nil {
		t.Fatal(err)
	}
	if resp, err := ws.CloseAndRecv(); err != nil || resp.GetBytesWritten() != uint64(len(data)) {
		t.Fatalf("Write = %v, %v", resp, err)
	}
	c.out <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 2, Epoch: 1, Items: []*masterv1.SealItem{
		{SegmentId: disk.GetSegmentId(), AllocationId: id, Checksum: checksum.Sum(data)},
	}}}}
	if sr := c.next(t).GetSealResult(); sr.GetItems()[0].GetCode() != 0 {
		t.Fatalf("seal = %v", sr)
	}
	rs, err := dc.Read(t.Context(), &agentv1.ReadRequest{SegmentId: disk.GetSegmentId(), AllocationId: id,
		Token: token.Sign(key, token.Claims{Mode: token.Read, Tenant: "t", Key: "obj", SegmentID: disk.GetSegmentId(), AllocationID: id, Expiry: exp}), ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	var got []byte
	for {
		msg, err := rs.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, msg.GetData()...)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("read back %d bytes, want the %d written", len(got), len(data))
	}
	// The same object through the bulk transfer listener it registered.
	pool := xfer.NewPool(xfer.Config{})
	defer pool.Close()
	got = make([]byte, len(data))
	res, err := pool.Read(t.Context(), c.reg.GetTransferEndpoint(), []*agentv1.TransferItem{{SegmentId: disk.GetSegmentId(), AllocationId: id,
		Token: token.Sign(key, token.Claims{Mode: token.Read, Tenant: "t", Key: "obj", SegmentID: disk.GetSegmentId(), AllocationID: id, Expiry: exp})}}, [][]byte{got})
	if err != nil || res[0].Err != nil || !bytes.Equal(got, data) || res[0].Checksum != checksum.Sum(data) {
		t.Fatalf("transfer Read = %+v, %v (bytes equal: %v)", res, err, bytes.Equal(got, data))
	}

	_, metrics := get(t, "http://"+r.agent.AdminAddr()+"/metrics")
	for _, want := range []string{"crescent_agent_segment_capacity_bytes", "crescent_agent_segment_used_bytes", "crescent_agent_data_bytes_in_total", "crescent_agent_link_state 2", "grpc_server_handled_total"} {
		if !strings.Contains(metrics, want) {
			t.Fatalf("/metrics lacks %q", want)
		}
	}

	// SIGTERM: Deregister, grace, stream closed, Run returns.
	r.cancel()
	if d := c.next(t).GetDeregister(); d == nil {
		t.Fatal("no Deregister on shutdown")
	}
	r.stop(t)
	<-c.done

	// Restart on the same directory: the same disk segment comes back
	// with the sealed object, under a new memory segment pair.
	r2 := startAgent(t, addr, dir)
	c2 := <-m.conns
	var found bool
	for _, a := range c2.reg.GetAllocations() {
		if a.GetSegmentId() == disk.GetSegmentId() && a.GetAllocationId() == id && a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED && a.GetKey() == "obj" {
			found = true
		}
	}
	if !found {
		t.Fatalf("restarted agent did not re-register the sealed allocation: %v", c2.reg.GetAllocations())
	}
	for _, s := range c2.reg.GetSegments() {
		if s.GetMedium() == masterv1.Medium_MEDIUM_MEMORY {
			for _, old := range c.reg.GetSegments() {
				if old.GetSegmentId() == s.GetSegmentId() {
					t.Fatalf("memory segment id %s reused after restart", s.GetSegmentId())
				}
			}
		}
	}
	r2.stop(t)
}

func TestConfigValidate(t *testing.T) {
	base := DefaultConfig()
	base.Master, base.HostID = "m:1", "h"
	tests := []struct {
		name   string
		mutate func(*Config)
		ok     bool
	}{
		{"defaults with master", func(*Config) {}, true},
		{"no master", func(c *Config) { c.Master = "" }, false},
		{"no host", func(c *Config) { c.HostID = "" }, false},
		{"zero segments", func(c *Config) { c.MemorySegments = 0 }, false},
		{"segments too small", func(c *Config) { c.Memory, c.MemorySegments = 1<<20, 4 }, false},
		{"disk size without dir", func(c *Config) { c.DiskSize = 1 << 30 }, false},
		{"disk dir without size", func(c *Config) { c.DiskDir = "/tmp/x" }, false},
		{"nothing to offer", func(c *Config) { c.Memory = 0 }, false},
		{"disk only", func(c *Config) { c.Memory, c.DiskDir, c.DiskSize = 0, "/tmp/x", 1<<30 }, true},
		{"tiny read chunk", func(c *Config) { c.ReadChunk = 100 }, false},
		{"transfer off", func(c *Config) { c.TransferAddr = "off" }, true},
		{"transfer address", func(c *Config) { c.TransferAddr, c.AdvertiseTransferAddr = "127.0.0.1:50054", "agent:50054" }, true},
		{"transfer address without port", func(c *Config) { c.TransferAddr = "127.0.0.1" }, false},
		{"advertised transfer without port", func(c *Config) { c.AdvertiseTransferAddr = "agent" }, false},
		{"advertised transfer while off", func(c *Config) { c.TransferAddr, c.AdvertiseTransferAddr = "off", "agent:1" }, false},
		{"no transfer connections", func(c *Config) { c.TransferMaxConns = 0 }, false},
		{"more per IP than in all", func(c *Config) { c.TransferMaxConns, c.TransferMaxConnsPerIP = 10, 11 }, false},
		{"transfer header over the protocol's", func(c *Config) { c.TransferMaxHeaderBytes = 1<<20 + 1 }, false},
		{"tiny transfer header", func(c *Config) { c.TransferMaxHeaderBytes = 100 }, false},
		{"no transfer io timeout", func(c *Config) { c.TransferIOTimeout = 0 }, false},
		{"transfer items below one request", func(c *Config) { c.TransferMaxItems = 4095 }, false},
		{"small transfer limits", func(c *Config) { c.TransferMaxConns, c.TransferMaxConnsPerIP, c.TransferMaxHeaderBytes = 1, 1, 4<<10 }, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.mutate(&c)
			if err := c.Validate(); (err == nil) != tc.ok {
				t.Fatalf("Validate = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestAdvertise(t *testing.T) {
	tests := []struct {
		configured, bound, want string
		wantErr                 bool
	}{
		{"", "127.0.0.1:50052", "127.0.0.1:50052", false},
		{"agent.example:1", "[::]:50052", "agent.example:1", false},
		{"no-port", "127.0.0.1:1", "", true},
	}
	for _, tc := range tests {
		got, err := advertise(tc.configured, tc.bound)
		if (err != nil) != tc.wantErr || (!tc.wantErr && got != tc.want) {
			t.Fatalf("advertise(%q, %q) = %q, %v; want %q", tc.configured, tc.bound, got, err, tc.want)
		}
	}
	if got, err := advertise("", "[::]:50052"); err != nil || strings.HasPrefix(got, "[::]") {
		t.Fatalf("advertise of an unspecified address = %q, %v; want the host name", got, err)
	}
}

func TestTransferAddresses(t *testing.T) {
	listen := []struct{ configured, grpc, want string }{
		{"", ":50052", ":0"},
		{"", "127.0.0.1:50052", "127.0.0.1:0"},
		{"", "[::1]:50052", "[::1]:0"},
		{"off", "127.0.0.1:50052", ""},
		{"127.0.0.1:50054", "127.0.0.1:50052", "127.0.0.1:50054"},
	}
	for _, tc := range listen {
		if got := transferListenAddr(tc.configured, tc.grpc); got != tc.want {
			t.Errorf("transferListenAddr(%q, %q) = %q, want %q", tc.configured, tc.grpc, got, tc.want)
		}
	}
	adv := []struct{ configured, data, bound, want string }{
		{"", "", "127.0.0.1:41234", "127.0.0.1:41234"},
		{"xfer.example:9", "data.example:1", "127.0.0.1:41234", "xfer.example:9"},
		{"", "data.example:1", "0.0.0.0:41234", "data.example:41234"},
	}
	for _, tc := range adv {
		if got, err := advertiseTransfer(tc.configured, tc.data, tc.bound); err != nil || got != tc.want {
			t.Errorf("advertiseTransfer(%q, %q, %q) = %q, %v; want %q", tc.configured, tc.data, tc.bound, got, err, tc.want)
		}
	}
}

func TestTransferOff(t *testing.T) {
	m, addr := startMaster(t)
	r := startAgentWith(t, addr, t.TempDir(), func(c *Config) { c.TransferAddr = TransferOff })
	c := <-m.conns
	if ep := c.reg.GetTransferEndpoint(); ep != "" || r.agent.TransferEndpoint() != "" {
		t.Fatalf("transfer endpoint with --transfer-addr off = %q / %q, want none", ep, r.agent.TransferEndpoint())
	}
	r.stop(t)
}

// TestShmemTHP: the kernel's shmem huge-page mode is the bracketed word;
// a file without one, or none at all, says nothing.
func TestShmemTHP(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		content, want string
		ok            bool
	}{
		{"always within_size advise [never] deny force\n", "never", true},
		{"always within_size [advise] never deny force\n", "advise", true},
		{"[always] within_size advise never deny force", "always", true},
		{"always advise never\n", "", false},
		{"", "", false},
	} {
		p := filepath.Join(dir, "shmem_enabled")
		if err := os.WriteFile(p, []byte(tc.content), 0o600); err != nil {
			t.Fatal(err)
		}
		if got, ok := shmemTHP(p); got != tc.want || ok != tc.ok {
			t.Errorf("shmemTHP(%q) = %q, %v; want %q, %v", tc.content, got, ok, tc.want, tc.ok)
		}
	}
	if _, ok := shmemTHP(filepath.Join(dir, "missing")); ok {
		t.Error("a missing file says a mode")
	}
}
