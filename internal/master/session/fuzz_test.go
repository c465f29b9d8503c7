package session

import (
	"context"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

func mustMarshal(f *testing.F, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		f.Fatal(err)
	}
	return b
}

func fuzzManager(tb testing.TB) *Manager {
	lg := testutil.Logger()
	reg, err := registry.New(registry.Config{}, registry.Deps{}, lg)
	if err != nil {
		tb.Fatal(err)
	}
	m, err := New(fastConfig(), Deps{Identity: cluster.Identity{Epoch: testEpoch, Keys: token.NewRingWithKey(testTokenKey)}, Registry: reg, Metadata: &fakeMeta{}}, lg)
	if err != nil {
		tb.Fatal(err)
	}
	return m
}

// FuzzRegister feeds arbitrary bytes, decoded as an agent's first message,
// through validation and into the registry: never a panic, and an accepted
// registration leaves every listed segment registered to the agent.
func FuzzRegister(f *testing.F) {
	f.Add(mustMarshal(f, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a1",
		withAllocations(&masterv1.Allocation{SegmentId: "a1-mem-0", AllocationId: 1, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k"}))}}))
	f.Add(mustMarshal(f, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{AgentId: "a", DataEndpoint: "x:1", GracefulUnmount: true,
		Segments: []*masterv1.SegmentInfo{{SegmentId: "d", Medium: masterv1.Medium_MEDIUM_DISK, Capacity: 10, Used: 11}}}}}))
	f.Add(mustMarshal(f, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: 1}}}))
	f.Add(mustMarshal(f, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{AgentId: "a", DataEndpoint: "x:1", Chunked: true, AllocationCount: 1 << 40,
		Segments: []*masterv1.SegmentInfo{{SegmentId: "m", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 10}}}}}))
	f.Add([]byte{0x0a, 0x02, 0x0a, 0x00})
	// A blank reservation as an agent lists it, and one that names an object.
	f.Add(mustMarshal(f, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Register{Register: registerMsg("a1",
		withAllocations(&masterv1.Allocation{SegmentId: "a1-mem-0", AllocationId: 2, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Blank: true},
			&masterv1.Allocation{SegmentId: "a1-mem-0", AllocationId: 3, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Key: "k", Blank: true}))}}))
	m := fuzzManager(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		var msg masterv1.ConnectRequest
		if proto.Unmarshal(data, &msg) != nil {
			return
		}
		_ = msgName(&msg)
		reg, err := validateRegister(msg.GetRegister(), testEpoch, DefaultMaxSegmentsPerAgent)
		if err != nil {
			return
		}
		gen, _, err := m.reg.Register(reg)
		if err != nil {
			return
		}
		m.reg.Activate(reg.AgentID, gen)
		for _, s := range reg.Segments {
			got, ok := m.reg.Segment(s.GetSegmentId())
			if !ok || got.AgentID != reg.AgentID {
				t.Fatalf("segment %q after Register: got %+v (found %v), want agent %q", s.GetSegmentId(), got, ok, reg.AgentID)
			}
		}
		m.reg.Disconnect(reg.AgentID, gen)
	})
}

// FuzzHandle feeds arbitrary bytes, decoded as an agent message on a live
// session with requests in flight, to the session's handler: never a panic,
// and every waiting call is answered at most once.
func FuzzHandle(f *testing.F) {
	seeds := []*masterv1.ConnectRequest{
		{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{Seq: 2, Segments: []*masterv1.SegmentInfo{{SegmentId: "s1", Capacity: 10, Used: 5}}}}},
		{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{RequestId: 1, Items: []*masterv1.ReserveItemResult{{AllocationId: 1}, {AllocationId: 2}}}}},
		{Msg: &masterv1.ConnectRequest_ReserveResult{ReserveResult: &masterv1.ReserveResult{RequestId: 1, Items: []*masterv1.ReserveItemResult{{AllocationId: 1}}}}},
		{Msg: &masterv1.ConnectRequest_SealResult{SealResult: &masterv1.SealResult{RequestId: 2, Items: []*masterv1.ItemStatus{{}, {Code: 15, Reason: "CHECKSUM_MISMATCH"}}}}},
		{Msg: &masterv1.ConnectRequest_ReleaseResult{ReleaseResult: &masterv1.ReleaseResult{RequestId: 3, Items: []*masterv1.ItemStatus{{}, {}}}}},
		{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: 4, Status: &masterv1.ItemStatus{Code: 5}}}},
		{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: 4, Items: []*masterv1.ItemStatus{{}, {Code: 9, Reason: "ALLOCATION_STATE"}}}}},
		{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: 4, Items: []*masterv1.ItemStatus{{}}}}},
		{Msg: &masterv1.ConnectRequest_CopyResult{CopyResult: &masterv1.CopyResult{RequestId: 4}}},
		{Msg: &masterv1.ConnectRequest_Deregister{Deregister: &masterv1.Deregister{Grace: durationpb.New(-time.Second)}}},
		{Msg: &masterv1.ConnectRequest_SegmentsUpdate{SegmentsUpdate: &masterv1.SegmentsUpdate{
			Mounted: []*masterv1.SegmentInfo{{SegmentId: "s2", Medium: masterv1.Medium_MEDIUM_DISK, Capacity: 1}}, UnmountedSegmentIds: []string{"s1", "zz"}}}},
		{Msg: &masterv1.ConnectRequest_Register{Register: &masterv1.Register{AgentId: "a1"}}},
		{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: &masterv1.RegisterChunk{Last: true}}},
		{Msg: &masterv1.ConnectRequest_SettingsApplied{SettingsApplied: &masterv1.SettingsApplied{TokenKeyId: 7}}},
		{Msg: &masterv1.ConnectRequest_AllocationsLost{AllocationsLost: &masterv1.AllocationsLost{Reason: "checksum mismatch", Allocations: []*masterv1.Allocation{
			{SegmentId: "s1", AllocationId: 1, Key: "k", ReplicaId: 1}, {SegmentId: "other", AllocationId: 2, Tenant: "t", Key: "j", ReplicaId: 2}}}}},
		{Msg: &masterv1.ConnectRequest_AllocationsLost{AllocationsLost: &masterv1.AllocationsLost{Allocations: []*masterv1.Allocation{{SegmentId: "s1", AllocationId: 1}}}}},
		{},
	}
	for _, s := range seeds {
		f.Add(mustMarshal(f, s))
	}
	m := fuzzManager(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		var msg masterv1.ConnectRequest
		if proto.Unmarshal(data, &msg) != nil {
			return
		}
		gen, _, err := m.reg.Register(registry.Registration{AgentID: "a1", HostID: "h", DataEndpoint: "e:1",
			Segments: []*masterv1.SegmentInfo{{SegmentId: "s1", Medium: masterv1.Medium_MEDIUM_MEMORY, Capacity: 100}}})
		if err != nil {
			t.Fatalf("Register: %v", err)
		}
		m.reg.Activate("a1", gen)
		defer func() {
			if ids := m.reg.Disconnect("a1", gen); len(ids) > 0 {
				m.reg.MarkUnmounted(ids)
			}
			for _, s := range m.reg.Segments() {
				if s.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING {
					m.reg.MarkUnmounted([]string{s.ID})
				}
			}
		}()
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		s := newSession(m, "a1", gen, ctx, cancel, nil)
		two := func(k kind) *call {
			c := &call{kind: k, done: make(chan outcome, 1)}
			switch k {
			case kindReserve:
				c.reserve = []*masterv1.ReserveItem{{SegmentId: "s1"}, {SegmentId: "s1"}}
			case kindSeal:
				c.seal = []*masterv1.SealItem{{SegmentId: "s1"}, {SegmentId: "s1"}}
			case kindRelease:
				c.release = []*masterv1.AllocationRef{{SegmentId: "s1"}, {SegmentId: "s1"}}
			case kindCopy:
				c.copy = []*masterv1.CopyItem{{}, {}}
			}
			return c
		}
		var calls []*call
		for id, k := range map[uint64]kind{1: kindReserve, 2: kindSeal, 3: kindRelease, 4: kindCopy} {
			c := two(k)
			if id == 1 {
				c.abandon() // a reserve whose caller gave up
			}
			calls = append(calls, c)
			s.pending[id] = &flight{kind: k, calls: []*call{c}, items: c.items(), sentAt: time.Now(), timeout: time.Second, counted: k != kindCopy}
		}
		s.inflight = 3
		_ = s.handle(&msg)
		for _, c := range calls {
			if n := len(c.done); n > 1 {
				t.Fatalf("call answered %d times", n)
			}
		}
	})
}

// FuzzRegisterChunk feeds arbitrary bytes, decoded as the messages of a
// chunked registration's table, to the table check: never a panic, never
// more allocations accepted than the Register announced, and every accepted
// allocation on a listed segment after the one before it.
func FuzzRegisterChunk(f *testing.F) {
	chunk := func(last bool, allocs ...*masterv1.Allocation) []byte {
		ch := &masterv1.RegisterChunk{Allocations: allocs, Last: last}
		if len(allocs) > 0 {
			ch.SegmentId = allocs[0].GetSegmentId()
			allocs[len(allocs)-1].SegmentId = "" // as agents send them
		}
		return mustMarshal(f, &masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_RegisterChunk{RegisterChunk: ch}})
	}
	sealed := func(seg string, id uint64) *masterv1.Allocation {
		return &masterv1.Allocation{SegmentId: seg, AllocationId: id, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k"}
	}
	f.Add(chunk(false, sealed("s0", 1), sealed("s0", 2)), chunk(true, sealed("s1", 1)))
	f.Add(chunk(false, sealed("s1", 1)), chunk(true, sealed("s0", 2)))
	f.Add(chunk(true, sealed("s0", 1), sealed("s0", 1)), []byte{})
	f.Add(chunk(true), []byte{0x4a, 0x02, 0x10, 0x01})
	blank := &masterv1.Allocation{SegmentId: "s0", AllocationId: 3, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Blank: true}
	f.Add(chunk(false, sealed("s0", 1), blank), chunk(true, sealed("s1", 1)))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		r := &masterv1.Register{AgentId: "a", DataEndpoint: "e:1", Chunked: true, AllocationCount: 3,
			Segments: []*masterv1.SegmentInfo{{SegmentId: "s0"}, {SegmentId: "s1"}}}
		cur := newTableCursor(r)
		type seen struct {
			pos int
			id  uint64
		}
		prev := seen{pos: -1}
		for _, data := range [][]byte{a, b} {
			var msg masterv1.ConnectRequest
			if proto.Unmarshal(data, &msg) != nil || msg.GetRegisterChunk() == nil {
				return
			}
			if err := cur.check(msg.GetRegisterChunk()); err != nil {
				return
			}
			for _, al := range msg.GetRegisterChunk().GetAllocations() {
				pos, ok := cur.order[al.GetSegmentId()]
				if !ok || pos < prev.pos || (pos == prev.pos && al.GetAllocationId() <= prev.id) {
					t.Fatalf("accepted %v after %+v", al, prev)
				}
				prev = seen{pos, al.GetAllocationId()}
			}
			if cur.got > cur.want {
				t.Fatalf("accepted %d allocations, the Register announced %d", cur.got, cur.want)
			}
		}
	})
}
