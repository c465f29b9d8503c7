package link

import (
	"bytes"
	"context"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/dataplane"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func sealedAlloc(t testing.TB, seg *segment.Segment, key string, data []byte) *masterv1.Allocation {
	t.Helper()
	a, err := seg.Reserve(&masterv1.ReserveItem{SegmentId: seg.ID(), Size: uint64(len(data)), Tenant: "t", Key: key, ReplicaId: 1}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	h, err := seg.OpenWrite(a.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	if err := h.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	h.Close()
	if err := seg.Seal([]segment.SealArg{{ID: a.GetAllocationId(), Checksum: checksum.Sum(data)}}, time.Now())[0]; err != nil {
		t.Fatal(err)
	}
	return a
}

func TestRegisterSettingsHeartbeat(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	sealed := sealedAlloc(t, h.mem, "sealed", []byte("hello"))
	if _, err := h.mem.Reserve(&masterv1.ReserveItem{Size: 10, Key: "pending"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	h.start()
	s := h.session()
	r := s.reg
	if r.GetAgentId() != "agent-1" || r.GetHostId() != "host-1" || r.GetDataEndpoint() != "agent-1:50052" || r.GetTransferEndpoint() != "agent-1:50054" || r.GetKnownEpoch() != 0 || r.GetGracefulUnmount() {
		t.Fatalf("Register = %v", r)
	}
	if len(r.GetSegments()) != 1 || r.GetSegments()[0].GetSegmentId() != h.mem.ID() || r.GetSegments()[0].GetMedium() != masterv1.Medium_MEDIUM_MEMORY {
		t.Fatalf("Register segments = %v", r.GetSegments())
	}
	if !r.GetChunked() || r.GetAllocationCount() != 2 || len(s.allocs) != 2 {
		t.Fatalf("Register chunked %v, allocation_count %d, chunks carried %d allocations; want chunked, 2, 2", r.GetChunked(), r.GetAllocationCount(), len(s.allocs))
	}
	for _, a := range s.allocs {
		if a.GetKey() == "sealed" && (a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED || a.GetAllocationId() != sealed.GetAllocationId() || a.GetChecksum() != checksum.Sum([]byte("hello"))) {
			t.Fatalf("sealed row = %v", a)
		}
	}
	if h.link.State() == StateConnected {
		t.Fatal("connected before Settings")
	}
	s.send <- settings(5)
	hb1, hb2 := s.heartbeat(t), s.heartbeat(t)
	if hb2.GetSeq() != hb1.GetSeq()+1 || len(hb1.GetSegments()) != 1 || hb1.GetSegments()[0].GetUsed() == 0 {
		t.Fatalf("heartbeats %v then %v", hb1, hb2)
	}
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected state")
	if got := h.link.Epoch(); got != 5 {
		t.Fatalf("Epoch = %d, want 5", got)
	}
	h.mu.Lock()
	n := len(h.settings)
	h.mu.Unlock()
	if n != 1 {
		t.Fatalf("OnSettings called %d times, want 1", n)
	}
}

func connected(t *testing.T, h *harness, epoch uint64) *fakeSession {
	t.Helper()
	h.start()
	s := h.session()
	s.send <- settings(epoch)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected")
	return s
}

func TestBatchedCommands(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	s := connected(t, h, 3)
	seg := h.mem.ID()
	data := []byte("0123456789")

	// Several requests in flight before any answer is read.
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 1, Epoch: 3, Items: []*masterv1.ReserveItem{
		{SegmentId: seg, Size: 10, Tenant: "t", Key: "a", ReplicaId: 1},
		{SegmentId: "missing", Size: 10, Key: "b"},
		{SegmentId: seg, Size: 1 << 30, Key: "c"},
	}}}}
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 2, Epoch: 3, Items: []*masterv1.ReserveItem{
		{SegmentId: seg, Size: 10, Tenant: "t", Key: "d", ReplicaId: 1},
	}}}}
	results := map[uint64]*masterv1.ReserveResult{}
	for len(results) < 2 {
		m := s.next(t)
		rr := m.GetReserveResult()
		if rr == nil {
			t.Fatalf("got %v, want a ReserveResult", m)
		}
		results[rr.GetRequestId()] = rr
	}
	r1 := results[1].GetItems()
	wantReasons := []string{"", "SEGMENT_NOT_FOUND", "NO_AVAILABLE_HANDLE"}
	for i, it := range r1 {
		if it.GetStatus().GetReason() != wantReasons[i] {
			t.Fatalf("reserve item %d = %v, want reason %q", i, it, wantReasons[i])
		}
	}
	a, d := r1[0].GetAllocationId(), results[2].GetItems()[0].GetAllocationId()
	if a == 0 || d == 0 || a == d {
		t.Fatalf("allocation ids %d and %d", a, d)
	}
	wh, err := h.mem.OpenWrite(a)
	if err != nil {
		t.Fatal(err)
	}
	if err := wh.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	wh.Close()

	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 3, Epoch: 3, Items: []*masterv1.SealItem{
		{SegmentId: seg, AllocationId: a, Checksum: checksum.Sum(data)},
		{SegmentId: seg, AllocationId: d, Checksum: 42},
	}}}}
	sr := s.next(t).GetSealResult()
	if sr.GetRequestId() != 3 || sr.GetItems()[0].GetCode() != 0 || sr.GetItems()[1].GetReason() != "CHECKSUM_MISMATCH" || codes.Code(sr.GetItems()[1].GetCode()) != codes.DataLoss {
		t.Fatalf("SealResult = %v", sr)
	}
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: 4, Epoch: 3, Items: []*masterv1.AllocationRef{
		{SegmentId: seg, AllocationId: d}, {SegmentId: seg, AllocationId: 9999},
	}}}}
	rel := s.next(t).GetReleaseResult()
	if rel.GetRequestId() != 4 || len(rel.GetItems()) != 2 || rel.GetItems()[0].GetCode() != 0 || rel.GetItems()[1].GetCode() != 0 {
		t.Fatalf("ReleaseResult = %v", rel)
	}
	tbl := h.segs.Table()
	if len(tbl) != 1 || tbl[0].GetAllocationId() != a || tbl[0].GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		t.Fatalf("table after commands = %v", tbl)
	}
}

// blockingData is a DataService whose Write holds until release is closed.
type blockingData struct {
	agentv1.UnimplementedDataServiceServer
	started chan struct{}
	release chan struct{}
}

func (b *blockingData) Write(stream agentv1.DataService_WriteServer) error {
	close(b.started)
	select {
	case <-b.release:
	case <-stream.Context().Done():
		return stream.Context().Err()
	}
	var n uint64
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			return stream.SendAndClose(&agentv1.WriteResponse{BytesWritten: n})
		}
		if err != nil {
			return err
		}
		n += uint64(len(m.GetData()))
	}
}

func serveData(t *testing.T, srv agentv1.DataServiceServer) grpc.DialOption {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	agentv1.RegisterDataServiceServer(gs, srv)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) })
}

func TestCommandsRunConcurrently(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	bd := &blockingData{started: make(chan struct{}), release: make(chan struct{})}
	h.link.deps.CopyDialOptions = []grpc.DialOption{serveData(t, bd)}
	src := sealedAlloc(t, h.mem, "src", bytes.Repeat([]byte("x"), 3000))
	s := connected(t, h, 1)

	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Copy{Copy: &masterv1.CopyRequest{
		RequestId: 10, Epoch: 1, Source: &masterv1.AllocationRef{SegmentId: h.mem.ID(), AllocationId: src.GetAllocationId()},
		TargetEndpoint: "passthrough:///other", Target: &masterv1.AllocationRef{SegmentId: "other-seg", AllocationId: 1}, TargetToken: []byte("tok"),
	}}}
	select {
	case <-bd.started:
	case <-time.After(5 * time.Second):
		t.Fatal("copy never reached the target")
	}
	// While the copy is stuck, other commands are answered.
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 11, Epoch: 1, Items: []*masterv1.ReserveItem{{SegmentId: h.mem.ID(), Size: 1, Key: "k"}}}}}
	if rr := s.next(t).GetReserveResult(); rr.GetRequestId() != 11 {
		t.Fatalf("want the reserve answered while a copy is in flight, got %v", rr)
	}
	close(bd.release)
	cr := s.next(t).GetCopyResult()
	if cr.GetRequestId() != 10 || cr.GetStatus().GetCode() != 0 {
		t.Fatalf("CopyResult = %v", cr)
	}
}

func TestCopyToAnotherAgent(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	// The target agent: a real data plane over its own memory segment.
	tmem, err := segment.NewMemory("target", 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	tset := segment.NewSet(tmem)
	defer tset.Close()
	keys := &dataplane.Keyring{}
	key := token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys.Set([]*masterv1.TokenKey{{Id: key.ID, Key: key.Secret}})
	h.link.deps.CopyDialOptions = []grpc.DialOption{serveData(t, dataplane.New(dataplane.Config{}, dataplane.Deps{Segments: tset, Keys: keys}, testutil.Logger()))}

	data := make([]byte, 3<<20+7)
	for i := range data {
		data[i] = byte(i * 7)
	}
	src := sealedAlloc(t, h.mem, "src", data[:1<<20-100])
	data = data[:1<<20-100]
	dst, err := tmem.Reserve(&masterv1.ReserveItem{Size: uint64(len(data)), Key: "src"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	s := connected(t, h, 1)
	tok := token.Sign(key, token.Claims{Mode: token.Write, Key: "src", SegmentID: tmem.ID(), AllocationID: dst.GetAllocationId(), Expiry: time.Now().Add(time.Minute)})
	copyReq := func(id uint64, tok []byte) {
		s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Copy{Copy: &masterv1.CopyRequest{
			RequestId: id, Epoch: 1, Source: &masterv1.AllocationRef{SegmentId: h.mem.ID(), AllocationId: src.GetAllocationId()},
			TargetEndpoint: "passthrough:///target", Target: &masterv1.AllocationRef{SegmentId: tmem.ID(), AllocationId: dst.GetAllocationId()}, TargetToken: tok,
		}}}
	}
	copyReq(1, []byte("forged"))
	if cr := s.next(t).GetCopyResult(); cr.GetStatus().GetReason() != "INVALID_TOKEN" {
		t.Fatalf("copy with a bad token = %v, want INVALID_TOKEN", cr)
	}
	copyReq(2, tok)
	if cr := s.next(t).GetCopyResult(); cr.GetRequestId() != 2 || cr.GetStatus().GetCode() != 0 {
		t.Fatalf("CopyResult = %v", cr)
	}
	if err := tmem.Seal([]segment.SealArg{{ID: dst.GetAllocationId(), Checksum: checksum.Sum(data)}}, time.Now())[0]; err != nil {
		t.Fatalf("target bytes do not match the source: %v", err)
	}
}

// TestSettingsAppliedAfterKeys: the agent answers every Settings with
// SettingsApplied naming its newest token key, and only once OnSettings
// (which hands the keys to the data plane) has returned: the master makes
// a registering agent's segments readable on that answer, so no client is
// handed a token the agent cannot verify yet.
func TestSettingsAppliedAfterKeys(t *testing.T) {
	h := newHarness(t, harnessOpts{applyDelay: 30 * time.Millisecond})
	type answer struct {
		keyID uint32
		seen  int // Settings OnSettings had been called with by then
	}
	got := make(chan answer, 4)
	h.master.onApplied = func(a *masterv1.SettingsApplied) {
		h.mu.Lock()
		n := len(h.settings)
		h.mu.Unlock()
		got <- answer{a.GetTokenKeyId(), n}
	}
	s := connected(t, h, 3)
	next := func() answer {
		t.Helper()
		select {
		case a := <-got:
			return a
		case <-time.After(5 * time.Second):
			t.Fatal("no SettingsApplied from the agent")
			return answer{}
		}
	}
	if a := next(); a != (answer{1, 1}) {
		t.Fatalf("answer to the registration's Settings: key %d after %d Settings applied, want key 1 after 1", a.keyID, a.seen)
	}
	rotated := settings(3)
	st := rotated.GetSettings()
	st.TokenKeys = append([]*masterv1.TokenKey{{Id: 2, Key: []byte("abcdef0123456789abcdef0123456789")}}, st.TokenKeys...)
	s.send <- rotated
	if a := next(); a != (answer{2, 2}) {
		t.Fatalf("answer to a rotation's Settings: key %d after %d Settings applied, want key 2 after 2", a.keyID, a.seen)
	}
}

func TestStaleEpochRejected(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	s := connected(t, h, 5)
	reserve := func(id, epoch uint64) *masterv1.ReserveResult {
		s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: id, Epoch: epoch, Items: []*masterv1.ReserveItem{
			{SegmentId: h.mem.ID(), Size: 1, Key: "a"}, {SegmentId: h.mem.ID(), Size: 1, Key: "b"},
		}}}}
		return s.next(t).GetReserveResult()
	}
	tests := []struct {
		name      string
		epoch     uint64
		wantStale bool
		wantEpoch uint64
	}{
		{"older", 4, true, 5},
		{"current", 5, false, 5},
		{"newer raises", 7, false, 7},
		{"between is now stale", 6, true, 7},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rr := reserve(uint64(100+i), tc.epoch)
			for _, it := range rr.GetItems() {
				stale := it.GetStatus().GetReason() == "STALE_EPOCH" && codes.Code(it.GetStatus().GetCode()) == codes.FailedPrecondition
				if stale != tc.wantStale || (!stale && it.GetStatus().GetCode() != 0) {
					t.Fatalf("item %v, want stale=%v", it, tc.wantStale)
				}
			}
			if got := h.link.Epoch(); got != tc.wantEpoch {
				t.Fatalf("Epoch = %d, want %d", got, tc.wantEpoch)
			}
		})
	}
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 1, Epoch: 1, Items: []*masterv1.SealItem{{SegmentId: h.mem.ID(), AllocationId: 1}}}}}
	if sr := s.next(t).GetSealResult(); sr.GetItems()[0].GetReason() != "STALE_EPOCH" {
		t.Fatalf("stale seal = %v", sr)
	}
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: 2, Epoch: 1, Items: []*masterv1.AllocationRef{{SegmentId: h.mem.ID(), AllocationId: 1}}}}}
	if rr := s.next(t).GetReleaseResult(); rr.GetItems()[0].GetReason() != "STALE_EPOCH" {
		t.Fatalf("stale release = %v", rr)
	}
	if _, ok := h.mem.Lookup(1); !ok {
		t.Fatal("a stale release freed an allocation")
	}
	// Settings from an older master end the session; the agent reconnects
	// and says which epoch it has accepted.
	s.send <- settings(2)
	s2 := h.session()
	if s2.reg.GetKnownEpoch() != 7 {
		t.Fatalf("re-Register known_epoch = %d, want 7", s2.reg.GetKnownEpoch())
	}
}

func TestReconnectReregistersFullTable(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	s := connected(t, h, 9)
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: 1, Epoch: 9, Items: []*masterv1.ReserveItem{
		{SegmentId: h.mem.ID(), Size: 0, Tenant: "t", Key: "empty", ReplicaId: 4},
	}}}}
	id := s.next(t).GetReserveResult().GetItems()[0].GetAllocationId()
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: 2, Epoch: 9, Items: []*masterv1.SealItem{
		{SegmentId: h.mem.ID(), AllocationId: id, Checksum: checksum.Sum(nil)},
	}}}}
	if sr := s.next(t).GetSealResult(); sr.GetItems()[0].GetCode() != 0 {
		t.Fatalf("seal = %v", sr)
	}
	// The master drops the stream, three times in a row before Settings.
	s.drop <- codesErr(codes.Unavailable)
	for range 3 {
		s = h.session()
		s.drop <- codesErr(codes.Unavailable)
	}
	s = h.session()
	if s.reg.GetKnownEpoch() != 9 || len(s.allocs) != 1 {
		t.Fatalf("re-Register = %v", s.reg)
	}
	a := s.allocs[0]
	if a.GetAllocationId() != id || a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED || a.GetKey() != "empty" || a.GetReplicaId() != 4 || a.GetSegmentId() != h.mem.ID() {
		t.Fatalf("re-registered row = %v", a)
	}
	s.send <- settings(9)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "reconnected")
	s.heartbeat(t)
}

func TestSettingsTimeoutReconnects(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: Config{SettingsTimeout: 50 * time.Millisecond}})
	h.start()
	s1 := h.session()
	// No Settings: the agent gives up and dials again.
	s2 := h.session()
	select {
	case <-s1.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the first session never ended")
	}
	s2.send <- settings(1)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "connected")
}

func TestSettingsReleaseAndReservedGrace(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	keep := sealedAlloc(t, h.mem, "keep", []byte("a"))
	drop := sealedAlloc(t, h.mem, "drop", []byte("b"))
	pending, err := h.mem.Reserve(&masterv1.ReserveItem{Size: 10, Key: "pending"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	h.start()
	s := h.session()
	st := settings(1)
	st.GetSettings().ReleaseAllocations = []*masterv1.AllocationRef{{SegmentId: h.mem.ID(), AllocationId: drop.GetAllocationId()}}
	st.GetSettings().ReservedGrace = durationpb.New(30 * time.Millisecond)
	s.send <- st
	testutil.Eventually(t, 5*time.Second, func() bool {
		_, k := h.mem.Lookup(keep.GetAllocationId())
		_, d := h.mem.Lookup(drop.GetAllocationId())
		_, p := h.mem.Lookup(pending.GetAllocationId())
		return k && !d && !p
	}, "unclaimed allocations released")
}

func TestGracefulDeregister(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: Config{ShutdownGrace: 300 * time.Millisecond}})
	s := connected(t, h, 1)
	start := time.Now()
	h.cancel()
	m := s.next(t)
	d := m.GetDeregister()
	if d == nil {
		t.Fatalf("got %v, want Deregister", m)
	}
	if g := d.GetGrace().AsDuration(); g <= 0 || g > 300*time.Millisecond {
		t.Fatalf("Deregister grace %v, want (0, 300ms]", g)
	}
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateDeregistering }, "deregistering state")
	// Still serving during the grace: heartbeats and commands.
	s.heartbeat(t)
	s.send <- &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: 1, Epoch: 1, Items: []*masterv1.AllocationRef{{SegmentId: h.mem.ID(), AllocationId: 5}}}}}
	if rr := s.next(t).GetReleaseResult(); rr.GetRequestId() != 1 {
		t.Fatalf("release during grace = %v", rr)
	}
	select {
	case err := <-h.done:
		if err != nil {
			t.Fatalf("Run = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after the grace")
	}
	h.cancel = nil
	if el := time.Since(start); el < 250*time.Millisecond {
		t.Fatalf("Run returned after %v, before the grace", el)
	}
	select {
	case <-s.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("stream not closed")
	}
	if !s.eof.Load() {
		t.Fatal("the agent did not close its send side cleanly")
	}
	if h.link.State() != StateDisconnected {
		t.Fatalf("state %v after Run, want disconnected", h.link.State())
	}
}

func TestShutdownWhileDisconnectedRegistersGracefully(t *testing.T) {
	h := newHarness(t, harnessOpts{cfg: Config{ShutdownGrace: 300 * time.Millisecond, SettingsTimeout: 5 * time.Second}})
	h.start()
	s := h.session()
	s.drop <- codesErr(codes.Unavailable)
	s = h.session()
	// Shut down while this session waits for Settings: once Settings come
	// the agent deregisters at once.
	h.cancel()
	s.send <- settings(1)
	if d := s.next(t).GetDeregister(); d == nil {
		t.Fatal("no Deregister after a shutdown during the handshake")
	}
	// The master drops the stream during the grace: the agent reconnects
	// and registers with graceful_unmount.
	s.drop <- codesErr(codes.Unavailable)
	s = h.session()
	if !s.reg.GetGracefulUnmount() {
		t.Fatalf("Register during the grace = %v, want graceful_unmount", s.reg)
	}
	s.send <- settings(1)
	if d := s.next(t).GetDeregister(); d == nil {
		t.Fatal("no Deregister on the graceful re-registration")
	}
	select {
	case <-h.done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return")
	}
	h.cancel = nil
}

func TestBlackholedNetworkReconnects(t *testing.T) {
	if testing.Short() {
		t.Skip("keepalive detection takes over 10 s (gRPC's minimum ping interval)")
	}
	var p *proxy
	h := newHarness(t, harnessOpts{tcp: true, addr: func(a string) string { p = newProxy(t, a); return p.addr() },
		cfg: Config{KeepaliveTime: 10 * time.Second, KeepaliveTimeout: 500 * time.Millisecond}})
	s := connected(t, h, 1)
	s.heartbeat(t)
	start := time.Now()
	p.cut()
	// Only keepalive can notice the dead connection; the agent then dials
	// again (a fresh connection through the proxy) and registers anew.
	s2 := h.sessionWithin(30 * time.Second)
	t.Logf("re-registered %v after the cut", time.Since(start))
	if s2.reg.GetKnownEpoch() != 1 {
		t.Fatalf("re-Register known_epoch = %d", s2.reg.GetKnownEpoch())
	}
	s2.send <- settings(1)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "reconnected")
}

func TestReconnectsPromptlyAfterMasterOutage(t *testing.T) {
	h := newHarness(t, harnessOpts{tcp: true, cfg: Config{BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond}})
	s := connected(t, h, 1)
	s.heartbeat(t)
	// Down long enough for many failed attempts: neither our backoff nor
	// the channel's redial backoff may grow past BackoffMax.
	h.restartMaster(1500 * time.Millisecond)
	start := time.Now()
	s2 := h.session()
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("reconnected %v after the master came back, want about BackoffMax", el)
	}
	s2.send <- settings(1)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "reconnected")
}

// TestQuickRedialAfterLongSession: when a session that served for a while
// ends (a master restarted), the agent dials again at once instead of
// after BackoffBase; one that ends early backs off as usual.
func TestQuickRedialAfterLongSession(t *testing.T) {
	clk := testutil.NewClock(time.Unix(1_700_000_000, 0))
	h := newHarness(t, harnessOpts{now: clk.Now, cfg: Config{BackoffBase: 3 * time.Second, BackoffMax: 3 * time.Second}})
	s := connected(t, h, 1)
	s.heartbeat(t)
	clk.Advance(quickRedialAfter)
	start := time.Now()
	s.drop <- codesErr(codes.Unavailable)
	s = h.session()
	if el := time.Since(start); el > time.Second {
		t.Fatalf("redialed %v after a long session ended, want about %v", el, quickRedial)
	}
	s.send <- settings(1)
	testutil.Eventually(t, 5*time.Second, func() bool { return h.link.State() == StateConnected }, "reconnected")
	// This one ends at once: the usual backoff (at least BackoffBase/2).
	start = time.Now()
	s.drop <- codesErr(codes.Unavailable)
	_ = h.session()
	if el := time.Since(start); el < time.Second {
		t.Fatalf("redialed %v after a short session, want the backoff (≥ 1.5s)", el)
	}
}

func TestBackoff(t *testing.T) {
	base, maxd := 100*time.Millisecond, 2*time.Second
	tests := []struct {
		attempt  int
		min, max time.Duration
	}{
		{0, 50 * time.Millisecond, 100 * time.Millisecond},
		{1, 100 * time.Millisecond, 200 * time.Millisecond},
		{3, 400 * time.Millisecond, 800 * time.Millisecond},
		{10, time.Second, 2 * time.Second},
		{1000, time.Second, 2 * time.Second},
	}
	for _, tc := range tests {
		var seen []time.Duration
		for range 50 {
			d := retry.Delay(base, maxd, tc.attempt)
			if d < tc.min || d > tc.max {
				t.Fatalf("backoff(attempt %d) = %v, want in [%v, %v]", tc.attempt, d, tc.min, tc.max)
			}
			seen = append(seen, d)
		}
		slices.Sort(seen)
		if seen[0] == seen[len(seen)-1] {
			t.Fatalf("backoff(attempt %d) has no jitter", tc.attempt)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"complete", Config{MasterAddr: "m:1", AgentID: "a", DataEndpoint: "a:2"}, true},
		{"no master", Config{AgentID: "a", DataEndpoint: "a:2"}, false},
		{"no agent id", Config{MasterAddr: "m:1", DataEndpoint: "a:2"}, false},
		{"no endpoint", Config{MasterAddr: "m:1", AgentID: "a"}, false},
		{"backoff inverted", Config{MasterAddr: "m:1", AgentID: "a", DataEndpoint: "a:2", BackoffBase: time.Second, BackoffMax: time.Millisecond}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg, Deps{Segments: segment.NewSet()}, testutil.Logger())
			if (err == nil) != tc.ok {
				t.Fatalf("New err = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}
