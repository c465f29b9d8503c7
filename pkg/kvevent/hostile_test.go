package kvevent

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// hostilePub is a raw TCP publisher: the connections it accepts are handed,
// in order, to the scripts given; later ones get the last script.
type hostilePub struct {
	l  net.Listener
	wg sync.WaitGroup
}

// script plays the publisher side of one connection.
type script func(t *testing.T, nc net.Conn)

func newHostilePub(t *testing.T, scripts ...script) *hostilePub {
	t.Helper()
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &hostilePub{l: l}
	p.wg.Go(func() {
		for i := 0; ; i++ {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			run := scripts[min(i, len(scripts)-1)]
			p.wg.Go(func() {
				defer nc.Close()
				nc.SetDeadline(time.Now().Add(20 * time.Second))
				run(t, nc)
			})
		}
	})
	t.Cleanup(func() { l.Close(); p.wg.Wait() })
	return p
}

func (p *hostilePub) endpoint() string { return zmtp.Endpoint(p.l) }

// pubGreeting is a ZMTP 3.0 NULL greeting as a server sends it.
func pubGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11], g[32] = 0xff, 0x7f, 3, 0, 1
	copy(g[12:], "NULL")
	return g
}

func longHdr(flags byte, size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flags | 0x02}, size)
}

// rawHandshake greets, reads the subscriber's greeting, then sends after
// (a READY, or anything) and waits until the subscriber hangs up.
func rawHandshake(after []byte) script {
	return func(t *testing.T, nc net.Conn) {
		nc.Write(pubGreeting())
		var g [64]byte
		if _, err := io.ReadFull(nc, g[:]); err != nil {
			return
		}
		nc.Write(after)
		io.Copy(io.Discard, nc) // until the subscriber closes
	}
}

// handshaken handshakes properly as typ, waits for the first message (the
// subscription or a replay request), then sends raw bytes and waits until
// the peer hangs up.
func handshaken(typ zmq4.SocketType, raw []byte) script {
	return func(t *testing.T, nc net.Conn) {
		c, err := zmtp.Handshake(nc, typ, true, 5*time.Second, zmtp.Limits{})
		if err != nil {
			return
		}
		if _, err := c.ReadMessage(); err != nil {
			return
		}
		c.Write(raw, 5*time.Second)
		io.Copy(io.Discard, nc)
	}
}

// wellBehaved publishes one valid batch with sequence 1 and stays.
func wellBehaved(payload []byte) script {
	return handshaken(zmq4.Pub, zmtp.AppendMessage(nil, nil, PutSeq(1), payload))
}

// TestSubscriberRefusesHostilePublisher is issue 11 item 1 on the
// subscriber's side: a publisher that announces a 1 GiB or 2^50-byte
// command or message frame, a frame over MaxFrame or a message over
// MaxMessage, in the handshake or after it, is disconnected before
// anything of that size is allocated; the error is surfaced (Subscribe's
// error, Stats.ProtocolErrors) and the subscriber carries on with the next
// connection.
func TestSubscriberRefusesHostilePublisher(t *testing.T) {
	const maxFrame, maxMessage = 1 << 20, 1<<20 + 1<<19
	opts := Options{MaxFrame: maxFrame, MaxMessage: maxMessage, ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond, DialTimeout: 5 * time.Second}
	good := wellBehaved(newStream().payload(t, stored("a")))

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	t.Run("handshake", func(t *testing.T) {
		for _, tt := range []struct {
			name    string
			after   []byte
			wantErr error
		}{
			{"READY of 1 GiB", longHdr(0x04, 1<<30), zmtp.ErrFrameTooLarge},
			{"READY of 2^50", longHdr(0x04, 1<<50), zmtp.ErrFrameTooLarge},
			{"message frame of 2^50 instead of READY", longHdr(0x00, 1<<50), zmtp.ErrProtocol},
			{"READY with a truncated property", zmtp.AppendCommand(nil, "READY", []byte{200, 'S'}), zmtp.ErrProtocol},
			{"READY without a Socket-Type", zmtp.AppendCommand(nil, "READY", nil), zmtp.ErrProtocol},
		} {
			t.Run(tt.name, func(t *testing.T) {
				pub := newHostilePub(t, rawHandshake(tt.after), good)
				_, err := Subscribe(t.Context(), pub.endpoint(), opts)
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("Subscribe = %v, want %v", err, tt.wantErr)
				}
				// The next connection is a good one: the same call works.
				var rec recorder
				subscribe(t, pub.endpoint(), rec.opts(opts))
				rec.waitSeqs(t, 1)
			})
		}
	})
	t.Run("data phase", func(t *testing.T) {
		for _, tt := range []struct {
			name string
			raw  []byte
		}{
			{"message frame of 1 GiB", longHdr(0x00, 1<<30)},
			{"message frame of 2^50", longHdr(0x01, 1<<50)},
			{"message frame of 2^64-1", longHdr(0x00, 1<<64-1)},
			{"frame over MaxFrame", longHdr(0x00, maxFrame+1)},
			{"message over MaxMessage", overMaxMessage(maxFrame)},
			{"command frame of 2^50", longHdr(0x04, 1<<50)},
			{"command over the command cap", longHdr(0x04, zmtp.DefaultMaxCommand+1)},
			{"reserved flag bits", []byte{0x40, 0}},
		} {
			t.Run(tt.name, func(t *testing.T) {
				// Connection 0 misbehaves after a clean handshake, connection
				// 1 misbehaves in its handshake, connection 2 publishes.
				pub := newHostilePub(t, handshaken(zmq4.Pub, tt.raw), rawHandshake(longHdr(0x04, 1<<50)), good)
				var rec recorder
				sub := subscribe(t, pub.endpoint(), rec.opts(opts))
				if got := rec.waitSeqs(t, 1); got[0] != 1 {
					t.Errorf("delivered %v, want [1]", got)
				}
				if st := sub.Stats(); st.ProtocolErrors != 2 || st.Reconnects != 1 {
					t.Errorf("ProtocolErrors = %d, Reconnects = %d; want 2 (one per hostile connection) and 1", st.ProtocolErrors, st.Reconnects)
				}
			})
		}
	})
	t.Run("replay", func(t *testing.T) {
		for _, raw := range [][]byte{longHdr(0x00, 1<<50), longHdr(0x01, 1<<30), longHdr(0x04, 1<<50)} {
			router := newHostilePub(t, handshaken(zmq4.Router, raw))
			err := Replay(t.Context(), router.endpoint(), 1, ReplayOptions{MaxFrame: maxFrame, MaxMessage: maxMessage}, func(Batch) error { return nil })
			if !errors.Is(err, zmtp.ErrFrameTooLarge) {
				t.Errorf("Replay from a router announcing %x = %v, want zmtp.ErrFrameTooLarge", raw, err)
			}
		}
	})

	runtime.ReadMemStats(&after)
	// Every case announced at least 1 MiB, most a GiB or more; allocation
	// stays within read buffers and the one legitimate 1 MiB frame.
	if d := after.TotalAlloc - before.TotalAlloc; d > 64<<20 {
		t.Errorf("hostile publishers made the subscriber allocate %d bytes", d)
	}
}

// overMaxMessage is [b"", seq, maxFrame bytes, ...] whose fourth frame
// announces 512 KiB: each frame within maxFrame, the message over
// maxFrame+512 KiB.
func overMaxMessage(maxFrame int) []byte {
	m := zmtp.AppendMessage(nil, nil, PutSeq(1), make([]byte, maxFrame), nil)
	return append(m[:len(m)-2], longHdr(0x00, 1<<19)...) // the last frame's header replaced
}
