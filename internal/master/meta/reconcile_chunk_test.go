package meta

import (
	"fmt"
	"maps"
	"runtime"
	"testing"

	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/token"
)

// TestReconcileInChunks: a new master fed each agent's table in chunks of
// every size rebuilds exactly what one Reconcile of the whole table does,
// and a second, chunked registration of the same agents (a reconnect)
// changes nothing.
func TestReconcileInChunks(t *testing.T) {
	for _, chunk := range []int{1, 3, 7, 1000} {
		t.Run(fmt.Sprint(chunk), func(t *testing.T) {
			e := newEnv(t, 3, 1, 1<<20, Config{Shards: 8})
			ctx := t.Context()
			for i := range 30 {
				e.put(t, PutSpec{Tenant: []string{"", "a", "b"}[i%3], Key: fmt.Sprintf("k%d", i), Size: uint64(10 + i), ReplicaNum: 1 + i%3})
			}
			want := views(e.s)
			s2, err := New(Config{Shards: 8}, Deps{Registry: e.c.Reg, Agents: e.c.Agents, Now: e.clk.Now,
				Identity: cluster.Identity{Epoch: 43, Keys: token.NewRing(0, nil)}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			for round := range 2 {
				for h := range 3 {
					agent := fmt.Sprintf("agent-%d", h)
					var segs []cluster.Segment
					for _, sg := range e.c.Reg.Segments() {
						if sg.AgentID == agent {
							segs = append(segs, sg)
						}
					}
					table := e.c.Agents.Table(agent)
					r := s2.BeginReconcile(ctx, agent, segs, uint64(len(table)))
					var back int
					for lo := 0; lo < len(table); lo += chunk {
						back += len(r.Apply(ctx, table[lo:min(lo+chunk, len(table))]))
					}
					back += len(r.Finish(ctx))
					if back != 0 {
						t.Fatalf("round %d, %s: %d allocations returned, want none", round, agent, back)
					}
				}
				if got := views(s2); !maps.Equal(got, want) {
					t.Fatalf("round %d: rebuilt objects differ:\n got %v\nwant %v", round, got, want)
				}
			}
		})
	}
}

// TestReconcileAnnouncedSizeNotTrusted: an agent that announces a huge
// table (the protocol allows up to 2^34) and sends a few allocations makes
// the master allocate for what arrived, not for the claim (256 shards each
// sized for 2^34/128 keys would be gigabytes).
func TestReconcileAnnouncedSizeNotTrusted(t *testing.T) {
	e := newEnv(t, 1, 1, 1<<20, Config{Shards: 256})
	ctx := t.Context()
	for i := range 30 {
		e.put(t, PutSpec{Tenant: fmt.Sprintf("t%d", i), Key: fmt.Sprintf("k%d", i), Size: 10, ReplicaNum: 1})
	}
	s2, err := New(Config{Shards: 256}, Deps{Registry: e.c.Reg, Agents: e.c.Agents, Now: e.clk.Now,
		Identity: cluster.Identity{Epoch: 43, Keys: token.NewRing(0, nil)}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	table := e.c.Agents.Table("agent-0")
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r := s2.BeginReconcile(ctx, "agent-0", e.c.Reg.Segments(), 1<<34)
	r.Apply(ctx, table)
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
		t.Fatalf("applying %d allocations announced as 2^34 allocated %d MiB", len(table), grew>>20)
	}
	r.Finish(ctx)
}
