package publisher

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// greeting is a ZMTP 3.0 NULL greeting as a client sends it.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// ready is a READY command announcing socket type typ and an empty Identity,
// as libzmq sends it.
func ready(typ string) []byte {
	var body []byte
	for _, kv := range [][2]string{{"Socket-Type", typ}, {"Identity", ""}} {
		body = append(body, byte(len(kv[0])))
		body = append(body, kv[0]...)
		body = binary.BigEndian.AppendUint32(body, uint32(len(kv[1])))
		body = append(body, kv[1]...)
	}
	return zmtp.AppendCommand(nil, "READY", body)
}

// long is a frame header with the 8-byte size form (flags: 0x04 command,
// 0x01 more; 0x02 long is added).
func long(flags byte, size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flags | 0x02}, size)
}

// hostile connects to ep from the loopback address local ("" for any),
// sends in, and reports whether the gateway then closed the connection
// (within 10s) instead of waiting for more.
func hostile(t *testing.T, ep, local string, in []byte) (closed bool) {
	t.Helper()
	nc := dialFrom(t, ep, local)
	defer nc.Close()
	if _, err := nc.Write(in); err != nil {
		return true // the gateway closed first
	}
	return closedByPeer(nc, 10*time.Second)
}

func dialFrom(t *testing.T, ep, local string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if local != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	}
	nc, err := d.DialContext(t.Context(), "tcp", strings.TrimPrefix(ep, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	return nc
}

// closedByPeer reads (and discards the gateway's greeting and READY) until
// the gateway closes nc, or within is over.
func closedByPeer(nc net.Conn, within time.Duration) bool {
	nc.SetReadDeadline(time.Now().Add(within))
	_, err := io.Copy(io.Discard, nc)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// TestHostilePeersDropped is issue 11 item 1 on the gateway's side: a peer
// on the PUB or the replay port that completes the greeting and announces
// a command or message frame of 1 GiB or 2^50 bytes (or anything else
// over the socket's limits, or malformed) is disconnected and counted; the
// gateway allocates nothing of the announced size, stays up, and still
// delivers to a well-behaved subscriber and replays to a DEALER.
func TestHostilePeersDropped(t *testing.T) {
	cfg := testConfig()
	cfg.ReplayMaxConnsPerPeer = 1024 // every hostile connection gets in
	p := start(t, cfg)
	good := collect(t, p, kvevent.Options{})

	type input struct {
		name string
		in   []byte // after the greeting
	}
	inputs := func(typ string, maxFrame int) []input {
		rd := ready(typ)
		return []input{
			{"READY of 1 GiB", long(0x04, 1<<30)},
			{"READY of 2^50", long(0x04, 1<<50)},
			{"READY of 2^64-1", long(0x04, 1<<64-1)},
			{"READY over the command cap", long(0x04, zmtp.DefaultMaxCommand+1)},
			{"message frame of 1 GiB instead of READY", long(0x01, 1<<30)},
			{"short data frame instead of READY", []byte{0x00, 3, 'a', 'b', 'c'}},
			{"READY with a truncated property", zmtp.AppendCommand(nil, "READY", []byte{200, 'S'})},
			{"READY with an unknown Socket-Type", ready("BOGUS")},
			{"message frame of 1 GiB", append(rd, long(0x00, 1<<30)...)},
			{"message frame of 2^50", append(rd, long(0x01, 1<<50)...)},
			{"message frame of 2^64-1", append(rd, long(0x00, 1<<64-1)...)},
			{"message frame just over the cap", append(rd, long(0x00, uint64(maxFrame)+1)...)},
			{"command frame of 1 GiB", append(rd, long(0x04, 1<<30)...)},
			{"command frame of 2^50", append(rd, long(0x04, 1<<50)...)},
			{"reserved flag bits", append(rd, 0x80, 0)},
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	attempts := uint64(0)
	for _, sock := range []struct {
		name, ep, typ string
		maxFrame      int
	}{
		{"pub", p.PubEndpoint(), "SUB", subLimits.MaxFrame},
		{"replay", p.ReplayEndpoint(), "DEALER", replayLimits.MaxFrame},
	} {
		for _, in := range inputs(sock.typ, sock.maxFrame) {
			t.Run(sock.name+"/"+in.name, func(t *testing.T) {
				dropped := p.Stats().PeersDropped
				if !hostile(t, sock.ep, "", append(greeting(), in.in...)) {
					t.Fatal("the gateway kept the connection open")
				}
				attempts++
				testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PeersDropped == dropped+1 }, "the drop to be counted")
			})
		}
	}
	runtime.ReadMemStats(&after)
	if attempts == 0 {
		t.Fatal("no hostile input was tried")
	}
	// Each of these announced at least a GiB or was refused from its
	// header; together they may not cost more than small buffers.
	if d := after.TotalAlloc - before.TotalAlloc; d > 64<<20 {
		t.Errorf("%d hostile connections allocated %d bytes", attempts, d)
	}

	// Still serving: live delivery and replay.
	p.Enqueue(ev(1))
	testutil.Eventually(t, 20*time.Second, func() bool { return good.events() == 1 }, "the event after the hostile peers")
	n := 0
	if err := kvevent.Replay(t.Context(), p.ReplayEndpoint(), 1, kvevent.ReplayOptions{}, func(kvevent.Batch) error { n++; return nil }); err != nil || n != 1 {
		t.Errorf("Replay after the hostile peers = %d batches, %v; want 1, nil", n, err)
	}
	if st := p.Stats(); st.PeersRefused != 0 {
		t.Errorf("PeersRefused = %d, want 0", st.PeersRefused)
	}
}

// TestHandshakeTimeoutFreesSlots: peers that connect and never complete
// the handshake (silent, or stuck after the greeting) are dropped after
// HandshakeTimeout on both ports, giving their slots back.
func TestHandshakeTimeoutFreesSlots(t *testing.T) {
	cfg := testConfig()
	cfg.MaxSubscribers = 2
	cfg.HandshakeTimeout = 200 * time.Millisecond
	p := start(t, cfg)
	for _, ep := range []string{p.PubEndpoint(), p.ReplayEndpoint()} {
		silent := dialFrom(t, ep, "")
		defer silent.Close()
		greeted := dialFrom(t, ep, "")
		defer greeted.Close()
		if _, err := greeted.Write(greeting()); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for _, nc := range []net.Conn{silent, greeted} {
			if !closedByPeer(nc, 10*time.Second) {
				t.Fatalf("%s: a peer that never finished its handshake is still connected", ep)
			}
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s: half-open peers dropped after %v, want about the 200ms handshake timeout", ep, d)
		}
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PeersDropped == 4 }, "4 drops")
	// Both slots are free again.
	collect(t, p, kvevent.Options{})
	collect(t, p, kvevent.Options{})
	p.Enqueue(ev(1))
	if err := kvevent.Replay(t.Context(), p.ReplayEndpoint(), 1, kvevent.ReplayOptions{}, func(kvevent.Batch) error { return nil }); err != nil {
		t.Errorf("Replay after the half-open peers: %v", err)
	}
}

// TestReplaySlotsPerPeerAndIdle: one remote IP holds at most
// ReplayMaxConnsPerPeer replay connections (more are refused and counted,
// while another IP still gets in), and a connection that sends no request
// for ReplayIdleTimeout is closed, so idle peers give their slots back.
func TestReplaySlotsPerPeerAndIdle(t *testing.T) {
	cfg := testConfig()
	cfg.ReplayMaxConnsPerPeer = 3
	cfg.ReplayIdleTimeout = 500 * time.Millisecond
	p := start(t, cfg)
	p.Enqueue(ev(1))
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().ReplayBatches == 1 }, "a batch")
	ep := p.ReplayEndpoint()

	// Three idle DEALERs from 127.0.0.1 take that IP's slots.
	idle := make([]*zmtp.Conn, 3)
	for i := range idle {
		idle[i] = handshake(t, dialFrom(t, ep, "127.0.0.1"))
		defer idle[i].Close()
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return replayConns(p) == 3 }, "3 replay connections")
	// A fourth from the same IP is refused at once.
	if !closedByPeer(dialFrom(t, ep, "127.0.0.1"), 5*time.Second) {
		t.Fatal("a fourth replay connection from one IP was kept")
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PeersRefused == 1 }, "the refusal to be counted")
	// Another IP is served meanwhile.
	other := handshake(t, dialFrom(t, ep, "127.0.0.2"))
	defer other.Close()
	if err := other.Write(zmtp.AppendMessage(nil, nil, kvevent.PutSeq(1)), time.Second); err != nil {
		t.Fatal(err)
	}
	if m, err := other.ReadMessage(); err != nil || len(m.Frames) != 4 {
		t.Fatalf("replay from another IP = %q, %v; want a 4-frame reply", m.Frames, err)
	}

	// The idle ones are closed after the idle timeout, and counted.
	for i, c := range idle {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.ReadMessage(); err == nil || errors.Is(err, zmtp.ErrProtocol) {
			t.Fatalf("idle connection %d: read = %v, want the gateway to close it", i, err)
		}
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PeersDropped >= 3 }, "the idle drops to be counted")
	// The IP's slots are back.
	if err := kvevent.Replay(t.Context(), ep, 1, kvevent.ReplayOptions{}, func(kvevent.Batch) error { return nil }); err != nil {
		t.Errorf("Replay after the idle peers were dropped: %v", err)
	}
}

func handshake(t *testing.T, nc net.Conn) *zmtp.Conn {
	t.Helper()
	c, err := zmtp.Handshake(nc, zmq4.Dealer, false, 5*time.Second, zmtp.Limits{MaxFrame: 1 << 20})
	if err != nil {
		nc.Close()
		t.Fatal(err)
	}
	return c
}

func replayConns(p *Publisher) int {
	p.mu.Lock()
	r := p.replay
	p.mu.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.conns)
}

// TestPingFloodKeepsItsBatches: a subscriber's queue holds at most
// maxQueuedPongs PONGs; PINGs past them are not answered, and PONGs
// pushed out of a full queue count as unanswered PINGs, not as dropped
// batches, so a subscriber flooding PINGs while it does not read
// neither pushes its own batches out with PONGs nor shows as lagging.
func TestPingFloodKeepsItsBatches(t *testing.T) {
	p := &pubSocket{queueBatches: 8, queueBytes: 1 << 20}
	sc := &subConn{notify: make(chan struct{}, 1)}
	pong := zmtp.AppendCommand(nil, "PONG", []byte("ctx"))
	batch := zmtp.AppendMessage(nil, []byte("topic"), []byte("seq"), []byte("payload"))
	for range 10 {
		sc.push(p, pong, true)
	}
	if len(sc.q) != maxQueuedPongs || sc.pongs != maxQueuedPongs || p.unanswered.Load() != 10-maxQueuedPongs {
		t.Fatalf("after 10 PINGs: %d queued, %d PONGs, %d unanswered; want %d, %d, %d",
			len(sc.q), sc.pongs, p.unanswered.Load(), maxQueuedPongs, maxQueuedPongs, 10-maxQueuedPongs)
	}
	// Eight batches fill the queue: the PONGs go first, as the oldest.
	for range 8 {
		sc.enqueue(p, batch)
	}
	if sc.pongs != 0 || p.unanswered.Load() != 10 || p.droppedBatches.Load() != 0 {
		t.Fatalf("after 8 batches: %d PONGs queued, %d unanswered, %d batches dropped; want 0, 10, 0",
			sc.pongs, p.unanswered.Load(), p.droppedBatches.Load())
	}
	sc.enqueue(p, batch)
	if p.droppedBatches.Load() != 1 || p.droppedBytes.Load() != uint64(len(batch)) || len(sc.q) != 8 {
		t.Fatalf("a ninth batch: %d dropped (%d bytes), %d queued; want 1 (%d bytes), 8",
			p.droppedBatches.Load(), p.droppedBytes.Load(), len(sc.q), len(batch))
	}
	// Once the writer takes the queue, PINGs are answered again.
	sc.q, sc.qBytes, sc.pongs = sc.q[:0], 0, 0
	sc.push(p, pong, true)
	if sc.pongs != 1 || p.unanswered.Load() != 10 {
		t.Fatalf("after the queue was written: %d PONGs queued, %d unanswered; want 1, 10", sc.pongs, p.unanswered.Load())
	}
}
