package ctl

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
)

// mediumName is the KV-event spelling of a medium (cpu/disk).
func mediumName(m masterv1.Medium) string {
	switch m {
	case masterv1.Medium_MEDIUM_MEMORY:
		return "cpu"
	case masterv1.Medium_MEDIUM_DISK:
		return "disk"
	}
	return "unknown"
}

func parseMedium(s string) (masterv1.Medium, error) {
	switch strings.ToLower(s) {
	case "", "memory", "mem", "cpu":
		return masterv1.Medium_MEDIUM_MEMORY, nil
	case "disk":
		return masterv1.Medium_MEDIUM_DISK, nil
	}
	return 0, usagef("unknown medium %q (want memory or disk)", s)
}

func putCmd(e *env) *cobra.Command {
	var (
		replicas int
		medium   string
		upsert   bool
		softPin  string
		hardPin  bool
		group    string
	)
	cmd := &cobra.Command{
		Use:   "put KEY FILE|-",
		Short: "Store a file (or stdin) under KEY",
		Args:  exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			m, err := parseMedium(medium)
			if err != nil {
				return err
			}
			opts := []client.PutOption{client.WithReplicas(replicas), client.WithMedium(m)}
			if upsert {
				opts = append(opts, client.WithUpsert())
			}
			if cmd.Flags().Changed("soft-pin") {
				var ttl time.Duration
				if softPin != "" && softPin != "true" {
					if ttl, err = time.ParseDuration(softPin); err != nil {
						return usagef("--soft-pin: %v", err)
					}
				}
				opts = append(opts, client.WithSoftPin(ttl))
			}
			if hardPin {
				opts = append(opts, client.WithHardPin())
			}
			if group != "" {
				opts = append(opts, client.WithGroup(group))
			}
			c, err := e.client(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			var src io.ReaderAt
			var size int64
			if args[1] == "-" {
				b, err := io.ReadAll(e.stdin)
				if err != nil {
					return err
				}
				src, size = bytes.NewReader(b), int64(len(b))
			} else {
				f, err := os.Open(args[1])
				if err != nil {
					return err
				}
				defer f.Close()
				st, err := f.Stat()
				if err != nil {
					return err
				}
				src, size = f, st.Size()
			}
			bar := newProgress(e.stderr, "put "+args[0], tty(e.stderr) && size >= 8<<20)
			opts = append(opts, client.WithPutProgress(bar.update))
			start := time.Now()
			err = c.PutFrom(ctx, args[0], src, size, opts...)
			bar.done()
			if err != nil {
				return err
			}
			if e.json() {
				return e.printJSON(map[string]any{"key": args[0], "size": size, "seconds": time.Since(start).Seconds()})
			}
			fmt.Fprintf(e.stderr, "stored %s (%d bytes) in %s\n", args[0], size, time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&replicas, "replicas", 1, "number of replicas, on distinct segments (across hosts when possible)")
	f.StringVar(&medium, "medium", "memory", "memory or disk")
	f.BoolVar(&upsert, "upsert", false, "replace an existing object")
	f.StringVar(&softPin, "soft-pin", "", "soft-pin the object (optionally for a TTL, e.g. --soft-pin=2h)")
	f.Lookup("soft-pin").NoOptDefVal = "true"
	f.BoolVar(&hardPin, "hard-pin", false, "never evict the object")
	f.StringVar(&group, "group", "", "group id carried on KV events")
	return cmd
}

func getCmd(e *env) *cobra.Command {
	return &cobra.Command{
		Use:   "get KEY [-o FILE|-]",
		Short: "Fetch KEY into a file or stdout (checksum verified)",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 2 {
				// put takes KEY FILE; get writes where -o says.
				return usagef("get takes one KEY and writes it to stdout; to write it to %s: crescentctl get %s -o %s", args[1], args[0], args[1])
			}
			return exactArgs(1)(cmd, args)
		},
		RunE: e.withClient(func(ctx context.Context, c *client.Client, args []string) error {
			var (
				w       io.Writer = e.stdout
				f       *os.File
				regular bool // f is a regular file (not /dev/null, not a pipe)
			)
			dest := e.output
			if dest != "" && dest != "-" {
				var err error
				if f, err = os.Create(dest); err != nil {
					return err
				}
				defer f.Close()
				w = f
				fi, err := f.Stat()
				regular = err == nil && fi.Mode().IsRegular()
			}
			bar := newProgress(e.stderr, "get "+args[0], tty(e.stderr) && dest != "" && dest != "-")
			_, err := c.GetTo(ctx, args[0], w, bar.update)
			bar.done()
			if err != nil && regular {
				// Whatever the file holds is not the object.
				_ = f.Close()
				_ = os.Remove(dest)
			}
			return err
		}),
	}
}

func statCmd(e *env) *cobra.Command {
	return &cobra.Command{
		Use:   "stat KEY",
		Short: "Show an object's size, checksum and replicas",
		Args:  exactArgs(1),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, args []string) error {
			info, err := c.Stat(ctx, args[0])
			if err != nil {
				return err
			}
			media := []string{}
			for _, m := range info.Media() {
				media = append(media, mediumName(m))
			}
			if e.json() {
				reps := make([]map[string]any, 0, len(info.Replicas))
				for _, r := range info.Replicas {
					reps = append(reps, map[string]any{
						"replica_id": r.GetReplicaId(), "segment_id": r.GetSegmentId(), "host_id": r.GetHostId(),
						"endpoint": r.GetDataEndpoint(), "transfer_endpoint": r.GetTransferEndpoint(), "medium": mediumName(r.GetMedium()),
						"status": strings.TrimPrefix(r.GetStatus().String(), "REPLICA_STATUS_"),
					})
				}
				return e.printJSON(map[string]any{"key": info.Key, "size": info.Size, "checksum": fmt.Sprintf("%016x", info.Checksum),
					"group_id": info.GroupID, "media": media, "replicas": reps})
			}
			fmt.Fprintf(e.stdout, "key:      %s\nsize:     %d\nchecksum: %016x\nmedia:    %s\n", info.Key, info.Size, info.Checksum, strings.Join(media, ","))
			if info.GroupID != "" {
				fmt.Fprintf(e.stdout, "group:    %s\n", info.GroupID)
			}
			for _, r := range info.Replicas {
				fmt.Fprintf(e.stdout, "replica %d: %s on %s (%s, transfer %s, segment %s) %s\n", r.GetReplicaId(),
					strings.TrimPrefix(r.GetStatus().String(), "REPLICA_STATUS_"), r.GetHostId(), r.GetDataEndpoint(), orDash(r.GetTransferEndpoint()), r.GetSegmentId(), mediumName(r.GetMedium()))
			}
			return nil
		}),
	}
}

func rmCmd(e *env) *cobra.Command {
	var (
		force  bool
		all    bool
		prefix string
		regex  string
	)
	cmd := &cobra.Command{
		Use:   "rm KEY... | --all | --prefix P | --regex R",
		Short: "Remove objects (leased or hard-pinned ones need --force)",
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			modes := 0
			for _, on := range []bool{all, prefix != "", regex != "", len(args) > 0} {
				if on {
					modes++
				}
			}
			if modes != 1 {
				return usagef("give KEYs, or exactly one of --all, --prefix, --regex")
			}
			c, err := e.client(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			var removed, skipped uint64
			switch {
			case all:
				removed, skipped, err = c.RemoveAll(ctx, force)
			case prefix != "":
				removed, skipped, err = c.RemoveByPrefix(ctx, prefix, force)
			case regex != "":
				removed, skipped, err = c.RemoveByRegex(ctx, regex, force)
			case len(args) == 1:
				if err = c.Remove(ctx, args[0], force); err == nil {
					removed = 1
				}
			default:
				var firstErr error
				for i, err := range c.BatchRemove(ctx, args, force) {
					if err != nil {
						fmt.Fprintln(e.stderr, "crescentctl:", err)
						skipped++
						if firstErr == nil {
							firstErr = err
						}
						continue
					}
					_ = i
					removed++
				}
				err = firstErr
			}
			if e.json() {
				_ = e.printJSON(map[string]any{"removed": removed, "skipped": skipped})
			} else if err == nil {
				fmt.Fprintf(e.stderr, "removed %d, skipped %d\n", removed, skipped)
			}
			return err
		},
	}
	f := cmd.Flags()
	f.BoolVar(&force, "force", false, "remove even when leased or hard-pinned")
	f.BoolVar(&all, "all", false, "remove every object of the tenant")
	f.StringVar(&prefix, "prefix", "", "remove objects whose key starts with this")
	f.StringVar(&regex, "regex", "", "remove objects whose key matches this RE2 regex")
	return cmd
}

func lsCmd(e *env) *cobra.Command {
	var prefix string
	cmd := &cobra.Command{
		Use:   "ls [--prefix P]",
		Short: "List objects of the tenant",
		Args:  exactArgs(0),
		RunE: e.withClient(func(ctx context.Context, c *client.Client, _ []string) (err error) {
			// The header goes out with the first page (or after an empty
			// listing), so a refused listing prints only its error.
			header := !e.json()
			printHeader := func() {
				if header {
					fmt.Fprintf(e.stdout, "%-40s %12s %8s %s\n", "KEY", "SIZE", "REPLICAS", "MEDIA")
					header = false
				}
			}
			defer func() {
				if err == nil {
					printHeader()
				}
			}()
			for o, lerr := range c.List(ctx, prefix) {
				if lerr != nil {
					return lerr
				}
				printHeader()
				media := []string{}
				for _, m := range o.GetMedia() {
					media = append(media, mediumName(m))
				}
				if e.json() {
					if err := e.printJSON(map[string]any{
						"key": o.GetKey(), "size": o.GetSize(), "replicas": o.GetReplicas(), "media": media,
						"group_id": o.GetGroupId(), "soft_pinned": o.GetSoftPinned(), "hard_pinned": o.GetHardPinned(), "processing": o.GetProcessing(),
					}); err != nil {
						return err
					}
					continue
				}
				fmt.Fprintf(e.stdout, "%-40s %12d %8d %s\n", o.GetKey(), o.GetSize(), o.GetReplicas(), strings.Join(media, ","))
			}
			return nil
		}),
	}
	cmd.Flags().StringVar(&prefix, "prefix", "", "only keys starting with this")
	return cmd
}
