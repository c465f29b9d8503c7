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

	EnqueuedEvents           uint64 `json:"enqueued_events"`
	LastSequence             uint64 `json:"last_sequence"`
	QueueDepth               int    `json:"queue_depth"`
	Subscribers              int    `json:"subscribers"`
	SubscriberDroppedBatches uint64 `json:"subscriber_dropped_batches"`
	ReplayBatches            int    `json:"replay_batches"`
	ReplayRequests           uint64 `json:"replay_requests"`
	PeersRefused             uint64 `json:"peers_refused"`
	PeersDropped             uint64 `json:"peers_dropped"`
	MasterEpoch              uint64 `json:"master_epoch"`
	MasterRevision           uint64 `json:"master_revision"`
	Resyncs                  uint64 `json:"resyncs"`
	Watching                 bool   `json:"watching"`
	AnnouncedEntries         int    `json:"announced_entries"`
}

// Service serves the status. Safe for concurrent use.
type Service struct {
	gatewayv1.UnimplementedGatewayServiceServer
	pub func() publisher.Stats
	src func() source.Status
}

// New builds the service over the two snapshot functions.
func New(pub func() publisher.Stats, src func() source.Status) *Service {
	return &Service{pub: pub, src: src}
}

// Snapshot reads every counter once.
func (s *Service) Snapshot() Status {
	p, src := s.pub(), s.src()
	return Status{
		Enabled: p.Enabled, PublishedBatches: p.PublishedBatches, PublishedEvents: p.PublishedEvents,
		DroppedEvents: p.DroppedEvents, SkippedKeylessEvents: p.SkippedKeylessEvents,
		EnqueuedEvents: p.EnqueuedEvents, LastSequence: p.LastSequence, QueueDepth: p.QueueDepth, Subscribers: p.Subscribers,
		SubscriberDroppedBatches: p.SubscriberDroppedBatches, ReplayBatches: p.ReplayBatches,
		ReplayRequests: p.ReplayRequests, PeersRefused: p.PeersRefused, PeersDropped: p.PeersDropped, MasterEpoch: src.Epoch, MasterRevision: src.Revision,
		Resyncs: src.Resyncs, Watching: src.Watching, AnnouncedEntries: src.Announced,
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
		gauge("kv_events_replay_batches", "Batches held in the replay ring.", func(st Status) float64 { return float64(st.ReplayBatches) }),
		counter("kv_events_replay_requests_total", "Replay requests served.", func(st Status) uint64 { return st.ReplayRequests }),
		counter("kv_events_peers_refused_total", "PUB and replay connections refused at accept (max-subscribers, replay-max-conns-per-peer).", func(st Status) uint64 { return st.PeersRefused }),
		counter("kv_events_peers_dropped_total", "PUB and replay connections dropped for a failed handshake, an oversized or malformed frame, or replay idleness.", func(st Status) uint64 { return st.PeersDropped }),
		gauge("master_epoch", "Epoch of the master change stream followed.", func(st Status) float64 { return float64(st.MasterEpoch) }),
		gauge("master_revision", "Last master change revision applied.", func(st Status) float64 { return float64(st.MasterRevision) }),
		counter("resyncs_total", "Snapshots taken from the master (initial, compaction, new epoch).", func(st Status) uint64 { return st.Resyncs }),
		gauge("announced_entries", "Readable (tenant, key, medium) entries announced to subscribers.", func(st Status) float64 { return float64(st.AnnouncedEntries) }),
	} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
