// Package gateway wires crescent-gateway: the master change source, the
// KV event publisher (PUB + replay ROUTER), and the status on the admin
// HTTP port and the gRPC port (internal/server).
package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/gateway/publisher"
	"github.com/crescent-kv/crescent/internal/gateway/source"
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
	cfg    Config
	lg     *slog.Logger
	pub    *publisher.Publisher
	src    *source.Source
	status *status.Service
	srv    *server.Server
	cc     *grpc.ClientConn // nil when Deps.Change was given

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

// New builds the gateway. It does no I/O (grpc.NewClient connects lazily).
func New(cfg Config, deps Deps, lg *slog.Logger) (*Gateway, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, lg: lg}
	change := deps.Change
	if change == nil {
		cc, err := grpc.NewClient(cfg.Master, grpc.WithTransportCredentials(insecure.NewCredentials()), rpccodec.DialOption(),
			grpc.WithStaticStreamWindowSize(masterWindow), grpc.WithStaticConnWindowSize(masterWindow))
		if err != nil {
			return nil, fmt.Errorf("master %s: %w", cfg.Master, err)
		}
		g.cc = cc
		change = masterv1.NewChangeServiceClient(cc)
	}
	pub, err := publisher.New(cfg.publisherConfig(), lg.With("part", "publisher"))
	if err != nil {
		g.Close()
		return nil, err
	}
	g.pub = pub
	g.src = source.New(source.Config{BackoffMin: cfg.ReconnectMin, BackoffMax: cfg.ReconnectMax}, change, pub, lg.With("part", "source"))
	g.status = status.New(pub.Stats, g.src.Status)
	reg := deps.Registry
	if reg == nil {
		reg = obs.NewRegistry()
	}
	if err := g.status.Register(reg); err != nil {
		g.Close()
		return nil, err
	}
	g.srv = server.New(server.Config{GRPCAddr: cfg.GRPCAddr, AdminAddr: cfg.AdminAddr, ShutdownTimeout: cfg.ShutdownTimeout}, lg, reg)
	gatewayv1.RegisterGatewayServiceServer(g.srv.GRPC, g.status)
	g.srv.Mux.Handle("GET /kv_events/status", g.status)
	g.srv.SetReadiness(func() error {
		st := g.status.Snapshot()
		switch {
		case !st.Enabled:
			return errors.New("publisher not running")
		case st.Resyncs == 0:
			return errors.New("no snapshot from the master yet")
		}
		return nil
	})
	return g, nil
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
	part("publisher", g.pub.Run)
	part("source", g.src.Run)
	part("server", g.srv.Run)
	g.lg.Info("gateway running", "master", g.cfg.Master, "pub", g.PubEndpoint(), "replay", g.ReplayEndpoint(),
		"grpc", g.GRPCAddr(), "admin", g.AdminAddr(), "backend_id", g.cfg.BackendID)
	wg.Wait()
	g.Close()
	return firstErr
}

// Close releases what New and Listen acquired. Idempotent.
func (g *Gateway) Close() error {
	g.closeOnce.Do(func() {
		if g.pub != nil {
			g.pub.Close()
		}
		if g.cc != nil {
			g.cc.Close()
		}
	})
	return nil
}
