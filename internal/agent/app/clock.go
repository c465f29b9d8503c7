package app

import (
	"log/slog"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// clockSlack is the difference from the master's clock an agent takes for
// none: the measurement includes the network delay and the time the
// Settings waited to be handled, so below this it cannot tell a skew from
// those.
const clockSlack = 250 * time.Millisecond

// clockWarn is the difference from the master's clock an agent warns of.
const clockWarn = time.Second

// masterClock is the clock the agent checks token expiries with. The
// master writes the expiries with its clock, so an agent whose own clock
// is off by more than a token's lifetime (a read lease, 10 s) would find
// every read token expired, or accept one long after its lease ended. It
// is the agent's clock moved by the difference it measured at the last
// Settings (Settings.master_time).
type masterClock struct {
	local  func() time.Time
	offset atomic.Int64 // nanoseconds the master's clock is ahead
	gauge  prometheus.Gauge
	lg     *slog.Logger
}

func newMasterClock(local func() time.Time, reg prometheus.Registerer, lg *slog.Logger) *masterClock {
	if local == nil {
		local = time.Now
	}
	c := &masterClock{local: local, lg: lg, gauge: prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "crescent_agent_master_clock_offset_seconds",
		Help: "How far the master's wall clock is ahead of this agent's (negative: behind), measured at its last Settings; token expiries are checked against the agent's clock moved by it (0 within 250 ms).",
	})}
	reg.MustRegister(c.gauge)
	return c
}

// Now is the master's clock as this agent knows it.
func (c *masterClock) Now() time.Time { return c.local().Add(time.Duration(c.offset.Load())) }

// observe measures the difference from the master's clock at a Settings;
// one from a master that sends no time changes nothing.
func (c *masterClock) observe(st *masterv1.Settings) {
	mt := st.GetMasterTime()
	if mt == nil {
		return
	}
	if err := mt.CheckValid(); err != nil {
		c.lg.Warn("the master sent a time that is not one; the clock's offset is unchanged", "err", err)
		return
	}
	off := mt.AsTime().Sub(c.local())
	c.gauge.Set(off.Seconds())
	if off.Abs() < clockSlack {
		off = 0
	}
	c.offset.Store(int64(off))
	if off.Abs() >= clockWarn {
		c.lg.Warn("this host's clock differs from the master's; tokens are checked against the master's clock, but fix the host's time (NTP)",
			"master_ahead_by", off.Round(time.Millisecond).String(), "master_id", st.GetMasterId())
	}
}
