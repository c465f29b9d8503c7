package zmtp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// nullGreeting is a ZMTP 3.0 NULL-mechanism greeting as a client sends it.
func nullGreeting() []byte {
	g := make([]byte, greetingLen)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// longHeader is a frame header with the LONG size form.
func longHeader(flags byte, size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flags | flagLong}, size)
}

// readyBody is a READY command body with the given properties (name, value pairs).
func readyBody(props ...string) []byte {
	b := []byte{5}
	b = append(b, "READY"...)
	for i := 0; i+1 < len(props); i += 2 {
		b = append(b, byte(len(props[i])))
		b = append(b, props[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(props[i+1])))
		b = append(b, props[i+1]...)
	}
	return b
}

// hostileHandshakes are what a peer sends after its greeting instead of a
// sane READY: each must fail the handshake with wantErr, allocating nothing
// near what it announces.
var hostileHandshakes = []struct {
	name    string
	after   []byte // bytes after the greeting
	wantErr error
}{
	{"command 1 GiB", longHeader(flagCommand, 1<<30), ErrFrameTooLarge},
	{"command 2^50", longHeader(flagCommand, 1<<50), ErrFrameTooLarge},
	{"command 2^64-1", longHeader(flagCommand, 1<<64-1), ErrFrameTooLarge},
	{"command just over the cap", longHeader(flagCommand, DefaultMaxCommand+1), ErrFrameTooLarge},
	{"data frame 1 GiB", longHeader(0, 1<<30), ErrProtocol},
	{"data frame 2^50 with more", longHeader(flagMore, 1<<50), ErrProtocol},
	{"short data frame", []byte{0, 3, 'a', 'b', 'c'}, ErrProtocol},
	{"command with more", []byte{flagCommand | flagMore, 6, 5, 'R', 'E', 'A', 'D', 'Y'}, ErrProtocol},
	{"reserved flag bits", []byte{0x84, 0}, ErrProtocol},
	{"empty command", []byte{flagCommand, 0}, ErrProtocol},
	{"command name overflows", []byte{flagCommand, 2, 9, 'R'}, ErrProtocol},
	{"not READY", AppendCommand(nil, "PING", []byte{0, 1}), ErrProtocol},
	// zmq4 indexes past the end of these READY bodies (a panic) if it sees them.
	{"property name overflows", AppendCommand(nil, "READY", []byte{200, 'S'}), ErrProtocol},
	{"property value length truncated", AppendCommand(nil, "READY", []byte{1, 'S', 0, 0}), ErrProtocol},
	{"property value overflows", AppendCommand(nil, "READY", []byte{1, 'S', 0xff, 0xff, 0xff, 0xff, 'x'}), ErrProtocol},
	// zmq4 panics on a missing or unknown Socket-Type.
	{"no Socket-Type", AppendCommand(nil, "READY", readyBody("Identity", "")[6:]), ErrProtocol},
	{"unknown Socket-Type", AppendCommand(nil, "READY", readyBody("Socket-Type", "FOO")[6:]), ErrProtocol},
	{"Socket-Type zmq4 does not find", AppendCommand(nil, "READY", readyBody("SOCKET-TYPE", "SUB")[6:]), ErrProtocol},
}

// TestHandshakeRefusesHostilePeers: a peer that completes the greeting and
// then announces a huge or malformed command is refused before zmq4 reads
// the frame, as server and as client, and nothing of its announced size is
// allocated.
func TestHandshakeRefusesHostilePeers(t *testing.T) {
	for _, server := range []bool{true, false} {
		for _, tt := range hostileHandshakes {
			name := tt.name + "/client"
			if server {
				name = tt.name + "/server"
			}
			t.Run(name, func(t *testing.T) {
				a, b := net.Pipe()
				defer a.Close()
				go func() {
					// The hostile peer: greet, then send tt.after, then
					// swallow whatever we send until closed.
					defer b.Close()
					go io.Copy(io.Discard, b)
					b.Write(nullGreeting())
					b.Write(tt.after)
				}()
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				c, err := Handshake(a, zmq4.Pub, server, 5*time.Second, Limits{})
				runtime.ReadMemStats(&after)
				if err == nil {
					c.Close()
					t.Fatal("Handshake succeeded")
				}
				if !errors.Is(err, tt.wantErr) {
					t.Errorf("Handshake error = %v, want %v", err, tt.wantErr)
				}
				if d := after.TotalAlloc - before.TotalAlloc; d > 1<<20 {
					t.Errorf("Handshake allocated %d bytes", d)
				}
			})
		}
	}
}

// TestHandshakeAcceptsLibzmqReady: READY as libzmq sends it (Socket-Type
// and Identity, the Identity empty or up to 255 bytes, property names in any
// case), in the short and the long size form, is accepted.
func TestHandshakeAcceptsLibzmqReady(t *testing.T) {
	id := string(make([]byte, 255))
	for _, tt := range []struct {
		name  string
		ready []byte
	}{
		{"short", AppendCommand(nil, "READY", readyBody("Socket-Type", "SUB", "Identity", "")[6:])},
		{"long with identity", AppendCommand(nil, "READY", readyBody("socket-type", "SUB", "Identity", id)[6:])},
		{"long form of a short frame", append(longHeader(flagCommand, uint64(len(readyBody("Socket-Type", "SUB")))), readyBody("Socket-Type", "SUB")...)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a, b := net.Pipe()
			defer a.Close()
			go func() {
				go io.Copy(io.Discard, b)
				b.Write(nullGreeting())
				b.Write(tt.ready)
				b.Write(AppendMessage(nil, []byte{1})) // the subscription
			}()
			c, err := Handshake(a, zmq4.Pub, true, 5*time.Second, Limits{})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			defer b.Close()
			if got := c.PeerType(); got != zmq4.Sub {
				t.Errorf("PeerType = %q, want SUB", got)
			}
			m, err := c.ReadMessage()
			if err != nil || len(m.Frames) != 1 || string(m.Frames[0]) != "\x01" {
				t.Errorf("first message after the handshake = %+v, %v; want the subscription", m, err)
			}
		})
	}
}

// FuzzHandshake: whatever a peer sends from its first byte on, the
// handshake as the gateway's PUB and ROUTER sockets run it (server side)
// and as kvevent's subscriber runs it (SUB, client side), with a short
// deadline, never panics, and it succeeds only past a greeting and a READY
// within the command limit.
func FuzzHandshake(f *testing.F) {
	ready := AppendCommand(nil, "READY", readyBody("Socket-Type", "SUB", "Identity", "")[6:])
	f.Add(append(nullGreeting(), ready...))
	f.Add(append(nullGreeting(), AppendCommand(nil, "READY", readyBody("Socket-Type", "DEALER")[6:])...))
	f.Add(append(nullGreeting(), longHeader(flagCommand, 1<<50)...))
	f.Add(append(nullGreeting(), longHeader(0, 1<<30)...))
	f.Add(append(nullGreeting(), AppendCommand(nil, "READY", []byte{200, 'S'})...))
	f.Add(nullGreeting()[:10])
	f.Fuzz(func(t *testing.T, in []byte) {
		for _, side := range []struct {
			typ    zmq4.SocketType
			server bool
		}{{zmq4.Pub, true}, {zmq4.Router, true}, {zmq4.Sub, false}} {
			typ := side.typ
			a, b := net.Pipe()
			done := make(chan struct{})
			go func() {
				defer close(done)
				go io.Copy(io.Discard, b) // our greeting and READY
				b.Write(in)
				b.Close()
			}()
			c, err := Handshake(a, typ, side.server, 200*time.Millisecond, Limits{MaxCommand: 1024})
			a.Close()
			<-done
			if err != nil {
				continue
			}
			c.Close()
			if len(in) < greetingLen+2 {
				t.Fatalf("handshake as %s succeeded on %d bytes", typ, len(in))
			}
			if _, err := readHandshakeCommand(bytes.NewReader(in[greetingLen:]), 1024); err != nil {
				t.Fatalf("handshake as %s succeeded past a bad command: %v", typ, err)
			}
		}
	})
}
