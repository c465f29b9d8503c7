package session

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// chunkedRegister is a chunked Register announcing n allocations.
func chunkedRegister(agentID string, n uint64, opts ...agentOpt) *masterv1.ConnectRequest {
	r := registerMsg(agentID, opts...)
	r.Chunked, r.AllocationCount = true, n
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: r}}
}

// sealedAllocs are n SEALED allocations of segment seg, ids from first.
func sealedAllocs(seg string, first uint64, n int) []*masterv1.Allocation {
	out := make([]*masterv1.Allocation, n)
	for i := range out {
		id := first + uint64(i)
		out[i] = &masterv1.Allocation{SegmentId: seg, AllocationId: id, Size: 64, Offset: id * 64,
			State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: fmt.Sprintf("k%d", id), SealedUnixMs: 1}
	}
	return out
}

// chunkMsg is a chunk of the allocations' segment (the first one's).
func chunkMsg(last bool, allocs ...*masterv1.Allocation) *masterv1.ConnectRequest {
	ch := &masterv1.RegisterChunk{Allocations: allocs, Last: last}
	if len(allocs) > 0 {
		ch.SegmentId = allocs[0].GetSegmentId()
	}
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}}
}

// TestChunkedRegisterProgressing: a registration whose chunks arrive slowly
// but steadily, for several times RegisterTimeout in all, succeeds; the
// metadata sees the whole table and the agent gets Settings and HEALTHY
// segments, and the registration metrics name it.
func TestChunkedRegisterProgressing(t *testing.T) {
	cfg := fastConfig()
	cfg.RegisterTimeout = 200 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{})
	const chunks, per = 8, 100
	conn, stream, cancel := h.open(chunkedRegister("slow", chunks*per))
	defer conn.Close()
	defer cancel()
	start := time.Now()
	for i := range chunks {
		time.Sleep(cfg.RegisterTimeout / 2)
		if h.m.Registering() != 1 {
			t.Fatalf("Registering() mid-stream: got %d, want 1", h.m.Registering())
		}
		if err := stream.Send(chunkMsg(i == chunks-1, sealedAllocs("slow-mem-0", uint64(1+i*per), per)...)); err != nil {
			t.Fatal(err)
		}
	}
	msg, err := stream.Recv()
	if err != nil || msg.GetSettings() == nil {
		t.Fatalf("after the last chunk: got %v, %v; want Settings", msg, err)
	}
	if took := time.Since(start); took < 2*cfg.RegisterTimeout {
		t.Fatalf("the registration took %v, want it past twice the register timeout %v", took, cfg.RegisterTimeout)
	}
	testutil.Eventually(t, time.Second, func() bool { return h.m.Registering() == 0 }, "the registration to end")
	calls := h.meta.reconcileCalls()
	if len(calls) != 1 || len(calls[0].allocs) != chunks*per {
		t.Fatalf("reconcile calls: got %d (first with %d allocations), want 1 with %d", len(calls), len(calls[0].allocs), chunks*per)
	}
	if got := segState(h, "slow-mem-0"); got != "ok/healthy" {
		t.Fatalf("segment after registration: got %s, want ok/healthy", got)
	}
	if got := promtest.ToFloat64(h.m.met.registerAllocs.WithLabelValues("slow")); got != chunks*per {
		t.Fatalf("crescent_master_agent_registration_allocations: got %v, want %d", got, chunks*per)
	}
	if got := promtest.ToFloat64(h.m.met.registerSeconds.WithLabelValues("slow")); got < (2 * cfg.RegisterTimeout).Seconds() {
		t.Fatalf("crescent_master_agent_registration_seconds: got %v, want at least %v", got, (2 * cfg.RegisterTimeout).Seconds())
	}
}

// TestChunkedRegisterStalled: a table that stops arriving mid-stream ends
// the stream UNAVAILABLE with a reason that says how far it got; its
// segments are not unmounted by liveness while it was registering.
func TestChunkedRegisterStalled(t *testing.T) {
	cfg := fastConfig()
	cfg.RegisterTimeout = 300 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{})
	conn, stream, cancel := h.open(chunkedRegister("stuck", 1000))
	defer conn.Close()
	defer cancel()
	if err := stream.Send(chunkMsg(false, sealedAllocs("stuck-mem-0", 1, 10)...)); err != nil {
		t.Fatal(err)
	}
	// Liveness runs (on the fake clock) far past unmount_after while the
	// agent is registering: its segment stays mounted.
	waitState(t, h, "stuck-mem-0", "ok/suspected", time.Second)
	h.advance(2 * cfg.UnmountAfter)
	if got := segState(h, "stuck-mem-0"); got != "ok/suspected" {
		t.Fatalf("segment of a registering agent after unmount_after: got %s, want ok/suspected", got)
	}
	_, err := stream.Recv()
	if got := status.Code(err); got != codes.Unavailable {
		t.Fatalf("code: got %v, want Unavailable (%v)", got, err)
	}
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "registration stalled") || !strings.Contains(msg, "10 of 1000") {
		t.Fatalf("message: got %q, want it to say the registration stalled after 10 of 1000 allocations", msg)
	}
	if got := promtest.ToFloat64(h.m.met.registrations.WithLabelValues("failed")); got != 1 {
		t.Fatalf("failed registrations: got %v, want 1", got)
	}
	if h.m.Registering() != 0 {
		t.Fatalf("Registering() after the stall: got %d, want 0", h.m.Registering())
	}
}

// TestChunkedRegisterMalformed: every malformed sequence ends the stream
// INVALID_ARGUMENT / INVALID_PARAMS with a reason, before Settings.
func TestChunkedRegisterMalformed(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	two := withSegments("m-mem-0", "m-mem-1")
	seg0 := func(first uint64, n int) []*masterv1.Allocation { return sealedAllocs("m-mem-0", first, n) }
	seg1 := func(first uint64, n int) []*masterv1.Allocation { return sealedAllocs("m-mem-1", first, n) }
	noKey := seg0(1, 1)
	noKey[0].Key = ""
	reserved := seg0(1, 1)
	reserved[0].State = masterv1.AllocationState_ALLOCATION_STATE_UNSPECIFIED
	namedBlank := seg0(1, 1) // a blank names no object
	namedBlank[0].State, namedBlank[0].Blank = masterv1.AllocationState_ALLOCATION_STATE_RESERVED, true
	sealedBlank := seg0(1, 1) // nor is one ever sealed
	sealedBlank[0].Tenant, sealedBlank[0].Key, sealedBlank[0].Blank = "", "", true
	inline := chunkedRegister("m", 1, two)
	inline.GetRegister().Allocations = seg0(1, 1)
	countOnly := &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("m", two)}}
	countOnly.GetRegister().AllocationCount = 3
	for _, tc := range []struct {
		name  string
		first *masterv1.ConnectRequest
		then  []*masterv1.ConnectRequest
		want  string
	}{
		{"too many in one chunk", chunkedRegister("m", MaxRegisterChunk+1, two), []*masterv1.ConnectRequest{chunkMsg(true, seg0(1, MaxRegisterChunk+1)...)}, "max 16384 per chunk"},
		{"more than announced", chunkedRegister("m", 5, two), []*masterv1.ConnectRequest{chunkMsg(false, seg0(1, 4)...), chunkMsg(true, seg0(5, 2)...)}, "more allocations than the 5"},
		{"last too early", chunkedRegister("m", 5, two), []*masterv1.ConnectRequest{chunkMsg(true, seg0(1, 4)...)}, "last chunk after 4 allocations"},
		{"repeated across chunks", chunkedRegister("m", 4, two), []*masterv1.ConnectRequest{chunkMsg(false, seg0(1, 2)...), chunkMsg(true, seg0(2, 2)...)}, "out of order"},
		{"segment order", chunkedRegister("m", 2, two), []*masterv1.ConnectRequest{chunkMsg(false, seg1(1, 1)...), chunkMsg(true, seg0(2, 1)...)}, "out of order"},
		{"mixed segments", chunkedRegister("m", 2, two), []*masterv1.ConnectRequest{chunkMsg(true, append(seg0(1, 1), seg1(2, 1)...)...)}, "in a chunk of segment"},
		{"unlisted segment", chunkedRegister("m", 1, two), []*masterv1.ConnectRequest{chunkMsg(true, sealedAllocs("other", 1, 1)...)}, "did not list"},
		{"no key", chunkedRegister("m", 1, two), []*masterv1.ConnectRequest{chunkMsg(true, noKey...)}, "has no key"},
		{"bad state", chunkedRegister("m", 1, two), []*masterv1.ConnectRequest{chunkMsg(true, reserved...)}, "has state"},
		{"blank with an object", chunkedRegister("m", 1, two), []*masterv1.ConnectRequest{chunkMsg(true, namedBlank...)}, "blank with an object or not RESERVED"},
		{"sealed blank", chunkedRegister("m", 1, two), []*masterv1.ConnectRequest{chunkMsg(true, sealedBlank...)}, "has no key"},
		{"heartbeat inside the table", chunkedRegister("m", 2, two), []*masterv1.ConnectRequest{chunkMsg(false, seg0(1, 1)...),
			{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: 1}}}}, "expected RegisterChunk"},
		{"chunked with inline allocations", inline, nil, "not inline"},
		{"count without chunked", countOnly, nil, "without chunked"},
		{"absurd count", chunkedRegister("m", 1<<40, two), nil, "exceeds"},
		{"chunk first", chunkMsg(true), nil, "first message must be Register"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, stream, cancel := h.open(tc.first)
			defer conn.Close()
			defer cancel()
			for _, m := range tc.then {
				if err := stream.Send(m); err != nil && !errors.Is(err, io.EOF) {
					t.Fatal(err)
				}
			}
			msg, err := stream.Recv()
			if err == nil {
				t.Fatalf("got %v, want the stream ended", msg)
			}
			if got := status.Code(err); got != codes.InvalidArgument {
				t.Fatalf("code: got %v, want InvalidArgument (%v)", got, err)
			}
			if got := rpcerr.Reason(err); got != "INVALID_PARAMS" {
				t.Fatalf("reason: got %q, want INVALID_PARAMS", got)
			}
			if msg := status.Convert(err).Message(); !strings.Contains(msg, tc.want) {
				t.Fatalf("message: got %q, want it to contain %q", msg, tc.want)
			}
		})
	}
	// A well-formed chunked registration still works afterwards, with an
	// empty table too, and with a blank reservation (RESERVED, flagged,
	// no object) in it.
	conn, stream, cancel := h.open(chunkedRegister("m", 0, two))
	defer conn.Close()
	defer cancel()
	if err := stream.Send(chunkMsg(true)); err != nil {
		t.Fatal(err)
	}
	if msg, err := stream.Recv(); err != nil || msg.GetSettings() == nil {
		t.Fatalf("empty chunked registration: got %v, %v; want Settings", msg, err)
	}
	blank := &masterv1.Allocation{SegmentId: "m-mem-0", AllocationId: 1, Size: 64, Blank: true,
		State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED}
	conn2, stream2, cancel2 := h.open(chunkedRegister("m", 1, two))
	defer conn2.Close()
	defer cancel2()
	if err := stream2.Send(chunkMsg(true, blank)); err != nil {
		t.Fatal(err)
	}
	if msg, err := stream2.Recv(); err != nil || msg.GetSettings() == nil {
		t.Fatalf("registration with a blank reservation: got %v, %v; want Settings", msg, err)
	}
}
