package session

import (
	"context"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// proxy is a loopback TCP proxy that can blackhole its connections: bytes
// in both directions are read and dropped, the connections stay open, and
// neither end learns anything — as when a network path silently dies.
type proxy struct {
	lis    net.Listener
	target string
	holed  atomic.Bool

	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{lis: lis, target: target}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) addr() string { return p.lis.Addr().String() }

func (p *proxy) blackhole() { p.holed.Store(true) }

func (p *proxy) accept() {
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(up, c) })
		p.wg.Go(func() { p.pipe(c, up) })
	}
}

// pipe copies src to dst until either fails, dropping bytes while holed.
func (p *proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.holed.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				_ = dst.Close()
			}
			return
		}
	}
}

func (p *proxy) close() {
	_ = p.lis.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// TestNetworkCutBlackhole cuts an agent's path to the master without closing
// anything: the master notices only through missed heartbeats, suspects the
// agent, then unmounts its segments, while another agent is unaffected.
func TestNetworkCutBlackhole(t *testing.T) {
	cfg := fastConfig()
	cfg.SuspectAfter = 300 * time.Millisecond
	cfg.UnmountAfter = time.Second
	cfg.RequestTimeout = 200 * time.Millisecond
	h := newHarness(t, cfg, harnessOpts{tcp: true, realClock: true})
	p := newProxy(t, h.addr)
	viaProxy := func(context.Context) (*grpc.ClientConn, error) {
		return grpc.NewClient(p.addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	cut := h.connectWith(viaProxy, "cut", withSegments("cut-0", "cut-1"))
	h.connectAgent("direct")
	waitState(t, h, "cut-0", "ok/healthy", 5*time.Second)

	p.blackhole()
	waitState(t, h, "cut-0", "ok/suspected", 5*time.Second)
	_, err := h.m.Reserve(t.Context(), "cut", []*masterv1.ReserveItem{{SegmentId: "cut-0", Size: 1, Key: "k"}})
	if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("reserve across the cut: got %v, want AGENT_UNAVAILABLE", err)
	}
	if _, err := h.m.Reserve(t.Context(), "direct", []*masterv1.ReserveItem{{SegmentId: "direct-mem-0", Size: 1, Key: "k"}}); err != nil {
		t.Fatalf("reserve at the other agent: %v", err)
	}
	waitState(t, h, "cut-0", "unmounted/suspected", 5*time.Second)
	waitState(t, h, "cut-1", "unmounted/suspected", 5*time.Second)
	if got := h.meta.dropped(); !slices.Equal(got, []string{"cut-0", "cut-1"}) {
		t.Fatalf("dropped: got %v, want [cut-0 cut-1]", got)
	}
	testutil.Eventually(t, 5*time.Second, func() bool { return !h.m.Connected("cut") }, "the cut agent's session closed")
	waitState(t, h, "direct-mem-0", "ok/healthy", 5*time.Second)
	if d, ok := h.reg.Segment("direct-mem-0"); !ok || d.Lifecycle != masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK {
		t.Fatalf("other agent's segment: got %+v", d)
	}
	cut.stop()
}
