package ctl

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// watch against test doubles of the gateway: a scripted PUB
// (testutil.Publisher) and a ROUTER that serves the snapshot and replay
// requests from a scripted state. The real gateway is exercised elsewhere.

// snapWatchGateway is the scripted state of a gateway process: its epoch,
// the batches it published (the replay ring) and its announced set.
type snapWatchGateway struct {
	t    *testing.T
	pub  *testutil.Publisher
	l    net.Listener
	wg   sync.WaitGroup
	wide bool // snapshot stream format
	enc  *kvevent.Encoder

	mu     sync.Mutex // guards the rest
	conns  map[net.Conn]bool
	epoch  []byte
	seq    uint64
	nextID uint64
	ring   map[uint64][]byte
	set    map[string]bool
}

func newSnapWatchGateway(t *testing.T, wide bool) *snapWatchGateway {
	pub, err := testutil.StartPublisher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pub.Close)
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &snapWatchGateway{t: t, pub: pub, l: l, wide: wide, conns: map[net.Conn]bool{},
		enc: kvevent.NewEncoder(kvevent.EncoderOptions{Envelope: kvevent.Envelope{BackendID: "gw"}, ObjectKey: true})}
	g.restart()
	g.wg.Go(g.accept)
	t.Cleanup(func() {
		l.Close()
		g.mu.Lock()
		for nc := range g.conns {
			nc.Close()
		}
		g.mu.Unlock()
		g.wg.Wait()
	})
	return g
}

// restart is a new gateway process without state: a new epoch, sequence
// and event ids from 1, an empty ring and set.
func (g *snapWatchGateway) restart() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.epoch = bytes.Repeat([]byte{byte(len(g.epoch) + int(g.seq) + 1)}, kvevent.EpochLen)
	g.seq, g.nextID, g.ring, g.set = 0, 1, map[uint64][]byte{}, map[string]bool{}
}

// publish stores keys (one event each) in one batch, live unless lost.
func (g *snapWatchGateway) publish(lost bool, keys ...string) {
	g.t.Helper()
	g.mu.Lock()
	evs := make([]kvevent.Event, len(keys))
	for i, k := range keys {
		evs[i] = kvevent.Event{ID: g.nextID, Type: kvevent.Stored, Tenant: "t", Key: k, Medium: kvevent.MediumCPU}
		g.nextID++
		g.set[k] = true
	}
	p, err := g.enc.AppendBatch(nil, 1000, evs)
	if err != nil {
		g.mu.Unlock()
		g.t.Fatal(err)
	}
	g.seq++
	g.ring[g.seq] = p
	seqF := kvevent.PutSeq(g.seq)
	if g.wide {
		seqF = kvevent.PutSeqEpoch(g.seq, g.epoch)
	}
	g.mu.Unlock()
	if lost {
		return
	}
	if err := g.pub.Send(nil, seqF, p); err != nil {
		g.t.Errorf("publish: %v", err)
	}
}

func (g *snapWatchGateway) waitSub() {
	g.t.Helper()
	ctx, cancel := context.WithTimeout(g.t.Context(), 10*time.Second)
	defer cancel()
	if err := g.pub.WaitSubscriber(ctx); err != nil {
		g.t.Fatal("no subscriber arrived")
	}
}

func (g *snapWatchGateway) endpoint() string { return zmtp.Endpoint(g.l) }

func (g *snapWatchGateway) accept() {
	for {
		nc, err := g.l.Accept()
		if err != nil {
			return
		}
		g.mu.Lock()
		g.conns[nc] = true
		g.mu.Unlock()
		g.wg.Go(func() {
			defer nc.Close()
			c, err := zmtp.Handshake(nc, zmq4.Router, true, 5*time.Second, zmtp.Limits{})
			if err != nil {
				return
			}
			for {
				m, err := c.ReadMessage()
				if err != nil {
					return
				}
				if m.Command != "" {
					continue
				}
				if c.Write(g.answer(m.Frames), 5*time.Second) != nil {
					return
				}
			}
		})
	}
}

// answer serves [b"", "snapshot"] with the set and [b"", seq] with the ring.
func (g *snapWatchGateway) answer(req [][]byte) []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(req) == 2 && string(req[1]) == "snapshot" {
		cut := int64(g.seq)
		if g.seq == 0 {
			cut = kvevent.CutNone
		}
		frames := [][]byte{nil, binary.BigEndian.AppendUint64(nil, uint64(cut)), g.epoch}
		var evs []kvevent.Event
		for k := range g.set {
			evs = append(evs, kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: k, Medium: kvevent.MediumCPU})
		}
		if len(evs) > 0 {
			c, err := g.enc.AppendBatch(nil, 1000, evs)
			if err != nil {
				panic(err)
			}
			frames = append(frames, c)
		}
		return zmtp.AppendMessage(nil, frames...)
	}
	from, _ := kvevent.DecodeSeq(req[len(req)-1])
	var out []byte
	for s := from; s <= g.seq; s++ {
		out = zmtp.AppendMessage(out, nil, nil, kvevent.PutSeq(s), g.ring[s])
	}
	return zmtp.AppendMessage(out, nil, nil, kvevent.PutSeq(kvevent.EndSeq), nil)
}

// snapWatchBuffer is a bytes.Buffer safe to read while watch writes.
type snapWatchBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *snapWatchBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *snapWatchBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// snapWatchStart runs crescentctl watch in the background.
func snapWatchStart(t *testing.T, args ...string) (stdout, stderr *snapWatchBuffer, code <-chan int) {
	t.Helper()
	stdout, stderr = &snapWatchBuffer{}, &snapWatchBuffer{}
	ch := make(chan int, 1)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	done := make(chan struct{})
	go func() {
		defer close(done)
		ch <- Main(ctx, append([]string{"watch"}, args...), strings.NewReader(""), stdout, stderr)
	}()
	t.Cleanup(func() { cancel(); <-done })
	return stdout, stderr, ch
}

// snapWatchLines waits for n JSON lines on stdout.
func snapWatchLines(t *testing.T, out *snapWatchBuffer, n int) []watchEvent {
	t.Helper()
	var rows []watchEvent
	testutil.Eventually(t, 20*time.Second, func() bool {
		rows = rows[:0]
		for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			if line == "" {
				continue
			}
			var ev watchEvent
			if err := json.Unmarshal([]byte(line), &ev); err != nil {
				t.Fatalf("stdout line %q: %v", line, err)
			}
			rows = append(rows, ev)
		}
		return len(rows) >= n
	}, "%d lines on stdout (have %q)", n, out)
	return rows
}

func snapWatchKeys(rows []watchEvent) string {
	var b strings.Builder
	for _, r := range rows {
		k := "?"
		if r.Key != nil {
			k = *r.Key
		}
		if r.Snapshot {
			k = "snap:" + k
		}
		b.WriteString(k)
		b.WriteByte(' ')
	}
	return strings.TrimSpace(b.String())
}

// TestWatchSnapshot: --snapshot prints the gateway's state, then live
// events; a gateway restart (a new epoch) prints one line on stderr and a
// fresh snapshot, and watch goes on.
func TestWatchSnapshot(t *testing.T) {
	gw := newSnapWatchGateway(t, true)
	gw.publish(true, "a")
	gw.publish(true, "b") // before watch started: only the snapshot has them
	out, errOut, code := snapWatchStart(t, "--gateway", gw.pub.Endpoint(), "--snapshot", gw.endpoint(), "--count", "6")
	gw.waitSub()
	rows := snapWatchLines(t, out, 2)
	if got := snapWatchKeys(rows); got != "snap:a snap:b" && got != "snap:b snap:a" {
		t.Fatalf("snapshot lines %q, want a and b", got)
	}
	for _, r := range rows {
		if r.Seq != 2 || r.EventID != 0 || r.EventType != "stored" {
			t.Errorf("snapshot line %+v, want seq 2 (the cut), event_id 0", r)
		}
	}
	gw.publish(false, "c")
	rows = snapWatchLines(t, out, 3)
	if r := rows[2]; r.Seq != 3 || r.Snapshot || *r.Key != "c" {
		t.Fatalf("live line %+v, want c at 3", r)
	}
	// The gateway restarts without state.
	gw.pub.DropConns()
	gw.restart()
	gw.waitSub()
	gw.publish(false, "x")
	rows = snapWatchLines(t, out, 4)
	if r := rows[3]; !r.Snapshot || *r.Key != "x" || r.Seq != 1 {
		t.Fatalf("after the restart %+v, want the new snapshot's x at 1", r)
	}
	gw.publish(false, "y")
	gw.publish(false, "z")
	select {
	case c := <-code:
		if c != ExitOK {
			t.Fatalf("exit %d, stderr %q", c, errOut)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("watch did not finish; stdout %q stderr %q", out, errOut)
	}
	if got := snapWatchKeys(snapWatchLines(t, out, 6)); !strings.HasSuffix(got, "snap:x y z") {
		t.Errorf("lines %q, want the new process's x (snapshot), y, z last", got)
	}
	if e := errOut.String(); strings.Count(e, "crescentctl:") != 1 || !strings.Contains(e, "restarted; rebuilt from its snapshot") {
		t.Errorf("stderr %q, want one rebuild line", e)
	}
}

// TestWatchReplayRestart: without --snapshot, a gateway restart with
// --replay resynchronises from the new process's replay ring; watch goes
// on.
func TestWatchReplayRestart(t *testing.T) {
	gw := newSnapWatchGateway(t, false)
	out, errOut, code := snapWatchStart(t, "--gateway", gw.pub.Endpoint(), "--replay", gw.endpoint(), "--count", "4")
	gw.waitSub()
	gw.publish(false, "a")
	gw.publish(false, "b")
	snapWatchLines(t, out, 2)
	// The gateway restarts without state and publishes x, y, z before watch
	// is back (they reach it only through the new process's replay ring).
	gw.restart()
	gw.mu.Lock()
	gw.nextID = 100 // event ids that do not go back: only replay can tell
	gw.mu.Unlock()
	gw.publish(true, "x")
	gw.publish(true, "y")
	gw.publish(true, "z")
	gw.pub.DropConns()
	gw.waitSub()
	select {
	case c := <-code:
		if c != ExitOK {
			t.Fatalf("exit %d, stderr %q", c, errOut)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("watch did not finish; stdout %q stderr %q", out, errOut)
	}
	if got := snapWatchKeys(snapWatchLines(t, out, 4)); got != "a b x y" {
		t.Errorf("lines %q, want a b then the new process's x y (replayed)", got)
	}
	if e := errOut.String(); !strings.Contains(e, "restarted; resynchronised from its replay ring") {
		t.Errorf("stderr %q, want the resynchronisation line", e)
	}
}

func TestWatchSnapshotUsage(t *testing.T) {
	var out, errb bytes.Buffer
	code := Main(t.Context(), []string{"watch", "--gateway", "tcp://127.0.0.1:1", "--replay", "tcp://127.0.0.1:2", "--from-seq", "1", "--snapshot", "tcp://127.0.0.1:3"},
		strings.NewReader(""), &out, &errb)
	if code != ExitUsage || !strings.Contains(errb.String(), "--from-seq and --snapshot") {
		t.Errorf("exit %d, stderr %q, want a usage error", code, errb.String())
	}
}
