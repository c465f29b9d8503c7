package kvevent

import (
	"bufio"
	"encoding/hex"
	"os/exec"
	"strings"
	"testing"
)

// pyPub is a libzmq PUB (through pyzmq) that binds an ephemeral loopback
// port, prints its endpoint, and sends the message given as hex frames
// every 20 ms until its stdin closes.
const pyPub = `
import sys, threading, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PUB)
s.setsockopt(zmq.LINGER, 0)
s.bind("tcp://127.0.0.1:*")
print(s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
frames = [bytes.fromhex(a) for a in sys.argv[1:]]
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
deadline = time.time() + 30
while not done.is_set() and time.time() < deadline:
    s.send_multipart(frames)
    time.sleep(0.02)
`

// TestInteropLibzmqPub: the subscriber's handshake guard accepts libzmq's
// greeting and READY as a PUB sends them, and the stream decodes. Skipped
// where python3 lacks zmq (Debian: python3-zmq).
func TestInteropLibzmqPub(t *testing.T) {
	python := ""
	for _, py := range []string{"python3", "/usr/bin/python3"} { // the system one, if another shadows it
		if exec.Command(py, "-c", "import zmq").Run() == nil {
			python = py
			break
		}
	}
	if python == "" {
		t.Skip("no python3 with zmq")
	}
	msg := []string{"", hex.EncodeToString(PutSeq(1)), hex.EncodeToString(newStream().payload(t, stored("a")))}
	cmd := exec.CommandContext(t.Context(), python, append([]string{"-c", pyPub}, msg...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	ep, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var rec recorder
	sub := subscribe(t, strings.TrimSpace(ep), rec.opts(Options{}))
	rec.waitSeqs(t, 1)
	sub.Close() // before the publisher goes
	if st := sub.Stats(); st.ProtocolErrors != 0 || st.Malformed != 0 {
		t.Errorf("stats %+v, want no protocol errors or malformed messages", st)
	}
}
