package testcluster

// Extras for the SDK's tests and examples (pkg/client).

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Replicas returns a copy of the bytes of every replica of a readable
// object, read straight from the agents' segments (memory or disk), in the
// master's replica order (Corrupt's). It fails the test when a replica
// cannot be read. Like Corrupt, it asks the master for the replica list, so
// it takes a read lease on the object.
func (c *Cluster) Replicas(tenant, key string) [][]byte {
	c.t.Helper()
	resp, err := masterv1.NewObjectServiceClient(c.Conn()).GetReplicaList(c.t.Context(),
		&masterv1.GetReplicaListRequest{Tenant: tenant, Key: key})
	if err != nil {
		c.t.Fatalf("Replicas %q: %v", key, err)
	}
	var out [][]byte
	for i, r := range resp.GetReplicas() {
		b, err := c.readReplica(r.GetSegmentId(), r.GetAllocationId())
		if err != nil {
			c.t.Fatalf("Replicas %q: replica %d: %v", key, i, err)
		}
		out = append(out, b)
	}
	return out
}

func (c *Cluster) readReplica(segID string, alloc uint64) ([]byte, error) {
	for _, a := range c.agents {
		if a == nil || a.cancel == nil {
			continue
		}
		seg, ok := a.app.Segments().Get(segID)
		if !ok {
			continue
		}
		h, err := seg.OpenRead(alloc)
		if err != nil {
			return nil, err
		}
		defer h.Close()
		b := make([]byte, h.Size())
		if err := h.ReadAt(b, 0); err != nil {
			return nil, err
		}
		return b, nil
	}
	return nil, fmt.Errorf("no running agent holds segment %s", segID)
}

// StartExample starts a cluster for a testable example, which has no
// testing.TB: a failure to start (or anything the harness would report with
// t.Fatalf) panics, and stop stops the cluster, panicking if a component
// failed to stop cleanly. Everything else is Start's; call only the
// methods that need no test of their own (MasterAddr, Conn, Calls, the
// hooks), not Client.
func StartExample(opts Options) (c *Cluster, stop func()) {
	tb := &exampleTB{}
	tb.ctx, tb.cancel = context.WithCancel(context.Background())
	c = Start(tb, opts)
	return c, tb.finish
}

// exampleTB is the little of testing.TB the harness uses, outside a test.
// The embedded (nil) interface supplies testing.TB's unexported method;
// calling any method not defined here panics.
type exampleTB struct {
	testing.TB

	ctx    context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	cleanups []func()
	errs     []string
}

func (*exampleTB) Helper()                    {}
func (*exampleTB) Name() string               { return "example" }
func (e *exampleTB) Context() context.Context { return e.ctx }

func (e *exampleTB) Cleanup(f func()) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cleanups = append(e.cleanups, f)
}

func (e *exampleTB) Errorf(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.errs = append(e.errs, fmt.Sprintf(format, args...))
}

func (e *exampleTB) Fatalf(format string, args ...any) {
	panic("testcluster: " + fmt.Sprintf(format, args...))
}

func (e *exampleTB) Fatal(args ...any) { panic("testcluster: " + fmt.Sprint(args...)) }

func (e *exampleTB) TempDir() string {
	dir, err := os.MkdirTemp("", "testcluster-example-")
	if err != nil {
		e.Fatalf("TempDir: %v", err)
	}
	e.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// finish runs the cleanups (last registered first), like the end of a
// test, and panics with the errors reported meanwhile.
func (e *exampleTB) finish() {
	e.cancel()
	e.mu.Lock()
	fs := e.cleanups
	e.cleanups = nil
	e.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.errs) > 0 {
		panic("testcluster: " + strings.Join(e.errs, "; "))
	}
}
