package meta

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"pgregory.net/rapid"
)

// TestPropertyInvariants drives random sequences of put / get / remove /
// upsert / remove-all / evict / offload / revoke / segment loss / lost
// allocations / drain / copy and move / clock steps over a few tenants
// and keys, and checks after every step that (a) the change
// log applied to an empty set gives exactly the readable set, (b) quota
// usage equals the sum of live object sizes, (c) no allocation is leaked
// or double-released at the fake agents, (d) every shard's recency list
// holds exactly its objects, in access order.
func TestPropertyInvariants(t *testing.T) {
	tenants := []string{"", "t1", "t2"}
	keys := []string{"a", "b", "c", "d", "e", "f"}
	rapid.Check(t, func(rt *rapid.T) {
		e := newEnv(t, 3, 2, 4096, Config{Shards: 4})
		// Disk segments, so that the background check offloads (issue 17
		// item 3), and copies that fail now and then.
		e.withDisk(0, 4096)
		e.withDisk(1, 2048)
		e.c.Agents.FailCopy = func(it *masterv1.CopyItem) error {
			if it.GetSource().GetAllocationId()%7 == 0 {
				return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "copy failed")
			}
			return nil
		}
		f := &follower{set: map[rkey]bool{}}
		ctx := t.Context()
		nextSeg := 0
		// open puts: (tenant,key) → client id
		open := map[ObjectRef]string{}
		pickRef := func(rt *rapid.T) ObjectRef {
			return ObjectRef{Tenant: rapid.SampledFrom(tenants).Draw(rt, "tenant"), Key: rapid.SampledFrom(keys).Draw(rt, "key")}
		}
		spec := func(rt *rapid.T, r ObjectRef, upsert bool) PutSpec {
			medium := masterv1.Medium_MEDIUM_MEMORY
			if rapid.IntRange(0, 3).Draw(rt, "disk") == 0 {
				medium = masterv1.Medium_MEDIUM_DISK
			}
			return PutSpec{
				Tenant: r.Tenant, Key: r.Key,
				Size:       rapid.Uint64Range(1, 1500).Draw(rt, "size"),
				ReplicaNum: rapid.IntRange(1, 3).Draw(rt, "replicas"),
				Medium:     medium,
				SoftPin:    rapid.Bool().Draw(rt, "softpin"),
				HardPin:    rapid.IntRange(0, 9).Draw(rt, "hardpin") == 0,
				Group:      rapid.SampledFrom([]string{"", "", "g1", "g2", "g3"}).Draw(rt, "group"),
				ClientID:   "c",
				Upsert:     upsert,
			}
		}
		norm := func(r ObjectRef) ObjectRef { r.Tenant = NormalizeTenant(r.Tenant); return r }
		rt.Repeat(map[string]func(*rapid.T){
			"put": func(rt *rapid.T) {
				r := pickRef(rt)
				sp := spec(rt, r, rapid.Bool().Draw(rt, "upsert"))
				if _, err := e.s.PutStart(ctx, sp); err != nil {
					return
				}
				delete(open, norm(r))
				if err := e.s.PutEnd(ctx, PutEndSpec{Tenant: r.Tenant, Key: r.Key, ClientID: "c", Checksum: sp.Size}); err != nil {
					rt.Fatalf("PutEnd after PutStart: %v", err)
				}
			},
			"putStartOnly": func(rt *rapid.T) {
				r := pickRef(rt)
				client := rapid.SampledFrom([]string{"c", "d"}).Draw(rt, "client")
				sp := spec(rt, r, rapid.Bool().Draw(rt, "upsert"))
				sp.ClientID = client
				if _, err := e.s.PutStart(ctx, sp); err == nil {
					open[norm(r)] = client
				}
			},
			"putEndOpen": func(rt *rapid.T) {
				r := norm(pickRef(rt))
				client, ok := open[r]
				if !ok {
					return
				}
				err := e.s.PutEnd(ctx, PutEndSpec{Tenant: r.Tenant, Key: r.Key, ClientID: client, Checksum: 7})
				if err == nil || rpcerr.Reason(err) == "PUT_EXPIRED" || rpcerr.Reason(err) == "OBJECT_NOT_FOUND" {
					delete(open, r)
				}
			},
			"revoke": func(rt *rapid.T) {
				r := norm(pickRef(rt))
				client, ok := open[r]
				if !ok {
					client = "c"
				}
				_ = e.s.PutRevoke(ctx, PutRevokeSpec{Tenant: r.Tenant, Key: r.Key, ClientID: client})
				delete(open, r)
			},
			"batchPut": func(rt *rapid.T) {
				n := rapid.IntRange(1, 6).Draw(rt, "n")
				specs := make([]PutSpec, n)
				for i := range specs {
					specs[i] = spec(rt, pickRef(rt), rapid.Bool().Draw(rt, "upsert"))
				}
				res := e.s.BatchPutStart(ctx, specs)
				var ends []PutEndSpec
				for i, r := range res {
					if r.Err == nil {
						delete(open, norm(ObjectRef{specs[i].Tenant, specs[i].Key}))
						ends = append(ends, PutEndSpec{Tenant: specs[i].Tenant, Key: specs[i].Key, ClientID: "c", Checksum: 1})
					}
				}
				e.s.BatchPutEnd(ctx, ends)
			},
			"get": func(rt *rapid.T) {
				r := pickRef(rt)
				_, _ = e.s.Get(ctx, GetSpec{Tenant: r.Tenant, Key: r.Key})
			},
			"batchGet": func(rt *rapid.T) {
				specs := []GetSpec{{Tenant: "t1", Key: "a"}, {Tenant: "", Key: "b"}, {Tenant: "t2", Key: "c"}}
				e.s.BatchGet(ctx, specs)
			},
			"expirePuts": func(rt *rapid.T) {
				// Puts older than the put timeout (30 s) are expired; their
				// PutEnd (putEndOpen) then answers PUT_EXPIRED.
				e.s.expirePuts(ctx)
			},
			"advance": func(rt *rapid.T) {
				e.clk.Advance(time.Duration(rapid.IntRange(1, 40).Draw(rt, "secs")) * time.Second)
			},
			"stepBack": func(rt *rapid.T) {
				// The clock steps backwards: reads and completions then
				// carry clocks older than the recency lists' tails.
				e.clk.Advance(-time.Duration(rapid.IntRange(1, 60).Draw(rt, "secs")) * time.Second)
			},
			"remove": func(rt *rapid.T) {
				r := pickRef(rt)
				_ = e.s.Remove(ctx, RemoveSpec{Tenant: r.Tenant, Key: r.Key, Force: rapid.Bool().Draw(rt, "force")})
			},
			"batchRemove": func(rt *rapid.T) {
				specs := []RemoveSpec{{Tenant: "t1", Key: "a"}, {Tenant: "t1", Key: "b", Force: true}, {Tenant: "", Key: "a"}}
				e.s.BatchRemove(ctx, specs)
			},
			"removeAll": func(rt *rapid.T) {
				_, _, _ = e.s.RemoveAll(ctx, rapid.SampledFrom(tenants).Draw(rt, "tenant"), rapid.Bool().Draw(rt, "force"))
			},
			"removeByPrefix": func(rt *rapid.T) {
				_, _, _, _ = e.s.RemoveByPrefix(ctx, rapid.SampledFrom(tenants).Draw(rt, "tenant"), rapid.SampledFrom(keys).Draw(rt, "prefix"), true, "")
			},
			"evict": func(rt *rapid.T) {
				e.s.evictFor(ctx, masterv1.Medium_MEDIUM_MEMORY, rapid.Uint64Range(1, 4096).Draw(rt, "need"), rapid.Uint64Range(1, 1500).Draw(rt, "largest"))
			},
			"evictOverHigh": func(rt *rapid.T) {
				e.s.evictOverHigh(ctx)
			},
			"offload": func(rt *rapid.T) {
				offloadSome(rt, e)
			},
			"loseSegment": func(rt *rapid.T) {
				segs := e.c.Reg.Segments()
				if len(segs) <= 3 {
					return
				}
				sg := rapid.SampledFrom(segs).Draw(rt, "segment")
				_ = e.c.Reg.SetLifecycle(sg.ID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING)
				e.s.DropSegments(ctx, []string{sg.ID})
				e.c.Agents.Unmount(sg.ID)
				_ = e.c.Reg.SetLifecycle(sg.ID, masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTED)
				nextSeg++
				e.c.Reg.Add(cluster.Segment{ID: fmt.Sprintf("new-%d", nextSeg), AgentID: sg.AgentID, HostID: sg.HostID, Capacity: 4096})
			},
			"drain": func(rt *rapid.T) {
				var ok []cluster.Segment
				for _, sg := range e.c.Reg.Segments() {
					if sg.CanAllocate() {
						ok = append(ok, sg)
					}
				}
				if len(ok) <= 3 {
					return
				}
				sg := rapid.SampledFrom(ok).Draw(rt, "segment")
				// The model's clock stands still: writes in progress
				// would be waited for forever, so they are not.
				cn, err := e.s.Drain(ctx, sg.ID, DrainOptions{WriteWait: -1})
				if err != nil {
					rt.Fatalf("drain %s: %v", sg.ID, err)
				}
				// Copies that keep failing keep their sources (counted as
				// left, the segment stays DRAINING); otherwise only writes
				// in progress may stay behind.
				if n := completeOn(e.s, sg.ID); uint64(n) > cn.GetLeft() {
					rt.Fatalf("drained segment %s still holds %d COMPLETE replicas, the drain says %d left", sg.ID, n, cn.GetLeft())
				}
				got, _ := e.c.Reg.Segment(sg.ID)
				if drained := got.Lifecycle == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED; drained != (cn.GetLeft() == 0) {
					rt.Fatalf("segment %s is %v with %d left", sg.ID, got.Lifecycle, cn.GetLeft())
				}
				nextSeg++
				e.c.Reg.Add(cluster.Segment{ID: fmt.Sprintf("new-%d", nextSeg), AgentID: sg.AgentID, HostID: sg.HostID, Capacity: 4096})
			},
			"migrate": func(rt *rapid.T) {
				// Copy or Move of some keys of one tenant to a segment, a
				// host or the memory medium (issue 17).
				var tg MigrateTarget
				switch rapid.IntRange(0, 3).Draw(rt, "target") {
				case 0, 1:
					tg.SegmentID = rapid.SampledFrom(e.c.Reg.Segments()).Draw(rt, "segment").ID
				case 2:
					tg.HostID = fmt.Sprintf("host-%d", rapid.IntRange(0, 2).Draw(rt, "host"))
				default:
					tg.Medium = rapid.SampledFrom([]masterv1.Medium{masterv1.Medium_MEDIUM_MEMORY, masterv1.Medium_MEDIUM_DISK}).Draw(rt, "medium")
				}
				sp := MigrateSpec{Tenant: rapid.SampledFrom(tenants).Draw(rt, "tenant"), Target: tg, Move: rapid.Bool().Draw(rt, "move"),
					Keys: rapid.SliceOfNDistinct(rapid.SampledFrom(keys), 1, 3, rapid.ID[string]).Draw(rt, "keys")}
				// Mostly keys that are readable, so most calls copy.
				var live []rkey
				for k := range readableSet(e.s) {
					live = append(live, k)
				}
				if len(live) > 0 && rapid.IntRange(0, 3).Draw(rt, "live") > 0 {
					slices.SortFunc(live, func(a, b rkey) int { return strings.Compare(a.tenant+"/"+a.key, b.tenant+"/"+b.key) })
					k := rapid.SampledFrom(live).Draw(rt, "object")
					sp.Tenant, sp.Keys = k.tenant, []string{k.key}
				}
				res, err := e.s.Migrate(ctx, sp)
				if err != nil {
					if r := rpcerr.Reason(err); r != "SEGMENT_UNAVAILABLE" && r != "SEGMENT_NOT_FOUND" {
						rt.Fatalf("migrate %+v: %v", sp, err)
					}
					return
				}
				for _, r := range res {
					if r.Err == nil && (r.Replica.GetStatus() != masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE || r.Source == "") {
						rt.Fatalf("migrate %s: OK without a COMPLETE replica and a source: %+v", r.Key, r)
					}
				}
			},
			"loseAllocations": func(rt *rapid.T) {
				// An agent's reads found sealed allocations bad: it drops
				// them and reports them (AllocationsLost), perhaps one
				// twice.
				agent := fmt.Sprintf("agent-%d", rapid.IntRange(0, 2).Draw(rt, "agent"))
				var sealed []*masterv1.Allocation
				for _, a := range e.c.Agents.Table(agent) {
					if a.GetState() == masterv1.AllocationState_ALLOCATION_STATE_SEALED {
						sealed = append(sealed, a)
					}
				}
				if len(sealed) == 0 {
					return
				}
				var lost []*masterv1.Allocation
				for range rapid.IntRange(1, 3).Draw(rt, "lost") {
					a := sealed[rapid.IntRange(0, len(sealed)-1).Draw(rt, "allocation")]
					e.c.Agents.Lose(metatest.Ref{Segment: a.GetSegmentId(), ID: a.GetAllocationId()})
					lost = append(lost, a)
				}
				e.s.Lost(ctx, agent, segsOf(e.c, agent), lost)
			},
			"agentBlip": func(rt *rapid.T) {
				// An agent is unreachable during one removal-type operation,
				// then reconnects and reconciles; it releases what the
				// master hands back.
				agent := fmt.Sprintf("agent-%d", rapid.IntRange(0, 2).Draw(rt, "agent"))
				e.c.Agents.SetDown(agent, true)
				r := pickRef(rt)
				switch rapid.IntRange(0, 4).Draw(rt, "op") {
				case 0:
					_ = e.s.Remove(ctx, RemoveSpec{Tenant: r.Tenant, Key: r.Key, Force: true})
				case 1:
					_, _, _ = e.s.RemoveAll(ctx, r.Tenant, true)
				case 2:
					sp := spec(rt, r, true)
					if _, err := e.s.PutStart(ctx, sp); err == nil {
						delete(open, norm(r))
						_ = e.s.PutEnd(ctx, PutEndSpec{Tenant: r.Tenant, Key: r.Key, ClientID: "c", Checksum: 3})
					}
				case 3:
					e.s.evictFor(ctx, masterv1.Medium_MEDIUM_MEMORY, 2048, 1024)
				case 4: // offloads whose copies, reserves or seals fail
					offloadSome(rt, e)
				}
				e.c.Agents.SetDown(agent, false)
				var segs []cluster.Segment
				for _, sg := range e.c.Reg.Segments() {
					if sg.AgentID == agent {
						segs = append(segs, sg)
					}
				}
				back := e.s.Reconcile(ctx, agent, segs, e.c.Agents.Table(agent))
				if len(back) > 0 {
					if err := e.c.Agents.Release(ctx, agent, back); err != nil {
						rt.Fatalf("agent release: %v", err)
					}
				}
			},
			"": func(rt *rapid.T) {
				checkInvariants(rt, e, f)
			},
		})
	})
}

// offloadSome runs an offload pass (issue 17 item 3) over one memory
// segment for a random need, as evictOverHigh would for a segment over its
// high watermark.
func offloadSome(rt *rapid.T, e *env) {
	var mem []cluster.Segment
	for _, sg := range e.c.Reg.Segments() {
		if sg.Medium == masterv1.Medium_MEDIUM_MEMORY {
			mem = append(mem, sg)
		}
	}
	if len(mem) == 0 {
		return
	}
	sg := rapid.SampledFrom(mem).Draw(rt, "segment")
	need := rapid.Int64Range(1, 4096).Draw(rt, "need")
	e.s.offloadMu.Lock()
	defer e.s.offloadMu.Unlock()
	e.s.offloadPass(context.Background(), []evictTarget{{seg: e.s.segs.intern(sg.ID), need: need}})
}
