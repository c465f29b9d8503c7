package ctl

import (
	"context"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
)

// prefetchCmd is crescentctl prefetch (issue 17): ask for a memory
// replica of the tenant's keys, queued or (--wait) at once.
func prefetchCmd(e *env) *cobra.Command {
	var wait bool
	cmd := &cobra.Command{
		Use:   "prefetch KEY... [--wait]",
		Short: "Promote objects to memory (a memory replica is added; the disk replica stays)",
		Long: "prefetch asks the master for a memory replica of each KEY of the tenant (--tenant). Without --wait the\n" +
			"keys go on the master's promotion queue and are copied in the background, within its byte-rate budget\n" +
			"(--promote-rate); with --wait they are copied before the command returns. Either way nothing is\n" +
			"evicted for it: a key that would take memory past its low watermark is not copied. One line per key\n" +
			"(queued, in memory, copied, or FAILED); the exit code is 1 when any key failed (3 when the first failure is a key not found).",
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("give at least one KEY")
			}
			return e.withClient(func(ctx context.Context, c *client.Client, args []string) error {
				var opts []client.PrefetchOption
				if wait {
					opts = append(opts, client.Wait())
				}
				res, err := c.Prefetch(ctx, args, opts...)
				if err != nil {
					return err
				}
				return e.printPrefetched(res)
			})(cmd, args)
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "copy to memory before returning instead of queueing")
	return cmd
}

// prefetchStates names PrefetchState values in output.
var prefetchStates = map[masterv1.PrefetchState]string{
	masterv1.PrefetchState_PREFETCH_STATE_QUEUED:    "queued",
	masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY: "in memory",
	masterv1.PrefetchState_PREFETCH_STATE_COPIED:    "copied",
}

// printPrefetched prints one line (or JSON object) per key and fails when
// any key failed.
func (e *env) printPrefetched(res []client.PrefetchResult) error {
	var firstErr error
	failed := 0
	for _, r := range res {
		if r.Err != nil {
			failed++
			if firstErr == nil {
				firstErr = r.Err
			}
		}
		state := prefetchStates[r.State]
		if e.json() {
			m := map[string]any{"key": r.Key, "ok": r.Err == nil}
			if r.Err != nil {
				m["error"] = r.Err.Error()
			} else {
				m["state"] = state
			}
			if r.Replica != nil {
				m["segment_id"], m["host_id"], m["medium"] = r.Replica.GetSegmentId(), r.Replica.GetHostId(), mediumName(r.Replica.GetMedium())
			}
			if err := e.printJSON(m); err != nil {
				return err
			}
			continue
		}
		switch {
		case r.Err != nil:
			fmt.Fprintf(e.stdout, "%s\tFAILED\t%v\n", r.Key, r.Err)
		case r.Replica != nil:
			fmt.Fprintf(e.stdout, "%s\t%s\t-> %s (%s, %s)\n", r.Key, state, r.Replica.GetSegmentId(), r.Replica.GetHostId(), mediumName(r.Replica.GetMedium()))
		default:
			fmt.Fprintf(e.stdout, "%s\t%s\n", r.Key, state)
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d keys failed; first: %w", failed, len(res), firstErr)
	}
	return nil
}
