package publisher

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
)

// pythonWithZmq finds a python3 with zmq and msgpack, or skips the test.
func pythonWithZmq(t *testing.T) string {
	t.Helper()
	for _, py := range []string{"python3", "/usr/bin/python3"} { // the system one, if another shadows it
		if exec.Command(py, "-c", "import zmq, msgpack").Run() == nil {
			return py
		}
	}
	t.Skip("no python3 with zmq and msgpack")
	return ""
}

// TestInteropPyzmq runs scripts/sub.py (libzmq through pyzmq) against the
// publisher: a libzmq DEALER replays through the handshake guard and the
// ROUTER's limits, and a libzmq SUB (READY with Socket-Type and Identity,
// then its subscription) receives the live stream. Skipped where python3
// lacks zmq or msgpack (Debian: python3-zmq python3-msgpack).
func TestInteropPyzmq(t *testing.T) {
	python := pythonWithZmq(t)
	p := start(t, testConfig())
	p.Enqueue(ev(0))
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().ReplayBatches == 1 }, "a retained batch")
	cmd := exec.CommandContext(t.Context(), python, "../../../services/gateway/scripts/sub.py",
		"--endpoint", p.PubEndpoint(), "--replay", p.ReplayEndpoint(), "--from", "1", "--count", "2", "--timeout", "20")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The SUB connects and the DEALER replays concurrently (libzmq connects
	// in the background), so the replay may come before or after batch 2
	// is retained: sub.py prints batch 2 from whichever it sees first.
	testutil.Eventually(t, 20*time.Second, func() bool {
		st := p.Stats()
		return st.Subscribers == 1 && st.ReplayRequests == 1
	}, "the libzmq SUB and its replay")
	p.Enqueue(ev(1))
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().LastSequence == 2 }, "batch 2")
	p.Enqueue(ev(2))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("sub.py: %v\nstderr: %s", err, errOut.String())
	}
	var seqs []uint64
	replayed := 0
	dec := json.NewDecoder(&out)
	for dec.More() {
		var b struct {
			Seq      uint64 `json:"seq"`
			Replayed bool   `json:"replayed"`
		}
		if err := dec.Decode(&b); err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, b.Seq)
		if b.Replayed {
			replayed++
		}
	}
	if want := []uint64{1, 2, 3}; !slices.Equal(seqs, want) || replayed < 1 || replayed > 2 {
		t.Errorf("sub.py printed seqs %v (%d replayed), want %v with 1 or 2 replayed; stderr: %s", seqs, replayed, want, errOut.String())
	}
	if st := p.Stats(); st.PeersDropped != 0 || st.PeersRefused != 0 || st.ReplayRequests != 1 {
		t.Errorf("stats %+v: want no peer dropped or refused, 1 replay request", st)
	}
}

// snapshotREQ is a libzmq REQ asking for a snapshot as llm-d does, printing
// the reply's frames (the REQ strips the envelope) in hex, as JSON.
const snapshotREQ = `
import json, sys, zmq
s = zmq.Context().socket(zmq.REQ)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.RCVTIMEO, 20000)
s.connect(sys.argv[1])
s.send(b"snapshot")
print(json.dumps([f.hex() for f in s.recv_multipart()]))
`

// TestInteropPyzmqSnapshot: a libzmq REQ gets the snapshot reply whole.
func TestInteropPyzmqSnapshot(t *testing.T) {
	python := pythonWithZmq(t)
	frames := [][]byte{cutFrame(9), testEpoch[:], bytes.Repeat([]byte("c"), 300), []byte("chunk")}
	p := newStarted(t, snapshotConfig(), testutil.Logger(), func(p *Publisher) { p.SetSnapshotSource(&fakeSource{frames: frames}) })
	out, err := exec.CommandContext(t.Context(), python, "-c", snapshotREQ, p.SnapshotEndpoint()).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	var got []string
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("python printed %q: %v", out, err)
	}
	want := make([]string, len(frames))
	for i, f := range frames {
		want[i] = hex.EncodeToString(f)
	}
	if !slices.Equal(got, want) {
		t.Errorf("libzmq REQ received %v, want %v", got, want)
	}
}

// topicClient is a libzmq SUB subscribed to "kv@" (llm-d's filter) that
// receives two live messages, then a libzmq DEALER that replays from the
// first (retained before the second was sent); it prints both as hex.
const topicClient = `
import json, sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.LINGER, 0)
sub.setsockopt(zmq.RCVTIMEO, 20000)
sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
sub.connect(sys.argv[1])
live = sub.recv_multipart()
sub.recv_multipart()
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.LINGER, 0)
d.setsockopt(zmq.RCVTIMEO, 20000)
d.connect(sys.argv[2])
d.send_multipart([b"", live[1][:8]])
replay = d.recv_multipart()
print(json.dumps({"live": [f.hex() for f in live], "replay": [f.hex() for f in replay]}))
`

// TestInteropPyzmqTopic: with a topic (snapshot format), a libzmq SUB
// subscribed to "kv@" receives [topic, seq8||epoch, payload] heartbeats,
// and a libzmq DEALER replays them as [b"", topic, seq8, payload].
func TestInteropPyzmqTopic(t *testing.T) {
	python := pythonWithZmq(t)
	cfg := topicConfig(testTopic)
	cfg.HeartbeatInterval = 20 * time.Millisecond
	p := start(t, cfg)
	out, err := exec.CommandContext(t.Context(), python, "-c", topicClient, p.PubEndpoint(), p.ReplayEndpoint()).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	var got struct{ Live, Replay []string }
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("python printed %q: %v", out, err)
	}
	frames := func(hexes []string) [][]byte {
		var fs [][]byte
		for _, h := range hexes {
			f, err := hex.DecodeString(h)
			if err != nil {
				t.Fatal(err)
			}
			fs = append(fs, f)
		}
		return fs
	}
	live, replay := frames(got.Live), frames(got.Replay)
	if len(live) != 3 || string(live[0]) != testTopic || len(live[1]) != 24 || !bytes.Equal(live[1][8:], testEpoch[:]) || !isHeartbeat(t, live[2]) {
		t.Fatalf("libzmq SUB received %q, want [topic, seq8||epoch, heartbeat]", live)
	}
	if want := [][]byte{{}, []byte(testTopic), live[1][:8], live[2]}; !slices.EqualFunc(replay, want, bytes.Equal) {
		t.Errorf("libzmq DEALER replayed %q, want %q", replay, want)
	}
}
