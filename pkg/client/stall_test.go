package client_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil/etcdtest"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// freezeAgent routes agent i's bulk transfer endpoint, for the client's
// lookups from now on, through a proxy that moves no byte in either
// direction while its connections stay open: what a client sees of an
// agent whose process is stopped (SIGSTOP), hung or cut off while its
// kernel still answers for it.
func (h *harness) freezeAgent(t *testing.T, i int) {
	t.Helper()
	p := etcdtest.NewProxy(t, h.Agent(i).TransferEndpoint())
	p.Blackhole()
	h.r.set(func() { h.r.proxy = map[string]string{agentID(i): p.Addr} })
	t.Cleanup(func() { h.r.set(func() { h.r.proxy = nil }) })
}

// TestFrozenAgent: reads and writes on a frozen agent end within the
// client's StallTimeout, a read going on to the object's other replica,
// where before they waited for the call's deadline (for ever, without
// one: `crescentctl get` of a key on a SIGSTOPped agent did not return).
func TestFrozenAgent(t *testing.T) {
	const stall = 300 * time.Millisecond
	h := start(t, testcluster.Options{Agents: 2})
	// On host-0: agent 0's replicas are read first. No spares: a put goes
	// where PutStart places it.
	c := h.client(t, client.Config{HostID: "host-0", StallTimeout: stall, DisableSpares: true})
	ctx := t.Context()
	two, one := make([]byte, 256<<10), make([]byte, 4096)
	_, _ = rand.Read(two)
	_, _ = rand.Read(one)
	if err := c.Put(ctx, "two", two, client.WithReplicas(2)); err != nil {
		t.Fatal(err)
	}
	if err := c.Put(ctx, "one", one, client.WithPreferLocal("host-0")); err != nil {
		t.Fatal(err)
	}
	h.replicaOn(t, "default", "one", "host-0")
	h.freezeAgent(t, 0)

	// within runs f with a deadline far beyond the stall bound and fails
	// the test if f needed more than a few stall bounds.
	within := func(what string, f func(ctx context.Context)) {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		start := time.Now()
		f(ctx)
		if took := time.Since(start); took > 10*stall {
			t.Fatalf("%s took %v with agent 0 frozen (StallTimeout %v)", what, took, stall)
		} else {
			t.Logf("%s: %v", what, took)
		}
	}
	within("a get of an object with a replica elsewhere", func(ctx context.Context) {
		if got, err := c.Get(ctx, "two"); err != nil || !bytes.Equal(got, two) {
			t.Fatalf("Get(two) = %d bytes, %v; want its bytes from agent 1", len(got), err)
		}
	})
	within("a get of an object only on the frozen agent", func(ctx context.Context) {
		_, err := c.Get(ctx, "one")
		if status.Code(err) != codes.Unavailable || rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
			t.Fatalf("Get(one) = %v, want UNAVAILABLE AGENT_UNAVAILABLE", err)
		}
	})
	within("a batch get of both", func(ctx context.Context) {
		got, errs := c.BatchGet(ctx, []string{"two", "one"})
		if errs[0] != nil || !bytes.Equal(got[0], two) || status.Code(errs[1]) != codes.Unavailable {
			t.Fatalf("BatchGet = %v; want two's bytes and one UNAVAILABLE", errs)
		}
	})
	within("a put on the frozen agent", func(ctx context.Context) {
		err := c.Put(ctx, "three", two, client.WithPreferLocal("host-0"))
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("Put on a frozen agent = %v, want UNAVAILABLE", err)
		}
	})
	if ok, err := c.Exist(ctx, "three"); err != nil || ok {
		t.Fatalf("Exist(three) after its put failed = %v, %v; want the put revoked", ok, err)
	}
}
