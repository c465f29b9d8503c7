package link

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	sessions    *prometheus.CounterVec
	redirects   prometheus.Counter
	commands    *prometheus.CounterVec
	heartbeats  prometheus.Counter
	expired     prometheus.Counter
	copiedBytes prometheus.Counter
	epoch       prometheus.Gauge
	resumes     *prometheus.CounterVec
	// lostReported counts allocations reported in AllocationsLost.
	lostReported prometheus.Counter

	// Follow streams (follow.go).
	followEstablished prometheus.Counter
	following         prometheus.Gauge
	followDeltas      prometheus.Counter
	followChanges     prometheus.Counter
	followResyncs     prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, l *Link) *metrics {
	m := &metrics{
		sessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_agent_link_sessions_total", Help: "Master sessions that ended, by result (established, failed, closed).",
		}, []string{"result"}),
		redirects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_agent_link_redirects_total", Help: "NOT_LEADER answers whose leader hint the link followed (issue 15, HA).",
		}),
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_agent_link_commands_total", Help: "Master commands received, by kind and result (accepted, stale_epoch).",
		}, []string{"kind", "result"}),
		heartbeats:  prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_link_heartbeats_total", Help: "Heartbeats sent to the master."}),
		expired:     prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_reservations_expired_total", Help: "RESERVED allocations released after the reserved grace."}),
		copiedBytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_copy_bytes_total", Help: "Bytes copied to other agents on the master's Copy requests."}),
		epoch:       prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_link_epoch", Help: "Highest master epoch accepted."}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_agent_link_resumes_total", Help: "Connect registrations offered without the table, by the master's answer (resumed, table_requested).",
		}, []string{"result"}),
		lostReported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_agent_link_lost_reported_total", Help: "Allocations dropped while serving (bad bytes on disk) reported to the master in AllocationsLost.",
		}),
		followEstablished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_agent_link_follow_established_total", Help: "Follow streams a standby master accepted (each sent the whole table).",
		}),
		following: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "crescent_agent_link_follow_streams", Help: "Follow streams open to standby masters now.",
		}),
		followDeltas: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_agent_link_follow_deltas_total", Help: "TableDelta messages sent on Follow streams.",
		}),
		followChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_agent_link_follow_changes_total", Help: "Table changes (seals, releases of sealed allocations) sent on Follow streams.",
		}),
		followResyncs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "crescent_agent_link_follow_resyncs_total", Help: "Follow streams ended because the table feed's ring had moved past them, to follow again with the whole table.",
		}),
	}
	if reg != nil {
		state := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_agent_link_state", Help: "Master link state: 0 disconnected, 1 connecting, 2 connected, 3 deregistering.",
		}, func() float64 { return float64(l.State()) })
		reg.MustRegister(m.sessions, m.redirects, m.commands, m.heartbeats, m.expired, m.copiedBytes, m.epoch, m.resumes, m.lostReported,
			m.followEstablished, m.following, m.followDeltas, m.followChanges, m.followResyncs, state)
	}
	return m
}
