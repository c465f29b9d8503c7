package segment

import (
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports per-segment capacity, usage, largest free extent and
// allocation counts, and disk segments' journal failures, read at scrape
// time.
type Collector struct {
	set                              *Set
	capacity, used, largest, allocns *prometheus.Desc
	jrnFailures, jrnFailing          *prometheus.Desc
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
		jrnFailures: prometheus.NewDesc("crescent_agent_segment_journal_failures_total",
			"Writes and syncs of a disk segment's journal that failed (a full filesystem, an I/O error).", labels, nil),
		jrnFailing: prometheus.NewDesc("crescent_agent_segment_journal_failing",
			"1 while a disk segment's journal cannot be written: the segment refuses reservations, seals and releases until it can.", labels, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.capacity
	ch <- c.used
	ch <- c.largest
	ch <- c.allocns
	ch <- c.jrnFailures
	ch <- c.jrnFailing
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
		if failures, failing, ok := sg.JournalStats(); ok {
			ch <- prometheus.MustNewConstMetric(c.jrnFailures, prometheus.CounterValue, float64(failures), lv...)
			ch <- prometheus.MustNewConstMetric(c.jrnFailing, prometheus.GaugeValue, b2f(failing), lv...)
		}
	}
}

func mediumLabel(sg *Segment) string {
	if sg.Medium() == masterv1.Medium_MEDIUM_DISK {
		return "disk"
	}
	return "memory"
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
