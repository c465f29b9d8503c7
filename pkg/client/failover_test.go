package client_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The tests of this file give the client several master addresses (issue
// 15, HA). The leader is the real master of a testcluster; a standby is a
// gRPC server that answers every call, unary or streaming, as a standby
// master does by the HA contract: UNAVAILABLE / NOT_LEADER with the
// leader's address in the ErrorInfo metadata key "leader" (empty during an
// election). It stands in for the master's standby mode, which is being
// written at the same time; once that exists these tests can run a real
// standby instead. A master that goes away is a TCP relay that is closed.

// standby is a fake standby master.
type standby struct {
	addr   string
	leader atomic.Pointer[string] // the address it names as the leader
	calls  atomic.Int64
}

func startStandby(t *testing.T, leader string) *standby {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &standby{addr: ln.Addr().String()}
	s.setLeader(leader)
	srv := grpc.NewServer(grpc.UnknownServiceHandler(func(any, grpc.ServerStream) error {
		s.calls.Add(1)
		return rpcerr.Status(&rpcerr.Error{
			Reason: masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, Msg: "this master is a standby",
			Metadata: map[string]string{"leader": *s.leader.Load()},
		})
	}))
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return s
}

func (s *standby) setLeader(addr string) { s.leader.Store(&addr) }

// relay forwards TCP connections to a target that can change; closing it
// is a master that went away (connections reset, new ones refused).
type relay struct {
	ln net.Listener
	wg sync.WaitGroup

	mu     sync.Mutex // guards target, conns, closed
	target string
	conns  map[net.Conn]bool
	closed bool
}

func startRelay(t *testing.T, target string) *relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relay{ln: ln, target: target, conns: map[net.Conn]bool{}}
	r.wg.Go(r.serve)
	t.Cleanup(r.close)
	return r
}

func (r *relay) addr() string { return r.ln.Addr().String() }

// retarget sends new connections to target and cuts the open ones.
func (r *relay) retarget(target string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.target = target
	r.cutLocked()
}

func (r *relay) close() {
	_ = r.ln.Close()
	r.mu.Lock()
	r.closed = true
	r.cutLocked()
	r.mu.Unlock()
	r.wg.Wait()
}

func (r *relay) cutLocked() {
	for c := range r.conns {
		_ = c.Close()
	}
	clear(r.conns)
}

// track registers c to be cut; false when the relay is closed.
func (r *relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = true
	return true
}

func (r *relay) serve() {
	for {
		down, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.wg.Go(func() { r.pipe(down) })
	}
}

func (r *relay) pipe(down net.Conn) {
	defer down.Close()
	r.mu.Lock()
	target := r.target
	r.mu.Unlock()
	up, err := net.Dial("tcp", target)
	if err != nil {
		return
	}
	defer up.Close()
	if !r.track(down) || !r.track(up) {
		return
	}
	r.wg.Go(func() {
		_, _ = io.Copy(down, up)
		_ = down.Close()
	})
	_, _ = io.Copy(up, down)
	_ = up.Close()
}

// haClient is an SDK client of the masters at addrs, closed at the end of
// the test.
func haClient(t *testing.T, master string, mod func(*client.Config)) *client.Client {
	t.Helper()
	cfg := client.Config{Master: master, Backoff: 10 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	c, err := client.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// snapshotKeys reads one tenant's snapshot through c's ChangeService
// client (a server stream).
func snapshotKeys(ctx context.Context, c *client.Client) ([]string, error) {
	snap, err := c.Changes().Snapshot(ctx, &masterv1.SnapshotRequest{Tenant: "default"})
	if err != nil {
		return nil, err
	}
	var keys []string
	for {
		page, err := snap.Recv()
		if err != nil {
			return nil, err
		}
		for _, e := range page.GetEntries() {
			keys = append(keys, e.GetKey())
		}
		if page.GetLast() {
			return keys, nil
		}
	}
}

// TestStandbyRedirectsToLeader: a client configured with a standby first
// and the leader second finds the leader through the standby's NOT_LEADER,
// and its later calls, unary and streaming, raw and wrapped, go straight to
// the leader.
func TestStandbyRedirectsToLeader(t *testing.T) {
	h := start(t, testcluster.Options{})
	s := startStandby(t, h.MasterAddr())
	c := haClient(t, s.addr+", "+h.MasterAddr(), nil)
	ctx := t.Context()

	if err := c.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatalf("Put through [standby, leader]: %v", err)
	}
	if n := s.calls.Load(); n != 1 {
		t.Fatalf("the standby saw %d calls, want 1 (the first, redirected)", n)
	}
	sameReplicas(t, h, "default", "k", 1, []byte("v"))
	if got, err := c.Get(ctx, "k"); err != nil || string(got) != "v" {
		t.Fatalf("Get: %q, %v", got, err)
	}
	if r, err := c.Admin().ListSegments(ctx, &masterv1.ListSegmentsRequest{}); err != nil || len(r.GetSegments()) != 2 {
		t.Fatalf("ListSegments: %v, %v", r, err)
	}
	if keys, err := snapshotKeys(ctx, c); err != nil || len(keys) != 1 || keys[0] != "k" {
		t.Fatalf("Snapshot: %v, %v; want [k]", keys, err)
	}
	if n := s.calls.Load(); n != 1 {
		t.Fatalf("the standby saw %d calls, want 1: later calls go straight to the leader", n)
	}

	// A stream opened first: the standby refuses it with the first
	// response, and the stream is opened again on the leader.
	c2 := haClient(t, s.addr+","+h.MasterAddr(), nil)
	if keys, err := snapshotKeys(ctx, c2); err != nil || len(keys) != 1 || keys[0] != "k" {
		t.Fatalf("Snapshot through [standby, leader]: %v, %v; want [k]", keys, err)
	}
	if n := s.calls.Load(); n != 2 {
		t.Fatalf("the standby saw %d calls, want 2", n)
	}
	// A permanent error comes back at once, from the leader.
	before := h.Calls("GetReplicaList")
	if _, err := c2.Get(ctx, "missing"); !errors.Is(err, client.ErrNotFound) || h.Calls("GetReplicaList") != before+1 {
		t.Fatalf("Get of a missing key: %v after %d calls, want OBJECT_NOT_FOUND after 1", err, h.Calls("GetReplicaList")-before)
	}
}

// TestLeaderGoesAway: the client works with the leader A; A goes away and,
// after an election during which B answers NOT_LEADER without a leader, B
// becomes the leader. Calls made during the failover succeed through B
// within their deadline, and the objects written before are there.
func TestLeaderGoesAway(t *testing.T) {
	h := start(t, testcluster.Options{})
	a := startRelay(t, h.MasterAddr())
	s := startStandby(t, a.addr())
	b := startRelay(t, s.addr)
	c := haClient(t, a.addr()+","+b.addr(), nil)
	ctx := t.Context()

	if err := c.Put(ctx, "before", []byte("1")); err != nil {
		t.Fatalf("Put through A: %v", err)
	}
	if n := s.calls.Load(); n != 0 {
		t.Fatalf("B saw %d calls while A led, want 0", n)
	}

	// A goes away; B is a standby without a leader until the election
	// ends (a real one takes seconds), then it is the leader (its relay
	// now reaches the master, as a standby that took over would serve).
	s.setLeader("")
	a.close()
	elected := make(chan struct{})
	go func() {
		defer close(elected)
		for s.calls.Load() < 2 && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
		b.retarget(h.MasterAddr())
	}()
	callCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := c.Put(callCtx, "during", []byte("2")); err != nil {
		t.Fatalf("Put during the failover: %v", err)
	}
	<-elected
	if n := s.calls.Load(); n < 2 {
		t.Fatalf("B saw %d calls during the election, want at least 2", n)
	}
	for _, k := range []string{"before", "during"} {
		if _, err := c.Get(callCtx, k); err != nil {
			t.Fatalf("Get %s after the failover: %v", k, err)
		}
	}
	if keys, err := snapshotKeys(callCtx, c); err != nil || len(keys) != 2 {
		t.Fatalf("Snapshot after the failover: %v, %v; want both keys", keys, err)
	}
}

// TestFailoverBoundedByDeadline: while no master leads (one is gone, the
// other a standby without a leader), a call returns when its context ends,
// promptly, with DEADLINE_EXCEEDED or UNAVAILABLE; without a deadline it
// returns after Config.FailoverTimeout. The package's goleak check sees
// that nothing is left running after Close.
func TestFailoverBoundedByDeadline(t *testing.T) {
	gone := startRelay(t, "127.0.0.1:1")
	gone.close()
	s := startStandby(t, "")
	c := haClient(t, gone.addr()+","+s.addr, func(cfg *client.Config) { cfg.FailoverTimeout = 300 * time.Millisecond })

	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Exist(ctx, "k")
	if code := status.Code(err); code != codes.DeadlineExceeded && code != codes.Unavailable {
		t.Fatalf("Exist under a 200 ms deadline: %v (%v), want DEADLINE_EXCEEDED or UNAVAILABLE", err, code)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("Exist under a 200 ms deadline returned after %v", took)
	}

	// A stream: the same.
	ctx, cancel = context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if _, err := snapshotKeys(ctx, c); status.Code(err) != codes.DeadlineExceeded && status.Code(err) != codes.Unavailable {
		t.Fatalf("Snapshot under a 200 ms deadline: %v", err)
	}

	// No deadline: the failover budget ends the call with the last
	// master's answer.
	start = time.Now()
	if _, err := c.Exist(t.Context(), "k"); status.Code(err) != codes.Unavailable {
		t.Fatalf("Exist without a deadline: %v, want UNAVAILABLE after the failover budget", err)
	}
	if took := time.Since(start); took < 300*time.Millisecond || took > 3*time.Second {
		t.Fatalf("Exist without a deadline returned after %v, want about the 300 ms failover budget", took)
	}
}
