// Package status exposes the gateway's counters three ways from one
// snapshot function: GET /kv_events/status (JSON, Mooncake's field names
// first), crescent.gateway.v1.GatewayService/GetStatus, and Prometheus
// metrics.
package status

import (
	"context"
	"encoding/json"
	"net/http"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	"github.com/crescent-kv/crescent/internal/gateway/publisher"
	"github.com/crescent-kv/crescent/internal/gateway/snapshot"
	"github.com/crescent-kv/crescent/internal/gateway/source"
	"github.com/prometheus/client_golang/prometheus"
)

// Status is the JSON document of GET /kv_events/status. The first five
// fields are Mooncake's; the rest are ours.
type Status struct {
	Enabled              bool   `json:"enabled"`
	PublishedBatches     uint64 `json:"published_batches"`
	PublishedEvents      uint64 `json:"published_events"`
	DroppedEvents        uint64 `json:"dropped_events"`
	SkippedKeylessEvents uint64 `json:"skipped_keyless_events"`

	EnqueuedEvents            uint64 `json:"enqueued_events"`
	LastSequence              uint64 `json:"last_sequence"`
	QueueDepth                int    `json:"queue_depth"`
	Subscribers               int    `json:"subscribers"`
	SubscriberDroppedBatches  uint64 `json:"subscriber_dropped_batches"`
	SubscriberUnansweredPings uint64 `json:"subscriber_unanswered_pings"`
	ReplayBatches             int    `json:"replay_batches"`
	ReplayRequests            uint64 `json:"replay_requests"`
	PeersRefused              uint64 `json:"peers_refused"`
	PeersDropped              uint64 `json:"peers_dropped"`
	MasterEpoch               uint64 `json:"master_epoch"`
	MasterRevision            uint64 `json:"master_revision"`
	Resyncs                   uint64 `json:"resyncs"`
	Watching                  bool   `json:"watching"`
	AnnouncedEntries          int    `json:"announced_entries"`

	// Continuity (docs/gateway-state.md).
	PublisherEpoch   string `json:"publisher_epoch"`
	NextSequence     uint64 `json:"next_sequence"`
	StreamFormat     string `json:"stream_format"`
	State            string `json:"state"`
	StateError       string `json:"state_error,omitempty"`
	ResumeHolding    bool   `json:"resume_holding"`
	HeartbeatsSent   uint64 `json:"heartbeats_sent"`
	JournalErrors    uint64 `json:"journal_errors"`
	SnapshotRequests uint64 `json:"snapshot_requests"`
	SnapshotsServed  uint64 `json:"snapshots_served"`
	SnapshotErrors   uint64 `json:"snapshot_errors"`
	RecorderFailed   bool   `json:"recorder_failed"`
	RecorderCut      int64  `json:"recorder_cut"`
	SnapshotBuffers  int64  `json:"snapshot_buffer_bytes"`
	Checkpoints      uint64 `json:"checkpoints"`
	CheckpointErrors uint64 `json:"checkpoint_errors"`
	LastCheckpointMs int64  `json:"last_checkpoint_unix_ms"`
}

// Sources are the functions a Status is read from. Recorder and State may
// be nil (no snapshot recorder; no state directory).
type Sources struct {
	Pub      func() publisher.Stats
	Src      func() source.Status
	Recorder func() snapshot.Stats
	// State reports how the persisted state started ("off", "new",
	// "restored", "reset") and why it was reset.
	State func() (mode, err string)
}

// Service serves the status. Safe for concurrent use.
type Service struct {
	gatewayv1.UnimplementedGatewayServiceServer
	src Sources
}

// New builds the service over the sources' snapshot functions.
func New(src Sources) *Service {
	return &Service{src: src}
}

// Snapshot reads every counter once. The source's first: it records a
// master revision only after it has queued that revision's events, so
// reading the publisher afterwards makes EnqueuedEvents count every event
// up to MasterRevision. Read the other way round, a snapshot could show
// the newest revision with its events not yet queued, and a caller waiting
// for "revision at the master's head, queue empty" (the tests' settled)
// stopped waiting one batch early.
func (s *Service) Snapshot() Status {
	src, p := s.src.Src(), s.src.Pub()
	var rec snapshot.Stats
	if s.src.Recorder != nil {
		rec = s.src.Recorder()
	}
	mode, stateErr := "off", ""
	if s.src.State != nil {
		mode, stateErr = s.src.State()
	}
	return Status{
		Enabled: p.Enabled, PublishedBatches: p.PublishedBatches, PublishedEvents: p.PublishedEvents,
		DroppedEvents: p.DroppedEvents, SkippedKeylessEvents: p.SkippedKeylessEvents,
		EnqueuedEvents: p.EnqueuedEvents, LastSequence: p.LastSequence, QueueDepth: p.QueueDepth, Subscribers: p.Subscribers,
		SubscriberDroppedBatches: p.SubscriberDroppedBatches, SubscriberUnansweredPings: p.SubscriberUnansweredPings, ReplayBatches: p.ReplayBatches,
		ReplayRequests: p.ReplayRequests, PeersRefused: p.PeersRefused, PeersDropped: p.PeersDropped, MasterEpoch: src.Epoch, MasterRevision: src.Revision,
		Resyncs: src.Resyncs, Watching: src.Watching, AnnouncedEntries: src.Announced,

		PublisherEpoch: p.Epoch.String(), NextSequence: p.NextSequence, StreamFormat: p.Format.String(),
		State: mode, StateError: stateErr, ResumeHolding: p.Holding, HeartbeatsSent: p.HeartbeatsSent, JournalErrors: p.JournalErrors,
		SnapshotRequests: p.SnapshotRequests, SnapshotsServed: p.SnapshotsServed, SnapshotErrors: p.SnapshotErrors,
		RecorderFailed: rec.Failed, RecorderCut: rec.Cut, SnapshotBuffers: rec.BufferBytes, Checkpoints: rec.Checkpoints, CheckpointErrors: rec.CheckpointErrors,
		LastCheckpointMs: rec.LastCheckpointUnixMilli,
	}
}

// ServeHTTP answers GET /kv_events/status.
func (s *Service) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(s.Snapshot())
}

// GetStatus implements GatewayService.
func (s *Service) GetStatus(context.Context, *gatewayv1.GetStatusRequest) (*gatewayv1.GetStatusResponse, error) {
	st := s.Snapshot()
	return &gatewayv1.GetStatusResponse{
		Enabled: st.Enabled, PublishedBatches: st.PublishedBatches, PublishedEvents: st.PublishedEvents,
		DroppedEvents: st.DroppedEvents, SkippedKeylessEvents: st.SkippedKeylessEvents,
		LastSequence: st.LastSequence, MasterEpoch: st.MasterEpoch, MasterRevision: st.MasterRevision,
		Resyncs: st.Resyncs, ReplayBatches: uint64(st.ReplayBatches),
		PublisherEpoch: st.PublisherEpoch, StreamFormat: st.StreamFormat, State: st.State, StateError: st.StateError,
		HeartbeatsSent: st.HeartbeatsSent, SnapshotsServed: st.SnapshotsServed, SnapshotErrors: st.SnapshotErrors,
		Checkpoints: st.Checkpoints, JournalErrors: st.JournalErrors,
	}, nil
}

// Register exports the same counters as Prometheus metrics, read at scrape time.
func (s *Service) Register(reg prometheus.Registerer) error {
	counter := func(name, help string, f func(Status) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "crescent", Subsystem: "gateway", Name: name, Help: help},
			func() float64 { return float64(f(s.Snapshot())) })
	}
	gauge := func(name, help string, f func(Status) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "crescent", Subsystem: "gateway", Name: name, Help: help},
			func() float64 { return f(s.Snapshot()) })
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	for _, c := range []prometheus.Collector{
		gauge("kv_events_enabled", "1 when the KV event publisher is bound and running.", func(st Status) float64 { return b2f(st.Enabled) }),
		counter("kv_events_published_batches_total", "ZMQ messages sent on the PUB socket.", func(st Status) uint64 { return st.PublishedBatches }),
		counter("kv_events_published_events_total", "Events inside the published messages.", func(st Status) uint64 { return st.PublishedEvents }),
		counter("kv_events_dropped_events_total", "Events dropped by the full queue; each burned one sequence number.", func(st Status) uint64 { return st.DroppedEvents }),
		counter("kv_events_skipped_keyless_events_total", "Per-object events suppressed because emit-object-key is false.", func(st Status) uint64 { return st.SkippedKeylessEvents }),
		gauge("kv_events_last_sequence", "Last sequence number assigned.", func(st Status) float64 { return float64(st.LastSequence) }),
		gauge("kv_events_queue_depth", "Events waiting in the queue.", func(st Status) float64 { return float64(st.QueueDepth) }),
		gauge("kv_events_subscribers", "Connections subscribed to the PUB socket.", func(st Status) float64 { return float64(st.Subscribers) }),
		counter("kv_events_enqueued_events_total", "Events accepted into the queue.", func(st Status) uint64 { return st.EnqueuedEvents }),
		counter("kv_events_subscriber_dropped_batches_total", "Messages discarded from slow subscribers' queues.", func(st Status) uint64 { return st.SubscriberDroppedBatches }),
		counter("kv_events_subscriber_unanswered_pings_total", "Subscribers' ZMTP PINGs left without a PONG: more than 4 waiting in one queue, or pushed out of a full one.", func(st Status) uint64 { return st.SubscriberUnansweredPings }),
		gauge("kv_events_replay_batches", "Batches held in the replay ring.", func(st Status) float64 { return float64(st.ReplayBatches) }),
		counter("kv_events_replay_requests_total", "Replay requests served.", func(st Status) uint64 { return st.ReplayRequests }),
		counter("kv_events_peers_refused_total", "PUB and replay connections refused at accept (max-subscribers, replay-max-conns-per-peer).", func(st Status) uint64 { return st.PeersRefused }),
		counter("kv_events_peers_dropped_total", "PUB and replay connections dropped for a failed handshake, an oversized or malformed frame, or replay idleness.", func(st Status) uint64 { return st.PeersDropped }),
		gauge("master_epoch", "Epoch of the master change stream followed.", func(st Status) float64 { return float64(st.MasterEpoch) }),
		gauge("master_revision", "Last master change revision applied.", func(st Status) float64 { return float64(st.MasterRevision) }),
		counter("resyncs_total", "Snapshots taken from the master (initial, compaction, new epoch).", func(st Status) uint64 { return st.Resyncs }),
		gauge("announced_entries", "Readable (tenant, key, medium) entries announced to subscribers.", func(st Status) float64 { return float64(st.AnnouncedEntries) }),
		gauge("kv_events_next_sequence", "Sequence number the next batch will take (continues across restarts with --state-dir).", func(st Status) float64 { return float64(st.NextSequence) }),
		counter("kv_events_heartbeats_total", "Idle heartbeats published (snapshot stream format).", func(st Status) uint64 { return st.HeartbeatsSent }),
		counter("kv_events_snapshot_requests_total", "Snapshot requests received on the snapshot endpoint.", func(st Status) uint64 { return st.SnapshotRequests }),
		counter("kv_events_snapshots_served_total", "Snapshot requests answered with a snapshot.", func(st Status) uint64 { return st.SnapshotsServed }),
		counter("kv_events_snapshot_errors_total", "Snapshot requests answered unavailable (-2).", func(st Status) uint64 { return st.SnapshotErrors }),
		gauge("kv_events_snapshot_buffer_bytes", "Memory held for snapshot replies: replies being sent, the last one, and buffers kept for the next build (dropped 10 s after the last request).", func(st Status) float64 { return float64(st.SnapshotBuffers) }),
		gauge("kv_events_recorder_failed", "1 when the snapshot recorder fell too far behind and stopped (snapshots unavailable, checkpoints stopped).", func(st Status) float64 { return b2f(st.RecorderFailed) }),
		counter("state_checkpoints_total", "Checkpoints written to the state directory.", func(st Status) uint64 { return st.Checkpoints }),
		counter("state_checkpoint_errors_total", "Checkpoints that failed to write.", func(st Status) uint64 { return st.CheckpointErrors }),
		counter("state_journal_errors_total", "Journal appends that failed; the state is reset at the next start.", func(st Status) uint64 { return st.JournalErrors }),
		gauge("state_restored", "1 when this process continued a publisher from its state directory.", func(st Status) float64 { return b2f(st.State == "restored") }),
	} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
