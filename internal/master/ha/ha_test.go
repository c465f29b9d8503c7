package ha

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newElector(t *testing.T, endpoint, advertise string) *Elector {
	t.Helper()
	e, err := New(Config{Endpoints: []string{endpoint}, Prefix: "/test/master/", LeaseTTL: 2 * time.Second,
		Advertise: advertise, DialTimeout: 2 * time.Second}, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// TestElection: one of two masters leads; the other's campaign waits
// until the first resigns, then leads with a higher epoch; a follower
// sees who leads.
func TestElection(t *testing.T) {
	etcd := etcdtest.Start(t)
	a, b := newElector(t, etcd.Endpoint, "a:1"), newElector(t, etcd.Endpoint, "b:1")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	follow := make(chan struct{})
	go func() { defer close(follow); b.Follow(ctx) }()

	ta, err := a.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !ta.Valid() || ta.Epoch == 0 {
		t.Fatalf("leader term: valid %v epoch %d", ta.Valid(), ta.Epoch)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return b.Leader() == "a:1" }, "b to see a lead")

	won := make(chan *Term, 1)
	go func() {
		tb, err := b.Campaign(ctx)
		if err != nil {
			t.Error(err)
		}
		won <- tb
	}()
	select {
	case <-won:
		t.Fatal("b elected while a leads")
	case <-time.After(3 * time.Second): // past a's TTL: a's renewals hold it
	}
	if !ta.Valid() {
		t.Fatal("a's term invalid while renewed")
	}
	ta.Resign(t.Context())
	if ta.Valid() {
		t.Fatal("a resigned term still valid")
	}
	tb := <-won
	if tb == nil {
		t.FailNow()
	}
	defer tb.Resign(context.Background())
	if tb.Epoch <= ta.Epoch {
		t.Fatalf("b's epoch %d not above a's %d", tb.Epoch, ta.Epoch)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return b.Leader() == "b:1" }, "b to see itself lead")
	cancel()
	<-follow
}

// TestTermLostWhenPartitioned: with the leader cut off from etcd (its
// traffic blackholed) its term turns invalid, and Lost closes, at most the
// TTL after the cut: before its lease can expire in etcd, which counts from
// the last renewal etcd received.
func TestTermLostWhenPartitioned(t *testing.T) {
	etcd := etcdtest.Start(t)
	proxy := etcdtest.NewProxy(t, etcd.Endpoint)
	a := newElector(t, proxy.Addr, "a:1")
	ta, err := a.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer ta.Resign(context.Background())
	time.Sleep(time.Second) // a renewal or two
	if !ta.Valid() {
		t.Fatal("term invalid while renewed")
	}
	cut := time.Now()
	proxy.Blackhole()
	select {
	case <-ta.Lost():
	case <-time.After(5 * time.Second):
		t.Fatal("term not lost 5s after the cut (TTL 2s)")
	}
	lost := time.Since(cut)
	if ta.Valid() {
		t.Fatal("lost term still valid")
	}
	if lost > 2*time.Second {
		t.Fatalf("term lost %v after the cut, later than the TTL (2s): etcd may have expired the lease first", lost)
	}
	t.Logf("term lost %v after the cut (TTL 2s)", lost)
	proxy.Restore()
}

// TestCampaignStopsWithoutEtcd: a standby whose etcd is gone stops
// campaigning when told to, within the dial timeout, and by itself once
// its campaign's lease lapses (a campaign on a lapsed lease cannot win).
// etcd's own Campaign resigns on its way out under the client's context
// and waited for etcd for as long as the process lived.
func TestCampaignStopsWithoutEtcd(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cancel  bool
		want    error
		within  time.Duration
		explain string
	}{
		{"context ends", true, context.Canceled, 10 * time.Second, "after its context ended"},
		{"lease lapses", false, ErrLost, 10 * time.Second, "after etcd became unreachable (lease TTL 2s)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			etcd := etcdtest.Start(t)
			proxy := etcdtest.NewProxy(t, etcd.Endpoint)
			a, b := newElector(t, etcd.Endpoint, "a:1"), newElector(t, proxy.Addr, "b:1")
			ta, err := a.Campaign(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer ta.Resign(context.Background())
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			errc := make(chan error, 1)
			go func() {
				tb, err := b.Campaign(ctx)
				if tb != nil {
					tb.Resign(context.Background())
				}
				errc <- err
			}()
			time.Sleep(500 * time.Millisecond) // b waits behind a
			proxy.Blackhole()
			cut := time.Now()
			if tc.cancel {
				cancel()
			}
			select {
			case err := <-errc:
				if !errors.Is(err, tc.want) {
					t.Fatalf("campaign ended with %v, want %v", err, tc.want)
				}
				t.Logf("campaign stopped %v %s: %v", time.Since(cut).Round(time.Millisecond), tc.explain, err)
			case <-time.After(tc.within):
				t.Fatalf("campaign still running %v %s (dial timeout 2s)", tc.within, tc.explain)
			}
			proxy.Restore()
		})
	}
}

// TestEpochsRise: every new term's epoch is above the last written, even
// when an earlier leader's clock ran ahead of this one's.
func TestEpochsRise(t *testing.T) {
	etcd := etcdtest.Start(t)
	a := newElector(t, etcd.Endpoint, "a:1")
	var last uint64
	for i := range 3 {
		if i == 2 { // a leader with a clock an hour ahead wrote the last epoch
			last = uint64(time.Now().Add(time.Hour).UnixNano())
			if _, err := a.cli.Put(t.Context(), a.epochKey(), strconv.FormatUint(last, 10)); err != nil {
				t.Fatal(err)
			}
		}
		ta, err := a.Campaign(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if ta.Epoch <= last {
			t.Fatalf("term %d: epoch %d not above %d", i, ta.Epoch, last)
		}
		last = ta.Epoch
		ta.Resign(t.Context())
	}
}

func TestConfigValidate(t *testing.T) {
	good := Config{Endpoints: []string{"x:1"}, Prefix: "/p/", LeaseTTL: 5 * time.Second, Advertise: "a:1", DialTimeout: time.Second}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, mut := range map[string]func(*Config){
		"no endpoints": func(c *Config) { c.Endpoints = nil },
		"prefix":       func(c *Config) { c.Prefix = "/p" },
		"ttl short":    func(c *Config) { c.LeaseTTL = time.Second },
		"ttl fraction": func(c *Config) { c.LeaseTTL = 2500 * time.Millisecond },
		"advertise":    func(c *Config) { c.Advertise = "" },
	} {
		c := good
		mut(&c)
		if c.Validate() == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestAgentsList: a leader records agents coming and going; a later term
// reads them; a term that ended can no longer write.
func TestAgentsList(t *testing.T) {
	etcd := etcdtest.Start(t)
	a := newElector(t, etcd.Endpoint, "a:1")
	ta, err := a.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		id string
		up bool
	}{{"agent-a", true}, {"agent-b", true}, {"agent-c", true}, {"agent-b", false}} {
		if err := ta.SetAgent(t.Context(), c.id, c.up); err != nil {
			t.Fatal(err)
		}
	}
	ta.Resign(t.Context())
	if err := ta.SetAgent(t.Context(), "agent-d", true); err == nil {
		t.Fatal("a resigned term recorded an agent")
	}
	tb, err := a.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Resign(context.Background())
	got, err := tb.Agents(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []string{"agent-a", "agent-c"}) {
		t.Fatalf("agents %q, want [agent-a agent-c]", got)
	}
	// A list past MaxAgents is refused, not read.
	a.cfg.MaxAgents = 1
	if got, err := tb.Agents(t.Context()); err == nil {
		t.Fatalf("agents %q past MaxAgents 1: want an error", got)
	}
}
