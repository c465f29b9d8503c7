// Package server is the gRPC and admin-HTTP bootstrap every Crescent process
// shares: a grpc.Server with health, reflection (so bare grpcurl works),
// OpenTelemetry tracing (internal/obs/tracing), recovery, slog logging and
// Prometheus interceptors, and an admin mux with
// /healthz, /readyz and /metrics. New starts nothing; Run serves until its
// context ends, then stops gracefully with a hard-stop timeout (open bidi
// streams would otherwise block GracefulStop forever).
//
// Security (issue 14) is part of the bootstrap: with TLS files configured
// (Security, loaded into Credentials) the gRPC port speaks mTLS and one
// auth.Authorizer enforces the server's Table on every call, default deny,
// after the metrics, logging and recovery interceptors and before any the
// caller adds; the admin port speaks HTTPS (client certificate optional):
// /healthz and /readyz are public, /metrics needs an admin principal, and
// /debug/pprof/ exists only with --pprof, for admins. Without TLS nothing is
// authenticated and Listen refuses addresses other than loopback unless
// --insecure (protected mode); Run then warns at start and every hour.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
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

// The flow-control windows of every server's connections and streams
// (static: see New). 16 MiB is also the most gRPC's BDP estimation would
// grow either to, so a peer can make a server buffer no more unread data
// per connection than before.
const (
	streamWindow = 16 << 20
	connWindow   = 16 << 20
)

// Config is the listening side of a process.
type Config struct {
	// GRPCAddr is host:port for gRPC; empty disables the gRPC server.
	GRPCAddr string
	// AdminAddr is host:port for admin HTTP; empty disables it.
	AdminAddr string
	// ShutdownTimeout bounds graceful shutdown before a hard stop.
	ShutdownTimeout time.Duration
	// Credentials are the process's Security, loaded; nil is plaintext
	// with the defaults (protected mode, no pprof).
	Credentials *Credentials
	// Table authorizes the services registered on GRPC, default deny; the
	// health and reflection services are public (PublicMethods). It is
	// enforced with TLS only: in plaintext every call is allowed and runs
	// as auth.InsecurePrincipal.
	Table auth.Table
	// QuietCodes are codes this server answers as a matter of course,
	// logged at debug level instead of warn (a standby master answers
	// every call UNAVAILABLE NOT_LEADER).
	QuietCodes []codes.Code
	// QuietReasons are error reasons (ErrorInfo, rpcerr.Reason) this
	// server answers as a matter of course, logged at debug as QuietCodes
	// are: a master's MASTER_RECOVERING while its agents re-register,
	// which every gateway and client meets at its start and retries.
	QuietReasons []string
	// ExtraMetrics, if set, is gathered on /metrics besides the server's
	// registry (a standby master exports its warm master's follow
	// metrics and runtime collectors this way). Its families must not
	// repeat the registry's.
	ExtraMetrics prometheus.Gatherer
}

// PublicMethods are the gRPC methods every server allows unauthenticated:
// health checks (load balancers, container probes) and reflection (bare
// grpcurl; it describes the API, never data).
var PublicMethods = []string{
	"/" + healthpb.Health_ServiceDesc.ServiceName + "/*",
	"/" + reflectionv1.ServerReflection_ServiceDesc.ServiceName + "/*",
	"/" + reflectionv1alpha.ServerReflection_ServiceDesc.ServiceName + "/*",
}

// HandshakeTimeout bounds a new connection's TLS handshake and HTTP/2
// preface on the gRPC port (grpc-go's default is 120 s, during which a
// peer that never finishes holds a goroutine and a socket).
var HandshakeTimeout = 10 * time.Second

// KeepaliveTime and KeepaliveTimeout are the servers' keepalive: a
// connection that has carried nothing for KeepaliveTime is pinged, and
// closed when the ping is not answered within KeepaliveTimeout. Clients
// ping more often (masterlist.Keepalive), so their connections are seldom
// silent that long.
const (
	KeepaliveTime    = 30 * time.Second
	KeepaliveTimeout = 10 * time.Second
)

// AdminIdleTimeout closes an admin HTTP connection that waits this long for
// its next request (net/http keeps one open for ever by default).
const AdminIdleTimeout = 2 * time.Minute

// InsecureWarnInterval is how often a server started with --insecure
// repeats its warning.
const InsecureWarnInterval = time.Hour

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
	conns   *connMetrics
	unary   grpc.UnaryServerInterceptor // every unary interceptor, chained (Unary)
	ready   atomic.Pointer[func() error]
	creds   *Credentials
	authz   *auth.Authorizer // nil when err is set
	err     error            // New's configuration error, returned by Listen
	// warnEvery is InsecureWarnInterval (tests shorten it).
	warnEvery time.Duration

	mu        sync.Mutex // guards grpcLis, adminLis
	grpcLis   net.Listener
	adminLis  net.Listener
	closeOnce sync.Once
}

// New builds the servers. It does no I/O. A bad Table or Credentials is
// reported by Listen (and so Run).
func New(cfg Config, lg *slog.Logger, reg *prometheus.Registry, opts ...grpc.ServerOption) *Server {
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 10 * time.Second
	}
	creds := cfg.Credentials
	if creds == nil {
		creds = &Credentials{Security: DefaultSecurity()}
	}
	if creds.MaxConns <= 0 || creds.MaxConnsPerIP <= 0 {
		c := *creds // the caller's stays as given
		if c.MaxConns <= 0 {
			c.MaxConns = DefaultMaxConns
		}
		if c.MaxConnsPerIP <= 0 {
			c.MaxConnsPerIP = DefaultMaxConnsPerIP
		}
		creds = &c
	}
	authz, authzErr := auth.NewAuthorizer(auth.Options{
		TrustDomain: creds.TrustDomain, Tokens: creds.Tokens, Table: cfg.Table,
		Logger: lg, Disabled: !creds.Secure(), Public: PublicMethods,
	})
	if authzErr != nil {
		authzErr = fmt.Errorf("authorization: %w", authzErr)
	}
	metrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets([]float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5}),
	))
	reg.MustRegister(metrics)
	level := callLevel(cfg.QuietCodes, cfg.QuietReasons)
	recoverOpt := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		lg.ErrorContext(ctx, "panic in grpc handler", "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
		return status.Errorf(codes.Internal, "internal error")
	})
	unary := []grpc.UnaryServerInterceptor{
		metrics.UnaryServerInterceptor(),
		finishLog(lg, level),
		recovery.UnaryServerInterceptor(recoverOpt),
	}
	stream := []grpc.StreamServerInterceptor{
		metrics.StreamServerInterceptor(),
		finishLogStream(lg, level),
		recovery.StreamServerInterceptor(recoverOpt),
	}
	if authz != nil {
		// Before every handler and every interceptor the caller adds
		// (which may read the principal, auth.FromContext).
		unary, stream = append(unary, authz.Unary()), append(stream, authz.Stream())
	}
	for _, o := range opts {
		if u, ok := o.(unaryOption); ok {
			unary = append(unary, u.ints...)
		}
	}
	base := []grpc.ServerOption{
		rpccodec.ServerOption(),
		// A server span per call (issue 16), in the context every
		// interceptor and handler sees, so their log lines carry its ids.
		tracing.ServerOption(),
		grpc.MaxRecvMsgSize(MaxMessageBytes),
		grpc.MaxSendMsgSize(MaxMessageBytes),
		grpc.MaxConcurrentStreams(MaxConcurrentStreams),
		// Static flow-control windows. gRPC's default, a window sized by
		// BDP estimation, makes the server answer a request that arrives
		// on an idle connection with a WINDOW_UPDATE and a BDP PING
		// before its response, and the client a PING ACK: two more
		// writes (and wake-ups) per call where calls are serialized, as
		// the SDK's coalesced batches are (issue 18: BatchGetReplicaList
		// took four writes on loopback instead of two). Requests to these
		// servers are metadata; these windows never bind them.
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
		grpc.ConnectionTimeout(HandshakeTimeout),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		// A client that vanished without closing (its host powered off or
		// cut off) would hold its connection, and its place under
		// MaxConnsPerIP, for grpc-go's default of two hours: ping a
		// connection silent for KeepaliveTime, close it when the ping goes
		// unanswered for KeepaliveTimeout.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: KeepaliveTime, Timeout: KeepaliveTimeout}),
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
	}
	if creds.Secure() {
		base = append(base, grpc.Creds(creds.Source.ServerCredentials(creds.clientAuth())))
	}
	gs := grpc.NewServer(append(base, opts...)...)
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	healthpb.RegisterHealthServer(gs, hs)
	reflection.Register(gs)

	s := &Server{cfg: cfg, lg: lg, GRPC: gs, Health: hs, Mux: http.NewServeMux(), Registry: reg, metrics: metrics,
		conns: newConnMetrics(reg), creds: creds, authz: authz, err: authzErr, warnEvery: InsecureWarnInterval, unary: chainUnary(unary)}
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
	// Prometheus scrapes with an admin certificate (or an admin bearer
	// token) when TLS is on.
	var gather prometheus.Gatherer = reg
	if cfg.ExtraMetrics != nil {
		gather = prometheus.Gatherers{reg, cfg.ExtraMetrics}
	}
	s.Mux.Handle("GET /metrics", s.Protect(promhttp.HandlerFor(gather, promhttp.HandlerOpts{Registry: reg}), auth.RoleAdmin))
	if creds.Pprof {
		// Profiles reveal memory contents (heap, goroutine stacks with
		// arguments): admins only, every request audited.
		for path, h := range map[string]http.HandlerFunc{
			"/debug/pprof/": pprof.Index, "/debug/pprof/cmdline": pprof.Cmdline, "/debug/pprof/profile": pprof.Profile,
			"/debug/pprof/symbol": pprof.Symbol, "/debug/pprof/trace": pprof.Trace,
		} {
			s.Mux.Handle(path, s.protect(h, true, auth.RoleAdmin))
		}
	}
	return s
}

// UnaryInterceptors is grpc.ChainUnaryInterceptor for New: the interceptors
// run, in order, after the server's own (metrics, logging, recovery,
// authorization) on every unary call, and in the chain Unary returns, which
// grpc.ChainUnaryInterceptor's cannot be. A server that answers unary calls
// carried on a stream (ObjectService.CallStream) adds its interceptors this
// way, so that those calls meet every one of them.
func UnaryInterceptors(ints ...grpc.UnaryServerInterceptor) grpc.ServerOption {
	return unaryOption{ints: ints}
}

// unaryOption is UnaryInterceptors' option; New takes it apart (grpc-go
// ignores an EmptyServerOption).
type unaryOption struct {
	grpc.EmptyServerOption
	ints []grpc.UnaryServerInterceptor
}

// Unary is the whole chain of unary interceptors the server runs on a unary
// call, as one: its own and those added with UnaryInterceptors. A handler
// that serves unary calls carried on a stream runs each through it, with
// its method's grpc.UnaryServerInfo, so that a call meets the same metrics,
// logging, recovery, authorization and gates whichever way it came.
func (s *Server) Unary() grpc.UnaryServerInterceptor { return s.unary }

// chainUnary chains ints into one interceptor, the first outermost, as
// grpc-go chains a server's.
func chainUnary(ints []grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		return ints[0](ctx, req, info, nextUnary(ints, 0, info, handler))
	}
}

func nextUnary(ints []grpc.UnaryServerInterceptor, i int, info *grpc.UnaryServerInfo, final grpc.UnaryHandler) grpc.UnaryHandler {
	if i == len(ints)-1 {
		return final
	}
	return func(ctx context.Context, req any) (any, error) {
		return ints[i+1](ctx, req, info, nextUnary(ints, i+1, info, final))
	}
}

// Protect wraps an admin HTTP handler for Mux: with TLS only principals of
// roles reach it (any authenticated one when roles is empty), the others
// get 401 or 403; in plaintext it is h. Handlers added to Mux unwrapped are
// public.
func (s *Server) Protect(h http.Handler, roles ...auth.Role) http.Handler {
	return s.protect(h, false, roles...)
}

func (s *Server) protect(h http.Handler, audit bool, roles ...auth.Role) http.Handler {
	switch {
	case s.authz == nil:
		// New failed; Listen refuses to serve. Deny rather than serve open.
		return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "server misconfigured", http.StatusInternalServerError)
		})
	case audit:
		return s.authz.HTTPAudit(h, roles...)
	}
	return s.authz.HTTP(h, roles...)
}

// Authorizer is the server's authorizer (nil when New's configuration
// failed), for listeners beside the gRPC port that share its principals.
func (s *Server) Authorizer() *auth.Authorizer { return s.authz }

// SetReadiness installs the check behind /readyz (nil error = ready).
func (s *Server) SetReadiness(check func() error) { s.ready.Store(&check) }

func (s *Server) readyErr() error {
	if f := s.ready.Load(); f != nil {
		return (*f)()
	}
	return nil
}

// Listen opens the configured listeners so callers (and tests using port 0)
// learn the real addresses before Run. In plaintext it refuses (and
// closes) a listener bound to anything but loopback unless --insecure
// (ErrProtectedMode). On error nothing stays open.
func (s *Server) Listen() error {
	if s.err != nil {
		return s.err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	listen := func(what, port, addr string, dst *net.Listener) error {
		if addr == "" || *dst != nil {
			return nil
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("%s listen %s: %w", what, addr, err)
		}
		if err := s.creds.CheckListen(what, l.Addr()); err != nil {
			_ = l.Close()
			return err
		}
		*dst = newLimitListener(l, port, s.creds.MaxConns, s.creds.MaxConnsPerIP, s.conns, s.lg)
		return nil
	}
	err := listen("grpc-addr", "grpc", s.cfg.GRPCAddr, &s.grpcLis)
	if err == nil {
		err = listen("admin-addr", "admin", s.cfg.AdminAddr, &s.adminLis)
	}
	if err != nil {
		for _, l := range []*net.Listener{&s.grpcLis, &s.adminLis} {
			if *l != nil {
				_ = (*l).Close()
				*l = nil
			}
		}
	}
	return err
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
		hs = &http.Server{Handler: s.Mux, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: AdminIdleTimeout,
			ErrorLog: slog.NewLogLogger(s.lg.Handler(), slog.LevelDebug)}
		serve := hs.Serve
		if s.creds.Secure() {
			// Client certificates are optional: /healthz and /readyz are
			// public; Protect decides the rest.
			hs.TLSConfig = s.creds.Source.ServerTLS(tls.VerifyClientCertIfGiven)
			serve = func(l net.Listener) error { return hs.ServeTLS(l, "", "") }
		}
		go func() {
			if err := serve(al); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("admin http: %w", err)
			}
		}()
		s.lg.Info("admin http listening", "addr", al.Addr().String(), "tls", s.creds.Secure(), "pprof", s.creds.Pprof)
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
		s.lg.Info("grpc listening", "addr", gl.Addr().String(), "tls", s.creds.Secure(), "bearer_tokens", s.creds.Tokens != nil)
	} else {
		close(grpcDone)
	}
	warnCtx, stopWarn := context.WithCancel(ctx)
	warnDone := make(chan struct{})
	if s.creds.Insecure && !s.creds.Secure() {
		go func() {
			defer close(warnDone)
			s.warnInsecure(warnCtx, gl, al)
		}()
	} else {
		close(warnDone)
	}

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	}
	stopWarn()
	<-warnDone
	s.shutdown(hs, grpcDone)
	return runErr
}

// warnInsecure logs that the server runs without protection, now and every
// warnEvery until ctx ends.
func (s *Server) warnInsecure(ctx context.Context, listeners ...net.Listener) {
	var addrs []string
	for _, l := range listeners {
		if l != nil {
			addrs = append(addrs, l.Addr().String())
		}
	}
	warn := func() {
		s.lg.Warn("insecure: plaintext, no authentication; anyone who reaches these ports may read and change every tenant's data (configure --tls-ca, --tls-cert, --tls-key)",
			"addrs", addrs)
	}
	warn()
	t := time.NewTicker(s.warnEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			warn()
		}
	}
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

// callLevel is the level of a call's "finished call" line by its error:
// debug for what a server answers as a matter of course (OK, a missing
// object, a refused precondition, and the codes and reasons the server
// names quiet), error for a fault of the server's (INTERNAL, UNKNOWN,
// DATA_LOSS), warn for the rest.
func callLevel(quietCodes []codes.Code, quietReasons []string) func(error) slog.Level {
	return func(err error) slog.Level {
		c := status.Code(err)
		if slices.Contains(quietCodes, c) || err != nil && slices.Contains(quietReasons, rpcerr.Reason(err)) {
			return slog.LevelDebug
		}
		switch c {
		case codes.OK, codes.NotFound, codes.AlreadyExists, codes.Canceled, codes.FailedPrecondition, codes.InvalidArgument, codes.OutOfRange:
			return slog.LevelDebug
		case codes.Internal, codes.Unknown, codes.DataLoss:
			return slog.LevelError
		default:
			return slog.LevelWarn
		}
	}
}
