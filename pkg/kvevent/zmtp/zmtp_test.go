package zmtp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket starts a writer goroutine that its Close never stops
	// (pubMWriter.run); the interop test below uses one as the reference peer.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// acceptOne accepts one connection on l and handshakes it as typ.
func acceptOne(t *testing.T, l net.Listener, typ zmq4.SocketType) <-chan *Conn {
	t.Helper()
	ch := make(chan *Conn, 1)
	go func() {
		defer close(ch)
		nc, err := l.Accept()
		if err != nil {
			return
		}
		c, err := Handshake(nc, typ, true, 5*time.Second, Limits{})
		if err != nil {
			t.Errorf("handshake: %v", err)
			nc.Close()
			return
		}
		ch <- c
	}()
	return ch
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// Our PUB side talks to zmq4's reference SUB socket.
func TestInteropWithZmq4Sub(t *testing.T) {
	l := listen(t)
	accepted := acceptOne(t, l, zmq4.Pub)
	sub := zmq4.NewSub(t.Context())
	defer sub.Close()
	if err := sub.Dial(Endpoint(l)); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	c := <-accepted
	if c == nil {
		t.Fatal("no connection")
	}
	defer c.Close()
	if got := c.PeerType(); got != zmq4.Sub {
		t.Errorf("PeerType = %q, want SUB", got)
	}
	m, err := c.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Frames) != 1 || !bytes.Equal(m.Frames[0], []byte{1}) {
		t.Fatalf("subscription = %+v, want one frame \\x01", m)
	}
	want := [][]byte{{}, {0, 0, 0, 0, 0, 0, 0, 1}, bytes.Repeat([]byte("p"), 300)}
	if err := c.Write(AppendMessage(nil, want...), time.Second); err != nil {
		t.Fatal(err)
	}
	got, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(got.Frames, want, bytes.Equal) {
		t.Errorf("zmq4 SUB got %q, want %q", got.Frames, want)
	}
}

// Our SUB side talks to zmq4's reference PUB socket.
func TestInteropWithZmq4Pub(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + pub.Addr().String()
	c, err := Dial(t.Context(), ep, zmq4.Sub, 5*time.Second, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Write(AppendMessage(nil, []byte{1}), time.Second); err != nil {
		t.Fatal(err)
	}
	want := [][]byte{{}, {0, 0, 0, 0, 0, 0, 0, 9}, []byte("payload")}
	got := make(chan Message, 1)
	go func() {
		m, err := c.ReadMessage()
		if err == nil {
			got <- m
		}
		close(got)
	}()
	// The subscription reaches the PUB asynchronously: publish until it lands.
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case m := <-got:
			if !slices.EqualFunc(m.Frames, want, bytes.Equal) {
				t.Fatalf("got %q, want %q", m.Frames, want)
			}
			return
		case <-tick.C:
			if err := pub.Send(zmq4.NewMsgFrom(want...)); err != nil {
				t.Fatal(err)
			}
		case <-deadline:
			t.Fatal("no message from zmq4 PUB")
		}
	}
}

// zmq4's DEALER reaches our ROUTER side with the replay request framing.
func TestInteropWithZmq4Dealer(t *testing.T) {
	l := listen(t)
	accepted := acceptOne(t, l, zmq4.Router)
	dealer := zmq4.NewDealer(t.Context())
	defer dealer.Close()
	if err := dealer.Dial(Endpoint(l)); err != nil {
		t.Fatal(err)
	}
	c := <-accepted
	if c == nil {
		t.Fatal("no connection")
	}
	defer c.Close()
	req := [][]byte{{}, {0, 0, 0, 0, 0, 0, 0, 5}}
	if err := dealer.Send(zmq4.NewMsgFrom(req...)); err != nil {
		t.Fatal(err)
	}
	m, err := c.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(m.Frames, req, bytes.Equal) {
		t.Fatalf("request = %q, want %q", m.Frames, req)
	}
	reply := [][]byte{{}, {}, {0, 0, 0, 0, 0, 0, 0, 5}, []byte("x")}
	if err := c.Write(AppendMessage(nil, reply...), time.Second); err != nil {
		t.Fatal(err)
	}
	got, err := dealer.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(got.Frames, reply, bytes.Equal) {
		t.Errorf("dealer got %q, want %q", got.Frames, reply)
	}
}

func TestHandshakeRejects(t *testing.T) {
	t.Run("silent peer times out", func(t *testing.T) {
		a, b := net.Pipe()
		defer b.Close()
		start := time.Now()
		_, err := Handshake(a, zmq4.Pub, true, 50*time.Millisecond, Limits{})
		if err == nil {
			t.Fatal("Handshake with a silent peer succeeded")
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("Handshake took %v, want about the 50ms timeout", d)
		}
	})
	t.Run("incompatible socket types", func(t *testing.T) {
		l := listen(t)
		accepted := make(chan error, 1)
		go func() {
			nc, err := l.Accept()
			if err != nil {
				accepted <- err
				return
			}
			defer nc.Close()
			_, err = Handshake(nc, zmq4.Pub, true, 5*time.Second, Limits{})
			accepted <- err
		}()
		c, err := Dial(t.Context(), Endpoint(l), zmq4.Pub, 5*time.Second, Limits{})
		if err == nil {
			c.Close()
			t.Error("PUB dialing PUB succeeded")
		}
		if err := <-accepted; err == nil {
			t.Error("PUB accepted PUB")
		}
	})
	t.Run("dial honours ctx", func(t *testing.T) {
		l := listen(t) // accepts at kernel level but never handshakes
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		_, err := Dial(ctx, Endpoint(l), zmq4.Sub, time.Minute, Limits{})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Dial = %v, want context.DeadlineExceeded", err)
		}
	})
}

func TestReaderLimits(t *testing.T) {
	long := func(n int) []byte { return AppendMessage(nil, make([]byte, n)) }
	tests := []struct {
		name    string
		in      []byte
		lim     Limits
		want    Message
		wantErr error
	}{
		{"message", AppendMessage(nil, []byte("a"), nil, []byte("bc")), Limits{}, Message{Frames: [][]byte{[]byte("a"), {}, []byte("bc")}}, nil},
		{"long frame", long(300), Limits{}, Message{Frames: [][]byte{make([]byte, 300)}}, nil},
		{"command", AppendCommand(nil, "PING", []byte{0, 1}), Limits{}, Message{Command: "PING", Frames: [][]byte{{0, 1}}}, nil},
		{"frame too large", long(300), Limits{MaxFrame: 299}, Message{}, ErrFrameTooLarge},
		{"huge announced size", []byte{flagLong, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, Limits{}, Message{}, ErrFrameTooLarge},
		{"too many frames", AppendMessage(nil, nil, nil, nil), Limits{MaxFrames: 2}, Message{}, ErrProtocol},
		{"reserved bits", []byte{0x80, 0}, Limits{}, Message{}, ErrProtocol},
		{"command with more", []byte{flagCommand | flagMore, 1, 0}, Limits{}, Message{}, ErrProtocol},
		{"command name overflows", []byte{flagCommand, 2, 5, 'a'}, Limits{}, Message{}, ErrProtocol},
		{"truncated body", []byte{0, 5, 'a'}, Limits{}, Message{}, io.ErrUnexpectedEOF},
		{"truncated after more", []byte{flagMore, 1, 'a'}, Limits{}, Message{}, io.EOF},
		{"message too large", AppendMessage(nil, make([]byte, 200), make([]byte, 200)), Limits{MaxMessage: 399}, Message{}, ErrMessageTooLarge},
		{"message at its limit", AppendMessage(nil, make([]byte, 200), make([]byte, 200)), Limits{MaxMessage: 400}, Message{Frames: [][]byte{make([]byte, 200), make([]byte, 200)}}, nil},
		{"command too large", AppendCommand(nil, "PING", make([]byte, 100)), Limits{MaxCommand: 100}, Message{}, ErrFrameTooLarge},
		{"huge command", []byte{flagCommand | flagLong, 0, 4, 0, 0, 0, 0, 0, 0}, Limits{MaxFrame: 1 << 60}, Message{}, ErrFrameTooLarge},
		{"huge MaxFrame leaves MaxMessage unbounded", AppendMessage(nil, []byte("a")), Limits{MaxFrame: 1 << 60}, Message{Frames: [][]byte{[]byte("a")}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := NewReader(bytes.NewReader(tt.in), tt.lim).ReadMessage()
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("ReadMessage error = %v, want %v", err, tt.wantErr)
			}
			if err == nil && (got.Command != tt.want.Command || !slices.EqualFunc(got.Frames, tt.want.Frames, bytes.Equal)) {
				t.Errorf("ReadMessage = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestReaderAllocatesAsBytesArrive: a frame within the limits whose bytes
// never come holds memory in proportion to what arrived, not to what its
// header announced; one that does arrive is read whole.
func TestReaderAllocatesAsBytesArrive(t *testing.T) {
	const announced = 48 << 20
	in := binary.BigEndian.AppendUint64([]byte{flagLong}, announced)
	in = append(in, make([]byte, 100<<10)...) // 100 KiB of it, then EOF
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := NewReader(bytes.NewReader(in), Limits{MaxFrame: 64 << 20}).ReadMessage()
	runtime.ReadMemStats(&after)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("ReadMessage = %v, want io.ErrUnexpectedEOF", err)
	}
	if d := after.TotalAlloc - before.TotalAlloc; d > 1<<20 {
		t.Errorf("reading 100 KiB of an announced 48 MiB frame allocated %d bytes", d)
	}
	whole := make([]byte, 3<<20+17)
	for i := range whole {
		whole[i] = byte(i)
	}
	m, err := NewReader(bytes.NewReader(AppendMessage(nil, whole)), Limits{MaxFrame: 64 << 20}).ReadMessage()
	if err != nil || len(m.Frames) != 1 || !bytes.Equal(m.Frames[0], whole) {
		t.Errorf("a 3 MiB frame read back wrong (err %v)", err)
	}
}

func TestSplitEndpoint(t *testing.T) {
	tests := []struct {
		ep, network, addr string
		ok                bool
	}{
		{"tcp://*:5557", "tcp", ":5557", true},
		{"tcp://127.0.0.1:5557", "tcp", "127.0.0.1:5557", true},
		{"tcp://[::1]:5557", "tcp", "[::1]:5557", true},
		{"ipc:///tmp/kv.sock", "unix", "/tmp/kv.sock", true},
		{"tcp://nohost", "", "", false},
		{"udp://*:1", "", "", false},
		{"ipc://", "", "", false},
	}
	for _, tt := range tests {
		n, a, err := SplitEndpoint(tt.ep)
		if (err == nil) != tt.ok || n != tt.network || a != tt.addr {
			t.Errorf("SplitEndpoint(%q) = %q, %q, %v; want %q, %q, ok=%v", tt.ep, n, a, err, tt.network, tt.addr, tt.ok)
		}
	}
}

// FuzzReader: arbitrary bytes from a peer never panic the frame reader nor
// make it allocate beyond its limits, and what it accepts re-encodes to the
// same bytes.
func FuzzReader(f *testing.F) {
	f.Add(AppendMessage(nil, []byte{}, []byte{0, 0, 0, 0, 0, 0, 0, 1}, []byte("payload")))
	f.Add(AppendCommand(nil, "SUBSCRIBE", nil))
	f.Add([]byte{flagLong, 0, 0, 0, 0, 0, 0, 1, 0})
	f.Fuzz(func(t *testing.T, in []byte) {
		r := NewReader(bytes.NewReader(in), Limits{MaxFrame: 4096, MaxFrames: 8})
		var out []byte
		for {
			m, err := r.ReadMessage()
			if err != nil {
				break
			}
			if len(m.Frames) > 8 {
				t.Fatalf("%d frames beyond the limit", len(m.Frames))
			}
			if m.Command != "" {
				out = AppendCommand(out, m.Command, m.Frames[0])
			} else {
				out = AppendMessage(out, m.Frames...)
			}
		}
		// Re-encoding uses the shortest size form; inputs may use long
		// forms for short frames, so only check decoding is stable.
		r2 := NewReader(bytes.NewReader(out), Limits{MaxFrame: 4096, MaxFrames: 8})
		for {
			if _, err := r2.ReadMessage(); err != nil {
				if !errors.Is(err, io.EOF) {
					t.Fatalf("re-encoded stream fails to decode: %v", err)
				}
				break
			}
		}
	})
}
