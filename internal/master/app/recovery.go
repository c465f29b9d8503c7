package app

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
)

// recovery gates ChangeService and ObjectService while a restarted master
// rebuilds its object map from agent registrations (a get would otherwise
// answer OBJECT_NOT_FOUND for an object whose agent is not back yet). It
// ends at the first moment, at least grace
// after Run started (or at once, for an elected leader that knows its
// agents: expect and exact), when no agent is registering (waiting for its
// Register, receiving or reconciling its table), or when max has passed:
// a gateway that resynced against a partly rebuilt master would publish
// `removed` for every object still to come back. A grace of 0 disables it.
type recovery struct {
	grace, max  time.Duration
	registering func() int
	// expect, if set before Run, counts agents recovery still waits for
	// (an elected leader's: the agents earlier leaders knew); exact says
	// that list holds every agent that may hold an object, so the grace
	// is not waited out once they are all back.
	expect     func() int
	exact      bool
	lg         *slog.Logger
	seconds    prometheus.Gauge
	recovering prometheus.Gauge

	// over mirrors ended for check's lock-free fast path: the ObjectService
	// gate of an elected leader asks on every call.
	over atomic.Bool
	// mu guards began, ended, took and span.
	mu    sync.Mutex
	began time.Time // zero before Run
	ended bool
	took  time.Duration
	// span is the recovery's master.rebuild span (a trace of its own),
	// from start until the recovery ends; nil when there is none.
	span trace.Span
}

// rebuildTracer makes the recovery's span.
var rebuildTracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/master/app")

func newRecovery(grace, max time.Duration, registering func() int, reg prometheus.Registerer, lg *slog.Logger) (*recovery, error) {
	r := &recovery{
		grace: grace, max: max, registering: registering, lg: lg,
		seconds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "crescent_master_recovery_seconds",
			Help: "Time from the master's start until its recovery ended: every agent that registered in the recovery grace finished registering (its allocation table rebuilt into the metadata), or recovery-max passed.",
		}),
		recovering: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "crescent_master_recovering",
			Help: "1 while the master is recovering after its start (ChangeService answers MASTER_RECOVERING), else 0.",
		}),
	}
	for _, c := range []prometheus.Collector{r.seconds, r.recovering} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// start marks Run's start.
func (r *recovery) start(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.began, r.ended = now, r.grace == 0
	r.over.Store(r.ended)
	if !r.ended {
		r.recovering.Set(1)
		_, r.span = rebuildTracer.Start(context.Background(), "master.rebuild", trace.WithTimestamp(now))
	}
}

// endSpanLocked ends the recovery's span at end: outcome "recovered",
// "recovery_max" (agents still registering) or "stopped".
func (r *recovery) endSpanLocked(outcome string, registering int, end time.Time) {
	if r.span == nil {
		return
	}
	if r.span.IsRecording() {
		r.span.SetAttributes(attrRecovery.String(outcome), attrRegistering.Int(registering))
	}
	r.span.End(trace.WithTimestamp(end))
	r.span = nil
}

// Attributes of the master.rebuild span.
const (
	attrRecovery    = attribute.Key("crescent.recovery.outcome")
	attrRegistering = attribute.Key("crescent.recovery.registering")
)

// check reports whether the master is still recovering at now and, if it
// is, how long the caller should wait before it asks again. It ends the
// recovery when its condition holds.
func (r *recovery) check(now time.Time) (recovering bool, retry time.Duration, registering int) {
	if r.over.Load() {
		return false, 0, 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ended {
		return false, 0, 0
	}
	if r.began.IsZero() {
		return true, r.grace, 0
	}
	since := now.Sub(r.began)
	if since < r.grace && !r.exact {
		return true, r.grace - since, r.registering()
	}
	n := r.registering()
	if r.expect != nil {
		n += r.expect()
	}
	if n > 0 && since < r.max {
		return true, 500 * time.Millisecond, n
	}
	r.ended, r.took = true, since
	r.over.Store(true)
	r.recovering.Set(0)
	r.seconds.Set(since.Seconds())
	if n > 0 {
		r.lg.Warn("master recovery ended at recovery-max with agents still registering", "took", since, "registering", n)
		r.endSpanLocked("recovery_max", n, now)
	} else {
		r.lg.Info("master recovered: every registering agent finished", "took", since)
		r.endSpanLocked("recovered", 0, now)
	}
	return false, 0, 0
}

// run ends the recovery as soon as its condition holds, so the metric and
// the log do not wait for a gateway to ask.
func (r *recovery) run(ctx context.Context) error {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		if rec, _, _ := r.check(time.Now()); !rec {
			return nil
		}
		select {
		case <-ctx.Done():
			r.mu.Lock()
			r.endSpanLocked("stopped", r.registering(), time.Now())
			r.mu.Unlock()
			return nil
		case <-t.C:
		}
	}
}

// unaryInterceptor answers ObjectService MASTER_RECOVERING while the
// master rebuilds its objects from the agents' registrations (after a
// restart, or once elected): before they are back a get would answer
// OBJECT_NOT_FOUND for an object that exists, and a put could place a
// second copy of a key an agent still holds. Clients retry
// MASTER_RECOVERING.
func (r *recovery) unaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if strings.HasPrefix(info.FullMethod, "/"+masterv1.ObjectService_ServiceDesc.ServiceName+"/") {
		if rec, retry, n := r.check(time.Now()); rec {
			return nil, rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING,
				"master started moments ago; agents are re-registering (%d registering, retry in %v)", n, retry.Round(time.Millisecond)))
		}
	}
	return h(ctx, req)
}

func (r *recovery) streamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if strings.HasPrefix(info.FullMethod, "/"+masterv1.ChangeService_ServiceDesc.ServiceName+"/") {
		if rec, retry, n := r.check(time.Now()); rec {
			return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING,
				"master started moments ago; agents are re-registering (%d registering, retry in %v)", n, retry.Round(time.Millisecond)))
		}
	}
	return handler(srv, ss)
}

// Recovered reports whether the recovery after start has ended and how long
// it took (crescent_master_recovery_seconds).
func (m *Master) Recovered() (time.Duration, bool) {
	m.rec.mu.Lock()
	defer m.rec.mu.Unlock()
	if !m.rec.ended || m.rec.began.IsZero() {
		return 0, false
	}
	return m.rec.took, true
}
