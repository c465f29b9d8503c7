// Package source follows the master's change stream and turns it into KV
// events without loss, duplication or silent divergence.
//
// It lists then watches (as Kubernetes informers and etcd watchers do):
// Snapshot gives the readable set at a revision, Watch continues from that
// revision. The source keeps the set it has announced to subscribers,
// (tenant, key, medium) → group, updated by every change it publishes.
// After a disconnect it resumes Watch from the last applied revision with
// the epoch that revision belongs to, skipping anything at or below it, so
// nothing is lost or repeated. When resuming is impossible — the revision
// was compacted, the master restarted or failed over (a new epoch), or the
// stream skipped a revision — it takes a new Snapshot, diffs it against the
// announced set and publishes exactly the difference: removed for what is
// gone, stored for what is new (or changed group).
package source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
)

// Sink receives events: EnqueueAt for the live stream (never blocks),
// EnqueueWaitAt for a resync diff (paced, never drops). pos is the master
// position after the call's events: what a restarted gateway resumes
// from once they are published (statedir.Position).
type Sink interface {
	EnqueueAt(pos statedir.Position, evs ...kvevent.Event)
	EnqueueWaitAt(ctx context.Context, pos statedir.Position, evs ...kvevent.Event) error
}

// LinkSink is a Sink that also takes the spans that recorded the changes
// behind some events (WatchResponse.links, parsed and bounded): the
// publisher links the span of the batch announcing them to those spans.
type LinkSink interface {
	EnqueueLinkedAt(pos statedir.Position, links []trace.SpanContext, evs ...kvevent.Event)
}

// Config tunes the source.
type Config struct {
	// BackoffMin and BackoffMax bound the jittered exponential backoff
	// between reconnects; it resets after a session that received data.
	BackoffMin, BackoffMax time.Duration
	// ResyncChunk is how many diff events one EnqueueWait carries.
	ResyncChunk int
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{BackoffMin: 100 * time.Millisecond, BackoffMax: 5 * time.Second, ResyncChunk: 4096}
}

// Status is the source's position.
type Status struct {
	// Epoch and Revision: the master epoch and the last change applied.
	Epoch, Revision uint64
	// Resyncs counts snapshots taken (the first one included).
	Resyncs uint64
	// Watching: a Watch stream is delivering.
	Watching bool
	// Master is the address of the master followed or tried (NewFollowing;
	// "" for New's single client).
	Master string
	// Announced is the size of the announced set.
	Announced int
}

// Source follows ChangeService. Run owns all mutable state; Status is safe
// from any goroutine.
type Source struct {
	cfg     Config
	client  masterv1.ChangeServiceClient // the current master's; Run replaces it
	masters *Masters                     // nil with New's single client
	pick    *masterlist.Picker
	sink    Sink
	lg      *slog.Logger
	// streak quiets the warnings of a run of failed reconnects (backoff).
	streak retry.Streak

	master atomic.Pointer[string] // pick.Current(), for Status

	epoch, revision, resyncs atomic.Uint64
	announcedN               atomic.Int64
	watching                 atomic.Bool

	// Owned by Run.
	codec     watchCodec
	resp      *masterv1.WatchResponse // reused by every Watch receive
	announced *announced.Set
	rev, ep   uint64
	synced    bool
}

// New builds a source following the one master behind client. It does no
// I/O.
func New(cfg Config, client masterv1.ChangeServiceClient, sink Sink, lg *slog.Logger) *Source {
	s := newSource(cfg, sink, lg, []string{""})
	s.client = client
	return s
}

// NewFollowing builds a source that follows the leader among masters
// (issue 15, HA; masters.go). It does no I/O; the caller closes masters
// after Run returned.
func NewFollowing(cfg Config, masters *Masters, sink Sink, lg *slog.Logger) *Source {
	s := newSource(cfg, sink, lg, masters.List())
	s.masters = masters
	return s
}

func newSource(cfg Config, sink Sink, lg *slog.Logger, list []string) *Source {
	def := DefaultConfig()
	if cfg.BackoffMin <= 0 {
		cfg.BackoffMin = def.BackoffMin
	}
	if cfg.BackoffMax < cfg.BackoffMin {
		cfg.BackoffMax = max(def.BackoffMax, cfg.BackoffMin)
	}
	if cfg.ResyncChunk <= 0 {
		cfg.ResyncChunk = def.ResyncChunk
	}
	s := &Source{cfg: cfg, pick: masterlist.NewPicker(list), sink: sink, lg: lg, codec: newWatchCodec(), resp: &masterv1.WatchResponse{}, announced: announced.New()}
	s.setMaster()
	return s
}

// setMaster publishes pick.Current() for Status.
func (s *Source) setMaster() {
	cur := s.pick.Current()
	s.master.Store(&cur)
}

// Restore starts the source from a restarted gateway's state: the set it
// had published and the master position of its last batch. Run then
// resumes Watch from there (and resyncs, diffing against set, if the
// master cannot serve it). Call it before Run; a zero pos means "take a
// snapshot first", as for a new gateway.
func (s *Source) Restore(set *announced.Set, pos statedir.Position) {
	s.announced, s.ep, s.rev, s.synced = set, pos.Epoch, pos.Revision, pos != statedir.Position{}
	s.epoch.Store(pos.Epoch)
	s.revision.Store(pos.Revision)
	s.announcedN.Store(int64(set.Len()))
}

// Status returns the current position.
func (s *Source) Status() Status {
	return Status{
		Epoch: s.epoch.Load(), Revision: s.revision.Load(), Resyncs: s.resyncs.Load(),
		Watching: s.watching.Load(), Announced: int(s.announcedN.Load()), Master: *s.master.Load(),
	}
}

// errResync marks conditions that only a snapshot can fix.
var errResync = errors.New("source: resync required")

// Run follows the master until ctx ends; it returns nil then.
func (s *Source) Run(ctx context.Context) error {
	for ctx.Err() == nil {
		if err := s.connect(); err != nil {
			if !s.backoff(ctx, err, "master connection failed; trying the next") {
				break
			}
			continue
		}
		justResynced := !s.synced
		if !s.synced {
			if err := s.resync(ctx); err != nil {
				if ctx.Err() != nil || !s.backoff(ctx, err, "snapshot from master failed; retrying") {
					break
				}
				continue
			}
		}
		healthy, err := s.watch(ctx)
		s.watching.Store(false)
		if ctx.Err() != nil {
			break
		}
		if healthy {
			s.pick.Healthy()
			s.streak.Succeed(time.Now())
		}
		if needsResync(err) {
			s.lg.Info("master change stream cannot resume; resyncing from a snapshot",
				"master", s.pick.Current(), "epoch", s.ep, "revision", s.rev, "reason", rpcerr.Reason(err), "err", err)
			s.synced = false
			if justResynced && !healthy && !s.wait(ctx, s.pick.Stay(s.cfg.BackoffMin, s.cfg.BackoffMax)) {
				break // a fresh snapshot did not help: do not spin
			}
			continue
		}
		if !s.backoff(ctx, err, "master change stream ended; reconnecting") {
			break
		}
	}
	return nil
}

// connect points s.client at the current master (NewFollowing).
func (s *Source) connect() error {
	if s.masters == nil {
		return nil
	}
	cc, err := s.masters.Get(s.pick.Current())
	if err != nil {
		return err
	}
	s.client = masterv1.NewChangeServiceClient(cc)
	return nil
}

// backoff moves to the next master after err (the leader it names, or the
// next address) and waits; false when ctx ended.
func (s *Source) backoff(ctx context.Context, err error, msg string) bool {
	from := s.pick.Current()
	d, redirected := s.pick.Next(err, s.cfg.BackoffMin, s.cfg.BackoffMax)
	s.setMaster()
	if redirected {
		s.lg.Info("master is not the leader; following its hint", "master", from, "leader", s.pick.Current())
	} else {
		// Warned of once, then every 10 s while the failures last.
		lvl, n, lasted := s.streak.FailLevel(time.Now())
		if lvl == slog.LevelWarn && rpcerr.Reason(err) == rpcerr.ReasonName(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING) {
			lvl = slog.LevelInfo // a master that just started: expected, and it says how long
		}
		s.lg.Log(ctx, lvl, msg, "master", from, "next", s.pick.Current(), "epoch", s.ep, "revision", s.rev, "err", err,
			"retry_in", d, "failures", n, "failing_for", lasted)
	}
	return s.wait(ctx, d)
}

// wait sleeps d, or until ctx ends (false).
func (s *Source) wait(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func needsResync(err error) bool {
	if errors.Is(err, errResync) {
		return true
	}
	switch rpcerr.Reason(err) {
	case rpcerr.ReasonName(masterv1.ErrorReason_ERROR_REASON_REVISION_COMPACTED),
		rpcerr.ReasonName(masterv1.ErrorReason_ERROR_REASON_EPOCH_MISMATCH),
		// A revision beyond the master's head: the log we followed is not this one.
		rpcerr.ReasonName(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS):
		return true
	}
	return false
}

// watch streams changes from the last applied revision. healthy reports
// whether the stream delivered anything.
func (s *Source) watch(ctx context.Context) (healthy bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := s.client.Watch(ctx, &masterv1.WatchRequest{FromRevision: s.rev, Epoch: s.ep}, grpc.ForceCodecV2(s.codec))
	if err != nil {
		return false, err
	}
	var evs []kvevent.Event
	resp := s.resp
	for {
		// Into the same response every time: watchCodec reuses its
		// changes, which the previous iteration is done with.
		if err := stream.RecvMsg(resp); err != nil {
			if errors.Is(err, io.EOF) {
				err = errors.New("master closed the change stream")
			}
			return healthy, err
		}
		if !healthy {
			healthy = true
			s.watching.Store(true)
			s.lg.Info("watching master changes", "epoch", s.ep, "from_revision", s.rev, "head_revision", resp.GetHeadRevision())
		}
		if resp.GetEpoch() != s.ep {
			return healthy, fmt.Errorf("%w: master epoch changed from %d to %d", errResync, s.ep, resp.GetEpoch())
		}
		evs = evs[:0]
		s.announced.Prefetch(resp.GetChanges())
		for _, ch := range resp.GetChanges() {
			r := ch.GetRevision()
			if r <= s.rev {
				continue // already applied (a resend after a reconnect)
			}
			if r != s.rev+1 {
				s.flush(evs, nil)
				return healthy, fmt.Errorf("%w: change stream jumped from revision %d to %d", errResync, s.rev, r)
			}
			if ev, ok := s.apply(ch); ok {
				evs = append(evs, ev)
			}
			s.rev = r
		}
		s.flush(evs, resp.GetLinks())
	}
}

// flush hands evs to the sink with the response's links (nil with tracing
// off at the master): parsed, at most tracectx.MaxLinks, invalid ones
// dropped.
func (s *Source) flush(evs []kvevent.Event, links []*masterv1.TraceContext) {
	if len(evs) > 0 {
		pos := statedir.Position{Epoch: s.ep, Revision: s.rev}
		if ls, ok := s.sink.(LinkSink); ok && len(links) > 0 {
			ls.EnqueueLinkedAt(pos, tracectx.ParseLinks(links), evs...)
		} else {
			s.sink.EnqueueAt(pos, evs...)
		}
	}
	s.revision.Store(s.rev)
	s.announcedN.Store(int64(s.announced.Len()))
}

// apply folds one change into the announced set and returns its event.
func (s *Source) apply(ch *masterv1.Change) (kvevent.Event, bool) {
	t := ch.GetTenant()
	switch ch.GetType() {
	case masterv1.ChangeType_CHANGE_TYPE_STORED:
		key, med, group := ch.GetKey(), announced.Medium(ch.GetMedium()), ch.GetGroupId()
		s.announced.Store(t, key, med, group)
		return kvevent.Event{Type: kvevent.Stored, Tenant: t, Key: key, Medium: med, GroupID: group}, true
	case masterv1.ChangeType_CHANGE_TYPE_REMOVED:
		key, med := ch.GetKey(), announced.Medium(ch.GetMedium())
		group := s.announced.Remove(t, key, med)
		return kvevent.Event{Type: kvevent.Removed, Tenant: t, Key: key, Medium: med, GroupID: group}, true
	case masterv1.ChangeType_CHANGE_TYPE_CLEARED:
		s.announced.Clear(t)
		return kvevent.Event{Type: kvevent.Cleared, Tenant: t}, true
	default:
		s.lg.Warn("unknown change type skipped", "revision", ch.GetRevision(), "type", int32(ch.GetType()))
		return kvevent.Event{}, false
	}
}

// tracer makes the source's resync spans.
var tracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/gateway/source")

// Attributes of a resync span: the events its difference published.
const (
	attrStored  = attribute.Key("crescent.resync.stored")
	attrRemoved = attribute.Key("crescent.resync.removed")
)

// resync lists the master's readable set and publishes the difference from
// the announced set, in a gateway.resync span of its own (the Snapshot
// call is its child).
func (s *Source) resync(ctx context.Context) (err error) {
	ctx, span := tracer.Start(ctx, "gateway.resync")
	defer func() { tracectx.End(span, err) }()
	sctx, cancel := context.WithCancel(ctx) // ends the snapshot stream early on error
	defer cancel()
	stream, err := s.client.Snapshot(sctx, &masterv1.SnapshotRequest{})
	if err != nil {
		return err
	}
	next := announced.New()
	var rev, epoch uint64
	for page := 0; ; page++ {
		resp, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("snapshot ended before its last page")
			}
			return err
		}
		if page == 0 {
			rev, epoch = resp.GetRevision(), resp.GetEpoch()
		} else if resp.GetRevision() != rev || resp.GetEpoch() != epoch {
			return fmt.Errorf("snapshot page %d at revision %d epoch %d, first page at %d/%d", page, resp.GetRevision(), resp.GetEpoch(), rev, epoch)
		}
		for _, e := range resp.GetEntries() {
			next.Store(e.GetTenant(), e.GetKey(), announced.Medium(e.GetMedium()), e.GetGroupId())
		}
		if resp.GetLast() {
			break
		}
	}
	cancel()
	diff := announced.Diff(s.announced, next)
	all := diff
	// Every chunk but the last carries the position from before the
	// resync: a gateway that stops in the middle of a diff resumes from
	// there, fails to Watch, and diffs again, instead of skipping the
	// rest. The last call (empty when nothing differs) moves it on.
	prev, at := statedir.Position{Epoch: s.ep, Revision: s.rev}, statedir.Position{Epoch: epoch, Revision: rev}
	for len(diff) > s.cfg.ResyncChunk {
		if err := s.sink.EnqueueWaitAt(ctx, prev, diff[:s.cfg.ResyncChunk]...); err != nil {
			return err
		}
		diff = diff[s.cfg.ResyncChunk:]
	}
	if err := s.sink.EnqueueWaitAt(ctx, at, diff...); err != nil {
		return err
	}
	removed := 0
	for _, ev := range all {
		if ev.Type == kvevent.Removed {
			removed++
		}
	}
	s.lg.Info("resynced from master snapshot", "epoch", epoch, "revision", rev, "entries", next.Len(),
		"stored", len(all)-removed, "removed", removed, "previous_epoch", s.ep, "previous_revision", s.rev)
	if span.IsRecording() {
		span.SetAttributes(tracectx.Items.Int(next.Len()), attrStored.Int(len(all)-removed), attrRemoved.Int(removed))
	}
	s.announced, s.rev, s.ep, s.synced = next, rev, epoch, true
	s.epoch.Store(epoch)
	s.revision.Store(rev)
	s.resyncs.Add(1)
	s.announcedN.Store(int64(next.Len()))
	return nil
}
