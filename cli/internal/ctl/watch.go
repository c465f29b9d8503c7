package ctl

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/spf13/cobra"
)

// watchEvent is one printed JSON line: the event in the wire's field names,
// plus the batch sequence it arrived in.
type watchEvent struct {
	Seq       uint64  `json:"seq"`
	EventID   uint64  `json:"event_id"`
	Timestamp int64   `json:"timestamp"`
	EventType string  `json:"event_type"`
	Tenant    string  `json:"tenant_id"`
	BackendID string  `json:"backend_id"`
	Key       *string `json:"object_key,omitempty"`
	Medium    *string `json:"medium"`
	GroupID   *string `json:"group_id,omitempty"`
	Replayed  bool    `json:"replayed,omitempty"`
	// Snapshot marks the events of a snapshot (--snapshot): the state at
	// sequence seq (the snapshot's cut), event_id 0.
	Snapshot bool `json:"snapshot,omitempty"`
}

func watchCmd(e *env) *cobra.Command {
	var (
		gateway   string
		replay    string
		snapshot  string
		topic     string
		fromSeq   uint64
		count     int
		heartbeat time.Duration
	)
	cmd := &cobra.Command{
		Use:   "watch [--gateway tcp://HOST:5557] [--from-seq N | --snapshot tcp://HOST:5559]",
		Short: "Print KV events from the gateway as JSON lines",
		Long: "watch subscribes to the gateway's ZMQ PUB socket, decodes every batch strictly and prints one\n" +
			"JSON object per event. Gaps in the sequence are repaired from the replay socket when possible\n" +
			"and reported on stderr otherwise. --from-seq N first replays the retained batches from N.\n" +
			"--snapshot starts from the gateway's snapshot instead (its events are printed with\n" +
			"\"snapshot\": true and the snapshot's sequence), then prints the live events after it; whenever\n" +
			"the stream's continuity is lost (a gateway restart, a gap replay cannot fill, no heartbeat) it\n" +
			"prints a line on stderr, fetches a fresh snapshot and goes on. Both stream formats (mooncake,\n" +
			"snapshot: epochs and heartbeats) are understood.",
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			if !cmd.Flags().Changed("replay") && cmd.Flags().Changed("gateway") {
				replay = ""
			}
			if fromSeq > 0 && replay == "" {
				return usagef("--from-seq needs --replay")
			}
			if fromSeq > 0 && snapshot != "" {
				return usagef("--from-seq and --snapshot exclude each other (the snapshot replaces the catch-up)")
			}
			var printed atomic.Int64
			var werr error
			sub, err := kvevent.Subscribe(ctx, gateway, kvevent.Options{
				ReplayEndpoint:   replay,
				FromSeq:          fromSeq,
				SnapshotEndpoint: snapshot,
				HeartbeatTimeout: heartbeat,
				Topic:            topic,
				DisableIndex:     true,
				OnBatch: func(b kvevent.Batch) {
					for _, ev := range b.Events {
						if count > 0 && printed.Load() >= int64(count) {
							cancel()
							return
						}
						w := watchEvent{Seq: b.Seq, EventID: ev.ID, Timestamp: ev.Timestamp, EventType: ev.Type.String(),
							Tenant: ev.Tenant, BackendID: ev.Envelope.BackendID, Replayed: b.Replayed, Snapshot: b.Snapshot}
						if ev.Type != kvevent.Cleared {
							k, m, g := ev.Key, ev.Medium.String(), ev.GroupID
							w.Key, w.Medium = &k, &m
							if g != "" {
								w.GroupID = &g
							}
						}
						if err := e.printJSON(w); err != nil && werr == nil {
							werr = err
							cancel()
						}
						if count > 0 && printed.Add(1) >= int64(count) {
							cancel()
						}
					}
				},
				OnGap: func(g kvevent.Gap) {
					switch {
					case g.Rebuilt && g.Reset:
						fmt.Fprintf(e.stderr, "crescentctl: the publisher restarted; rebuilt from its snapshot: %v\n", g.Err)
					case g.Rebuilt:
						fmt.Fprintf(e.stderr, "crescentctl: stream continuity lost; rebuilt from a snapshot: %v\n", g.Err)
					case g.Reset && replay != "":
						fmt.Fprintf(e.stderr, "crescentctl: the publisher restarted; resynchronised from its replay ring\n")
					case g.Reset:
						fmt.Fprintf(e.stderr, "crescentctl: the publisher restarted (events before this point may be stale; use --snapshot or --replay to resynchronise)\n")
					default:
						fmt.Fprintf(e.stderr, "crescentctl: gap in sequence [%d, %d): %v\n", g.From, g.To, g.Err)
					}
				},
			})
			if err != nil {
				return fmt.Errorf("subscribe %s: %w", gateway, err)
			}
			defer sub.Close()
			<-sub.Done()
			if werr != nil {
				return werr
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&gateway, "gateway", "tcp://localhost:5557", "gateway PUB endpoint")
	f.StringVar(&replay, "replay", "tcp://localhost:5558", "gateway replay ROUTER endpoint (gap repair, --from-seq); default only with the default --gateway")
	f.Uint64Var(&fromSeq, "from-seq", 0, "first replay every retained batch from this sequence")
	f.StringVar(&snapshot, "snapshot", "", "gateway snapshot ROUTER endpoint (e.g. tcp://localhost:5559): start from its state and rebuild from it whenever continuity is lost")
	f.StringVar(&topic, "topic", "", "the stream's topic frame: empty (Mooncake format), or the gateway's --topic (snapshot format, e.g. kv@host:5557@model)")
	f.DurationVar(&heartbeat, "heartbeat-timeout", 0, "snapshot stream format: silence after which the gateway is taken for gone (0 = 5s)")
	f.IntVar(&count, "count", 0, "exit after printing this many events (0 = run until interrupted)")
	return cmd
}
