// Package gateway wires crescent-gateway: the master change source, the
// KV event publisher (PUB + replay ROUTER), and the status on the admin
// HTTP port and the gRPC port (internal/server).
package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/gateway/publisher"
	"github.com/crescent-kv/crescent/internal/gateway/snapshot"
	"github.com/crescent-kv/crescent/internal/gateway/source"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/gateway/status"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Deps are optional collaborators; zero values are built from Config.
type Deps struct {
	// Change is the master's ChangeService; nil dials Config.Master.
	Change masterv1.ChangeServiceClient
	// Registry receives the metrics; nil creates one (obs.NewRegistry).
	Registry *prometheus.Registry
}

// Gateway is one crescent-gateway process.
type Gateway struct {
	cfg     Config
	lg      *slog.Logger
	pub     *publisher.Publisher
	src     *source.Source
	rec     *snapshot.Recorder // nil with neither a state dir nor a snapshot endpoint
	status  *status.Service
	srv     *server.Server
	masters *source.Masters // nil when Deps.Change was given

	// The persisted state (nil without --state-dir) and how it started.
	state   *statedir.Dir
	journal *statedir.Journal
	mode    string
	modeErr error

	closeOnce sync.Once
}

// masterWindow is the HTTP/2 flow-control window of the master connection
// (stream and connection). The change stream is one long one-way stream:
// with gRPC's dynamic window (64 KiB, grown by BDP pings) the gateway sent
// a WINDOW_UPDATE for every 16 KiB or so it read, and BDP pings besides,
// each a write and a wake-up of the transport's writer (about 7% of its CPU
// following the master live); with a static 1 MiB it sends one per 256
// KiB. At most this much of the stream is buffered unread.
const masterWindow = 1 << 20

// New builds the gateway. With a state directory it locks it and reads
// the persisted state (docs/gateway-state.md); it binds nothing and does
// not dial (grpc.NewClient connects lazily).
func New(cfg Config, deps Deps, lg *slog.Logger) (*Gateway, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, lg: lg, mode: stateOff}
	if err := g.build(deps); err != nil {
		g.Close()
		return nil, err
	}
	return g, nil
}

func (g *Gateway) build(deps Deps) error {
	cfg, lg := g.cfg, g.lg
	creds, err := cfg.Security.Load(lg)
	if err != nil {
		return err
	}
	if cfg.MasterCreds == nil && creds.Secure() {
		// mTLS with the gateway's certificate; the server must be a master.
		cfg.MasterCreds = creds.Client(auth.RoleMaster)
	}
	change := deps.Change
	if change == nil {
		creds := cfg.MasterCreds
		if creds == nil {
			creds = insecure.NewCredentials()
		}
		addrs, err := source.SplitMasters(cfg.Master)
		if err != nil {
			return err
		}
		// One connection per master address (issue 15, HA): the source
		// follows the leader among them.
		if g.masters, err = source.NewMasters(addrs, grpc.WithTransportCredentials(creds), rpccodec.DialOption(),
			grpc.WithStaticStreamWindowSize(masterWindow), grpc.WithStaticConnWindowSize(masterWindow)); err != nil {
			return err
		}
	}

	pcfg := cfg.publisherConfig()
	st := persisted{mode: stateOff, header: statedir.Header{PublisherEpoch: statedir.NewEpoch()}}
	if cfg.StateDir != "" {
		opts := statedir.DefaultOptions()
		opts.SyncInterval = cfg.StateSyncInterval
		opts.KeepSeqs = uint64(max(cfg.ReplayBuffer, 1))
		d, err := statedir.Open(cfg.StateDir, opts, lg.With("part", "state"))
		if err != nil {
			return err
		}
		g.state = d
		if st, err = loadState(d, cfg.ReplayBuffer, int(cfg.ReplayBufferBytes), lg.With("part", "state")); err != nil {
			return err
		}
		if g.journal, err = d.OpenJournal(st.header.PublisherEpoch); err != nil {
			return err
		}
		pcfg.StartSeq, pcfg.StartEventID = st.header.Seq, st.header.LastEventID
		if st.mode == stateRestored {
			// Hold until as many subscribers as the last checkpoint saw
			// are back (none: no hold). The checkpoint a new epoch starts
			// with was written before anyone could subscribe and cannot
			// tell: hold the whole --resume-hold rather than publish to
			// no one.
			pcfg.ResumeSubscribers = st.header.Subscribers
			if !st.subscribersKnown {
				pcfg.ResumeSubscribers = math.MaxInt
			}
		}
	}
	g.mode, g.modeErr = st.mode, st.reason
	pcfg.Epoch = st.header.PublisherEpoch
	pub, err := publisher.New(pcfg, lg.With("part", "publisher"))
	if err != nil {
		return err
	}
	g.pub = pub
	scfg := source.Config{BackoffMin: cfg.ReconnectMin, BackoffMax: cfg.ReconnectMax}
	if g.masters != nil {
		g.src = source.NewFollowing(scfg, g.masters, pub, lg.With("part", "source"))
	} else {
		g.src = source.New(scfg, change, pub, lg.With("part", "source"))
	}

	if g.state != nil || cfg.Snapshot != "" {
		rcfg := cfg.recorderConfig()
		rcfg.Epoch = pcfg.Epoch
		deps := snapshot.Deps{Subscribers: func() int { return pub.Stats().Subscribers }}
		if g.state != nil {
			deps.Checkpointer = g.state
		}
		if g.rec, err = snapshot.New(rcfg, deps, lg.With("part", "recorder")); err != nil {
			return err
		}
		pub.SetRecorder(g.rec)
		if cfg.Snapshot != "" {
			pub.SetSnapshotSource(g.rec)
		}
	}
	if g.journal != nil {
		pub.SetJournal(g.journal)
	}
	if st.mode == stateRestored {
		h := st.header
		g.rec.Restore(h.PublisherEpoch, h.Seq, h.Master, h.LastEventID, st.pubSet)
		if err := pub.RestoreRing(st.ring); err != nil {
			return err
		}
		g.src.Restore(st.srcSet, h.Master)
	}

	g.status = status.New(status.Sources{Pub: pub.Stats, Src: g.src.Status, Recorder: g.recorderStats, State: g.stateStatus})
	reg := deps.Registry
	if reg == nil {
		reg = obs.NewRegistry()
	}
	if err := g.status.Register(reg); err != nil {
		return err
	}
	g.srv = server.New(server.Config{
		GRPCAddr: cfg.GRPCAddr, AdminAddr: cfg.AdminAddr, ShutdownTimeout: cfg.ShutdownTimeout,
		Credentials: creds, Table: authTable(),
	}, lg, reg)
	gatewayv1.RegisterGatewayServiceServer(g.srv.GRPC, g.status) // authServices
	g.srv.Mux.Handle("GET /kv_events/status", g.srv.Protect(g.status, statusRoles...))
	g.srv.SetReadiness(func() error {
		st := g.status.Snapshot()
		switch {
		case !st.Enabled:
			return errors.New("publisher not running")
		case st.MasterEpoch == 0:
			return errors.New("no snapshot from the master yet (and no restored position)")
		}
		return nil
	})
	return nil
}

// recorderStats reads the recorder's counters (zero without one).
func (g *Gateway) recorderStats() snapshot.Stats {
	if g.rec == nil {
		return snapshot.Stats{}
	}
	return g.rec.Stats()
}

// stateStatus reports how the persisted state started and its last error.
func (g *Gateway) stateStatus() (mode string, errText string) {
	if g.modeErr != nil {
		errText = g.modeErr.Error()
	}
	return g.mode, errText
}

// Listen binds every socket, so callers learn the addresses before Run.
func (g *Gateway) Listen() error {
	if err := g.pub.Listen(); err != nil {
		return err
	}
	return g.srv.Listen()
}

// PubEndpoint is the dialable PUB endpoint (after Listen).
func (g *Gateway) PubEndpoint() string { return g.pub.PubEndpoint() }

// ReplayEndpoint is the dialable replay endpoint (after Listen; "" if disabled).
func (g *Gateway) ReplayEndpoint() string { return g.pub.ReplayEndpoint() }

// SnapshotEndpoint is the dialable snapshot endpoint (after Listen; "" if disabled).
func (g *Gateway) SnapshotEndpoint() string { return g.pub.SnapshotEndpoint() }

// AdminAddr and GRPCAddr are the bound addresses (after Listen).
func (g *Gateway) AdminAddr() string { return g.srv.AdminAddr() }

// GRPCAddr is the bound gRPC address (after Listen).
func (g *Gateway) GRPCAddr() string { return g.srv.GRPCAddr() }

// Status returns the current counters.
func (g *Gateway) Status() status.Status { return g.status.Snapshot() }

// Run serves until ctx ends or a part fails; it then stops every part (the
// publisher publishes what it has queued) and returns the first failure.
func (g *Gateway) Run(ctx context.Context) error {
	if err := g.Listen(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	part := func(name string, run func(context.Context) error) {
		wg.Go(func() {
			err := run(ctx)
			if err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = fmt.Errorf("%s: %w", name, err)
				}
				mu.Unlock()
			}
			cancel() // one part ending stops the others
		})
	}
	// The recorder outlives the publisher, so its final checkpoint holds
	// every batch published; the journal is closed (fsynced) last.
	recCtx, stopRec := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRec()
	var recDone chan struct{}
	if g.rec != nil {
		recDone = make(chan struct{})
		go func() {
			defer close(recDone)
			if err := g.rec.Run(recCtx); err != nil {
				g.lg.Error("snapshot recorder stopped", "err", err)
			}
		}()
	}
	part("publisher", func(ctx context.Context) error {
		err := g.pub.Run(ctx)
		stopRec()
		return err
	})
	part("source", g.src.Run)
	part("server", g.srv.Run)
	if g.journal != nil && g.cfg.StateSyncInterval > 0 {
		// Append fsyncs only when it runs; an idle publisher's last
		// batches are fsynced here.
		part("journal sync", func(ctx context.Context) error {
			syncJournal(ctx, g.journal.Sync, g.cfg.StateSyncInterval, g.lg)
			return nil
		})
	}
	g.lg.Info("gateway running", "master", g.cfg.Master, "pub", g.PubEndpoint(), "replay", g.ReplayEndpoint(),
		"grpc", g.GRPCAddr(), "admin", g.AdminAddr(), "backend_id", g.cfg.BackendID)
	wg.Wait()
	stopRec()
	if recDone != nil {
		<-recDone
	}
	g.Close()
	return firstErr
}

// syncJournal calls sync every interval until ctx ends. A failed journal
// (a full or failing --state-dir) only costs the next start its state: the
// gateway goes on publishing, so after the first failure this logs it and
// waits for ctx. It must not return before: Run stops every part when one
// returns, and a full state directory stopped the whole gateway, quietly
// (exit status 0, "stopped").
func syncJournal(ctx context.Context, sync func() error, interval time.Duration, lg *slog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := sync(); err != nil {
				lg.Error("journal fsync failed; publishing without it, and the state will be reset at the next start", "err", err)
				<-ctx.Done()
				return
			}
		}
	}
}

// Close releases what New and Listen acquired. Idempotent.
func (g *Gateway) Close() error {
	g.closeOnce.Do(func() {
		if g.pub != nil {
			g.pub.Close()
		}
		if g.masters != nil {
			_ = g.masters.Close()
		}
		if g.journal != nil {
			if err := g.journal.Close(); err != nil {
				g.lg.Error("journal close failed", "err", err)
			}
		}
		if g.state != nil {
			_ = g.state.Close()
		}
	})
	return nil
}
