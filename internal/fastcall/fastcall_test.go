package fastcall

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/proto"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func lookup(id uint64, keys ...string) *masterv1.CallStreamRequest {
	req := &masterv1.BatchGetReplicaListRequest{}
	for _, k := range keys {
		req.Items = append(req.Items, &masterv1.GetReplicaListRequest{Tenant: "t", Key: k})
	}
	return &masterv1.CallStreamRequest{RequestId: id, Call: &masterv1.CallStreamRequest_BatchGetReplicaList{BatchGetReplicaList: req}}
}

func TestFrames(t *testing.T) {
	m := lookup(7, "a", strings.Repeat("k", 200<<10)) // past readStep
	b, err := AppendFrame([]byte("x"), m, MaxRequest)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadFrame(bytes.NewReader(b[1:]), nil, MaxRequest)
	if err != nil {
		t.Fatal(err)
	}
	var back masterv1.CallStreamRequest
	if err := rpccodec.Unmarshal(got, &back); err != nil || !proto.Equal(&back, m) {
		t.Fatalf("round trip: %v", err)
	}
	if _, err := AppendFrame(nil, m, 1024); !errors.Is(err, ErrProtocol) {
		t.Errorf("a frame over its limit: %v, want ErrProtocol", err)
	}
	if _, err := ReadFrame(bytes.NewReader(b[1:]), nil, 1024); !errors.Is(err, ErrProtocol) {
		t.Errorf("reading a frame over the limit: %v, want ErrProtocol", err)
	}
	if _, err := ReadFrame(bytes.NewReader(b[1:len(b)-1]), nil, MaxRequest); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a cut frame: %v, want unexpected EOF", err)
	}
	if _, err := ReadFrame(bytes.NewReader(nil), nil, MaxRequest); err != io.EOF {
		t.Errorf("no frame: %v, want EOF", err)
	}
	// A peer that announces the largest frame and sends little holds
	// little.
	var huge [4]byte
	binary.BigEndian.PutUint32(huge[:], MaxRequest)
	buf, err := ReadFrame(io.MultiReader(bytes.NewReader(huge[:]), strings.NewReader("abc")), nil, MaxRequest)
	if err == nil || cap(buf) > readStep {
		t.Errorf("an announced %d-byte frame of 3 bytes: %v, buffer of %d", MaxRequest, err, cap(buf))
	}
}

// start serves a Server on a loopback port with answer; it stops when the
// test ends.
func start(t *testing.T, cfg Config, answer Answer) (*Server, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := NewServer(cfg, answer, testutil.Logger())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return s, lis.Addr().String()
}

func echo(ctx context.Context, r *masterv1.CallStreamRequest) *masterv1.CallStreamResponse {
	m := &masterv1.CallStreamResponse{RequestId: r.GetRequestId()}
	if p, ok := peer.FromContext(ctx); !ok || p.Addr == nil {
		m.Code, m.Message = 13, "no peer in the call's context"
	}
	return m
}

type client struct {
	nc net.Conn
	br *bufio.Reader
}

func dial(t *testing.T, addr string) *client {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	_ = nc.SetDeadline(time.Now().Add(10 * time.Second))
	return &client{nc: nc, br: bufio.NewReader(nc)}
}

func (c *client) call(t *testing.T, pre string, m *masterv1.CallStreamRequest) (*masterv1.CallStreamResponse, error) {
	t.Helper()
	b, err := AppendFrame([]byte(pre), m, MaxRequest)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.nc.Write(b); err != nil {
		return nil, err
	}
	in, err := ReadFrame(c.br, nil, MaxResponse)
	if err != nil {
		return nil, err
	}
	r := &masterv1.CallStreamResponse{}
	return r, rpccodec.Unmarshal(in, r)
}

// TestServe: calls are answered in order on a connection, with the peer in
// their context, empty calls too; a bad preamble, a frame over MaxRequest or bytes that do
// not decode end the connection (counted), and the others serve on.
func TestServe(t *testing.T) {
	s, addr := start(t, Config{}, echo)
	c := dial(t, addr)
	for i, pre := range []string{Preamble, "", ""} {
		r, err := c.call(t, pre, lookup(uint64(i+1), "a", "b"))
		if err != nil || r.GetRequestId() != uint64(i+1) || r.GetCode() != 0 {
			t.Fatalf("call %d: %v, %v", i+1, r, err)
		}
	}
	for name, b := range map[string][]byte{
		"bad preamble": []byte("CXF1\x00\x00\x00\x00"),
		"over limit":   append([]byte(Preamble), 0xff, 0xff, 0xff, 0xff),
		"not protobuf": append([]byte(Preamble), 0, 0, 0, 3, 0xff, 0xff, 0xff),
	} {
		bad := dial(t, addr)
		if _, err := bad.nc.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := bad.br.ReadByte(); err == nil {
			t.Errorf("%s: the connection stayed", name)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return s.Stats().Dropped == 3 }, "3 dropped, got %d", s.Stats().Dropped)
	if r, err := c.call(t, "", lookup(9, "c")); err != nil || r.GetRequestId() != 9 {
		t.Fatalf("after the others' violations: %v, %v", r, err)
	}
	// An empty call (a client's probe) is answered and counted apart.
	if r, err := c.call(t, "", &masterv1.CallStreamRequest{RequestId: 10}); err != nil || r.GetRequestId() != 10 {
		t.Fatalf("empty call: %v, %v", r, err)
	}
	if st := s.Stats(); st.Calls != 4 || st.Pings != 1 {
		t.Errorf("%d calls and %d pings answered, want 4 and 1", st.Calls, st.Pings)
	}
}

// TestLimits: connections past the per-address cap are closed at once; an
// idle connection is closed after IdleTimeout.
func TestLimits(t *testing.T) {
	s, addr := start(t, Config{MaxConnsPerIP: 2, IdleTimeout: 300 * time.Millisecond}, echo)
	a, b := dial(t, addr), dial(t, addr)
	for _, c := range []*client{a, b} {
		if _, err := c.call(t, Preamble, lookup(1, "a")); err != nil {
			t.Fatal(err)
		}
	}
	third := dial(t, addr)
	if _, err := third.call(t, Preamble, lookup(1, "a")); err == nil {
		t.Error("a third connection from one address was served")
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return s.Stats().Refused == 1 }, "the refusal counted")
	// Idle past IdleTimeout: closed.
	time.Sleep(600 * time.Millisecond)
	if _, err := a.call(t, "", lookup(2, "a")); err == nil {
		t.Error("a connection idle past IdleTimeout served")
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return s.Stats().Conns == 0 }, "idle connections closed")
}

// TestShutdown: when Serve ends, a call running is answered, idle
// connections close, and Serve returns.
func TestShutdown(t *testing.T) {
	release, started := make(chan struct{}), make(chan struct{})
	slow := func(ctx context.Context, r *masterv1.CallStreamRequest) *masterv1.CallStreamResponse {
		close(started)
		<-release
		return echo(ctx, r)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := NewServer(Config{}, slow, testutil.Logger())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, lis) }()
	busy, idle := dial(t, lis.Addr().String()), dial(t, lis.Addr().String())
	if _, err := idle.nc.Write([]byte(Preamble)); err != nil {
		t.Fatal(err)
	}
	answered := make(chan error, 1)
	go func() {
		_, err := busy.call(t, Preamble, lookup(1, "a"))
		answered <- err
	}()
	<-started
	cancel()
	if _, err := idle.br.ReadByte(); err == nil {
		t.Error("an idle connection stayed open after Serve's end")
	}
	close(release)
	if err := <-answered; err != nil {
		t.Errorf("the running call: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
