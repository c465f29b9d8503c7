package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// pySub is one e2e/testdata/strict_subscriber.py process: a consumer on
// real libzmq written from a document (the contract, or llm-d's snapshot
// consumer), not from Crescent's Go code.
type pySub struct {
	t    testing.TB
	mode string
	in   io.WriteCloser
	out  *bufio.Scanner
	mu   sync.Mutex // one dump at a time
}

type pyDump struct {
	Ready bool           `json:"ready"`
	Index [][3]string    `json:"index"`
	Stats map[string]any `json:"stats"`
}

// python finds a python3 with zmq and msgpack. CI installs them
// (.ci/run); elsewhere the test skips, except under CI=true.
func python(t testing.TB) string {
	t.Helper()
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if exec.Command(py, "-c", "import zmq, msgpack").Run() == nil {
			return py
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("python3 with zmq and msgpack is required under CI (apt-get install python3-zmq python3-msgpack)")
	}
	t.Skip("no python3 with zmq and msgpack (Debian: python3-zmq python3-msgpack)")
	return ""
}

func startPySub(t testing.TB, c *Cluster, py, mode string) *pySub {
	t.Helper()
	cmd := exec.Command(py, "testdata/strict_subscriber.py", "--mode", mode,
		"--pub", c.GatewayPub, "--replay", c.GatewayRepl, "--snapshot", c.GatewaySnap)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() && stderr.Len() > 0 {
			t.Logf("==== strict_subscriber.py --mode %s stderr\n%s", mode, tail(stderr.String(), 40))
		}
	})
	p := &pySub{t: t, mode: mode, in: in, out: bufio.NewScanner(out)}
	p.out.Buffer(make([]byte, 1<<20), 256<<20)
	if !p.out.Scan() {
		t.Fatalf("strict_subscriber.py did not start: %v\n%s", p.out.Err(), stderr.String())
	}
	return p
}

func (p *pySub) dump() (pyDump, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, err := io.WriteString(p.in, "dump\n"); err != nil {
		return pyDump{}, err
	}
	if !p.out.Scan() {
		return pyDump{}, fmt.Errorf("subscriber exited: %v", p.out.Err())
	}
	var d pyDump
	err := json.Unmarshal(p.out.Bytes(), &d)
	return d, err
}

// waitEqual waits until the subscriber is ready and its index equals the
// master's readable set; it returns the subscriber's stats then.
func (p *pySub) waitEqual(t testing.TB, c *Cluster, step string) map[string]any {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	var stats map[string]any
	err := testutil.Poll(t, 30*time.Second, func() error {
		d, err := p.dump()
		if err != nil {
			return err
		}
		stats = d.Stats
		if !d.Ready {
			return errors.New("subscriber not ready (bootstrapping)")
		}
		idx := make([]kvevent.Key, 0, len(d.Index))
		for _, k := range d.Index {
			m := kvevent.MediumCPU
			if k[2] == "disk" {
				m = kvevent.MediumDisk
			}
			idx = append(idx, kvevent.Key{Tenant: k[0], Key: k[1], Medium: m})
		}
		master, err := c.readable(ctx)
		if err != nil {
			return err
		}
		if diff := sameSet(idx, master); diff != "" {
			return errors.New(diff)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: %s subscriber never matched the master: %v (stats %v)", step, p.mode, err, stats)
	}
	t.Logf("%s: %s subscriber equals the master; stats %v", step, p.mode, stats)
	return stats
}

// TestGatewayRestartStrictSubscribers: subscribers that stay attached
// while the gateway is killed (SIGKILL) and started again — on a quiet
// cache, where nothing happens after the restart, and on a busy one — and
// stopped cleanly hold the master's readable set after every step: in the
// Mooncake format by the continued sequence plus replay (a contract-only
// subscriber), in the snapshot format by epoch, heartbeats and snapshots
// (llm-d's consumer).
func TestGatewayRestartStrictSubscribers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mode  string
		flags []string
	}{
		{"mooncake format, contract subscriber", "contract", nil},
		{"snapshot format, llm-d consumer", "llmd", []string{"--stream-format", "snapshot", "--topic", "kv@{pub}@e2e-model"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			py := python(t)
			c := StartCluster(t, Options{Agents: 2, Gateway: true, GatewayFlags: tc.flags})
			sub := startPySub(t, c, py, tc.mode)
			ctx := ctxT(t, 3*time.Minute)
			cl := c.Client("default")
			put := func(key string) {
				t.Helper()
				if err := cl.Put(ctx, key, []byte(key)); err != nil {
					t.Fatalf("put %s: %v", key, err)
				}
			}
			for i := range 30 {
				put(fmt.Sprintf("a/%02d", i))
			}
			sub.waitEqual(t, c, "initial")
			before := c.gatewayStatus(t)
			if before.State != "new" || before.PublisherEpoch == "" {
				t.Fatalf("first start: status %+v, want state new with an epoch", before)
			}

			// Quiet: killed; 20 stored and a prefix removed while it is
			// down; started; nothing happens afterwards.
			c.Gateway.Kill()
			for i := range 20 {
				put(fmt.Sprintf("b/%02d", i))
			}
			if _, _, err := cl.RemoveByPrefix(ctx, "a/1", true); err != nil {
				t.Fatal(err)
			}
			c.Gateway.Restart()
			sub.waitEqual(t, c, "quiet SIGKILL restart")
			after := c.gatewayStatus(t)
			if after.State != "restored" || after.PublisherEpoch != before.PublisherEpoch || after.LastSequence <= before.LastSequence {
				t.Fatalf("after SIGKILL: status %+v, want state restored, epoch %s, sequence past %d", after, before.PublisherEpoch, before.LastSequence)
			}

			// Busy: a writer stores and removes throughout the kill.
			var stop atomic.Bool
			var done atomic.Int64
			var wg sync.WaitGroup
			wg.Go(func() {
				for i := 0; !stop.Load(); i++ {
					if err := cl.Put(ctx, fmt.Sprintf("busy/%04d", i), []byte("x")); err != nil && ctx.Err() == nil {
						t.Errorf("busy put: %v", err)
						return
					}
					if i >= 10 {
						_ = cl.Remove(ctx, fmt.Sprintf("busy/%04d", i-10), true)
					}
					done.Add(1)
				}
			})
			// The load runs before the kill, while the gateway is down, and
			// after it is back.
			progress := func(n int64) {
				t.Helper()
				at := done.Load()
				testutil.Eventually(t, 30*time.Second, func() bool { return done.Load() >= at+n }, "%d more busy puts", n)
			}
			progress(30)
			c.Gateway.Kill()
			progress(30)
			c.Gateway.Restart()
			progress(30)
			stop.Store(true)
			wg.Wait()
			sub.waitEqual(t, c, "busy SIGKILL restart")

			// Clean stop: the final checkpoint; changes while down.
			c.Gateway.Stop()
			put("c/after-sigterm")
			c.Gateway.Restart()
			stats := sub.waitEqual(t, c, "SIGTERM restart")
			if st := c.gatewayStatus(t); st.State != "restored" || st.PublisherEpoch != before.PublisherEpoch {
				t.Fatalf("after SIGTERM: status %+v, want the same epoch restored", st)
			}
			if tc.mode == "llmd" {
				// Idle now: heartbeats keep the consumer's publisher alive.
				testutil.EventuallyNoError(t, 10*time.Second, func() error {
					d, err := sub.dump()
					if err != nil {
						return err
					}
					if n, _ := d.Stats["heartbeats"].(float64); n < 2 {
						return fmt.Errorf("%v heartbeats received", n)
					}
					return nil
				})
			}
			if tc.mode == "contract" {
				for _, k := range []string{"resets", "unrepaired", "malformed"} {
					if n, _ := stats[k].(float64); n != 0 {
						t.Errorf("contract subscriber %s = %v; want 0 (stats %v)", k, n, stats)
					}
				}
			}
		})
	}
}

// TestGatewayStateLost: a gateway whose state directory is unreadable
// starts a new publisher epoch and says so; the llm-d consumer rebuilds
// on the epoch change and matches the master again.
func TestGatewayStateLost(t *testing.T) {
	py := python(t)
	c := StartCluster(t, Options{Agents: 1, Gateway: true, GatewayFlags: []string{"--stream-format", "snapshot", "--topic", "kv@{pub}@e2e-model"}})
	sub := startPySub(t, c, py, "llmd")
	ctx := ctxT(t, 2*time.Minute)
	cl := c.Client("default")
	for i := range 10 {
		if err := cl.Put(ctx, fmt.Sprintf("k/%d", i), []byte("v")); err != nil {
			t.Fatal(err)
		}
	}
	sub.waitEqual(t, c, "initial")
	before := c.gatewayStatus(t)
	c.Gateway.Stop()
	testutil.FlipByte(t, filepath.Join(c.GatewayState, "checkpoint"), 40)
	if err := cl.Remove(ctx, "k/0", true); err != nil {
		t.Fatal(err)
	}
	c.Gateway.Restart()
	st := c.gatewayStatus(t)
	if st.State != "reset" || st.StateError == "" || st.PublisherEpoch == before.PublisherEpoch {
		t.Fatalf("status after a corrupt checkpoint = %+v; want state reset with a reason and a new epoch", st)
	}
	stats := sub.waitEqual(t, c, "after state reset")
	if n, _ := stats["bootstraps"].(float64); n < 2 {
		t.Errorf("llm-d consumer bootstrapped %v times; want a rebuild on the new epoch", n)
	}
}
