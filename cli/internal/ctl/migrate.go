package ctl

import (
	"context"
	"fmt"

	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
)

// cpCmd and mvCmd are crescentctl cp and mv (issue 17): Copy and Move of
// the tenant's keys to a segment, a host or a medium.
func cpCmd(e *env) *cobra.Command { return migrateCmd(e, false) }

func mvCmd(e *env) *cobra.Command { return migrateCmd(e, true) }

func migrateCmd(e *env, move bool) *cobra.Command {
	var (
		seg, host, medium, from string
		admin                   bool
	)
	use, short, long := "cp KEY... (--to-segment S | --to-host H | --to-medium memory|disk)",
		"Copy objects to another segment, host or medium (a new replica; the source stays)",
		"cp adds a replica of each KEY of the tenant (--tenant) on the target; the bytes go agent to agent.\n"+
			"It fails for a key that already has a replica on the target, that is being written, or when the\n"+
			"target has no room (cp never evicts). One line per key; the exit code is 1 when any key failed."
	if move {
		use, short, long = "mv KEY... (--to-segment S | --to-host H | --to-medium memory|disk) [--from-segment S]",
			"Move objects to another segment, host or medium (the target is readable before the source goes)",
			"mv copies each KEY of the tenant (--tenant) to the target, then removes the source replica: the one on\n"+
				"--from-segment, else the first readable one not on the target. The object stays readable throughout;\n"+
				"a failed copy leaves the source in place. Hard-pinned objects are not moved. One line per key; the\n"+
				"exit code is 1 when any key failed."
	}
	cmd := &cobra.Command{
		Use: use, Short: short, Long: long,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("give at least one KEY")
			}
			to := client.Target{Segment: seg, Host: host}
			n := 0
			for _, on := range []bool{seg != "", host != "", medium != ""} {
				if on {
					n++
				}
			}
			if n != 1 {
				return usagef("give exactly one of --to-segment, --to-host, --to-medium")
			}
			if medium != "" {
				m, err := parseMedium(medium)
				if err != nil {
					return err
				}
				to.Medium = m
			}
			return e.withClient(func(ctx context.Context, c *client.Client, args []string) error {
				var opts []client.MigrateOption
				if from != "" {
					opts = append(opts, client.FromSegment(from))
				}
				if admin {
					opts = append(opts, client.AsAdmin())
				}
				run := c.Copy
				if move {
					run = c.Move
				}
				res, err := run(ctx, args, to, opts...)
				if err != nil {
					return err
				}
				return e.printMigrated(res, move)
			})(cmd, args)
		},
	}
	f := cmd.Flags()
	f.StringVar(&seg, "to-segment", "", "target segment id")
	f.StringVar(&host, "to-host", "", "target host id (a segment there of the source's medium)")
	f.StringVar(&medium, "to-medium", "", "target medium: memory or disk")
	f.BoolVar(&admin, "admin", false, "use AdminService (CopyObjects/MoveObjects): operators, any --tenant, audited")
	if move {
		f.StringVar(&from, "from-segment", "", "the replica to move, by its segment")
	}
	return cmd
}

// printMigrated prints one line (or JSON object) per key and fails when
// any key failed.
func (e *env) printMigrated(res []client.MigrateResult, move bool) error {
	verb := "copied"
	if move {
		verb = "moved"
	}
	var firstErr error
	failed := 0
	for _, r := range res {
		if r.Err != nil {
			failed++
			if firstErr == nil {
				firstErr = r.Err
			}
		}
		if e.json() {
			m := map[string]any{"key": r.Key, "ok": r.Err == nil, "source_segment_id": r.Source}
			if r.Err != nil {
				m["error"] = r.Err.Error()
			} else {
				m["segment_id"], m["host_id"], m["medium"] = r.Replica.GetSegmentId(), r.Replica.GetHostId(), mediumName(r.Replica.GetMedium())
			}
			if err := e.printJSON(m); err != nil {
				return err
			}
			continue
		}
		if r.Err != nil {
			fmt.Fprintf(e.stdout, "%s\tFAILED\t%v\n", r.Key, r.Err)
			continue
		}
		fmt.Fprintf(e.stdout, "%s\t%s\t%s -> %s (%s, %s)\n", r.Key, verb, r.Source,
			r.Replica.GetSegmentId(), r.Replica.GetHostId(), mediumName(r.Replica.GetMedium()))
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d keys failed; first: %w", failed, len(res), firstErr)
	}
	return nil
}
