package testcluster_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestClusterLifecycle drives the harness the way the SDK, CLI and
// gateway tests use it: bytes through real agents, events through the
// real gateway, an agent stopped and started, the master restarted.
func TestClusterLifecycle(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 8 << 20})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()

	sub, err := kvevent.Subscribe(ctx, c.Gateway().PubEndpoint(), kvevent.Options{
		ReplayEndpoint: c.Gateway().ReplayEndpoint(), Logger: testutil.Logger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	cl := c.Client(t)
	want := bytes.Repeat([]byte("crescent"), 4096)
	if err := cl.Put(ctx, "k1", want); err != nil {
		t.Fatalf("Put: %v", err)
	}
	got, err := cl.Get(ctx, "k1")
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("Get: %d bytes, %v", len(got), err)
	}
	testutil.Eventually(t, 30*time.Second, func() bool { return sub.Index().Len() > 0 }, "the gateway to announce k1")

	// An agent leaves cleanly and comes back; the cluster keeps serving.
	c.StopAgent(1)
	if err := cl.Put(ctx, "k2", want); err != nil {
		t.Fatalf("Put with one agent: %v", err)
	}
	c.StartAgent(1)
	c.WaitSegments(4) // two agents, memory + disk each

	// A master restart loses no replica that a running agent still holds
	// (k2 went to agent 0 alone; k1 may have left with agent 1's memory).
	c.RestartMaster()
	testutil.EventuallyNoError(t, 30*time.Second, func() error {
		got, err := cl.Get(ctx, "k2")
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return errors.New("k2 changed across the master restart")
		}
		return nil
	})
	if _, err := cl.Get(ctx, "missing"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Get missing: %v, want ErrNotFound", err)
	}
}

// TestHooksAndCorrupt checks the fault-injection points the SDK and CLI
// tests rely on.
func TestHooksAndCorrupt(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Agents: 1})
	ctx := t.Context()
	cl := c.Client(t, func(cfg *client.Config) { cfg.DisableTransfer = true })
	if err := cl.Put(ctx, "a", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if got := c.Keys("default"); len(got) != 1 || got[0] != "a" {
		t.Fatalf("Keys = %v", got)
	}
	if c.Calls("PutStart") == 0 {
		t.Fatal("PutStart was not counted")
	}

	refuse := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "hooked")
	c.SetMasterHook(func(m string) error {
		if m == "GetReplicaList" {
			return refuse
		}
		return nil
	})
	if _, err := cl.Get(ctx, "a"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("hooked Get: %v", err)
	}
	c.SetMasterHook(nil)

	c.SetAgentHook(func(int, string) error { return errors.New("agent down") })
	if _, err := cl.Get(ctx, "a"); err == nil {
		t.Fatal("Get succeeded with every agent call failing")
	}
	c.SetAgentHook(nil)

	c.Corrupt("default", "a", 0)
	if _, err := cl.Get(ctx, "a"); err == nil {
		t.Fatal("Get of a corrupted replica succeeded")
	}
}
