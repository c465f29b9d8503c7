package meta

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/protobuf/proto"
)

func FuzzDecodePageToken(f *testing.F) {
	f.Add("")
	f.Add(EncodePageToken("key/1"))
	f.Add("!!")
	f.Fuzz(func(t *testing.T, tok string) {
		key, err := DecodePageToken(tok)
		if err != nil {
			return
		}
		if tok != "" && EncodePageToken(key) != tok {
			t.Fatalf("token %q decodes to %q which encodes differently", tok, key)
		}
	})
}

// FuzzReconcile feeds arbitrary agent registrations (bytes from the
// network) to Reconcile: it must never panic, and the metadata must stay
// consistent (quota usage equals the objects held, records match state,
// the recency lists hold the objects in access order).
func FuzzReconcile(f *testing.F) {
	seed, _ := proto.Marshal(&masterv1.Register{AgentId: "agent-0", Allocations: []*masterv1.Allocation{
		{SegmentId: "seg-0-0", AllocationId: 1, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k", Checksum: 3, SealedUnixMs: 5},
		{SegmentId: "seg-0-0", AllocationId: 2, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k", Checksum: 4, SealedUnixMs: 9},
		{SegmentId: "seg-0-1", AllocationId: 1, Size: 0, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Tenant: "t", Key: "x"},
	}})
	f.Add(seed)
	// Blank reservations: as an agent lists them, and malformed ones the
	// session would refuse (a blank naming an object, a sealed blank).
	blanks, _ := proto.Marshal(&masterv1.Register{AgentId: "agent-0", Allocations: []*masterv1.Allocation{
		{SegmentId: "seg-0-0", AllocationId: 7, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_RESERVED, Blank: true},
		{SegmentId: "seg-0-0", AllocationId: 8, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k", Checksum: 3, Blank: true},
		{SegmentId: "seg-0-1", AllocationId: 2, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Blank: true},
	}})
	f.Add(blanks)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var reg masterv1.Register
		if proto.Unmarshal(b, &reg) != nil {
			return
		}
		c := metatest.NewCluster(1, 2, 1<<20)
		s, err := New(Config{Shards: 2}, Deps{Registry: c.Reg, Agents: c.Agents, Identity: cluster.Identity{Keys: token.NewRing(0, nil)}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		e := &env{s: s, c: c, clk: newClock()}
		e.put(t, PutSpec{Key: "k", Size: 10})
		s.Reconcile(context.Background(), "agent-0", segsOf(c, "agent-0"), reg.GetAllocations())
		f := &follower{set: map[rkey]bool{}}
		f.catchUp(t, s.log)
		want := readableSet(s)
		if len(f.set) != len(want) {
			t.Fatalf("change log set %v, readable %v", f.set, want)
		}
		objs, _, _ := s.Stats()
		n := 0
		for i := range s.shards {
			for _, m := range s.shards[i].tenants {
				n += m.len()
			}
		}
		if int(objs) != n {
			t.Fatalf("quota objects %d, map holds %d", objs, n)
		}
		checkRecencyLists(t, s)
	})
}

// FuzzFollowDelta feeds arbitrary TableDeltas (bytes from an agent's
// Follow stream; the session checks only their sequence and segments) to a
// following store that holds a table: it must never panic, never send a
// release, and stay consistent (records match state, quota usage matches
// the objects, recency lists in order).
func FuzzFollowDelta(f *testing.F) {
	seal := func(seg string, id uint64, key string, sum uint64, ms int64) *masterv1.Allocation {
		return &masterv1.Allocation{SegmentId: seg, AllocationId: id, Size: 10, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED,
			Key: key, Checksum: sum, SealedUnixMs: ms}
	}
	seed, _ := proto.Marshal(&masterv1.TableDelta{FromVersion: 1, Version: 4,
		Sealed:   []*masterv1.Allocation{seal("seg-0-0", 7, "k", 5, 9), seal("seg-0-1", 8, "j", 1, 1)},
		Released: []*masterv1.Allocation{seal("seg-0-0", 1, "k", 0, 0), seal("seg-0-1", 8, "j", 0, 0)}})
	f.Add(seed)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var d masterv1.TableDelta
		if proto.Unmarshal(b, &d) != nil {
			return
		}
		c := metatest.NewCluster(1, 2, 1<<20)
		s, err := New(Config{Shards: 2}, Deps{Registry: c.Reg, Agents: c.Agents, Identity: cluster.Identity{Keys: token.NewRing(0, nil)}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		s.SetFollowing(true)
		segs := segsOf(c, "agent-0")
		s.Reconcile(context.Background(), "agent-0", segs, []*masterv1.Allocation{seal("seg-0-0", 1, "k", 3, 5), seal("seg-0-1", 2, "k", 3, 5)})
		s.FollowDelta(context.Background(), "agent-0", segs, d.GetSealed(), d.GetReleased())
		if _, _, rel := c.Agents.Calls(); rel != 0 {
			t.Fatalf("a following store sent %d releases", rel)
		}
		fl := &follower{set: map[rkey]bool{}}
		fl.catchUp(t, s.log)
		if want := readableSet(s); len(fl.set) != len(want) {
			t.Fatalf("change log set %v, readable %v", fl.set, want)
		}
		checkRecencyLists(t, s)
	})
}
