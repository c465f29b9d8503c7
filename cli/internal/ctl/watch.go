package ctl

import (
	"context"
	"fmt"
	"sync/atomic"

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
}

func watchCmd(e *env) *cobra.Command {
	var (
		gateway string
		replay  string
		fromSeq uint64
		count   int
	)
	cmd := &cobra.Command{
		Use:   "watch [--gateway tcp://HOST:5557] [--from-seq N]",
		Short: "Print KV events from the gateway as JSON lines",
		Long: "watch subscribes to the gateway's ZMQ PUB socket, decodes every batch strictly and prints one\n" +
			"JSON object per event. Gaps in the sequence are repaired from the replay socket when possible\n" +
			"and reported on stderr otherwise. --from-seq N first replays the retained batches from N.",
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
			var printed atomic.Int64
			var werr error
			sub, err := kvevent.Subscribe(ctx, gateway, kvevent.Options{
				ReplayEndpoint: replay,
				FromSeq:        fromSeq,
				DisableIndex:   true,
				OnBatch: func(b kvevent.Batch) {
					for _, ev := range b.Events {
						if count > 0 && printed.Load() >= int64(count) {
							cancel()
							return
						}
						w := watchEvent{Seq: b.Seq, EventID: ev.ID, Timestamp: ev.Timestamp, EventType: ev.Type.String(),
							Tenant: ev.Tenant, BackendID: ev.Envelope.BackendID, Replayed: b.Replayed}
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
					fmt.Fprintf(e.stderr, "crescentctl: gap in sequence [%d, %d) reset=%v: %v\n", g.From, g.To, g.Reset, g.Err)
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
	f.IntVar(&count, "count", 0, "exit after printing this many events (0 = run until interrupted)")
	return cmd
}
