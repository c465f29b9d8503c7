package server

import (
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/crescent-kv/crescent/internal/conntrack"
	"github.com/prometheus/client_golang/prometheus"
)

// Defaults for Security.MaxConns and MaxConnsPerIP. A client process holds
// one connection to each master it calls and, without the bulk transfer
// path, one to each agent; an agent one to its master; a gateway one to
// each master. An idle gRPC connection costs the server about 18 KiB and a
// descriptor (3000 raised a master's RSS by 54 MB), so the per-address cap
// bounds what one host can pin at about 18 MiB, the total at about 300 MiB;
// without them a peer could open connections until the process ran out of
// descriptors or memory.
const (
	DefaultMaxConns      = 16384
	DefaultMaxConnsPerIP = 1024
)

// refusalLogEvery is how often a listener that keeps refusing connections
// says so (the count is in crescent_server_connections_refused_total).
const refusalLogEvery = 10 * time.Second

// connMetrics are the connection gauges and refusal counters of a process's
// listeners, by port ("grpc", "admin").
type connMetrics struct {
	open    *prometheus.GaugeVec
	refused *prometheus.CounterVec
}

func newConnMetrics(reg prometheus.Registerer) *connMetrics {
	m := &connMetrics{
		open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "crescent_server_connections",
			Help: "Open connections on the process's gRPC and admin ports, by port.",
		}, []string{"port"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "crescent_server_connections_refused_total",
			Help: "Connections closed as they were accepted because the port held its maximum (--max-connections) or the remote address held its own (--max-connections-per-ip), by port and limit.",
		}, []string{"port", "limit"}),
	}
	reg.MustRegister(m.open, m.refused)
	return m
}

// limitListener admits at most maxConns connections, and maxConnsPerIP from
// one remote IP address: a connection past either is closed as it is
// accepted, before any buffer or goroutine is spent on it (gRPC's own
// server would keep every one it is given). Accept never returns such a
// refusal: the server goes on accepting.
type limitListener struct {
	net.Listener
	port              string
	maxConns, maxPer  int
	t                 *conntrack.Tracker[netip.Addr]
	open              prometheus.Gauge
	refusedAll        prometheus.Counter
	refusedPer        prometheus.Counter
	lg                *slog.Logger
	lastLog, refusals atomic.Int64 // unix nanoseconds of the last warning; refusals since
}

func newLimitListener(l net.Listener, port string, maxConns, maxPerIP int, m *connMetrics, lg *slog.Logger) *limitListener {
	return &limitListener{
		Listener: l, port: port, maxConns: maxConns, maxPer: maxPerIP,
		t:          conntrack.New[netip.Addr](maxConns, maxPerIP),
		open:       m.open.WithLabelValues(port),
		refusedAll: m.refused.WithLabelValues(port, "max_connections"),
		refusedPer: m.refused.WithLabelValues(port, "max_connections_per_ip"),
		lg:         lg,
	}
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ip := conntrack.RemoteIP(nc)
		c, err := l.t.Add(nc, ip)
		if err == nil {
			l.open.Inc()
			return &trackedConn{Conn: nc, l: l, c: c}, nil
		}
		// Counted before the close: a peer that sees its connection
		// closed finds the refusal in the metrics already.
		l.refused(ip, err)
		_ = nc.Close()
	}
}

// refused counts a refusal and warns of it, at most every refusalLogEvery.
func (l *limitListener) refused(ip netip.Addr, err error) {
	what := "the port holds its maximum of connections"
	if errors.Is(err, conntrack.ErrMaxConnsPerKey) {
		l.refusedPer.Inc()
		what = "the remote address holds its maximum of connections"
	} else {
		l.refusedAll.Inc()
	}
	n := l.refusals.Add(1)
	now := time.Now().UnixNano()
	last := l.lastLog.Load()
	if now-last < int64(refusalLogEvery) || !l.lastLog.CompareAndSwap(last, now) {
		return
	}
	l.refusals.Add(-n)
	l.lg.Warn("refusing connections: "+what, "port", l.port, "remote", ip.String(), "refused", n,
		"max_connections", l.maxConns, "max_connections_per_ip", l.maxPer, "open", l.t.Len())
}

// trackedConn is an admitted connection: closing it frees its place.
type trackedConn struct {
	net.Conn
	l    *limitListener
	c    *conntrack.Conn[netip.Addr]
	once sync.Once
}

func (c *trackedConn) Close() error {
	err := net.ErrClosed
	c.once.Do(func() {
		err = nil
		c.l.t.Remove(c.c) // closes the connection
		c.l.open.Dec()
	})
	return err
}
