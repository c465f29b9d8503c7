// Package server is the gRPC and admin-HTTP bootstrap every Crescent process
// shares: a grpc.Server with health, reflection (so bare grpcurl works),
// recovery, slog logging and Prometheus interceptors, and an admin mux with
// /healthz, /readyz and /metrics. New starts nothing; Run serves until its
// context ends, then stops gracefully with a hard-stop timeout (open bidi
// streams would otherwise block GracefulStop forever).
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/rpccodec"
	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
)

// MaxMessageBytes is the default gRPC message limit in both directions: large
// enough for 64 MiB data-plane chunks and big batch responses.
const MaxMessageBytes = 256 << 20

// MaxConcurrentStreams caps the calls one client connection may have open at
// once (grpc-go's default is unlimited: every stream a peer opens is a
// goroutine and buffers). Calls past it wait in the client for a free slot;
// nothing Crescent runs needs more than a few dozen per connection.
const MaxConcurrentStreams = 1024

// Config is the listening side of a process.
type Config struct {
	// GRPCAddr is host:port for gRPC; empty disables the gRPC server.
	GRPCAddr string
	// AdminAddr is host:port for admin HTTP; empty disables it.
	AdminAddr string
	// ShutdownTimeout bounds graceful shutdown before a hard stop.
	ShutdownTimeout time.Duration
}

// Server is a gRPC server plus an admin HTTP server.
type Server struct {
	cfg Config
	lg  *slog.Logger

	// GRPC is the server to register services on before Run.
	GRPC *grpc.Server
	// Health is the gRPC health service; Run marks it SERVING.
	Health *health.Server
	// Mux is the admin mux; add handlers before Run.
	Mux *http.ServeMux
	// Registry holds the process's metrics.
	Registry *prometheus.Registry

	metrics *grpcprom.ServerMetrics
	ready   atomic.Pointer[func() error]

	mu        sync.Mutex // guards grpcLis, adminLis
	grpcLis   net.Listener
	adminLis  net.Listener
	closeOnce sync.Once
}

// New builds the servers. It does no I/O.
func New(cfg Config, lg *slog.Logger, reg *prometheus.Registry, opts ...grpc.ServerOption) *Server {
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 10 * time.Second
	}
	metrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets([]float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5}),
	))
	reg.MustRegister(metrics)
	logOpts := []logging.Option{
		logging.WithLogOnEvents(logging.FinishCall),
		logging.WithLevels(func(c codes.Code) logging.Level {
			switch c {
			case codes.OK, codes.NotFound, codes.AlreadyExists, codes.Canceled, codes.FailedPrecondition, codes.InvalidArgument, codes.OutOfRange:
				return logging.LevelDebug
			case codes.Internal, codes.Unknown, codes.DataLoss:
				return logging.LevelError
			default:
				return logging.LevelWarn
			}
		}),
	}
	recoverOpt := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		lg.ErrorContext(ctx, "panic in grpc handler", "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
		return status.Errorf(codes.Internal, "internal error")
	})
	base := []grpc.ServerOption{
		rpccodec.ServerOption(),
		grpc.MaxRecvMsgSize(MaxMessageBytes),
		grpc.MaxSendMsgSize(MaxMessageBytes),
		grpc.MaxConcurrentStreams(MaxConcurrentStreams),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.ChainUnaryInterceptor(
			metrics.UnaryServerInterceptor(),
			logging.UnaryServerInterceptor(slogAdapter(lg), logOpts...),
			recovery.UnaryServerInterceptor(recoverOpt),
		),
		grpc.ChainStreamInterceptor(
			metrics.StreamServerInterceptor(),
			logging.StreamServerInterceptor(slogAdapter(lg), logOpts...),
			recovery.StreamServerInterceptor(recoverOpt),
		),
	}
	gs := grpc.NewServer(append(base, opts...)...)
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	healthpb.RegisterHealthServer(gs, hs)
	reflection.Register(gs)

	s := &Server{cfg: cfg, lg: lg, GRPC: gs, Health: hs, Mux: http.NewServeMux(), Registry: reg, metrics: metrics}
	s.Mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	s.Mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := s.readyErr(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	s.Mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	// Profiling for operators (the admin port is not for the public).
	s.Mux.HandleFunc("/debug/pprof/", pprof.Index)
	s.Mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	s.Mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	s.Mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	s.Mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return s
}

func slogAdapter(l *slog.Logger) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		l.Log(ctx, slog.Level(lvl), msg, fields...)
	})
}

// SetReadiness installs the check behind /readyz (nil error = ready).
func (s *Server) SetReadiness(check func() error) { s.ready.Store(&check) }

func (s *Server) readyErr() error {
	if f := s.ready.Load(); f != nil {
		return (*f)()
	}
	return nil
}

// Listen opens the configured listeners so callers (and tests using port 0)
// learn the real addresses before Run.
func (s *Server) Listen() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cfg.GRPCAddr != "" && s.grpcLis == nil {
		l, err := net.Listen("tcp", s.cfg.GRPCAddr)
		if err != nil {
			return fmt.Errorf("grpc listen %s: %w", s.cfg.GRPCAddr, err)
		}
		s.grpcLis = l
	}
	if s.cfg.AdminAddr != "" && s.adminLis == nil {
		l, err := net.Listen("tcp", s.cfg.AdminAddr)
		if err != nil {
			return fmt.Errorf("admin listen %s: %w", s.cfg.AdminAddr, err)
		}
		s.adminLis = l
	}
	return nil
}

// GRPCAddr is the bound gRPC address (after Listen), or "".
func (s *Server) GRPCAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.grpcLis == nil {
		return ""
	}
	return s.grpcLis.Addr().String()
}

// AdminAddr is the bound admin address (after Listen), or "".
func (s *Server) AdminAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.adminLis == nil {
		return ""
	}
	return s.adminLis.Addr().String()
}

// Run listens (if Listen was not called), serves until ctx ends or a server
// fails, then shuts down: health NOT_SERVING, GracefulStop, hard Stop after
// ShutdownTimeout. It returns nil on a clean, context-driven shutdown.
func (s *Server) Run(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	s.metrics.InitializeMetrics(s.GRPC)
	s.mu.Lock()
	gl, al := s.grpcLis, s.adminLis
	s.mu.Unlock()

	errc := make(chan error, 2)
	var hs *http.Server
	if al != nil {
		hs = &http.Server{Handler: s.Mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := hs.Serve(al); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("admin http: %w", err)
			}
		}()
		s.lg.Info("admin http listening", "addr", al.Addr().String())
	}
	grpcDone := make(chan struct{})
	if gl != nil {
		s.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		go func() {
			defer close(grpcDone)
			if err := s.GRPC.Serve(gl); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
				errc <- fmt.Errorf("grpc: %w", err)
			}
		}()
		s.lg.Info("grpc listening", "addr", gl.Addr().String())
	} else {
		close(grpcDone)
	}

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	}
	s.shutdown(hs, grpcDone)
	return runErr
}

func (s *Server) shutdown(hs *http.Server, grpcDone <-chan struct{}) {
	s.closeOnce.Do(func() {
		s.Health.Shutdown()
		stopped := make(chan struct{})
		go func() {
			s.GRPC.GracefulStop()
			close(stopped)
		}()
		t := time.NewTimer(s.cfg.ShutdownTimeout)
		defer t.Stop()
		select {
		case <-stopped:
		case <-t.C:
			s.lg.Warn("graceful stop timed out; stopping hard", "timeout", s.cfg.ShutdownTimeout)
			s.GRPC.Stop()
			<-stopped
		}
		<-grpcDone
		if hs != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = hs.Shutdown(ctx)
			cancel()
		}
	})
}
