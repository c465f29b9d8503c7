package segment

import (
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports per-segment capacity, usage, largest free extent and
// allocation counts, read at scrape time.
type Collector struct {
	set                              *Set
	capacity, used, largest, allocns *prometheus.Desc
}

// NewCollector returns a collector over set; register it on the process
// registry.
func NewCollector(set *Set) *Collector {
	labels := []string{"segment", "name", "medium"}
	return &Collector{
		set:      set,
		capacity: prometheus.NewDesc("crescent_agent_segment_capacity_bytes", "Usable bytes of the segment.", labels, nil),
		used:     prometheus.NewDesc("crescent_agent_segment_used_bytes", "Bytes held by allocations (alignment included).", labels, nil),
		largest:  prometheus.NewDesc("crescent_agent_segment_largest_free_extent_bytes", "Largest contiguous free extent.", labels, nil),
		allocns:  prometheus.NewDesc("crescent_agent_segment_allocations", "Allocations in the table by state.", append(labels, "state"), nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.capacity
	ch <- c.used
	ch <- c.largest
	ch <- c.allocns
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, sg := range c.set.All() {
		st, reserved, sealed := sg.Stats()
		lv := []string{sg.ID(), sg.Name(), mediumLabel(sg)}
		ch <- prometheus.MustNewConstMetric(c.capacity, prometheus.GaugeValue, float64(st.Capacity), lv...)
		ch <- prometheus.MustNewConstMetric(c.used, prometheus.GaugeValue, float64(st.Used), lv...)
		ch <- prometheus.MustNewConstMetric(c.largest, prometheus.GaugeValue, float64(st.LargestFree), lv...)
		ch <- prometheus.MustNewConstMetric(c.allocns, prometheus.GaugeValue, float64(reserved), append(lv, "reserved")...)
		ch <- prometheus.MustNewConstMetric(c.allocns, prometheus.GaugeValue, float64(sealed), append(lv, "sealed")...)
	}
}

func mediumLabel(sg *Segment) string {
	if sg.Medium() == masterv1.Medium_MEDIUM_DISK {
		return "disk"
	}
	return "memory"
}
