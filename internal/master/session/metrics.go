package session

import (
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	sessions      prometheus.Gauge
	registrations *prometheus.CounterVec
	batches       *prometheus.CounterVec
	batchItems    *prometheus.HistogramVec
	// roundTrip is commandSeconds bound to each kind, so that completing
	// a command message costs no label lookup.
	commandSeconds *prometheus.HistogramVec
	roundTrip      [numKinds]prometheus.Observer
	timeouts       *prometheus.CounterVec
	keyRotations   prometheus.Counter

	registerSeconds *prometheus.GaugeVec
	registerAllocs  *prometheus.GaugeVec

	follows       *prometheus.CounterVec
	followChanges prometheus.Counter
	resumes       *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		sessions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "crescent_master_agent_sessions",
			Help: "Agent sessions currently connected.",
		}),
		registrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_master_agent_registrations_total",
			Help: "Agent registrations, by result (accepted, rejected, failed: a chunked table stalled or was malformed).",
		}, []string{"result"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_master_agent_command_batches_total",
			Help: "Command messages sent to agents, by kind (reserve, seal, release, copy).",
		}, []string{"kind"}),
		batchItems: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "crescent_master_agent_command_batch_items",
			Help:    "Items per command message sent to agents, by kind.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 11),
		}, []string{"kind"}),
		commandSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "crescent_master_agent_command_seconds",
			Help: "Round trip of a command message to an agent, from the master's send to the agent's result, by kind (a put's Reserve is one hop of its PutStart).",
			// 50 µs to about 1.6 s; a long copy lands in +Inf.
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}, []string{"kind"}),
		timeouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_master_agent_command_timeouts_total",
			Help: "Agent command calls that timed out, by kind.",
		}, []string{"kind"}),
		keyRotations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_token_key_rotations_total",
			Help: "Data-plane token key rotations (each re-sends Settings to every agent).",
		}),
		registerSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "crescent_master_agent_registration_seconds",
			Help: "Duration of the agent's last accepted registration, from its stream's start to Settings (allocation table received and reconciled).",
		}, []string{"agent_id"}),
		registerAllocs: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "crescent_master_agent_registration_allocations",
			Help: "Allocations in the agent's last accepted registration.",
		}, []string{"agent_id"}),
		follows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_master_agent_follows_total",
			Help: "Agent Follow streams a standby took (accepted: table taken; rejected; failed while taking the table).",
		}, []string{"result"}),
		followChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_master_agent_follow_changes_total",
			Help: "Allocation table changes a standby applied from its agents' Follow streams.",
		}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_master_agent_resumes_total",
			Help: "Registrations that offered to resume from a followed table, by result (resumed: no table sent; refused: the table was asked for).",
		}, []string{"result"}),
	}
	for k := range numKinds {
		m.roundTrip[k] = m.commandSeconds.WithLabelValues(k.String())
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.sessions, m.registrations, m.batches, m.batchItems, m.commandSeconds, m.timeouts, m.keyRotations, m.registerSeconds, m.registerAllocs,
			m.follows, m.followChanges, m.resumes} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
