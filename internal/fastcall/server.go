package fastcall

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/conntrack"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// Config bounds a Server. Zero fields take the defaults.
type Config struct {
	// MaxConns bounds the open connections (default 4096); MaxConnsPerIP
	// those from one remote address (default 64). A connection past
	// either is closed at once.
	MaxConns, MaxConnsPerIP int
	// IdleTimeout closes a connection that starts no request for this long
	// (default 2 min); IOTimeout bounds a TLS handshake, the preamble, the
	// rest of a request once its first byte came, and writing an answer
	// (default 30 s).
	IdleTimeout, IOTimeout time.Duration
}

func (c Config) withDefaults() Config {
	if c.MaxConns <= 0 {
		c.MaxConns = 4096
	}
	if c.MaxConnsPerIP <= 0 {
		c.MaxConnsPerIP = 64
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 2 * time.Minute
	}
	if c.IOTimeout <= 0 {
		c.IOTimeout = 30 * time.Second
	}
	return c
}

// Answer runs one call and returns its answer (objectsvc.Service.Answer:
// through the unary interceptors, under ctx, which carries the
// connection's peer and TLS state as a gRPC call's context does).
type Answer func(ctx context.Context, req *masterv1.CallStreamRequest) *masterv1.CallStreamResponse

// Server serves the lookup listener.
type Server struct {
	cfg    Config
	answer Answer
	lg     *slog.Logger

	// conns admits connections under MaxConns and MaxConnsPerIP and knows
	// which are between calls, which shutdown closes at once.
	conns *conntrack.Tracker[netip.Addr]
	wg    sync.WaitGroup

	refused, dropped, calls, pings atomic.Uint64
}

// NewServer returns a server that answers calls with answer.
func NewServer(cfg Config, answer Answer, lg *slog.Logger) *Server {
	cfg = cfg.withDefaults()
	return &Server{cfg: cfg, answer: answer, lg: lg, conns: conntrack.New[netip.Addr](cfg.MaxConns, cfg.MaxConnsPerIP)}
}

// Stats are the server's counters.
type Stats struct {
	Conns   int    // open now
	Refused uint64 // connections closed at once: over a cap
	Dropped uint64 // connections ended for a protocol violation
	Calls   uint64 // calls answered
	Pings   uint64 // empty calls answered: clients' probes (pkg/client)
}

// Stats reads the counters.
func (s *Server) Stats() Stats {
	return Stats{Conns: s.conns.Len(), Refused: s.refused.Load(), Dropped: s.dropped.Load(), Calls: s.calls.Load(), Pings: s.pings.Load()}
}

// Serve accepts connections on lis (a TLS listener when the master has
// TLS) until ctx ends or lis fails, then closes every connection and
// waits for their goroutines; a call running is answered first if it can
// be within IOTimeout.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	stop := context.AfterFunc(ctx, func() { _ = lis.Close() })
	defer stop()
	var err error
	for {
		nc, aerr := retry.Accept(ctx, lis, s.lg, "lookup")
		if aerr != nil {
			if ctx.Err() == nil {
				err = aerr
			}
			break
		}
		c, rerr := s.conns.Add(nc, conntrack.RemoteIP(nc))
		if rerr != nil { // either cap, or closing: all refusals alike
			s.refused.Add(1)
			_ = nc.Close()
			continue
		}
		s.wg.Go(func() { s.serve(ctx, nc, c) })
	}
	_ = lis.Close()
	// A connection between calls ends now; one in a call answers it first
	// (its next MarkIdle says stop).
	s.conns.Shutdown()
	s.wg.Wait()
	return err
}

// serve runs one connection, c its entry in s.conns: the TLS handshake,
// the preamble, then calls in order until the peer leaves, breaks the
// protocol, idles out or the server closes. Between calls it is idle,
// during one busy; marking either takes no lock, so a call costs the
// server no shared lock.
func (s *Server) serve(ctx context.Context, nc net.Conn, c *conntrack.Conn[netip.Addr]) {
	defer s.conns.Remove(c)
	pr := &peer.Peer{Addr: nc.RemoteAddr(), LocalAddr: nc.LocalAddr()}
	if tc, ok := nc.(*tls.Conn); ok {
		_ = tc.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
		if err := tc.Handshake(); err != nil {
			s.lg.Debug("lookup listener TLS handshake failed", "remote", nc.RemoteAddr().String(), "err", err)
			return
		}
		_ = tc.SetDeadline(time.Time{})
		pr.AuthInfo = credentials.TLSInfo{State: tc.ConnectionState(), CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}
	}
	ctx = peer.NewContext(context.WithoutCancel(ctx), pr)
	_ = nc.SetReadDeadline(time.Now().Add(s.cfg.IOTimeout))
	var pre [len(Preamble)]byte
	if _, err := io.ReadFull(nc, pre[:]); err != nil {
		return
	}
	if string(pre[:]) != Preamble {
		s.dropped.Add(1)
		s.lg.Debug("not a lookup connection", "remote", nc.RemoteAddr().String(), "preamble", fmt.Sprintf("%q", pre[:]))
		return
	}
	br := bufio.NewReaderSize(nc, 16<<10)
	var in, out []byte
	for {
		if !c.MarkIdle() {
			return // shutdown: the call before was answered
		}
		_ = nc.SetReadDeadline(time.Now().Add(s.cfg.IdleTimeout))
		if _, err := br.Peek(1); err != nil {
			return // gone, idle, or closed by shutdown
		}
		c.MarkBusy()
		_ = nc.SetReadDeadline(time.Now().Add(s.cfg.IOTimeout))
		var err error
		if in, err = ReadFrame(br, in, MaxRequest); err != nil {
			s.protocol(nc, err)
			return
		}
		req := &masterv1.CallStreamRequest{}
		if err := rpccodec.UnmarshalLimited(in, req); err != nil {
			s.protocol(nc, fmt.Errorf("%w: a request that does not decode: %v", ErrProtocol, err))
			return
		}
		resp := s.answer(ctx, req)
		if req.GetCall() == nil {
			s.pings.Add(1)
		} else {
			s.calls.Add(1)
		}
		if out, err = AppendFrame(out[:0], resp, MaxResponse); err != nil {
			s.lg.Warn("lookup answer not framed", "remote", nc.RemoteAddr().String(), "err", err)
			return
		}
		_ = nc.SetWriteDeadline(time.Now().Add(s.cfg.IOTimeout))
		if _, err := nc.Write(out); err != nil {
			return
		}
		if cap(in) > 1<<20 {
			in = nil // a large request's buffer is not kept
		}
		if cap(out) > 1<<20 {
			out = nil
		}
	}
}

// protocol counts and logs a connection that broke the protocol (a
// closed connection or a timeout is not one).
func (s *Server) protocol(nc net.Conn, err error) {
	if errors.Is(err, ErrProtocol) {
		s.dropped.Add(1)
		s.lg.Debug("lookup connection dropped", "remote", nc.RemoteAddr().String(), "err", err)
	}
}
