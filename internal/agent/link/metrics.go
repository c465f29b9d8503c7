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
	}
	if reg != nil {
		state := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "crescent_agent_link_state", Help: "Master link state: 0 disconnected, 1 connecting, 2 connected, 3 deregistering.",
		}, func() float64 { return float64(l.State()) })
		reg.MustRegister(m.sessions, m.redirects, m.commands, m.heartbeats, m.expired, m.copiedBytes, m.epoch, state)
	}
	return m
}
