package session

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

func lostMsg(reason string, allocs ...*masterv1.Allocation) *masterv1.ConnectRequest {
	return &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_AllocationsLost{AllocationsLost: &masterv1.AllocationsLost{Allocations: allocs, Reason: reason}}}
}

// lostAllocs is n allocations of segment seg as an agent reports them.
func lostAllocs(seg string, n int) []*masterv1.Allocation {
	out := make([]*masterv1.Allocation, n)
	for i := range out {
		out[i] = &masterv1.Allocation{SegmentId: seg, AllocationId: uint64(i + 1), Key: fmt.Sprintf("k%d", i), ReplicaId: 1}
	}
	return out
}

// TestAllocationsLost: an agent's AllocationsLost reaches Metadata.Lost
// with the agent's current segments (those mounted since its
// registration too, no other agent's) and the allocations as sent, up to
// MaxLostAllocations of them; the session goes on.
func TestAllocationsLost(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	h.connectAgent("b1")
	a := h.connectAgent("a1")
	a.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{
		Mounted: []*masterv1.SegmentInfo{{SegmentId: "a1-disk-0", Medium: masterv1.Medium_MEDIUM_DISK, Capacity: 1 << 30}},
	}}})
	waitState(t, h, "a1-disk-0", "ok/healthy", time.Second)

	sent := []*masterv1.Allocation{
		{SegmentId: "a1-disk-0", AllocationId: 7, Tenant: "t", Key: "k1", ReplicaId: 3},
		{SegmentId: "b1-mem-0", AllocationId: 3, Key: "k2", ReplicaId: 1}, // not a1's: Lost ignores it
	}
	a.send(lostMsg(strings.Repeat("checksum mismatch ", 100), sent...))
	a.send(lostMsg("read: input/output error", lostAllocs("a1-mem-0", MaxLostAllocations)...))
	testutil.Eventually(t, 5*time.Second, func() bool { return len(h.meta.lostCalls()) == 2 }, "two Lost calls")

	calls := h.meta.lostCalls()
	for i, c := range calls {
		var ids []string
		for _, sg := range c.segments {
			if sg.AgentID != "a1" {
				t.Fatalf("call %d: segment %s of agent %q, want a1's only", i, sg.ID, sg.AgentID)
			}
			ids = append(ids, sg.ID)
		}
		slices.Sort(ids)
		if c.agentID != "a1" || !slices.Equal(ids, []string{"a1-disk-0", "a1-mem-0"}) {
			t.Fatalf("call %d: agent %q segments %v, want a1 with [a1-disk-0 a1-mem-0]", i, c.agentID, ids)
		}
	}
	if got := calls[0].allocs; !slices.EqualFunc(got, sent, func(x, y *masterv1.Allocation) bool { return proto.Equal(x, y) }) {
		t.Fatalf("allocations: got %v, want %v", got, sent)
	}
	if got := len(calls[1].allocs); got != MaxLostAllocations {
		t.Fatalf("allocations of a full report: got %d, want %d", got, MaxLostAllocations)
	}
	select {
	case <-a.ended:
		t.Fatalf("the session ended after a valid report: %v", a.waitEnded(0))
	default:
	}
	if !h.m.Connected("a1") {
		t.Fatal("Connected(a1): got false, want true")
	}
}

// TestAllocationsLostInvalid: a report past MaxLostAllocations, or with an
// allocation that does not name its segment and object within the
// master's limits, ends the session with INVALID_ARGUMENT /
// INVALID_PARAMS before the metadata sees any of it.
func TestAllocationsLostInvalid(t *testing.T) {
	h := newHarness(t, fastConfig(), harnessOpts{})
	one := func(f func(a *masterv1.Allocation)) []*masterv1.Allocation {
		a := &masterv1.Allocation{SegmentId: "x", AllocationId: 1, Key: "k", ReplicaId: 1}
		f(a)
		return []*masterv1.Allocation{a}
	}
	tests := []struct {
		name   string
		allocs func(agent string) []*masterv1.Allocation
	}{
		{"too many", func(agent string) []*masterv1.Allocation { return lostAllocs(agent+"-mem-0", MaxLostAllocations+1) }},
		{"no segment id", func(string) []*masterv1.Allocation { return one(func(a *masterv1.Allocation) { a.SegmentId = "" }) }},
		{"long segment id", func(string) []*masterv1.Allocation {
			return one(func(a *masterv1.Allocation) { a.SegmentId = strings.Repeat("s", maxIDLen+1) })
		}},
		{"no key", func(string) []*masterv1.Allocation { return one(func(a *masterv1.Allocation) { a.Key = "" }) }},
		{"long key", func(string) []*masterv1.Allocation {
			return one(func(a *masterv1.Allocation) { a.Key = strings.Repeat("k", maxKeyLen+1) })
		}},
		{"long tenant", func(string) []*masterv1.Allocation {
			return one(func(a *masterv1.Allocation) { a.Tenant = strings.Repeat("t", maxTenantLen+1) })
		}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			agent := fmt.Sprintf("bad%d", i)
			a := h.connectAgent(agent)
			a.send(lostMsg("checksum mismatch", tt.allocs(agent)...))
			err := a.waitEnded(5 * time.Second)
			if status.Code(err) != codes.InvalidArgument || rpcerr.Reason(err) != "INVALID_PARAMS" {
				t.Fatalf("got %v, want INVALID_ARGUMENT / INVALID_PARAMS", err)
			}
		})
	}
	if n := len(h.meta.lostCalls()); n != 0 {
		t.Fatalf("Lost called %d times for invalid reports, want 0", n)
	}
}

// TestClipReason: a reason is logged up to maxLostReason bytes, cut at a
// rune boundary.
func TestClipReason(t *testing.T) {
	for _, r := range []string{"", "checksum mismatch", strings.Repeat("x", maxLostReason), strings.Repeat("x", 5000), "x" + strings.Repeat("é", maxLostReason)} {
		got := clipReason(r)
		if len(got) > maxLostReason || !utf8.ValidString(got) || !strings.HasPrefix(r, got) {
			t.Fatalf("clipReason(%d bytes) = %d bytes (valid UTF-8 %v), want a valid prefix of at most %d", len(r), len(got), utf8.ValidString(got), maxLostReason)
		}
		if len(r) <= maxLostReason && got != r {
			t.Fatalf("clipReason cut a reason of %d bytes", len(r))
		}
		if len(r) > maxLostReason && len(got) < maxLostReason-utf8.UTFMax {
			t.Fatalf("clipReason kept %d bytes of %d, want nearly %d", len(got), len(r), maxLostReason)
		}
	}
}
