// Package zmtp carries ZeroMQ messages over a net.Conn: the ZMTP 3.0
// greeting and NULL-security handshake come from github.com/go-zeromq/zmq4
// (zmq4.Open, which also checks socket-type compatibility), and the data
// phase is framed here, with bounded frame sizes and whole-message writes.
//
// Why not zmq4's sockets directly: its PUB socket queues every message
// without limit (or silently drops past an HWM with no count) and one
// blocking writer goroutine serves every subscriber, so a SUB that connects
// and never reads stalls all others and grows the queue; its reader
// allocates whatever frame size a peer announces; its accept loop runs each
// handshake inline with no deadline; and replying to a PING writes from the
// reading goroutine. Owning the framing lets the gateway keep one writer per
// connection, bounded per-subscriber queues, handshake deadlines and frame
// limits, while interoperating with libzmq (pyzmq) peers. zmq4.Open still
// runs the handshake, but only over bytes a guard has checked first (see
// handshakeGuard): no peer input reaches zmq4's allocating reader unchecked.
package zmtp

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// Frame flag bits (ZMTP 3.0, RFC 23).
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

// greetingLen is the size of a ZMTP 3.x greeting.
const greetingLen = 64

// DefaultMaxCommand is the default bound on a command frame (Limits.MaxCommand).
// libzmq's READY (Socket-Type and an Identity of at most 255 bytes) is under
// 300 bytes; PING, PONG, SUBSCRIBE and CANCEL are smaller still.
const DefaultMaxCommand = 4 << 10

// Errors. A peer that violates the protocol or a limit gets one of these
// (wrapped) and should be disconnected.
var (
	ErrProtocol        = errors.New("zmtp: protocol violation")
	ErrFrameTooLarge   = errors.New("zmtp: frame too large")
	ErrMessageTooLarge = errors.New("zmtp: message too large")
)

// Limits bound what a Reader and a Handshake accept from a peer. Each is
// checked against the size a frame header announces, before anything of
// that size is allocated.
type Limits struct {
	// MaxFrame is the largest data frame body accepted (bytes; default 1 MiB).
	MaxFrame int
	// MaxFrames is the most frames in one message (default 16).
	MaxFrames int
	// MaxMessage is the largest message accepted: the sum of its data frame
	// bodies (bytes; default MaxFrame × MaxFrames, which bounds it anyway).
	MaxMessage int
	// MaxCommand is the largest command frame body accepted, in the
	// handshake (READY) and after it (default DefaultMaxCommand).
	MaxCommand int
}

func (lim Limits) withDefaults() Limits {
	if lim.MaxFrame <= 0 {
		lim.MaxFrame = 1 << 20
	}
	if lim.MaxFrames <= 0 {
		lim.MaxFrames = 16
	}
	if lim.MaxMessage <= 0 {
		lim.MaxMessage = math.MaxInt
		if lim.MaxFrame <= math.MaxInt/lim.MaxFrames {
			lim.MaxMessage = lim.MaxFrame * lim.MaxFrames
		}
	}
	if lim.MaxCommand <= 0 {
		lim.MaxCommand = DefaultMaxCommand
	}
	return lim
}

// Message is one ZMTP message: data frames, or a command (Command set,
// Frames holds its one body).
type Message struct {
	Frames  [][]byte
	Command string
}

// Reader reads ZMTP data-phase traffic with limits. It is not safe for
// concurrent use; one goroutine reads a connection.
type Reader struct {
	r   *bufio.Reader
	lim Limits
}

// readChunk is the most a Reader allocates ahead of the bytes that arrive:
// a frame up to this size is read into one buffer of its size; a larger one
// grows as its bytes come in, so a peer that announces a large frame and
// sends little of it holds little memory.
const readChunk = 64 << 10

// NewReader wraps r. Its read buffer is sized to the limits (4 KiB for a
// socket that only receives small frames, at most 64 KiB).
func NewReader(r io.Reader, lim Limits) *Reader {
	lim = lim.withDefaults()
	size := min(max(lim.MaxFrame, lim.MaxCommand)+9, readChunk)
	return &Reader{r: bufio.NewReaderSize(r, max(size, 4<<10)), lim: lim}
}

// ReadMessage reads the next complete message or command. A frame larger
// than the limits is refused from its header (ErrFrameTooLarge,
// ErrMessageTooLarge); after any error the connection should be closed.
func (r *Reader) ReadMessage() (Message, error) {
	var m Message
	total := 0 // data bytes in m
	for {
		flags, err := r.r.ReadByte()
		if err != nil {
			return Message{}, err
		}
		if flags&^(flagMore|flagLong|flagCommand) != 0 {
			return Message{}, fmt.Errorf("%w: reserved flag bits %#x", ErrProtocol, flags)
		}
		var size uint64
		if flags&flagLong != 0 {
			var b [8]byte
			if _, err := io.ReadFull(r.r, b[:]); err != nil {
				return Message{}, unexpected(err)
			}
			size = binary.BigEndian.Uint64(b[:])
		} else {
			c, err := r.r.ReadByte()
			if err != nil {
				return Message{}, unexpected(err)
			}
			size = uint64(c)
		}
		if flags&flagCommand != 0 {
			if size > uint64(r.lim.MaxCommand) {
				return Message{}, fmt.Errorf("%w: %d-byte command (max %d)", ErrFrameTooLarge, size, r.lim.MaxCommand)
			}
		} else {
			if size > uint64(r.lim.MaxFrame) {
				return Message{}, fmt.Errorf("%w: %d bytes (max %d)", ErrFrameTooLarge, size, r.lim.MaxFrame)
			}
			if size > uint64(r.lim.MaxMessage-total) {
				return Message{}, fmt.Errorf("%w: over %d bytes", ErrMessageTooLarge, r.lim.MaxMessage)
			}
			total += int(size)
		}
		body, err := r.readBody(int(size))
		if err != nil {
			return Message{}, err
		}
		if flags&flagCommand != 0 {
			if len(m.Frames) > 0 || flags&flagMore != 0 {
				return Message{}, fmt.Errorf("%w: command inside a multi-frame message", ErrProtocol)
			}
			if len(body) == 0 || int(body[0]) > len(body)-1 {
				return Message{}, fmt.Errorf("%w: malformed command", ErrProtocol)
			}
			n := int(body[0])
			return Message{Command: string(body[1 : 1+n]), Frames: [][]byte{body[1+n:]}}, nil
		}
		if len(m.Frames) == r.lim.MaxFrames {
			return Message{}, fmt.Errorf("%w: more than %d frames", ErrProtocol, r.lim.MaxFrames)
		}
		m.Frames = append(m.Frames, body)
		if flags&flagMore == 0 {
			return m, nil
		}
	}
}

// readBody reads a frame body of size bytes (already checked against the
// limits), allocating at most readChunk, or twice what has arrived, ahead.
func (r *Reader) readBody(size int) ([]byte, error) {
	if size <= readChunk {
		body := make([]byte, size)
		if _, err := io.ReadFull(r.r, body); err != nil {
			return nil, unexpected(err)
		}
		return body, nil
	}
	body := make([]byte, 0, readChunk)
	for len(body) < size {
		if len(body) == cap(body) {
			body = slices.Grow(body, min(len(body), size-len(body)))
		}
		n := min(cap(body), size) - len(body)
		m, err := io.ReadFull(r.r, body[len(body):len(body)+n])
		body = body[:len(body)+m]
		if err != nil {
			return nil, unexpected(err)
		}
	}
	return body, nil
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// AppendMessage appends the wire form of a message with the given frames.
func AppendMessage(dst []byte, frames ...[]byte) []byte {
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags |= flagMore
		}
		dst = appendFrameHeader(dst, flags, len(f))
		dst = append(dst, f...)
	}
	return dst
}

// AppendCommand appends the wire form of a command frame.
func AppendCommand(dst []byte, name string, body []byte) []byte {
	dst = appendFrameHeader(dst, flagCommand, 1+len(name)+len(body))
	dst = append(dst, byte(len(name)))
	dst = append(dst, name...)
	return append(dst, body...)
}

// IsCommand reports whether wire, a message's wire form as AppendMessage
// or AppendCommand make it, is a command (PING, PONG, SUBSCRIBE...).
func IsCommand(wire []byte) bool { return len(wire) > 0 && wire[0]&flagCommand != 0 }

func appendFrameHeader(dst []byte, flags byte, n int) []byte {
	if n > 255 {
		dst = append(dst, flags|flagLong)
		return binary.BigEndian.AppendUint64(dst, uint64(n))
	}
	return append(dst, flags, byte(n))
}

// Conn is a handshaken ZMTP connection. Reads go through ReadMessage (one
// reading goroutine); writes through Write (one writing goroutine).
type Conn struct {
	nc  net.Conn
	zc  *zmq4.Conn
	rd  *Reader
	typ zmq4.SocketType
}

// Handshake runs the ZMTP greeting and NULL handshake on nc as a socket of
// type typ, within timeout, and checks the peer's type is compatible. The
// peer's greeting and READY are checked before zmq4 parses them: a command
// frame over lim.MaxCommand fails with ErrFrameTooLarge, and a data frame,
// a command other than READY or malformed READY properties with ErrProtocol,
// each before anything of the announced size is allocated. The caller
// closes nc on error.
func Handshake(nc net.Conn, typ zmq4.SocketType, server bool, timeout time.Duration, lim Limits) (*Conn, error) {
	lim = lim.withDefaults()
	if timeout > 0 {
		if err := nc.SetDeadline(time.Now().Add(timeout)); err != nil {
			return nil, err
		}
	}
	g := &handshakeGuard{Conn: nc, maxCommand: lim.MaxCommand}
	zc, err := zmq4.Open(g, null.Security(), typ, zmq4.SocketIdentity(""), server, nil)
	if err != nil {
		return nil, err
	}
	if err := nc.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	return &Conn{nc: nc, zc: zc, rd: NewReader(nc, lim), typ: typ}, nil
}

// PeerType is the peer's socket type from its READY metadata.
func (c *Conn) PeerType() zmq4.SocketType {
	return zmq4.SocketType(c.zc.Peer.Meta["Socket-Type"])
}

// ReadMessage reads the next message or command.
func (c *Conn) ReadMessage() (Message, error) { return c.rd.ReadMessage() }

// Write writes pre-framed bytes (AppendMessage output) with an optional
// deadline (0: none).
func (c *Conn) Write(b []byte, timeout time.Duration) error {
	bufs := net.Buffers{b}
	return c.WriteBuffers(&bufs, timeout)
}

// WriteBuffers writes several pre-framed messages in one vectored write.
func (c *Conn) WriteBuffers(bufs *net.Buffers, timeout time.Duration) error {
	if timeout > 0 {
		if err := c.nc.SetWriteDeadline(time.Now().Add(timeout)); err != nil {
			return err
		}
	}
	_, err := bufs.WriteTo(c.nc)
	return err
}

// SetReadDeadline sets the read deadline of the underlying connection.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.nc.SetReadDeadline(t) }

// RemoteAddr is the peer's address.
func (c *Conn) RemoteAddr() net.Addr { return c.nc.RemoteAddr() }

// Close closes the connection; it unblocks a pending read or write.
func (c *Conn) Close() error { return c.nc.Close() }

// SplitEndpoint turns a ZMQ endpoint into a Go network and address:
// tcp://*:5557 → ("tcp", ":5557"), tcp://host:5557, ipc:///path → ("unix", "/path").
func SplitEndpoint(ep string) (network, addr string, err error) {
	switch {
	case strings.HasPrefix(ep, "tcp://"):
		addr = strings.TrimPrefix(ep, "tcp://")
		if strings.HasPrefix(addr, "*:") {
			addr = addr[1:]
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return "", "", fmt.Errorf("zmtp: endpoint %q: %w", ep, err)
		}
		return "tcp", addr, nil
	case strings.HasPrefix(ep, "ipc://"):
		addr = strings.TrimPrefix(ep, "ipc://")
		if addr == "" {
			return "", "", fmt.Errorf("zmtp: endpoint %q: empty path", ep)
		}
		return "unix", addr, nil
	default:
		return "", "", fmt.Errorf("zmtp: endpoint %q: want tcp://host:port or ipc://path", ep)
	}
}

// Listen binds a ZMQ endpoint.
func Listen(ep string) (net.Listener, error) {
	network, addr, err := SplitEndpoint(ep)
	if err != nil {
		return nil, err
	}
	return net.Listen(network, addr)
}

// Endpoint renders a bound listener as a dialable endpoint (tcp://127.0.0.1:port
// for a wildcard bind).
func Endpoint(l net.Listener) string {
	switch a := l.Addr().(type) {
	case *net.TCPAddr:
		host := a.IP.String()
		if a.IP.IsUnspecified() {
			host = "127.0.0.1"
		}
		return "tcp://" + net.JoinHostPort(host, fmt.Sprint(a.Port))
	default:
		return "ipc://" + l.Addr().String()
	}
}

// Dial connects to a ZMQ endpoint and handshakes as typ, honouring ctx for
// both the connect and the handshake.
func Dial(ctx context.Context, ep string, typ zmq4.SocketType, timeout time.Duration, lim Limits) (*Conn, error) {
	network, addr, err := SplitEndpoint(ep)
	if err != nil {
		return nil, err
	}
	if network == "tcp" && strings.HasPrefix(addr, ":") {
		addr = "127.0.0.1" + addr
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	// Handshake reads block on the socket: close it if ctx ends first.
	stop := context.AfterFunc(ctx, func() { nc.Close() })
	c, err := Handshake(nc, typ, false, timeout, lim)
	if !stop() || err != nil {
		nc.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	return c, nil
}
