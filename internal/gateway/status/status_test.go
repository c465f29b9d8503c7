package status

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	"github.com/crescent-kv/crescent/internal/gateway/publisher"
	"github.com/crescent-kv/crescent/internal/gateway/snapshot"
	"github.com/crescent-kv/crescent/internal/gateway/source"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/prometheus/client_golang/prometheus"
)

// sample gives every counter a distinct value, so a field wired to the
// wrong source shows.
func sample() *Service {
	return New(Sources{Pub: func() publisher.Stats {
		return publisher.Stats{
			Enabled: true, PublishedBatches: 1, PublishedEvents: 2, DroppedEvents: 3, SkippedKeylessEvents: 4,
			EnqueuedEvents: 5, LastSequence: 6, QueueDepth: 7, ReplayBatches: 8, Subscribers: 9,
			SubscriberDroppedBatches: 10, ReplayRequests: 11, PeersRefused: 12, PeersDropped: 13,
			HeartbeatsSent: 18, NextSequence: 19, SnapshotRequests: 20, SnapshotsServed: 21, SnapshotErrors: 22, JournalErrors: 23,
			SubscriberUnansweredPings: 29,
			Format:                    publisher.FormatSnapshot, Epoch: statedir.Epoch{0xab},
		}
	}, Src: func() source.Status {
		return source.Status{Epoch: 14, Revision: 15, Resyncs: 16, Watching: true, Announced: 17}
	}, Recorder: func() snapshot.Stats {
		return snapshot.Stats{Cut: 24, Failed: true, Checkpoints: 25, CheckpointErrors: 26, LastCheckpointUnixMilli: 27, BufferBytes: 28}
	}, State: func() (string, string) { return "reset", "checkpoint: corrupt" }})
}

func TestHTTP(t *testing.T) {
	rec := httptest.NewRecorder()
	sample().ServeHTTP(rec, httptest.NewRequest("GET", "/kv_events/status", nil))
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type %q", ct)
	}
	body := rec.Body.String()
	// Mooncake's five fields come first, in its order.
	want := []string{`"enabled"`, `"published_batches"`, `"published_events"`, `"dropped_events"`, `"skipped_keyless_events"`, `"enqueued_events"`}
	last := -1
	for _, k := range want {
		i := strings.Index(body, k)
		if i <= last {
			t.Fatalf("field %s out of order in %s", k, body)
		}
		last = i
	}
	var got map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]any{
		"enabled": true, "published_batches": 1.0, "published_events": 2.0, "dropped_events": 3.0, "skipped_keyless_events": 4.0,
		"enqueued_events": 5.0, "last_sequence": 6.0, "queue_depth": 7.0, "replay_batches": 8.0, "subscribers": 9.0,
		"subscriber_dropped_batches": 10.0, "replay_requests": 11.0, "peers_refused": 12.0, "peers_dropped": 13.0,
		"master_epoch": 14.0, "master_revision": 15.0, "resyncs": 16.0, "watching": true, "announced_entries": 17.0,
		"publisher_epoch": "ab000000000000000000000000000000", "next_sequence": 19.0, "stream_format": "snapshot",
		"state": "reset", "state_error": "checkpoint: corrupt", "resume_holding": false, "heartbeats_sent": 18.0,
		"journal_errors": 23.0, "snapshot_requests": 20.0, "snapshots_served": 21.0, "snapshot_errors": 22.0,
		"recorder_failed": true, "recorder_cut": 24.0, "checkpoints": 25.0, "checkpoint_errors": 26.0, "last_checkpoint_unix_ms": 27.0,
		"snapshot_buffer_bytes": 28.0, "subscriber_unanswered_pings": 29.0,
	} {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if len(got) != 37 {
		t.Errorf("%d fields, want 37", len(got))
	}
}

func TestGetStatus(t *testing.T) {
	r, err := sample().GetStatus(t.Context(), &gatewayv1.GetStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.GetEnabled() || r.GetPublishedBatches() != 1 || r.GetPublishedEvents() != 2 || r.GetDroppedEvents() != 3 ||
		r.GetSkippedKeylessEvents() != 4 || r.GetLastSequence() != 6 || r.GetMasterEpoch() != 14 || r.GetMasterRevision() != 15 ||
		r.GetResyncs() != 16 || r.GetReplayBatches() != 8 || r.GetPublisherEpoch() != "ab000000000000000000000000000000" ||
		r.GetStreamFormat() != "snapshot" || r.GetState() != "reset" || r.GetStateError() != "checkpoint: corrupt" ||
		r.GetHeartbeatsSent() != 18 || r.GetSnapshotsServed() != 21 || r.GetSnapshotErrors() != 22 || r.GetCheckpoints() != 25 ||
		r.GetJournalErrors() != 23 {
		t.Fatalf("GetStatus = %v", r)
	}
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := sample()
	if err := s.Register(reg); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		m := mf.GetMetric()[0]
		if m.GetCounter() != nil {
			got[mf.GetName()] = m.GetCounter().GetValue()
		} else {
			got[mf.GetName()] = m.GetGauge().GetValue()
		}
	}
	for name, want := range map[string]float64{
		"crescent_gateway_kv_events_enabled": 1, "crescent_gateway_kv_events_published_batches_total": 1,
		"crescent_gateway_kv_events_published_events_total": 2, "crescent_gateway_kv_events_dropped_events_total": 3,
		"crescent_gateway_kv_events_skipped_keyless_events_total": 4, "crescent_gateway_kv_events_last_sequence": 6,
		"crescent_gateway_kv_events_queue_depth": 7, "crescent_gateway_kv_events_subscribers": 9,
		"crescent_gateway_kv_events_enqueued_events_total": 5, "crescent_gateway_kv_events_subscriber_dropped_batches_total": 10,
		"crescent_gateway_kv_events_replay_batches": 8, "crescent_gateway_kv_events_replay_requests_total": 11,
		"crescent_gateway_kv_events_peers_refused_total": 12, "crescent_gateway_kv_events_peers_dropped_total": 13,
		"crescent_gateway_master_epoch": 14, "crescent_gateway_master_revision": 15, "crescent_gateway_resyncs_total": 16,
		"crescent_gateway_announced_entries":       17,
		"crescent_gateway_kv_events_next_sequence": 19, "crescent_gateway_kv_events_heartbeats_total": 18,
		"crescent_gateway_kv_events_snapshot_requests_total": 20, "crescent_gateway_kv_events_snapshots_served_total": 21,
		"crescent_gateway_kv_events_snapshot_errors_total": 22, "crescent_gateway_kv_events_recorder_failed": 1,
		"crescent_gateway_state_checkpoints_total": 25, "crescent_gateway_state_checkpoint_errors_total": 26,
		"crescent_gateway_state_journal_errors_total": 23, "crescent_gateway_state_restored": 0,
		"crescent_gateway_kv_events_snapshot_buffer_bytes": 28, "crescent_gateway_kv_events_subscriber_unanswered_pings_total": 29,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v", name, got[name], want)
		}
	}
	if len(got) != 30 {
		t.Errorf("%d metrics, want 30", len(got))
	}
	if err := s.Register(reg); err == nil {
		t.Fatal("registering the same metrics twice must fail")
	}
}
