package gateway_test

// The gateway against the real master, agents and SDK (internal/testcluster):
// what it promises end to end is that a kvevent subscriber attached to it
// holds exactly the master's readable set. These tests live in the external
// package because testcluster imports this one; they share the package's
// test binary, so its TestMain (goleak) covers them.

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/gateway"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// waitFor bounds every wait of these tests.
const waitFor = 30 * time.Second

// recorder is a kvevent subscriber to the cluster's gateway that also keeps
// every event and gap it was given, in order.
type recorder struct {
	sub *kvevent.Subscriber

	mu     sync.Mutex
	events []string // event strings (see eventString), in delivery order
	gaps   []kvevent.Gap
}

// subscribe attaches a subscriber to g with replay from sequence 1 and
// waits until the gateway counts it.
func subscribe(t *testing.T, g *gateway.Gateway) *recorder {
	t.Helper()
	r := &recorder{}
	sub, err := kvevent.Subscribe(t.Context(), g.PubEndpoint(), kvevent.Options{
		ReplayEndpoint: g.ReplayEndpoint(), FromSeq: 1, Logger: testutil.Logger(),
		ReconnectMin: time.Millisecond, ReconnectMax: 20 * time.Millisecond,
		OnBatch: func(b kvevent.Batch) {
			r.mu.Lock()
			defer r.mu.Unlock()
			for _, e := range b.Events {
				r.events = append(r.events, eventString(e))
			}
		},
		OnGap: func(gp kvevent.Gap) {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.gaps = append(r.gaps, gp)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	r.sub = sub
	testutil.Eventually(t, waitFor, func() bool { return g.Status().Subscribers == 1 }, "the gateway to count the subscriber")
	return r
}

func eventString(e kvevent.Event) string {
	if e.Type == kvevent.Cleared {
		return fmt.Sprintf("%s %s", e.Type, e.Tenant)
	}
	return fmt.Sprintf("%s %s/%s %s group=%q", e.Type, e.Tenant, e.Key, e.Medium, e.GroupID)
}

// mark is the number of events received so far; since(mark) the ones after.
func (r *recorder) mark() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.events)
}

func (r *recorder) since(mark int) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events[mark:])
}

func (r *recorder) gapList() []kvevent.Gap {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.gaps)
}

// settled waits until the gateway has applied the running master's head
// revision in its epoch, published everything it enqueued, and the
// subscriber has received the last sequence. (Not that the gateway reports
// Watching: the master sends nothing on a Watch stream until a change
// follows the requested revision, and Watching means a stream delivered.)
func settled(t *testing.T, c *testcluster.Cluster, r *recorder) {
	t.Helper()
	testutil.EventuallyNoError(t, waitFor, func() error {
		log := c.Master().Store.Log()
		epoch, head := log.Epoch(), log.Head()
		st, ss := c.Gateway().Status(), r.sub.Stats()
		// The subscriber counts a batch's events before OnBatch runs.
		if st.MasterEpoch == epoch && st.MasterRevision == head &&
			st.EnqueuedEvents == st.PublishedEvents+st.DroppedEvents && ss.LastSeq == st.LastSequence &&
			uint64(r.mark()) == ss.Events {
			return nil
		}
		return fmt.Errorf("pipeline did not settle: gateway %+v subscriber %+v master epoch %d head %d", st, ss, epoch, head)
	})
}

// registered waits until n segments are OK and HEALTHY at the master. A
// segment is OK from the moment its agent registers, but turns HEALTHY only
// once the master has reconciled the agent's allocations (adopted its
// objects), which is what these tests wait for after a restart.
func registered(t *testing.T, c *testcluster.Cluster, n int) {
	t.Helper()
	admin := masterv1.NewAdminServiceClient(c.Conn())
	testutil.EventuallyNoError(t, waitFor, func() error {
		resp, err := admin.ListSegments(t.Context(), &masterv1.ListSegmentsRequest{})
		if err != nil {
			return err
		}
		ok := 0
		for _, sg := range resp.GetSegments() {
			if sg.GetLifecycle() == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK && sg.GetHealth() == masterv1.SegmentHealth_SEGMENT_HEALTH_HEALTHY {
				ok++
			}
		}
		if ok < n {
			return fmt.Errorf("%d of %d segments OK and healthy", ok, n)
		}
		return nil
	})
}

func wireMedium(m masterv1.Medium) kvevent.Medium {
	if m == masterv1.Medium_MEDIUM_MEMORY {
		return kvevent.MediumCPU
	}
	return kvevent.MediumDisk
}

// readable is the master's readable set of the tenants, as (tenant, key,
// medium), listed through the SDK (ListObjects: the media on which each
// object has a complete replica), sorted as kvevent.Index.Keys sorts.
func readable(t *testing.T, cl *client.Client, tenants ...string) []kvevent.Key {
	t.Helper()
	var out []kvevent.Key
	for _, tn := range tenants {
		for o, err := range cl.Tenant(tn).List(t.Context(), "") {
			if err != nil {
				t.Fatalf("list %s: %v", tn, err)
			}
			for _, m := range o.GetMedia() {
				out = append(out, kvevent.Key{Tenant: tn, Key: o.GetKey(), Medium: wireMedium(m)})
			}
		}
	}
	slices.SortFunc(out, func(a, b kvevent.Key) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Medium, b.Medium))
	})
	return out
}

// mirrors fails the test unless the subscriber's index is exactly the
// master's readable set of the tenants (and holds no other tenant).
func mirrors(t *testing.T, r *recorder, cl *client.Client, tenants ...string) []kvevent.Key {
	t.Helper()
	got, want := r.sub.Index().Keys(), readable(t, cl, tenants...)
	if !slices.Equal(got, want) {
		t.Fatalf("subscriber index (%d) != master readable set (%d)\n got %v\nwant %v", len(got), len(want), got, want)
	}
	return want
}

// quiet fails the test if the subscriber saw a gap, a reset or a malformed
// message, or the gateway dropped an event.
func quiet(t *testing.T, c *testcluster.Cluster, r *recorder) {
	t.Helper()
	st, ss := c.Gateway().Status(), r.sub.Stats()
	if ss.MissingSeqs != 0 || ss.Unrepaired != 0 || ss.Resets != 0 || ss.Malformed != 0 || st.DroppedEvents != 0 {
		t.Errorf("subscriber %+v, gateway dropped %d: want no gaps, resets, malformed messages or drops", ss, st.DroppedEvents)
	}
	if g := r.gapList(); len(g) != 0 {
		t.Errorf("gaps = %+v, want none", g)
	}
}

func put(t *testing.T, cl *client.Client, key string, opts ...client.PutOption) {
	t.Helper()
	if err := cl.Put(t.Context(), key, []byte("v:"+key), opts...); err != nil {
		t.Fatalf("put %s/%s: %v", cl.TenantName(), key, err)
	}
}

var (
	memory = client.WithMedium(masterv1.Medium_MEDIUM_MEMORY)
	disk   = client.WithMedium(masterv1.Medium_MEDIUM_DISK)
)

// TestClusterSubscriberMirrorsMaster: puts on both media in two tenants,
// an upsert that changes the group, Remove, RemoveByPrefix and RemoveAll
// reach a subscriber as exactly the master's readable set, each as the
// events the change implies, with the counters moving in step.
func TestClusterSubscriberMirrorsMaster(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 8 << 20})
	g := c.Gateway()
	r := subscribe(t, g)
	cl := c.Client(t)
	alpha, beta := cl.Tenant("alpha"), cl.Tenant("beta")
	if st := g.Status(); st.Resyncs != 1 || st.PublishedEvents != 0 || st.AnnouncedEntries != 0 {
		t.Fatalf("fresh gateway status %+v: want one (empty) snapshot, nothing published", st)
	}

	for layer := range 3 {
		for block := range 4 {
			key := fmt.Sprintf("model/layer-%d/block-%d", layer, block)
			put(t, alpha, key, memory, client.WithGroup("g1"))
			put(t, beta, key, memory)
		}
		put(t, alpha, fmt.Sprintf("disk/layer-%d", layer), disk, client.WithGroup("g2"))
	}
	settled(t, c, r)
	set := mirrors(t, r, cl, "alpha", "beta")
	if len(set) != 27 {
		t.Fatalf("readable set has %d entries, want 27", len(set))
	}
	if grp, ok := r.sub.Index().Has(kvevent.Key{Tenant: "alpha", Key: "disk/layer-1", Medium: kvevent.MediumDisk}); !ok || grp != "g2" {
		t.Errorf("index entry for alpha/disk/layer-1 on disk: group %q, %v; want g2", grp, ok)
	}
	st1 := g.Status()
	if st1.PublishedEvents != 27 || st1.AnnouncedEntries != 27 || st1.Resyncs != 1 {
		t.Errorf("after 27 puts: gateway %+v, want 27 events published, 27 announced, no resync", st1)
	}

	// An upsert replaces the object: removed with its old group, stored
	// with the new one.
	mark := r.mark()
	put(t, alpha, "model/layer-0/block-0", memory, client.WithGroup("g3"), client.WithUpsert())
	settled(t, c, r)
	if got, want := r.since(mark), []string{
		`removed alpha/model/layer-0/block-0 cpu group="g1"`,
		`stored alpha/model/layer-0/block-0 cpu group="g3"`,
	}; !slices.Equal(got, want) {
		t.Errorf("upsert published %q, want %q", got, want)
	}
	mirrors(t, r, cl, "alpha", "beta")

	// Remove and RemoveByPrefix: one removed event per object.
	mark = r.mark()
	if err := alpha.Remove(t.Context(), "disk/layer-2", false); err != nil {
		t.Fatal(err)
	}
	if removed, skipped, err := alpha.RemoveByPrefix(t.Context(), "model/layer-1/", false); err != nil || removed != 4 || skipped != 0 {
		t.Fatalf("RemoveByPrefix: removed %d skipped %d, %v; want 4, 0", removed, skipped, err)
	}
	settled(t, c, r)
	got := r.since(mark)
	want := []string{`removed alpha/disk/layer-2 disk group="g2"`}
	for block := range 4 {
		want = append(want, fmt.Sprintf(`removed alpha/model/layer-1/block-%d cpu group="g1"`, block))
	}
	slices.Sort(got[1:]) // the prefix scan goes in no particular order
	if !slices.Equal(got, want) {
		t.Errorf("Remove and RemoveByPrefix published %q, want %q", got, want)
	}
	mirrors(t, r, cl, "alpha", "beta")

	// RemoveAll empties the tenant: a removed event per object, then cleared.
	mark = r.mark()
	if removed, skipped, err := beta.RemoveAll(t.Context(), false); err != nil || removed != 12 || skipped != 0 {
		t.Fatalf("RemoveAll: removed %d skipped %d, %v; want 12, 0", removed, skipped, err)
	}
	put(t, beta, "after-clear", memory)
	settled(t, c, r)
	got = r.since(mark)
	want = nil
	for layer := range 3 {
		for block := range 4 {
			want = append(want, fmt.Sprintf(`removed beta/model/layer-%d/block-%d cpu group=""`, layer, block))
		}
	}
	want = append(want, "cleared beta", `stored beta/after-clear cpu group=""`)
	if len(got) == len(want) {
		slices.Sort(got[:12]) // removed shard by shard
	}
	if !slices.Equal(got, want) {
		t.Errorf("RemoveAll then put published %q, want %q", got, want)
	}
	set = mirrors(t, r, cl, "alpha", "beta")

	st, ss := g.Status(), r.sub.Stats()
	quiet(t, c, r)
	if st.Resyncs != 1 {
		t.Errorf("resyncs = %d, want 1: nothing here needs a snapshot", st.Resyncs)
	}
	if st.PublishedEvents != ss.Events || st.PublishedEvents != uint64(r.mark()) || st.PublishedEvents != 27+2+5+14 {
		t.Errorf("gateway published %d events, subscriber got %d (%d recorded); want %d", st.PublishedEvents, ss.Events, r.mark(), 27+2+5+14)
	}
	if st.AnnouncedEntries != len(set) || st.LastSequence != ss.LastSeq || st.PublishedBatches < st1.PublishedBatches+4 {
		t.Errorf("gateway %+v: want %d announced, last sequence %d, at least 4 more batches than %d", st, len(set), ss.LastSeq, st1.PublishedBatches)
	}
}

// TestClusterAgentLeaves: an agent that stops cleanly takes its objects
// with it, and the gateway announces exactly those as removed; when it
// comes back with its disk, the gateway announces what the master adopts.
func TestClusterAgentLeaves(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 8 << 20})
	g := c.Gateway()
	r := subscribe(t, g)
	cl := c.Client(t).Tenant("t")

	onAgent := map[int][]string{} // agent → keys placed there
	for i := range 2 {
		for j := range 3 {
			for _, m := range []struct {
				name string
				opt  client.PutOption
			}{{"mem", memory}, {"disk", disk}} {
				key := fmt.Sprintf("%s/%d/%d", m.name, i, j)
				put(t, cl, key, m.opt, client.WithReplicas(1), client.WithPreferLocal(fmt.Sprintf("host-%d", i)))
				info, err := cl.Stat(t.Context(), key)
				if err != nil {
					t.Fatal(err)
				}
				if len(info.Replicas) != 1 || info.Replicas[0].GetAgentId() != fmt.Sprintf("agent-%d", i) {
					t.Fatalf("%s placed on %v, want agent-%d alone", key, info.Replicas, i)
				}
				onAgent[i] = append(onAgent[i], key)
			}
		}
	}
	slices.Sort(onAgent[0])
	slices.Sort(onAgent[1])
	settled(t, c, r)
	if n := len(mirrors(t, r, cl, "t")); n != 12 {
		t.Fatalf("readable set has %d entries, want 12", n)
	}

	mark := r.mark()
	c.StopAgent(1)
	testutil.EventuallyNoError(t, waitFor, func() error {
		if got := c.Keys("t"); !slices.Equal(got, onAgent[0]) {
			return fmt.Errorf("master still lists %v after agent-1 left, want %v", got, onAgent[0])
		}
		return nil
	})
	settled(t, c, r)
	mirrors(t, r, cl, "t")
	var want []string
	for _, key := range onAgent[1] {
		m := kvevent.MediumCPU
		if strings.HasPrefix(key, "disk/") {
			m = kvevent.MediumDisk
		}
		want = append(want, fmt.Sprintf(`removed t/%s %s group=""`, key, m))
	}
	slices.Sort(want)
	got := r.since(mark)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("agent-1 leaving published %q, want exactly its objects removed %q", got, want)
	}

	// Back with the same disk directory: its disk objects are adopted
	// (its memory died with it).
	mark = r.mark()
	c.StartAgent(1)
	registered(t, c, 4)
	settled(t, c, r)
	mirrors(t, r, cl, "t")
	want = nil
	for _, key := range onAgent[1] {
		if strings.HasPrefix(key, "disk/") {
			want = append(want, fmt.Sprintf(`stored t/%s disk group=""`, key))
		}
	}
	got = r.since(mark)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("agent-1 returning published %q, want its disk objects stored %q", got, want)
	}
	quiet(t, c, r)
	if st := g.Status(); st.Resyncs != 1 {
		t.Errorf("resyncs = %d, want 1", st.Resyncs)
	}
}

// TestClusterMasterRestart: after a master restart (a new epoch; agents
// re-register and the master adopts what they hold) the gateway resyncs
// and publishes only what changed while it was not following, not the
// whole set again. The master hook keeps the gateway off the new master's
// ChangeService, with the reason the master's own recovery grace gives,
// until the agents have re-registered and the test has changed the set;
// the master's stream is then the only source of truth.
func TestClusterMasterRestart(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 8 << 20})
	g := c.Gateway()
	r := subscribe(t, g)
	cl := c.Client(t)
	alpha, beta := cl.Tenant("alpha"), cl.Tenant("beta")
	for i := range 8 {
		put(t, alpha, fmt.Sprintf("mem/%d", i), memory, client.WithGroup("g"))
		put(t, beta, fmt.Sprintf("disk/%d", i), disk)
	}
	settled(t, c, r)
	before := mirrors(t, r, cl, "alpha", "beta")
	st0 := g.Status()
	oldEpoch := st0.MasterEpoch
	mark := r.mark()

	c.SetMasterHook(func(m string) error {
		if m == "Watch" || m == "Snapshot" {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING, "test: agents are re-registering")
		}
		return nil
	})
	c.RestartMaster()
	// RestartMaster waits for as many OK segments as there are running
	// agents, and a segment is OK before its agent's objects are adopted;
	// each agent here has two segments (memory and disk).
	registered(t, c, 4)
	newEpoch := c.Master().Store.Log().Epoch()
	if newEpoch == oldEpoch {
		t.Fatalf("master restarted in the same epoch %d", oldEpoch)
	}
	if after := readable(t, cl, "alpha", "beta"); !slices.Equal(after, before) {
		t.Fatalf("the restarted master adopted %v, want everything the agents held %v", after, before)
	}
	// Changed while the gateway is away.
	put(t, alpha, "new-after-restart", memory, client.WithGroup("g"))
	if err := beta.Remove(t.Context(), "disk/3", false); err != nil {
		t.Fatal(err)
	}
	if st := g.Status(); st.MasterEpoch != oldEpoch || st.Watching || st.PublishedEvents != st0.PublishedEvents {
		t.Fatalf("gateway followed the new master through the hook: %+v", st)
	}

	c.SetMasterHook(nil)
	testutil.Eventually(t, waitFor, func() bool { return g.Status().Resyncs == 2 }, "the gateway to resync")
	settled(t, c, r)
	mirrors(t, r, cl, "alpha", "beta")
	if got, want := r.since(mark), []string{
		`removed beta/disk/3 disk group=""`,
		`stored alpha/new-after-restart cpu group="g"`,
	}; !slices.Equal(got, want) {
		t.Errorf("resync after the restart published %q, want only the difference %q", got, want)
	}
	st := g.Status()
	if st.MasterEpoch != newEpoch || st.Resyncs != 2 || st.PublishedEvents != st0.PublishedEvents+2 {
		t.Errorf("gateway after resync %+v: want epoch %d, 2 resyncs, %d events published", st, newEpoch, st0.PublishedEvents+2)
	}
	quiet(t, c, r)

	// And it follows the new master live.
	mark = r.mark()
	if err := alpha.Remove(t.Context(), "mem/0", false); err != nil {
		t.Fatal(err)
	}
	settled(t, c, r)
	if got := r.since(mark); !slices.Equal(got, []string{`removed alpha/mem/0 cpu group="g"`}) {
		t.Errorf("live after the resync: published %q", got)
	}
	if !g.Status().Watching {
		t.Error("gateway does not report watching after a change reached it")
	}
	before = mirrors(t, r, cl, "alpha", "beta")

	// Unscripted: the gateway may now snapshot the new master before every
	// agent has re-registered (the harness runs without a recovery grace)
	// and learn the rest from the adoptions' changes; either way it ends on
	// the master's set, without a gap at the subscriber.
	c.RestartMaster()
	registered(t, c, 4)
	testutil.Eventually(t, waitFor, func() bool { return g.Status().Resyncs == 3 }, "the gateway to resync again")
	settled(t, c, r)
	if got := mirrors(t, r, cl, "alpha", "beta"); !slices.Equal(got, before) {
		t.Errorf("after the second restart the set is %v, want what the agents held %v", got, before)
	}
	quiet(t, c, r)
}

// TestClusterGatewayRestart: a subscriber connected to one gateway process
// reconnects to its replacement on the same endpoints, detects the
// restart, and converges on the master's set from the new process's replay
// ring, including what changed while no gateway ran.
func TestClusterGatewayRestart(t *testing.T) {
	var pub, replay string // the first gateway's endpoints, reused by the second
	c := testcluster.Start(t, testcluster.Options{Gateway: true, GatewayConfig: func(cfg *gateway.Config) {
		if pub != "" {
			cfg.Pub, cfg.Replay = pub, replay
		}
	}})
	pub, replay = c.Gateway().PubEndpoint(), c.Gateway().ReplayEndpoint()
	cl := c.Client(t).Tenant("t")
	for i := range 20 {
		put(t, cl, fmt.Sprintf("k%02d", i), memory)
	}
	r := subscribe(t, c.Gateway())
	for i := range 5 {
		if err := cl.Remove(t.Context(), fmt.Sprintf("k%02d", i), false); err != nil {
			t.Fatal(err)
		}
	}
	settled(t, c, r)
	mirrors(t, r, cl, "t")

	c.StopGateway()
	for i := 5; i < 10; i++ {
		if err := cl.Remove(t.Context(), fmt.Sprintf("k%02d", i), false); err != nil {
			t.Fatal(err)
		}
	}
	put(t, cl, "while-down", memory)
	c.StartGateway()
	g := c.Gateway()
	if g.PubEndpoint() != pub || g.ReplayEndpoint() != replay {
		t.Fatalf("new gateway on %s/%s, want the old endpoints %s/%s", g.PubEndpoint(), g.ReplayEndpoint(), pub, replay)
	}
	testutil.Eventually(t, waitFor, func() bool { return g.Status().Subscribers == 1 }, "the subscriber to reconnect")
	put(t, cl, "after-restart", memory) // at least one live event
	// Sequence numbers restarted, so "same last sequence" proves nothing
	// here: wait for the index to converge on the master's set.
	testutil.EventuallyNoError(t, waitFor, func() error {
		if got, want := r.sub.Index().Keys(), readable(t, cl, "t"); !slices.Equal(got, want) {
			return fmt.Errorf("after a gateway restart the index (%d) never matched the master set (%d); subscriber %+v gateway %+v",
				len(got), len(want), r.sub.Stats(), g.Status())
		}
		return nil
	})
	settled(t, c, r)
	if n := len(mirrors(t, r, cl, "t")); n != 12 {
		t.Errorf("readable set has %d entries, want 12", n)
	}
	if ss := r.sub.Stats(); ss.Resets != 1 || ss.Unrepaired != 0 {
		t.Errorf("subscriber stats %+v, want one reset, nothing unrepaired", ss)
	}
	if gaps := r.gapList(); len(gaps) != 1 || !gaps[0].Reset {
		t.Errorf("gaps = %+v, want exactly one reset", gaps)
	}
}

// TestClusterStatusEndpoints: /kv_events/status, /metrics, GetStatus and
// /readyz report the counters of what the real master's changes became,
// here with emit-object-key off (per-object events are skipped, cleared
// is published).
func TestClusterStatusEndpoints(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 8 << 20,
		GatewayConfig: func(cfg *gateway.Config) { cfg.EmitObjectKey = false }})
	g := c.Gateway()
	cl := c.Client(t).Tenant("t")
	put(t, cl, "a", memory)
	put(t, cl, "b", disk)
	if removed, _, err := cl.RemoveAll(t.Context(), false); err != nil || removed != 2 {
		t.Fatalf("RemoveAll: removed %d, %v; want 2", removed, err)
	}
	// Stored a, stored b, removed a, removed b are skipped; cleared is published.
	testutil.Eventually(t, waitFor, func() bool {
		st := g.Status()
		return st.PublishedEvents == 1 && st.MasterRevision == c.Master().Store.Log().Head()
	}, "the cleared event")

	resp, err := http.Get("http://" + g.AdminAddr() + "/kv_events/status")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var doc map[string]any
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatalf("status is not JSON: %v\n%s", err, body)
	}
	want := map[string]any{
		"enabled": true, "published_batches": 1.0, "published_events": 1.0, "dropped_events": 0.0, "skipped_keyless_events": 4.0,
		"enqueued_events": 1.0, "last_sequence": 1.0, "resyncs": 1.0, "watching": true, "announced_entries": 0.0,
		"master_epoch": float64(c.Master().Store.Log().Epoch()), "master_revision": float64(c.Master().Store.Log().Head()),
	}
	for k, v := range want {
		if doc[k] != v {
			t.Errorf("status %s = %v, want %v", k, doc[k], v)
		}
	}
	// Mooncake's five fields come first.
	order := []string{`"enabled"`, `"published_batches"`, `"published_events"`, `"dropped_events"`, `"skipped_keyless_events"`, `"enqueued_events"`}
	for i := 1; i < len(order); i++ {
		if strings.Index(string(body), order[i-1]) > strings.Index(string(body), order[i]) {
			t.Errorf("status field %s after %s", order[i-1], order[i])
		}
	}

	resp, err = http.Get("http://" + g.AdminAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, line := range []string{
		"crescent_gateway_kv_events_enabled 1",
		"crescent_gateway_kv_events_published_events_total 1",
		"crescent_gateway_kv_events_skipped_keyless_events_total 4",
		"crescent_gateway_kv_events_dropped_events_total 0",
		"crescent_gateway_kv_events_peers_refused_total 0",
		"crescent_gateway_kv_events_peers_dropped_total 0",
		"crescent_gateway_resyncs_total 1",
	} {
		if !strings.Contains(string(metrics), line+"\n") {
			t.Errorf("metrics lack %q", line)
		}
	}

	cc, err := grpc.NewClient(g.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	status := func() *gatewayv1.GetStatusResponse {
		t.Helper()
		gs, err := gatewayv1.NewGatewayServiceClient(cc).GetStatus(t.Context(), &gatewayv1.GetStatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return gs
	}
	gs := status()
	if !gs.GetEnabled() || gs.GetPublishedEvents() != 1 || gs.GetPublishedBatches() != 1 || gs.GetSkippedKeylessEvents() != 4 ||
		gs.GetMasterEpoch() != c.Master().Store.Log().Epoch() || gs.GetMasterRevision() != c.Master().Store.Log().Head() ||
		gs.GetLastSequence() != 1 || gs.GetResyncs() != 1 || gs.GetReplayBatches() != 1 {
		t.Errorf("GetStatus = %v", gs)
	}

	resp, err = http.Get("http://" + g.AdminAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz = %d, want 200 once synced", resp.StatusCode)
	}

	// The counters move with the next change: a second tenant cleared.
	other := c.Client(t).Tenant("u")
	put(t, other, "x", memory)
	if _, _, err := other.RemoveAll(t.Context(), false); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, waitFor, func() bool {
		return g.Status().MasterRevision == c.Master().Store.Log().Head() && g.Status().PublishedEvents == 2
	}, "the second cleared event")
	gs = status()
	if gs.GetPublishedEvents() != 2 || gs.GetSkippedKeylessEvents() != 6 || gs.GetLastSequence() != 2 ||
		gs.GetMasterRevision() != c.Master().Store.Log().Head() {
		t.Errorf("GetStatus after the second clear = %v", gs)
	}
}

// TestClusterGatewayRestartWithState: a gateway with a state directory,
// in the snapshot stream format with an llm-d topic, stopped and started
// again on the same endpoints, keeps its publisher epoch and continues its
// sequence; a pkg/kvevent subscriber that bootstrapped from the snapshot
// endpoint stays attached, sees no reset and no rebuild, and holds the
// master's set, including what changed while no gateway ran.
func TestClusterGatewayRestartWithState(t *testing.T) {
	const topic = "kv@127.0.0.1:5557@test-model"
	state := t.TempDir()
	var pub, replay, snap string // the first gateway's endpoints, reused by the second
	c := testcluster.Start(t, testcluster.Options{Gateway: true, GatewayConfig: func(cfg *gateway.Config) {
		cfg.StateDir, cfg.StreamFormat, cfg.Topic = state, "snapshot", topic
		if pub != "" {
			cfg.Pub, cfg.Replay, cfg.Snapshot = pub, replay, snap
		}
	}})
	g := c.Gateway()
	pub, replay, snap = g.PubEndpoint(), g.ReplayEndpoint(), g.SnapshotEndpoint()
	cl := c.Client(t).Tenant("t")
	for i := range 20 {
		put(t, cl, fmt.Sprintf("k%02d", i), memory)
	}
	var rebuilds atomic.Int64
	sub, err := kvevent.Subscribe(t.Context(), pub, kvevent.Options{
		ReplayEndpoint: replay, SnapshotEndpoint: snap, Topic: topic, Logger: testutil.Logger(),
		ReconnectMin: time.Millisecond, ReconnectMax: 20 * time.Millisecond,
		OnGap: func(gp kvevent.Gap) {
			if gp.Rebuilt || gp.Reset {
				rebuilds.Add(1)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	converged := func(step string) {
		t.Helper()
		testutil.EventuallyNoError(t, waitFor, func() error {
			if got, want := sub.Index().Keys(), readable(t, cl, "t"); !slices.Equal(got, want) {
				return fmt.Errorf("%s: index (%d) differs from the master set (%d); subscriber %+v", step, len(got), len(want), sub.Stats())
			}
			return nil
		})
	}
	converged("bootstrap")
	// A live message after the snapshot tells the subscriber the stream's
	// format (a heartbeat at the latest): one that reconnects before any
	// cannot tell a continued stream from a new one and rebuilds.
	testutil.Eventually(t, waitFor, func() bool { return sub.Stats().Heartbeats > 0 }, "a heartbeat")
	before := g.Status()
	if before.State != "new" || before.StreamFormat != "snapshot" {
		t.Fatalf("first start: %+v", before)
	}

	c.StopGateway()
	for i := range 5 {
		if err := cl.Remove(t.Context(), fmt.Sprintf("k%02d", i), false); err != nil {
			t.Fatal(err)
		}
	}
	put(t, cl, "while-down", memory)
	c.StartGateway()
	g = c.Gateway()
	converged("after the restart")
	// The status follows the publisher: it may name the last batch a
	// moment after the subscriber applied it.
	testutil.EventuallyNoError(t, waitFor, func() error {
		after := g.Status()
		if after.State != "restored" || after.PublisherEpoch != before.PublisherEpoch || after.LastSequence <= before.LastSequence {
			return fmt.Errorf("after the restart: state %q epoch %s seq %d; want restored, epoch %s, past %d",
				after.State, after.PublisherEpoch, after.LastSequence, before.PublisherEpoch, before.LastSequence)
		}
		return nil
	})
	if st := sub.Stats(); rebuilds.Load() != 0 || st.Resets != 0 || st.Unrepaired != 0 || st.Snapshots != 1 {
		t.Errorf("subscriber %+v, %d rebuilds; want the one bootstrap snapshot and no reset, rebuild or unrepaired gap", st, rebuilds.Load())
	}
}
