// Package changesvc adapts crescent.master.v1.ChangeService to the change
// log and snapshots of the object metadata. Each stream has exactly one
// sending goroutine (the handler); a watcher buffers at most one response
// worth of records and reads the rest straight from the log, so a slow
// watcher costs nothing until it falls out of the retained window, where it
// gets REVISION_COMPACTED and must resync.
package changesvc

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
)

// Config tunes the adapter.
type Config struct {
	// MaxChangesPerResponse bounds one WatchResponse (default 1024).
	MaxChangesPerResponse int
	// SnapshotPageSize bounds one SnapshotResponse (default 1000).
	SnapshotPageSize int
	// MaxSnapshots bounds the Snapshot streams served at once (default
	// DefaultMaxSnapshots): each holds a copy of the readable set until its
	// client has read it, so more fail with RESOURCE_EXHAUSTED /
	// LIMIT_EXCEEDED instead of multiplying that memory.
	MaxSnapshots int
}

// DefaultMaxSnapshots is Config.MaxSnapshots's default: a gateway or two,
// each resyncing, and room for an operator's tool.
const DefaultMaxSnapshots = 4

// Source is what the service reads: the metadata store.
type Source interface {
	Log() *changelog.Log
	Snapshot(ctx context.Context, tenant string) (uint64, []meta.SnapshotEntry, error)
}

// Service implements masterv1.ChangeServiceServer.
type Service struct {
	masterv1.UnimplementedChangeServiceServer
	src Source
	cfg Config
	// snapshots holds one token per Snapshot stream in progress.
	snapshots chan struct{}
	// stopping ends every Watch (Close): they never end on their own, so
	// a graceful server stop would wait them out to its hard-stop timer.
	stopping context.Context
	stop     context.CancelFunc
}

// New returns the adapter. It does no I/O.
func New(cfg Config, src Source) *Service {
	if cfg.MaxChangesPerResponse <= 0 {
		cfg.MaxChangesPerResponse = 1024
	}
	if cfg.SnapshotPageSize <= 0 {
		cfg.SnapshotPageSize = 1000
	}
	if cfg.MaxSnapshots <= 0 {
		cfg.MaxSnapshots = DefaultMaxSnapshots
	}
	s := &Service{src: src, cfg: cfg, snapshots: make(chan struct{}, cfg.MaxSnapshots)}
	s.stopping, s.stop = context.WithCancel(context.Background())
	return s
}

// Close ends every Watch stream with UNAVAILABLE / MASTER_SHUTTING_DOWN
// (a gateway reconnects, to this master's successor) and refuses new
// ones. Call it before stopping the gRPC server.
func (s *Service) Close() { s.stop() }

func errShuttingDown() error {
	return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_SHUTTING_DOWN, "master is shutting down"))
}

// Register registers the service on a gRPC server.
func (s *Service) Register(r grpc.ServiceRegistrar) { masterv1.RegisterChangeServiceServer(r, s) }

// Watch implements ChangeService.Watch.
func (s *Service) Watch(req *masterv1.WatchRequest, stream grpc.ServerStreamingServer[masterv1.WatchResponse]) error {
	l := s.src.Log()
	if e := req.GetEpoch(); e != 0 && e != l.Epoch() {
		return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_EPOCH_MISMATCH,
			"epoch %d is not the master's current epoch %d: resync with Snapshot", e, l.Epoch()))
	}
	if s.stopping.Err() != nil {
		return errShuttingDown()
	}
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	defer context.AfterFunc(s.stopping, cancel)()
	from := req.GetFromRevision()
	var buf []changelog.Record
	var links []trace.SpanContext
	for {
		recs, head, compact, err := l.Read(from, s.cfg.MaxChangesPerResponse, buf[:0])
		if err != nil {
			return rpcerr.Status(err)
		}
		buf = recs
		if len(recs) == 0 {
			if err := l.Wait(ctx, from); err != nil {
				if s.stopping.Err() != nil {
					return errShuttingDown()
				}
				return rpcerr.Status(err)
			}
			continue
		}
		resp := &masterv1.WatchResponse{
			Changes:         make([]*masterv1.Change, len(recs)),
			Epoch:           l.Epoch(),
			HeadRevision:    head,
			CompactRevision: compact,
		}
		// One allocation for the response's changes, not one per change:
		// under a put load this loop ran once per stored object.
		arena := make([]masterv1.Change, len(recs))
		for i, r := range recs {
			r.Fill(&arena[i])
			resp.Changes[i] = &arena[i]
		}
		// The sampled spans that recorded these changes (none with
		// tracing off): the gateway's publish span links to them.
		links = l.Links(from, recs[len(recs)-1].Revision, tracectx.MaxLinks, links[:0])
		for _, sc := range links {
			if tc := tracectx.CommandOf(sc); tc != nil {
				resp.Links = append(resp.Links, tc)
			}
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
		from = recs[len(recs)-1].Revision
	}
}

// Snapshot implements ChangeService.Snapshot: at most MaxSnapshots at once,
// each sending pages of SnapshotPageSize entries.
func (s *Service) Snapshot(req *masterv1.SnapshotRequest, stream grpc.ServerStreamingServer[masterv1.SnapshotResponse]) error {
	select {
	case s.snapshots <- struct{}{}:
		defer func() { <-s.snapshots }()
	default:
		return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED,
			"%d snapshots already in progress (max %d); retry later", s.cfg.MaxSnapshots, s.cfg.MaxSnapshots))
	}
	ctx := stream.Context()
	rev, entries, err := s.src.Snapshot(ctx, req.GetTenant())
	if err != nil {
		return rpcerr.Status(err)
	}
	epoch := s.src.Log().Epoch()
	for start := 0; ; start += s.cfg.SnapshotPageSize {
		end := min(start+s.cfg.SnapshotPageSize, len(entries))
		page := &masterv1.SnapshotResponse{Revision: rev, Epoch: epoch, Last: end == len(entries)}
		page.Entries = make([]*masterv1.SnapshotEntry, 0, end-start)
		for _, e := range entries[start:end] {
			page.Entries = append(page.Entries, &masterv1.SnapshotEntry{Tenant: e.Tenant, Key: e.Key, Medium: e.Medium, GroupId: e.Group})
		}
		if err := stream.Send(page); err != nil {
			return err
		}
		if page.Last {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return rpcerr.Status(err)
		}
	}
}
