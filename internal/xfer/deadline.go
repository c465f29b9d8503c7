package xfer

import (
	"context"
	"net"
	"sync/atomic"
	"time"
)

// Deadlines moves a connection's deadline a step at a time within one call,
// for the bulk transfer client and the shared-memory client alike: each
// step gets the stall bound from its start, or the call's deadline when
// that is sooner (alone when the bound is not positive), and once the
// call's context has ended its past deadline stays. Only the goroutine
// making the call uses it, but for the context's end.
type Deadlines struct {
	nc    net.Conn
	limit time.Time // the call's deadline; zero: none
	stall time.Duration
	// interrupted is set when the call's context ends, before the past
	// deadline that unblocks the connection: Step sees one or the other.
	interrupted atomic.Bool
}

// Begin starts a call on nc under ctx with the stall bound and arranges for
// ctx's end to unblock nc; it sets no deadline (Step does). stop is
// context.AfterFunc's: false once the context has ended.
func (d *Deadlines) Begin(ctx context.Context, nc net.Conn, stall time.Duration) (stop func() bool) {
	d.nc, d.stall = nc, stall
	d.limit, _ = ctx.Deadline()
	d.interrupted.Store(false)
	return context.AfterFunc(ctx, func() {
		d.interrupted.Store(true)
		_ = nc.SetDeadline(aLongTimeAgo)
	})
}

// Step sets the deadline of the call's next step.
func (d *Deadlines) Step() {
	t := d.limit
	if d.stall > 0 {
		if s := time.Now().Add(d.stall); t.IsZero() || s.Before(t) {
			t = s
		}
	}
	_ = d.nc.SetDeadline(t)
	if d.interrupted.Load() {
		_ = d.nc.SetDeadline(aLongTimeAgo)
	}
}
