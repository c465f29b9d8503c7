package xfer

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestStallTimeout: an agent whose process is stopped or hung keeps its
// connections open (its kernel still acknowledges), so only a deadline
// ends a call to it. Each step of an exchange has StallTimeout: the call
// fails UNAVAILABLE AGENT_UNAVAILABLE soon after, even with no deadline
// of its own, while an agent that is slow but moving is waited for.
func TestStallTimeout(t *testing.T) {
	const stall = 300 * time.Millisecond
	// wantStalled checks a call that should have ended by the stall bound.
	wantStalled := func(t *testing.T, p *Pool, addr string, err error, took time.Duration) {
		t.Helper()
		if rpcerr.Reason(err) != "AGENT_UNAVAILABLE" || status.Code(err) != codes.Unavailable ||
			!errors.Is(err, os.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "transfer stalled") {
			t.Fatalf("call to a stalled agent = %v, want UNAVAILABLE AGENT_UNAVAILABLE, transfer stalled", err)
		}
		if took < stall || took > stall+3*time.Second {
			t.Fatalf("call to a stalled agent ended after %v, want about %v", took, stall)
		}
		t.Logf("%v after %v", err, took)
		p.mu.Lock()
		idle := len(p.idle[addr])
		p.mu.Unlock()
		if idle != 0 {
			t.Fatalf("%d idle connections after a stalled call, want 0", idle)
		}
	}

	t.Run("no_answer", func(t *testing.T) {
		a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
			_, _, err := request(br)
			return err // and never answer
		})
		p := NewPool(Config{StallTimeout: stall})
		defer p.Close()
		start := time.Now()
		_, err := p.Read(context.Background(), a.addr(), items(1), [][]byte{make([]byte, 4)})
		wantStalled(t, p, a.addr(), err, time.Since(start))
	})

	t.Run("payload_stops", func(t *testing.T) {
		a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
			if _, _, err := request(br); err != nil {
				return err
			}
			b, _ := AppendFrame(nil, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 64 << 10, ObjectSize: 64 << 10}}})
			_, err := c.Write(append(b, make([]byte, 1024)...)) // 1 KiB of 64, then nothing
			return err
		})
		p := NewPool(Config{StallTimeout: stall})
		defer p.Close()
		start := time.Now()
		_, err := p.Read(context.Background(), a.addr(), items(1), [][]byte{make([]byte, 64<<10)})
		wantStalled(t, p, a.addr(), err, time.Since(start))
	})

	t.Run("never_reads", func(t *testing.T) {
		stop := make(chan struct{})
		a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
			<-stop // reads nothing past the preamble
			return net.ErrClosed
		})
		t.Cleanup(func() { close(stop) }) // before startFake's cleanup waits
		p := NewPool(Config{StallTimeout: stall})
		defer p.Close()
		start := time.Now()
		_, err := p.Write(context.Background(), a.addr(), items(1), [][]byte{make([]byte, 64<<20)})
		wantStalled(t, p, a.addr(), err, time.Since(start))
	})

	t.Run("slow_but_moving", func(t *testing.T) {
		// 16 MiB in 1 MiB writes 40 ms apart: 640 ms in all, more than
		// the stall bound, but about 160 ms per 4 MiB step.
		obj := bytes.Repeat([]byte("0123456789abcdef"), 1<<20)
		a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
			if _, _, err := request(br); err != nil {
				return err
			}
			b, _ := AppendFrame(nil, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: uint64(len(obj)), ObjectSize: uint64(len(obj))}}})
			if _, err := c.Write(b); err != nil {
				return err
			}
			for rest := obj; len(rest) > 0; rest = rest[1<<20:] {
				time.Sleep(40 * time.Millisecond)
				if _, err := c.Write(rest[:1<<20]); err != nil {
					return err
				}
			}
			return nil
		})
		p := NewPool(Config{StallTimeout: stall})
		defer p.Close()
		dst := make([]byte, len(obj))
		start := time.Now()
		res, err := p.Read(context.Background(), a.addr(), items(1), [][]byte{dst})
		if err != nil || res[0].Err != nil || !bytes.Equal(dst, obj) {
			t.Fatalf("slow read = %+v, %v", res, err)
		}
		if took := time.Since(start); took < stall {
			t.Fatalf("the slow read took %v, less than the stall bound %v: it proves nothing", took, stall)
		}
	})

	t.Run("off", func(t *testing.T) {
		a := startFake(t, func(c net.Conn, br *bufio.Reader) error {
			_, _, err := request(br)
			return err
		})
		p := NewPool(Config{StallTimeout: -1})
		defer p.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 2*stall)
		defer cancel()
		start := time.Now()
		_, err := p.Read(ctx, a.addr(), items(1), [][]byte{make([]byte, 4)})
		if err != context.DeadlineExceeded || time.Since(start) < 2*stall {
			t.Fatalf("with the stall bound off, Read = %v after %v, want context.DeadlineExceeded after %v", err, time.Since(start), 2*stall)
		}
	})
}
