package testcluster

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/server"
	"google.golang.org/grpc"
)

// hooks are the cluster's fault-injection points and call counters. The
// interceptors are installed on every master and agent the cluster starts,
// so a hook set before a restart still applies after it.
type hooks struct {
	master atomic.Pointer[func(method string) error]
	agent  atomic.Pointer[func(agent int, method string) error]

	mu    sync.Mutex
	calls map[string]int
}

// method is the last element of a gRPC full method name.
func method(full string) string { return full[strings.LastIndex(full, "/")+1:] }

func (h *hooks) count(m string) {
	h.mu.Lock()
	if h.calls == nil {
		h.calls = map[string]int{}
	}
	h.calls[m]++
	h.mu.Unlock()
}

func (h *hooks) masterOptions() []grpc.ServerOption {
	check := func(full string) error {
		m := method(full)
		h.count(m)
		if fn := h.master.Load(); fn != nil {
			if err := (*fn)(m); err != nil {
				return rpcerr.Status(err)
			}
		}
		return nil
	}
	return []grpc.ServerOption{
		// In the chain calls carried on CallStream meet too: a hook on
		// "BatchGetReplicaList" sees (and fails) the lookups either way.
		server.UnaryInterceptors(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
			if err := check(info.FullMethod); err != nil {
				return nil, err
			}
			return next(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, next grpc.StreamHandler) error {
			// The agents' session stream is never failed by the hook:
			// a test that wants an agent gone stops it. CallStream is
			// (an SDK whose stream is refused makes its calls unary),
			// and the hook judges each call it carries too, by that
			// call's name, in the unary chain above.
			if info.FullMethod != "/"+masterv1.SegmentService_ServiceDesc.ServiceName+"/Connect" {
				if err := check(info.FullMethod); err != nil {
					return err
				}
			}
			return next(srv, ss)
		}),
	}
}

func (h *hooks) agentOptions(i int) []grpc.ServerOption {
	check := func(full string) error {
		m := method(full)
		h.count(m)
		if fn := h.agent.Load(); fn != nil {
			if err := (*fn)(i, m); err != nil {
				return rpcerr.Status(err)
			}
		}
		return nil
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
			if err := check(info.FullMethod); err != nil {
				return nil, err
			}
			return next(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, next grpc.StreamHandler) error {
			if err := check(info.FullMethod); err != nil {
				return err
			}
			return next(srv, ss)
		}),
	}
}

// SetMasterHook makes every master RPC (by method name, "PutStart") first
// ask hook; a non-nil error is the call's answer, through rpcerr.Status,
// so an *rpcerr.Error keeps its reason. nil removes the hook. The agents'
// session streams are exempt.
func (c *Cluster) SetMasterHook(hook func(method string) error) {
	if hook == nil {
		c.hooks.master.Store(nil)
		return
	}
	c.hooks.master.Store(&hook)
}

// SetAgentHook makes every DataService RPC of every agent ("Write",
// "Read", "BatchWrite", "BatchRead", "Verify") ask hook with the agent's index; a
// non-nil error fails the whole call. The bulk transfer listener (raw
// TCP) is not hooked: clients that must not use it set
// client.Config.DisableTransfer, or the test stops the agent. nil removes
// the hook.
func (c *Cluster) SetAgentHook(hook func(agent int, method string) error) {
	if hook == nil {
		c.hooks.agent.Store(nil)
		return
	}
	c.hooks.agent.Store(&hook)
}

// Calls reports how many times a master or agent gRPC method was called
// since the cluster started.
func (c *Cluster) Calls(method string) int {
	c.hooks.mu.Lock()
	defer c.hooks.mu.Unlock()
	return c.hooks.calls[method]
}

// Keys returns the tenant's readable keys at the master, sorted.
func (c *Cluster) Keys(tenant string) []string {
	c.t.Helper()
	var out []string
	objects := masterv1.NewObjectServiceClient(c.Conn())
	token := ""
	for {
		resp, err := objects.ListObjects(c.t.Context(), &masterv1.ListObjectsRequest{Tenant: tenant, PageToken: token})
		if err != nil {
			c.t.Fatalf("ListObjects: %v", err)
		}
		for _, o := range resp.GetObjects() {
			out = append(out, o.GetKey())
		}
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	slices.Sort(out)
	return out
}

// Corrupt flips the first byte of replica i (in the master's replica
// order) of a readable object, in place in the agent's memory segment, so
// a reader finds its checksum wrong. It fails the test for a replica on
// disk.
func (c *Cluster) Corrupt(tenant, key string, replica int) {
	c.t.Helper()
	resp, err := masterv1.NewObjectServiceClient(c.Conn()).GetReplicaList(c.t.Context(),
		&masterv1.GetReplicaListRequest{Tenant: tenant, Key: key})
	if err != nil {
		c.t.Fatalf("Corrupt %q: %v", key, err)
	}
	reps := resp.GetReplicas()
	if replica >= len(reps) {
		c.t.Fatalf("Corrupt %q: replica %d of %d", key, replica, len(reps))
	}
	r := reps[replica]
	if err := c.flipFirstByte(r.GetSegmentId(), r.GetAllocationId()); err != nil {
		c.t.Fatalf("Corrupt %q replica %d: %v", key, replica, err)
	}
}

func (c *Cluster) flipFirstByte(segID string, alloc uint64) error {
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
			return err
		}
		defer h.Close()
		b, err := h.Bytes(0, 1)
		if err != nil {
			return err
		}
		if b == nil {
			return fmt.Errorf("segment %s is on disk; Corrupt flips memory only", segID)
		}
		b[0] ^= 0xff
		return nil
	}
	return fmt.Errorf("no running agent holds segment %s", segID)
}
