package app

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// followAgent is a hand-driven agent end of SegmentService for one
// agent id with one memory segment.
type followAgent struct {
	id, seg string
}

func (a followAgent) register(count uint64, pos *masterv1.TablePosition, resume bool) *masterv1.ConnectRequest {
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{
		AgentId: a.id, HostId: "host-" + a.id, DataEndpoint: "127.0.0.1:1",
		Segments: []*masterv1.SegmentInfo{{SegmentId: a.seg, Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 1 << 20, Alignment: 64}},
		Chunked:  true, AllocationCount: count, TablePosition: pos, Resume: resume,
	}}}
}

func (a followAgent) alloc(id uint64, key string) *masterv1.Allocation {
	return &masterv1.Allocation{SegmentId: a.seg, AllocationId: id, Offset: id * 256, Size: 100,
		State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Tenant: "t", Key: key, Checksum: 1000 + id,
		CreatedUnixMs: 1, SealedUnixMs: int64(id)}
}

func (a followAgent) table(allocs ...*masterv1.Allocation) []*masterv1.ConnectRequest {
	for _, x := range allocs {
		x.SegmentId = ""
	}
	return []*masterv1.ConnectRequest{{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: &masterv1.RegisterChunk{
		SegmentId: a.seg, Allocations: allocs, Last: true}}}}
}

func delta(from, to uint64, sealed, released []*masterv1.Allocation) *masterv1.ConnectRequest {
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_TableDelta{TableDelta: &masterv1.TableDelta{
		FromVersion: from, Version: to, Sealed: sealed, Released: released}}}
}

type connectStream interface {
	Send(*masterv1.ConnectRequest) error
	Recv() (*masterv1.ConnectResponse, error)
}

func sendAll(t *testing.T, s connectStream, msgs ...*masterv1.ConnectRequest) {
	t.Helper()
	for _, m := range msgs {
		if err := s.Send(m); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
}

// applied is an agent's answer to st once it holds st's keys: the master
// makes the agent's segments readable on it.
func applied(st *masterv1.Settings) *masterv1.ConnectRequest {
	a := &masterv1.SettingsApplied{}
	if keys := st.GetTokenKeys(); len(keys) > 0 {
		a.TokenKeyId = keys[0].GetId()
	}
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SettingsApplied{SettingsApplied: a}}
}

func recv(t *testing.T, s connectStream) *masterv1.ConnectResponse {
	t.Helper()
	r, err := s.Recv()
	if err != nil {
		t.Fatalf("recv: %v", err)
	}
	return r
}

// TestWarmStandbyResumes follows two agents into a standby's master, moves
// their tables on with deltas, elects it, and checks that an agent whose
// followed position matches registers without its table (resumed, its
// objects readable at once under the new epoch) while one that does not
// is asked for its table and registers in full on the same stream.
func TestWarmStandbyResumes(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.RecoveryGrace = 0
	m, err := newStandbyMaster(cfg, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	m.Sessions.SetStandby()

	// The standby's SegmentService, as standBy serves it.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	masterv1.RegisterSegmentServiceServer(gs, &standbySegments{m: m.Sessions, notLeader: func() error {
		return rpcerr.Status(rpcerr.NotLeader("leader:1"))
	}})
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	seg := masterv1.NewSegmentServiceClient(cc)

	// A standby refuses Connect with the leader's address.
	c, err := seg.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Recv(); rpcerr.Reason(err) != "NOT_LEADER" {
		t.Fatalf("standby Connect: %v, want NOT_LEADER", err)
	}

	a1 := followAgent{"agent-1", "seg-1"}
	f1, err := seg.Follow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendAll(t, f1, a1.register(3, &masterv1.TablePosition{Instance: "i1", Version: 5}, false))
	sendAll(t, f1, a1.table(a1.alloc(1, "k1"), a1.alloc(2, "k2"), a1.alloc(3, "k3"))...)
	if st := recv(t, f1).GetSettings(); st == nil || !st.GetStandby() || len(st.GetTokenKeys()) != 0 {
		t.Fatalf("follow answer %v, want Settings with standby and no keys", st)
	}
	// Changes 6 and 7 (k4 sealed, k1 released); then 8, which repeats an
	// allocation the table already showed (a no-op).
	sendAll(t, f1, delta(5, 7, []*masterv1.Allocation{a1.alloc(4, "k4")}, []*masterv1.Allocation{a1.alloc(1, "k1")}),
		delta(7, 8, []*masterv1.Allocation{a1.alloc(2, "k2")}, nil))
	waitFor(t, func() bool { o, _, _ := m.Store.Stats(); return o == 3 && m.Store.Log().Head() >= 5 })

	// A delta that does not continue the position ends the stream.
	a2 := followAgent{"agent-2", "seg-2"}
	f2, err := seg.Follow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendAll(t, f2, a2.register(1, &masterv1.TablePosition{Instance: "i2", Version: 1}, false))
	sendAll(t, f2, a2.table(a2.alloc(1, "j1"))...)
	recv(t, f2)
	sendAll(t, f2, delta(3, 4, []*masterv1.Allocation{a2.alloc(2, "j2")}, nil))
	if _, err := f2.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("delta out of sequence: %v, want InvalidArgument", err)
	}

	// Elected.
	m.Sessions.EndFollowing()
	if _, err := f1.Recv(); rpcerr.Reason(err) != "MASTER_IS_LEADER" {
		t.Fatalf("follow stream after the election: %v, want MASTER_IS_LEADER", err)
	}
	gs.Stop()
	m.promote(42, nil)
	if m.Store.Epoch() != 42 || m.Store.Log().Epoch() != 42 || m.Store.Log().Head() != 0 {
		t.Fatalf("promoted store: epoch %d, log epoch %d head %d; want 42, 42, 0", m.Store.Epoch(), m.Store.Log().Epoch(), m.Store.Log().Head())
	}
	if err := m.Server.Listen(); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.run(rctx) }()
	defer func() { stop(); <-done }()
	lc, err := grpc.NewClient(m.Server.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close()
	lseg := masterv1.NewSegmentServiceClient(lc)

	// The leader refuses Follow.
	f, err := lseg.Follow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Recv(); rpcerr.Reason(err) != "MASTER_IS_LEADER" {
		t.Fatalf("leader Follow: %v, want MASTER_IS_LEADER", err)
	}

	c1, err := lseg.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendAll(t, c1, a1.register(0, &masterv1.TablePosition{Instance: "i1", Version: 8}, true))
	st := recv(t, c1).GetSettings()
	if st == nil || !st.GetResumed() || st.GetEpoch() != 42 || len(st.GetTokenKeys()) == 0 {
		t.Fatalf("resume answer %v, want Settings resumed in epoch 42 with keys", st)
	}
	sendAll(t, c1, applied(st))
	obj := masterv1.NewObjectServiceClient(lc)
	for _, k := range []string{"k2", "k3", "k4"} {
		waitFor(t, func() bool {
			r, err := obj.Exist(ctx, &masterv1.ExistRequest{Tenant: "t", Key: k})
			return err == nil && r.GetExists()
		})
	}
	if r, err := obj.Exist(ctx, &masterv1.ExistRequest{Tenant: "t", Key: "k1"}); err != nil || r.GetExists() {
		t.Fatalf("k1 (released while followed): %v %v, want absent", r, err)
	}

	// agent-2's follow stopped at 1; it offers 4: its table is asked for.
	c2, err := lseg.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendAll(t, c2, a2.register(0, &masterv1.TablePosition{Instance: "i2", Version: 4}, true))
	if tr := recv(t, c2).GetTableRequest(); tr == nil || tr.GetReason() == "" {
		t.Fatalf("want TableRequest with a reason")
	}
	sendAll(t, c2, a2.register(2, &masterv1.TablePosition{Instance: "i2", Version: 4}, false))
	sendAll(t, c2, a2.table(a2.alloc(1, "j1"), a2.alloc(2, "j2"))...)
	st = recv(t, c2).GetSettings()
	if st == nil || st.GetResumed() {
		t.Fatalf("full registration answer %v, want Settings not resumed", st)
	}
	sendAll(t, c2, applied(st))
	waitFor(t, func() bool {
		r, err := obj.Exist(ctx, &masterv1.ExistRequest{Tenant: "t", Key: "j2"})
		return err == nil && r.GetExists()
	})
	c1.CloseSend()
	c2.CloseSend()
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStandbyMetrics scrapes a leader and a standby: crescent_master_leader
// tells them apart, the standby exports its follow metrics and runtime
// collectors but none of the serving master's families (the alerts count
// the masters that export crescent_master_recovering).
func TestStandbyMetrics(t *testing.T) {
	etcd := etcdtest.Start(t)
	admin := map[*haMaster]string{}
	var ms []*haMaster
	for range 2 {
		a := freePort(t)
		m := startHAMaster(t, etcd.Endpoint, func(c *Config) { c.AdminAddr = a })
		admin[m] = a
		ms = append(ms, m)
	}
	lead, _ := leaderOf(t, ms)
	scrape := func(m *haMaster) string {
		resp, err := http.Get("http://" + admin[m] + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("scrape %s: %d %v", admin[m], resp.StatusCode, err)
		}
		return string(b)
	}
	for _, m := range ms {
		body := scrape(m)
		has := func(s string) bool { return strings.Contains(body, s) }
		if m == lead {
			if !has("\ncrescent_master_leader 1\n") || !has("\ncrescent_master_recovering ") {
				t.Fatalf("leader's metrics lack crescent_master_leader 1 or crescent_master_recovering")
			}
			continue
		}
		if !has("\ncrescent_master_leader 0\n") || !has("\ncrescent_master_agent_follow_changes_total 0\n") || !has("\ngo_goroutines ") {
			t.Fatalf("standby's metrics lack crescent_master_leader 0, the follow metrics or the runtime's:\n%s", body)
		}
		if has("crescent_master_recovering") || has("crescent_master_objects") {
			t.Fatalf("standby exports the serving master's families")
		}
	}
}

// TestEndFollowingEndsEveryStream: an election ends every Follow stream at
// once, including one that has not registered yet (EndFollowing waits for
// their handlers, and the standby's server stops only after it returns).
func TestEndFollowingEndsEveryStream(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	m, seg := serveStandby(t, cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	// A stream that has sent nothing yet: its handler waits for a Register.
	f, err := seg.Follow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_ = f
	time.Sleep(200 * time.Millisecond) // the handler is running, waiting
	done := make(chan struct{})
	go func() { m.Sessions.EndFollowing(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("EndFollowing still waiting 3s after the election: a follow stream was not ended")
	}
}

// TestStandbyEndsFollowOfLostAgent: a standby whose sweep finds a followed
// agent lost (no heartbeat within unmount-after: it stalled) unmounts its
// segments, and ends its follow stream, as a leader ends a lost agent's
// session. A stream that went on applied the agent's next deltas to
// segments no longer mounted: objects the standby, once elected, listed
// and never served (the soak, seed 41838869).
func TestStandbyEndsFollowOfLostAgent(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.HeartbeatInterval, cfg.SuspectAfter, cfg.UnmountAfter = 50*time.Millisecond, 100*time.Millisecond, 300*time.Millisecond
	m, seg := serveStandby(t, cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	sweepCtx, stopSweep := context.WithCancel(ctx)
	swept := make(chan struct{})
	go func() { _ = m.Sessions.Run(sweepCtx); close(swept) }()
	defer func() { stopSweep(); <-swept }()

	a := followAgent{"agent-1", "seg-1"}
	f, err := seg.Follow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendAll(t, f, a.register(1, &masterv1.TablePosition{Instance: "i1", Version: 1}, false))
	sendAll(t, f, a.table(a.alloc(1, "k1"))...)
	if st := recv(t, f).GetSettings(); st == nil || !st.GetStandby() {
		t.Fatalf("follow answer %v, want standby Settings", st)
	}
	// The agent stalls: no heartbeat. The sweep finds it lost.
	got := make(chan error, 1)
	go func() {
		_, err := f.Recv()
		got <- err
	}()
	select {
	case err := <-got:
		if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
			t.Fatalf("the follow stream ended with %v, want AGENT_UNAVAILABLE", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the follow stream of an agent the standby found lost still runs 5 s later")
	}
	if o, _, _ := m.Store.Stats(); o != 0 {
		t.Fatalf("%d objects on the standby after the agent was lost, want 0", o)
	}
}

// serveStandby starts a standby's master on cfg and serves its
// SegmentService as standBy does (Connect refused without a leader's
// address); the test's cleanup stops them.
func serveStandby(t *testing.T, cfg Config) (*Master, masterv1.SegmentServiceClient) {
	t.Helper()
	m, err := newStandbyMaster(cfg, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.discard)
	m.Sessions.SetStandby()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	masterv1.RegisterSegmentServiceServer(gs, &standbySegments{m: m.Sessions, notLeader: func() error { return nil }})
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return m, masterv1.NewSegmentServiceClient(cc)
}
