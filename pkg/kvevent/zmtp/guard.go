package zmtp

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"

	"github.com/go-zeromq/zmq4"
	"golang.org/x/text/cases"
	"golang.org/x/text/language"
)

// handshakeGuard stands between zmq4.Open and the peer during the
// handshake. zmq4 allocates whatever size a frame header announces (a 2^50
// READY panics with makeslice, 1 GiB is allocated) and indexes past the end
// of a malformed READY's properties, so the guard reads the peer's side
// itself, checks it, and only then lets zmq4 read it: first the 64-byte
// greeting, then exactly one command frame, which must be a well-formed
// READY within maxCommand bytes that names a socket type zmq4 knows (zmq4
// panics on any other). zmq4 reads the same bytes in the same order
// (the greeting, then one frame, with exact-size reads), so the guard never
// holds more than one checked frame and reads nothing past the handshake:
// what follows is left on the connection for the data-phase Reader.
// Writes pass through.
type handshakeGuard struct {
	net.Conn
	maxCommand int
	greeted    bool   // the greeting has been read and checked
	framed     bool   // the command frame has been read and checked
	buf        []byte // checked bytes zmq4 has not read yet
}

func (g *handshakeGuard) Read(p []byte) (int, error) {
	if len(g.buf) == 0 {
		if err := g.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p, g.buf)
	g.buf = g.buf[n:]
	return n, nil
}

func (g *handshakeGuard) fill() error {
	switch {
	case !g.greeted:
		g.greeted = true
		b := make([]byte, greetingLen)
		if _, err := io.ReadFull(g.Conn, b); err != nil {
			return unexpected(err)
		}
		// zmq4 checks the rest (version, mechanism) without allocating.
		if b[0] != 0xff || b[9] != 0x7f {
			return fmt.Errorf("%w: bad greeting signature", ErrProtocol)
		}
		g.buf = b
	case !g.framed:
		g.framed = true
		b, err := readHandshakeCommand(g.Conn, g.maxCommand)
		if err != nil {
			return err
		}
		g.buf = b
	default:
		return fmt.Errorf("%w: read past the handshake", ErrProtocol)
	}
	return nil
}

// readHandshakeCommand reads one frame, which must be a READY command of
// at most maxCommand bytes with well-formed properties, and returns its
// wire bytes as received.
func readHandshakeCommand(r io.Reader, maxCommand int) ([]byte, error) {
	var hdr [9]byte
	if _, err := io.ReadFull(r, hdr[:2]); err != nil {
		return nil, unexpected(err)
	}
	flags := hdr[0]
	if flags&^(flagLong|flagCommand) != 0 || flags&flagCommand == 0 {
		return nil, fmt.Errorf("%w: frame flags %#x where the handshake wants a command", ErrProtocol, flags)
	}
	n := 2
	size := uint64(hdr[1])
	if flags&flagLong != 0 {
		if _, err := io.ReadFull(r, hdr[2:9]); err != nil {
			return nil, unexpected(err)
		}
		n = 9
		size = binary.BigEndian.Uint64(hdr[1:9])
	}
	if size > uint64(maxCommand) {
		return nil, fmt.Errorf("%w: %d-byte handshake command (max %d)", ErrFrameTooLarge, size, maxCommand)
	}
	b := make([]byte, n+int(size))
	copy(b, hdr[:n])
	if _, err := io.ReadFull(r, b[n:]); err != nil {
		return nil, unexpected(err)
	}
	if err := checkReady(b[n:]); err != nil {
		return nil, err
	}
	return b, nil
}

// checkReady checks a command body is READY with well-formed properties
// (each a 1-byte name length, the name, a 4-byte big-endian value length and
// the value, all inside the body) and a Socket-Type zmq4 knows: zmq4 panics
// on a missing or unknown one. Property names are matched the way zmq4 keys
// them (title-cased, the last of equal names wins).
func checkReady(body []byte) error {
	if len(body) == 0 || int(body[0]) > len(body)-1 {
		return fmt.Errorf("%w: malformed handshake command", ErrProtocol)
	}
	name := body[1 : 1+int(body[0])]
	if string(name) != "READY" {
		return fmt.Errorf("%w: handshake command %q, want READY", ErrProtocol, name)
	}
	title := cases.Title(language.Und, cases.NoLower) // zmq4's toTitle
	var sockType []byte
	found := false
	p := body[1+len(name):]
	for len(p) > 0 {
		k := int(p[0])
		if len(p) < 1+k+4 {
			return fmt.Errorf("%w: READY property truncated", ErrProtocol)
		}
		key := p[1 : 1+k]
		v := binary.BigEndian.Uint32(p[1+k:])
		p = p[1+k+4:]
		if uint64(v) > uint64(len(p)) {
			return fmt.Errorf("%w: READY property value overflows the command", ErrProtocol)
		}
		if title.String(string(key)) == "Socket-Type" {
			sockType, found = p[:v], true
		}
		p = p[v:]
	}
	if !found || !knownSocketType(zmq4.SocketType(sockType)) {
		return fmt.Errorf("%w: READY without a known Socket-Type (got %q)", ErrProtocol, sockType)
	}
	return nil
}

func knownSocketType(t zmq4.SocketType) bool {
	switch t {
	case zmq4.Pair, zmq4.Pub, zmq4.Sub, zmq4.Req, zmq4.Rep, zmq4.Dealer, zmq4.Router,
		zmq4.Pull, zmq4.Push, zmq4.XPub, zmq4.XSub:
		return true
	}
	return false
}
