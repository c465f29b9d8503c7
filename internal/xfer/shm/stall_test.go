package shm

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// stallAgent is a hand-written shared-memory agent that shares one 1 MiB
// memfd segment, "s", and hands each request to serve.
func stallAgent(t *testing.T, serve func(uc *net.UnixConn, br *bufio.Reader)) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "shm")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "agent.sock")
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.MemfdCreate("stall", 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, 1<<20); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []*net.UnixConn
	wg.Go(func() {
		for {
			uc, err := lis.AcceptUnix()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, uc)
			mu.Unlock()
			wg.Go(func() {
				defer uc.Close()
				br := bufio.NewReader(uc)
				pre := make([]byte, len(Preamble))
				if _, err := io.ReadFull(br, pre); err != nil {
					return
				}
				hello, _ := AppendHello(nil, []Segment{{ID: "s", Size: 1 << 20}})
				if _, _, err := uc.WriteMsgUnix(hello, unix.UnixRights(fd), nil); err != nil {
					return
				}
				serve(uc, br)
			})
		}
	})
	t.Cleanup(func() {
		_ = lis.Close()
		mu.Lock()
		for _, uc := range conns {
			_ = uc.Close()
		}
		mu.Unlock()
		wg.Wait()
		_ = unix.Close(fd)
		_ = os.RemoveAll(dir)
	})
	return path
}

// TestStallTimeout: a shared-memory agent that stops answering (its
// process stopped or hung: the socket stays open) fails a call after
// StallTimeout, even one with no deadline, both waiting for a grant and
// for a release's answer.
func TestStallTimeout(t *testing.T) {
	const stall = 300 * time.Millisecond
	item := func() []*agentv1.TransferItem {
		return []*agentv1.TransferItem{{SegmentId: "s", AllocationId: 1, Token: []byte("t")}}
	}
	check := func(t *testing.T, c *Client, err error, took time.Duration) {
		t.Helper()
		if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" || status.Code(err) != codes.Unavailable ||
			!errors.Is(err, os.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "stalled") {
			t.Fatalf("call to a stalled agent = %v, want UNAVAILABLE AGENT_UNAVAILABLE, stalled", err)
		}
		if took < stall || took > stall+3*time.Second {
			t.Fatalf("call to a stalled agent ended after %v, want about %v", took, stall)
		}
		if c.Err() == nil {
			t.Fatal("the stalled socket is not marked as failed")
		}
		t.Logf("%v after %v", err, took)
	}

	t.Run("grant", func(t *testing.T) {
		path := stallAgent(t, func(uc *net.UnixConn, br *bufio.Reader) {
			_, _ = xfer.ReadFrame(br, nil, &agentv1.TransferRequest{})
			_, _ = br.ReadByte() // and never answer
		})
		c := New(Config{Path: path, StallTimeout: stall})
		defer c.Close()
		start := time.Now()
		_, err := c.Read(context.Background(), item(), [][]byte{make([]byte, 4096)})
		check(t, c, err, time.Since(start))
	})

	t.Run("release", func(t *testing.T) {
		path := stallAgent(t, func(uc *net.UnixConn, br *bufio.Reader) {
			req := &agentv1.TransferRequest{}
			if _, err := xfer.ReadFrame(br, nil, req); err != nil {
				return
			}
			g, _ := AppendGrant(nil, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: req.GetItems()[0].GetLength()}}}, []uint64{0})
			if _, err := uc.Write(g); err != nil {
				return
			}
			_, _ = io.ReadFull(br, make([]byte, len(Release)))
			_, _ = br.ReadByte() // the release is never answered
		})
		c := New(Config{Path: path, StallTimeout: stall})
		defer c.Close()
		start := time.Now()
		_, err := c.Write(context.Background(), item(), [][]byte{make([]byte, 4096)})
		check(t, c, err, time.Since(start))
	})
}
