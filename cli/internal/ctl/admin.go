package ctl

import (
	"context"
	"fmt"
	"strings"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
)

func ago(ms int64) string {
	if ms == 0 {
		return "never"
	}
	return time.Since(time.UnixMilli(ms)).Round(100 * time.Millisecond).String()
}

func segmentsCmd(e *env) *cobra.Command {
	return &cobra.Command{
		Use:   "segments",
		Short: "List segments with lifecycle, health and usage",
		Args:  exactArgs(0),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, _ []string) error {
			r, err := c.Admin().ListSegments(ctx, &masterv1.ListSegmentsRequest{})
			if err != nil {
				return err
			}
			if !e.json() {
				fmt.Fprintf(e.stdout, "%-36s %-10s %-8s %-6s %-22s %-10s %12s %12s %8s %s\n", "SEGMENT", "AGENT", "HOST", "MEDIUM", "LIFECYCLE", "HEALTH", "USED", "CAPACITY", "REPLICAS", "DRAIN")
			}
			for _, s := range r.GetSegments() {
				lc := strings.TrimPrefix(s.GetLifecycle().String(), "SEGMENT_LIFECYCLE_")
				h := strings.TrimPrefix(s.GetHealth().String(), "SEGMENT_HEALTH_")
				if e.json() {
					if err := e.printJSON(map[string]any{
						"segment_id": s.GetInfo().GetSegmentId(), "agent_id": s.GetAgentId(), "host_id": s.GetHostId(),
						"medium": mediumName(s.GetInfo().GetMedium()), "lifecycle": lc, "health": h,
						"used": s.GetInfo().GetUsed(), "capacity": s.GetInfo().GetCapacity(), "replicas": s.GetReplicas(),
						"can_allocate": s.GetCanAllocate(), "can_serve_read": s.GetCanServeRead(), "last_heartbeat_unix_ms": s.GetLastHeartbeatUnixMs(),
						"drain": drainJSON(s.GetDrain()),
					}); err != nil {
						return err
					}
					continue
				}
				fmt.Fprintf(e.stdout, "%-36s %-10s %-8s %-6s %-22s %-10s %12d %12d %8d %s\n", s.GetInfo().GetSegmentId(), s.GetAgentId(), s.GetHostId(),
					mediumName(s.GetInfo().GetMedium()), lc, h, s.GetInfo().GetUsed(), s.GetInfo().GetCapacity(), s.GetReplicas(), drainColumn(s.GetDrain()))
			}
			return nil
		}),
	}
}

func agentsCmd(e *env) *cobra.Command {
	return &cobra.Command{
		Use:   "agents",
		Short: "List agents and their sessions",
		Args:  exactArgs(0),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, _ []string) error {
			r, err := c.Admin().ListAgents(ctx, &masterv1.ListAgentsRequest{})
			if err != nil {
				return err
			}
			if !e.json() {
				fmt.Fprintf(e.stdout, "%-24s %-10s %-22s %-22s %-9s %-12s %s\n", "AGENT", "HOST", "ENDPOINT", "TRANSFER", "CONNECTED", "HEARTBEAT", "SEGMENTS")
			}
			for _, a := range r.GetAgents() {
				if e.json() {
					if err := e.printJSON(map[string]any{"agent_id": a.GetAgentId(), "host_id": a.GetHostId(), "endpoint": a.GetDataEndpoint(),
						"transfer_endpoint": a.GetTransferEndpoint(), "connected": a.GetConnected(), "last_heartbeat_unix_ms": a.GetLastHeartbeatUnixMs(), "segments": a.GetSegmentIds(), "version": a.GetVersion()}); err != nil {
						return err
					}
					continue
				}
				fmt.Fprintf(e.stdout, "%-24s %-10s %-22s %-22s %-9v %-12s %d\n", a.GetAgentId(), a.GetHostId(), a.GetDataEndpoint(), orDash(a.GetTransferEndpoint()), a.GetConnected(), ago(a.GetLastHeartbeatUnixMs()), len(a.GetSegmentIds()))
			}
			return nil
		}),
	}
}

func drainCmd(e *env) *cobra.Command {
	var undo, noEvict, wait bool
	var interval time.Duration
	cmd := &cobra.Command{
		Use:   "drain SEGMENT",
		Short: "Move a segment's replicas elsewhere and stop allocating on it (--undo: put it back in service)",
		Long: "drain moves every replica off SEGMENT and marks it DRAINED; it takes no new allocations. It waits\n" +
			"for writes in progress on the segment (at most the master's put timeout) and moves them too, and\n" +
			"answers what it did: replicas moved, other objects offloaded to disk or evicted elsewhere to make room, replicas dropped\n" +
			"for lack of room, and replicas left (copies that kept failing; the segment then stays DRAINING, the\n" +
			"exit status is 1, and drain can be run again). The drain runs while crescentctl waits for it:\n" +
			"interrupting crescentctl stops it after the chunk it is copying (the segment stays DRAINING).\n" +
			"--wait also shows its progress on stderr, from the segment's entry in the master's listing: a\n" +
			"line rewritten in place on a terminal, otherwise a line each --interval when the counts moved.\n" +
			"--no-evict never evicts other objects: when the rest of the cluster is full, the drain stops with\n" +
			"RESOURCE_EXHAUSTED (NO_AVAILABLE_HANDLE), the segment stays DRAINING, and nothing is dropped.\n" +
			"A drain of a segment already being drained waits for that drain and reports its outcome.\n" +
			"drain --undo returns a DRAINING or DRAINED segment to OK (replicas already moved stay where they are)\n" +
			"and stops a drain still in progress after the chunk it is copying.",
		Args: exactArgs(1),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, args []string) error {
			if undo {
				if noEvict || wait {
					return usagef("--undo takes neither --no-evict nor --wait")
				}
				r, err := c.Admin().UndrainSegment(ctx, &masterv1.UndrainSegmentRequest{SegmentId: args[0]})
				if err != nil {
					return err
				}
				lc := strings.TrimPrefix(r.GetSegment().GetLifecycle().String(), "SEGMENT_LIFECYCLE_")
				if e.json() {
					return e.printJSON(map[string]any{"segment_id": args[0], "lifecycle": lc})
				}
				fmt.Fprintf(e.stdout, "segment %s: %s\n", args[0], lc)
				return nil
			}
			if interval <= 0 {
				return usagef("--interval must be positive")
			}
			req := &masterv1.DrainSegmentRequest{SegmentId: args[0], NoEvict: noEvict}
			var r *masterv1.DrainSegmentResponse
			var err error
			if wait {
				r, err = drainShowingProgress(ctx, c.Admin(), req, newDrainLine(e.stderr, args[0], tty(e.stderr)), interval)
			} else {
				r, err = c.Admin().DrainSegment(ctx, req)
			}
			if err != nil {
				return err
			}
			lc := strings.TrimPrefix(r.GetSegment().GetLifecycle().String(), "SEGMENT_LIFECYCLE_")
			n := r.GetCounts()
			if e.json() {
				if err := e.printJSON(map[string]any{"segment_id": args[0], "lifecycle": lc, "total": n.GetTotal(), "moved": n.GetMoved(),
					"evicted": n.GetEvicted(), "offloaded": n.GetOffloaded(), "dropped": n.GetDropped(), "failed": n.GetFailed(), "left": n.GetLeft(), "writes_waited": n.GetWritesWaited()}); err != nil {
					return err
				}
			} else {
				fmt.Fprintf(e.stdout, "segment %s: %s: moved %d of %d, offloaded %d and evicted %d elsewhere, dropped %d, left %d\n",
					args[0], lc, n.GetMoved(), n.GetTotal(), n.GetOffloaded(), n.GetEvicted(), n.GetDropped(), n.GetLeft())
			}
			if n.GetLeft() > 0 {
				return fmt.Errorf("drain of %s incomplete: %d replicas left on it (%d copies failed); it stays DRAINING, run drain again", args[0], n.GetLeft(), n.GetFailed())
			}
			return nil
		}),
	}
	cmd.Flags().BoolVar(&undo, "undo", false, "undrain: return the segment to OK (UndrainSegment)")
	cmd.Flags().BoolVar(&noEvict, "no-evict", false, "never evict other objects to make room; stop with RESOURCE_EXHAUSTED when the rest of the cluster is full")
	cmd.Flags().BoolVar(&wait, "wait", false, "show the drain's progress on stderr while it runs")
	cmd.Flags().DurationVar(&interval, "interval", time.Second, "with --wait, how often to look at the drain's progress")
	return cmd
}

func quotaCmd(e *env) *cobra.Command {
	cmd := &cobra.Command{Use: "quota", Short: "Get or set the tenant's quota"}
	var maxBytes, maxObjects uint64
	set := &cobra.Command{
		Use:   "set",
		Short: "Set the tenant's max bytes and objects (0 = unlimited)",
		Args:  exactArgs(0),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, _ []string) error {
			r, err := c.Admin().SetTenantQuota(ctx, &masterv1.SetTenantQuotaRequest{Tenant: e.tenant, MaxBytes: maxBytes, MaxObjects: maxObjects})
			if err != nil {
				return err
			}
			return printQuota(e, r.GetQuota())
		}),
	}
	set.Flags().Uint64Var(&maxBytes, "max-bytes", 0, "maximum bytes (0 = unlimited)")
	set.Flags().Uint64Var(&maxObjects, "max-objects", 0, "maximum objects (0 = unlimited)")
	get := &cobra.Command{
		Use:   "get",
		Short: "Show the tenant's quota and usage",
		Args:  exactArgs(0),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, _ []string) error {
			r, err := c.Admin().GetTenantQuota(ctx, &masterv1.GetTenantQuotaRequest{Tenant: e.tenant})
			if err != nil {
				return err
			}
			return printQuota(e, r.GetQuota())
		}),
	}
	cmd.AddCommand(set, get)
	return cmd
}

func printQuota(e *env, q *masterv1.TenantQuota) error {
	if e.json() {
		return e.printJSON(map[string]any{"tenant": q.GetTenant(), "max_bytes": q.GetMaxBytes(), "max_objects": q.GetMaxObjects(),
			"used_bytes": q.GetUsedBytes(), "used_objects": q.GetUsedObjects()})
	}
	fmt.Fprintf(e.stdout, "tenant %s: bytes %d/%d objects %d/%d (0 = unlimited)\n", q.GetTenant(), q.GetUsedBytes(), q.GetMaxBytes(), q.GetUsedObjects(), q.GetMaxObjects())
	return nil
}

func statusCmd(e *env) *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Show the master's cluster summary",
		Args:  exactArgs(0),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, _ []string) error {
			r, err := c.Admin().GetClusterStatus(ctx, &masterv1.GetClusterStatusRequest{})
			if err != nil {
				return err
			}
			if e.json() {
				return e.printJSON(map[string]any{"master_id": r.GetMasterId(), "epoch": r.GetEpoch(), "leader": r.GetLeader(), "objects": r.GetObjects(),
					"bytes": r.GetBytes(), "revision": r.GetRevision(), "agents_connected": r.GetAgentsConnected(), "segments": r.GetSegments(),
					"capacity_bytes": r.GetCapacityBytes(), "used_bytes": r.GetUsedBytes()})
			}
			fmt.Fprintf(e.stdout, "master %s epoch %d leader=%v\nobjects %d (%d bytes), revision %d\nagents %d, segments %d, used %d of %d bytes\n",
				r.GetMasterId(), r.GetEpoch(), r.GetLeader(), r.GetObjects(), r.GetBytes(), r.GetRevision(), r.GetAgentsConnected(), r.GetSegments(), r.GetUsedBytes(), r.GetCapacityBytes())
			return nil
		}),
	}
}

// orDash prints an empty field as "-".
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
