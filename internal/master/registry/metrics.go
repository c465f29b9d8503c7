package registry

import "github.com/prometheus/client_golang/prometheus"

// Counts returns the number of remembered segments per (lifecycle, health).
func (r *Registry) Counts() map[[2]string]int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := map[[2]string]int{}
	for _, e := range r.segs {
		out[[2]string{LifecycleLabel(e.seg.Lifecycle), HealthLabel(e.seg.Health)}]++
	}
	return out
}

var segmentsDesc = prometheus.NewDesc("crescent_master_segments",
	"Segments known to the master, by lifecycle and health.", []string{"lifecycle", "health"}, nil)

// collector exports the registry's counts at scrape time, so the gauge can
// never drift from the registry.
type collector struct{ r *Registry }

func (c collector) Describe(ch chan<- *prometheus.Desc) { ch <- segmentsDesc }

func (c collector) Collect(ch chan<- prometheus.Metric) {
	for k, n := range c.r.Counts() {
		ch <- prometheus.MustNewConstMetric(segmentsDesc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
}
