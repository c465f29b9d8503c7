package source

import (
	"context"
	"fmt"
	"github.com/crescent-kv/crescent/internal/master/mastertest"
	"slices"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/fakemaster"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

type realMaster = mastertest.Master

func startRealMaster(t *testing.T, addr string) *realMaster {
	return mastertest.Start(t, addr, nil)
}

func startStandby(t *testing.T, leader string) (string, func()) {
	return mastertest.StartStandby(t, leader)
}

// serveFake serves a fake master of epoch holding keys of tenant "t" and
// group "g" (in memory; "key:disk" on disk) until stop or the test's end.
func serveFake(t *testing.T, epoch uint64, keys ...string) (m *fakemaster.Master, addr string, stop func()) {
	t.Helper()
	m = fakemaster.New(epoch)
	for _, k := range keys {
		medium := masterv1.Medium_MEDIUM_MEMORY
		if key, ok := strings.CutSuffix(k, ":disk"); ok {
			k, medium = key, masterv1.Medium_MEDIUM_DISK
		}
		m.Put("t", k, medium, "g")
	}
	addr, stop, err := fakemaster.Serve(m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return m, addr, stop
}

// runFollowing starts a source following list with the gateway's defaults.
func runFollowing(t *testing.T, list []string, snk *sink) *Source {
	t.Helper()
	ms, err := NewMasters(list, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	src := NewFollowing(DefaultConfig(), ms, snk, testutil.Logger())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if err := ms.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return src
}

// TestFollowLeader: given [standby, leader], the source is redirected by
// the standby and follows the real leader's change stream; when that leader
// is stopped and a new master starts at the standby's address, the source
// resyncs from the new leader (a new epoch) and watches it.
func TestFollowLeader(t *testing.T) {
	leader := startRealMaster(t, "127.0.0.1:0")
	standby, stopStandby := startStandby(t, leader.Addr)
	snk := newSink()
	src := runFollowing(t, []string{standby, leader.Addr}, snk)

	// An idle master's Watch sends nothing, so the source never reports
	// Watching here: its snapshot's epoch and the address say whom it follows.
	following := func(m *realMaster) func() bool {
		return func() bool {
			s := src.Status()
			return s.Epoch == m.M.Identity.Epoch && s.Master == m.Addr
		}
	}
	testutil.Eventually(t, 10*time.Second, following(leader), "the source to follow the leader %s", leader.Addr)

	stopStandby()
	leader.Stop()
	began := time.Now()
	next := startRealMaster(t, standby)
	testutil.Eventually(t, 10*time.Second, following(next), "the source to follow the new leader %s", next.Addr)
	t.Logf("following the new leader %v after the old one stopped", time.Since(began))
	if got := src.Status().Resyncs; got != 2 {
		t.Errorf("resyncs = %d, want 2 (one per leader)", got)
	}
	// The positions handed to the sink move forward: the old epoch, then
	// the new one.
	var epochs []uint64
	for _, c := range snk.positions() {
		if len(epochs) == 0 || epochs[len(epochs)-1] != c.pos.Epoch {
			epochs = append(epochs, c.pos.Epoch)
		}
	}
	if want := []uint64{leader.M.Identity.Epoch, next.M.Identity.Epoch}; !slices.Equal(epochs, want) {
		t.Errorf("sink position epochs %v, want %v", epochs, want)
	}
}

// TestFailoverPublishesDifference: the standby names a leader outside the
// list; after that leader goes, the source moves on to the list's next
// master (a new epoch with a different readable set) and publishes exactly
// the difference.
func TestFailoverPublishesDifference(t *testing.T) {
	_, oldAddr, stopOld := serveFake(t, 1, "a", "b")
	next, nextAddr, _ := serveFake(t, 2, "b", "c:disk")
	standby, _ := startStandby(t, oldAddr)

	snk := newSink()
	src := runFollowing(t, []string{standby, nextAddr}, snk)
	testutil.Eventually(t, 10*time.Second, func() bool {
		s := src.Status()
		return s.Watching && s.Epoch == 1 && s.Master == oldAddr
	}, "the source to follow the hinted leader")
	n := len(snk.events())

	stopOld()
	testutil.Eventually(t, 10*time.Second, func() bool {
		s := src.Status()
		return s.Watching && s.Epoch == 2 && s.Master == nextAddr
	}, "the source to follow the next master")
	got := snk.events()[n:]
	want := []kvevent.Event{
		{Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU, GroupID: "g"},
		{Type: kvevent.Stored, Tenant: "t", Key: "c", Medium: kvevent.MediumDisk, GroupID: "g"},
	}
	if !sameEvents(got, want) {
		t.Fatalf("events after the failover %v, want %v", got, want)
	}
	h := &harness{m: next, src: src, sink: snk}
	h.indexMatches(t)
}

func sameEvents(got, want []kvevent.Event) bool {
	key := func(e kvevent.Event) string {
		return fmt.Sprintf("%v/%s/%s/%v/%s", e.Type, e.Tenant, e.Key, e.Medium, e.GroupID)
	}
	g, w := make([]string, len(got)), make([]string, len(want))
	for i, e := range got {
		g[i] = key(e)
	}
	for i, e := range want {
		w[i] = key(e)
	}
	slices.Sort(g)
	slices.Sort(w)
	return slices.Equal(g, w)
}

// TestFrozenLeader: a leader that stops answering while its connection
// stays open (SIGSTOP, a paused VM: its kernel still acknowledges) is left
// once keepalive notices, and the source follows the next master and
// publishes the difference. Without keepalive the Watch stream waited on
// it for ever: in a make run-ha session with the leader SIGSTOPped, puts
// the new leader acknowledged never reached the subscribers.
func TestFrozenLeader(t *testing.T) {
	_, oldAddr, _ := serveFake(t, 1, "a")
	_, nextAddr, _ := serveFake(t, 2, "b")
	frozen := etcdtest.NewProxy(t, oldAddr)

	snk := newSink()
	src := runFollowing(t, []string{frozen.Addr, nextAddr}, snk)
	testutil.Eventually(t, 10*time.Second, func() bool {
		s := src.Status()
		return s.Watching && s.Epoch == 1 && s.Master == frozen.Addr
	}, "the source to follow the first master")
	n := len(snk.events())

	frozen.Blackhole()
	began := time.Now()
	bound := masterlist.KeepaliveTime + masterlist.KeepaliveTimeout
	testutil.Eventually(t, bound+15*time.Second, func() bool {
		s := src.Status()
		return s.Watching && s.Epoch == 2 && s.Master == nextAddr
	}, "the source to leave the frozen master for the next one")
	t.Logf("following the next master %v after the first froze (keepalive bound %v)", time.Since(began), bound)
	got := snk.events()[n:]
	want := []kvevent.Event{
		{Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU, GroupID: "g"},
		{Type: kvevent.Stored, Tenant: "t", Key: "b", Medium: kvevent.MediumCPU, GroupID: "g"},
	}
	if !sameEvents(got, want) {
		t.Fatalf("events after the failover %v, want %v", got, want)
	}
}
