package kvevent

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// routerDouble is a ROUTER test double of the remote peer: for each request
// it writes the messages handle returns (nil: hang up without answering).
// It stands in for the gateway's snapshot (and replay) sockets.
type routerDouble struct {
	l      net.Listener
	wg     sync.WaitGroup
	done   chan struct{}
	reqs   atomic.Int64
	asked  chan int // request numbers, as they arrive (dropped when full)
	handle func(n int, req [][]byte) [][][]byte
	mu     sync.Mutex // guards conns and at
	conns  map[net.Conn]bool
	at     []time.Time // when each request arrived
}

func newRouterDouble(t *testing.T, handle func(n int, req [][]byte) [][][]byte) *routerDouble {
	t.Helper()
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &routerDouble{l: l, done: make(chan struct{}), asked: make(chan int, 64), handle: handle, conns: map[net.Conn]bool{}}
	r.wg.Go(func() {
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			r.mu.Lock()
			r.conns[nc] = true
			r.mu.Unlock()
			r.wg.Go(func() { r.serve(nc) })
		}
	})
	t.Cleanup(func() {
		close(r.done)
		l.Close()
		r.mu.Lock()
		for nc := range r.conns {
			nc.Close()
		}
		r.mu.Unlock()
		r.wg.Wait()
	})
	return r
}

func (r *routerDouble) serve(nc net.Conn) {
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
		r.mu.Lock()
		r.at = append(r.at, time.Now())
		r.mu.Unlock()
		n := int(r.reqs.Add(1))
		select {
		case r.asked <- n:
		default:
		}
		out := r.handle(n, m.Frames)
		if out == nil {
			return
		}
		var buf []byte
		for _, msg := range out {
			buf = zmtp.AppendMessage(buf, msg...)
		}
		if err := c.Write(buf, 5*time.Second); err != nil {
			return
		}
	}
}

func (r *routerDouble) endpoint() string { return zmtp.Endpoint(r.l) }

// arrivals is when each request so far arrived.
func (r *routerDouble) arrivals() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.at)
}

// waitAsked waits for request number n.
func (r *routerDouble) waitAsked(t *testing.T, n int) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case got := <-r.asked:
			if got >= n {
				return
			}
		case <-timeout:
			t.Fatalf("request %d never arrived (%d so far)", n, r.reqs.Load())
		}
	}
}

// snapshotReply is a REQ reply: the delimiter, then frames.
func snapshotReply(frames ...[]byte) [][][]byte {
	return [][][]byte{append([][]byte{nil}, frames...)}
}

func putCut(cut int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(cut)) }

func newEpoch() []byte {
	e := make([]byte, EpochLen)
	rand.Read(e)
	return e
}

// chunk encodes a snapshot chunk of stored events (event_id 0).
func chunk(t testing.TB, keys ...string) []byte {
	t.Helper()
	evs := make([]Event, len(keys))
	for i, k := range keys {
		evs[i] = Event{Type: Stored, Tenant: "t", Key: k, Medium: MediumCPU}
	}
	p, err := NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: "b"}, LegacyCompat: true, ObjectKey: true}).AppendBatch(nil, 1000, evs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func heartbeatPayload(t testing.TB) []byte {
	t.Helper()
	p, err := NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: "b"}}).AppendHeartbeat(nil, 1000)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDecodeSeqFrame(t *testing.T) {
	epoch := newEpoch()
	seq, e, err := DecodeSeqFrame(PutSeq(7))
	if err != nil || seq != 7 || e != nil {
		t.Errorf("8-byte frame: %d %x %v, want 7, nil epoch", seq, e, err)
	}
	f := PutSeqEpoch(0x0102030405060708, epoch)
	if len(f) != 24 {
		t.Fatalf("PutSeqEpoch frame has %d bytes", len(f))
	}
	seq, e, err = DecodeSeqFrame(f)
	if err != nil || seq != 0x0102030405060708 || !bytes.Equal(e, epoch) {
		t.Errorf("24-byte frame: %#x %x %v, want the sequence and epoch %x", seq, e, err, epoch)
	}
	for _, n := range []int{0, 1, 7, 9, 16, 23, 25, 32} {
		if _, _, err := DecodeSeqFrame(make([]byte, n)); !errors.Is(err, ErrMalformed) {
			t.Errorf("%d-byte frame: err %v, want ErrMalformed", n, err)
		}
	}
	if _, err := DecodeSeq(f); err == nil {
		t.Error("DecodeSeq accepted a 24-byte frame; it stays the Mooncake format's")
	}
	defer func() {
		if recover() == nil {
			t.Error("PutSeqEpoch with a 15-byte epoch did not panic")
		}
	}()
	PutSeqEpoch(1, epoch[:15])
}

func TestDecodeSnapshotFormat(t *testing.T) {
	epoch := newEpoch()
	good := payload(mpMap(validKVs(Stored, true, 1)))
	hb := heartbeatPayload(t)
	var d Decoder
	f1 := PutSeqEpoch(5, epoch)
	b, err := d.DecodeMessage([][]byte{nil, f1, good})
	if err != nil {
		t.Fatal(err)
	}
	if b.Seq != 5 || !bytes.Equal(b.Epoch, epoch) || len(b.Events) != 1 || b.Heartbeat() {
		t.Errorf("batch = %+v", b)
	}
	f1[10] ^= 0xff // the batch does not alias the frame
	if !bytes.Equal(b.Epoch, epoch) {
		t.Error("Batch.Epoch aliases the sequence frame")
	}
	h, err := d.DecodeMessage([][]byte{nil, PutSeqEpoch(6, epoch), hb})
	if err != nil {
		t.Fatalf("heartbeat: %v", err)
	}
	if !h.Heartbeat() || h.Seq != 6 || len(h.Events) != 0 || !bytes.Equal(h.Epoch, epoch) {
		t.Errorf("heartbeat = %+v", h)
	}
	if &h.Epoch[0] != &b.Epoch[0] {
		t.Error("batches of one epoch do not share it")
	}
	if b, err := d.DecodeMessage([][]byte{nil, PutSeqEpoch(0, epoch), hb}); err != nil || b.Seq != 0 {
		t.Errorf("snapshot format, seq 0 (vLLM counts from 0): %v", err)
	}
	if b, err := d.DecodeMessage([][]byte{nil, PutSeq(7), good}); err != nil || b.Epoch != nil {
		t.Errorf("Mooncake format after snapshot format: %+v, %v", b, err)
	}
	rejects := []struct {
		name   string
		frames [][]byte
	}{
		{"heartbeat in the Mooncake format", [][]byte{nil, PutSeq(1), hb}},
		{"end marker with epoch", [][]byte{nil, PutSeqEpoch(EndSeq, epoch), good}},
		{"65 events with epoch", [][]byte{nil, PutSeqEpoch(1, epoch), msgOf65(t)}},
		{"heartbeat with trailing byte", [][]byte{nil, PutSeqEpoch(1, epoch), append(slices.Clone(hb), 0)}},
		{"heartbeat float timestamp", [][]byte{nil, PutSeqEpoch(1, epoch), mpArr(mpFloat64(1), mpArr(), mpUint(0))}},
		{"heartbeat 2 elements", [][]byte{nil, PutSeqEpoch(1, epoch), mpArr(mpUint(1), mpArr())}},
		{"topic not empty", [][]byte{[]byte("kv@x@m"), PutSeqEpoch(1, epoch), good}},
	}
	for _, tt := range rejects {
		if _, err := d.DecodeMessage(tt.frames); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err %v, want ErrMalformed", tt.name, err)
		}
	}
	// DecodePayload: heartbeats only with AllowEmpty.
	if _, err := d.DecodePayload(1, hb); err == nil {
		t.Error("DecodePayload accepted a heartbeat without AllowEmpty")
	}
	d.AllowEmpty = true
	if b, err := d.DecodePayload(1, hb); err != nil || !b.Heartbeat() {
		t.Errorf("DecodePayload with AllowEmpty: %+v %v", b, err)
	}
	if _, err := d.DecodeMessage([][]byte{nil, PutSeq(1), hb}); err == nil {
		t.Error("AllowEmpty made DecodeMessage accept a Mooncake-format heartbeat")
	}
}

func msgOf65(t *testing.T) []byte {
	t.Helper()
	var evs [][]byte
	for i := range 65 {
		evs = append(evs, mpMap(validKVs(Cleared, true, uint64(i+1))))
	}
	return payload(evs...)
}

func TestDecodeSnapshotReply(t *testing.T) {
	epoch := newEpoch()
	c1, c2 := chunk(t, "a", "b"), chunk(t, "c")
	s, err := DecodeSnapshotReply([][]byte{putCut(41), epoch, c1, c2})
	if err != nil {
		t.Fatal(err)
	}
	if s.Cut != 41 || !bytes.Equal(s.Epoch, epoch) || len(s.Batches) != 2 || s.Events() != 3 {
		t.Fatalf("snapshot = %+v", s)
	}
	for _, b := range s.Batches {
		if !b.Snapshot || b.Seq != 41 || !bytes.Equal(b.Epoch, epoch) {
			t.Errorf("chunk = %+v, want Snapshot, Seq 41 and the epoch", b)
		}
	}
	if s, err := DecodeSnapshotReply([][]byte{putCut(-1), epoch}); err != nil || s.Cut != CutNone || len(s.Batches) != 0 {
		t.Errorf("cut -1: %+v %v", s, err)
	}
	if s, err := DecodeSnapshotReply([][]byte{putCut(9), epoch, payload(slices.Repeat([][]byte{mpMap(validKVs(Stored, true, 0))}, 64)...)}); err != nil || s.Events() != 64 {
		t.Errorf("64 stored events with event_id 0: %v", err)
	}
	if s, err := DecodeSnapshotReply([][]byte{putCut(9), epoch}); err != nil || s.Cut != 9 {
		t.Errorf("empty set at cut 9: %+v %v", s, err)
	}
	if _, err := DecodeSnapshotReply([][]byte{putCut(-2), epoch}); !errors.Is(err, ErrSnapshotUnavailable) || errors.Is(err, ErrMalformed) {
		t.Errorf("cut -2: err %v, want ErrSnapshotUnavailable", err)
	}
	removed := payload(mpMap(validKVs(Removed, true, 0)))
	storedID := payload(mpMap(validKVs(Stored, true, 3)))
	rejects := []struct {
		name   string
		frames [][]byte
	}{
		{"no frames", nil},
		{"cut only", [][]byte{putCut(1)}},
		{"cut 7 bytes", [][]byte{putCut(1)[:7], epoch}},
		{"cut 9 bytes", [][]byte{append(putCut(1), 0), epoch}},
		{"epoch 15 bytes", [][]byte{putCut(1), epoch[:15]}},
		{"epoch 24 bytes", [][]byte{putCut(1), append(slices.Clone(epoch), 1, 2, 3, 4, 5, 6, 7, 8)}},
		{"cut -3", [][]byte{putCut(-3), epoch}},
		{"cut -2 with chunks", [][]byte{putCut(-2), epoch, c1}},
		{"cut -1 with chunks", [][]byte{putCut(-1), epoch, c1}},
		{"empty chunk", [][]byte{putCut(1), epoch, nil}},
		{"heartbeat chunk", [][]byte{putCut(1), epoch, heartbeatPayload(t)}},
		{"removed in a chunk", [][]byte{putCut(1), epoch, removed}},
		{"event_id in a chunk", [][]byte{putCut(1), epoch, storedID}},
		{"65 events", [][]byte{putCut(1), epoch, payload(slices.Repeat([][]byte{mpMap(validKVs(Stored, true, 0))}, 65)...)}},
		{"64 events, one removed", [][]byte{putCut(1), epoch, payload(append(slices.Repeat([][]byte{mpMap(validKVs(Stored, true, 0))}, 63), mpMap(validKVs(Removed, true, 0)))...)}},
		{"garbage chunk", [][]byte{putCut(1), epoch, c1, []byte{0x93, 0xcb}}},
		{"trailing byte", [][]byte{putCut(1), epoch, append(slices.Clone(c1), 0xc0)}},
	}
	for _, tt := range rejects {
		if _, err := DecodeSnapshotReply(tt.frames); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err %v, want ErrMalformed", tt.name, err)
		}
	}
}

func TestFetchSnapshot(t *testing.T) {
	epoch := newEpoch()
	c := chunk(t, "a", "b")
	var lastReq [][]byte
	var mu sync.Mutex
	stop := make(chan struct{})
	srv := newRouterDouble(t, func(n int, req [][]byte) [][][]byte {
		mu.Lock()
		lastReq = req
		mu.Unlock()
		switch n {
		case 1:
			return snapshotReply(putCut(3), epoch, c)
		case 2:
			return snapshotReply(putCut(-2), epoch)
		case 3:
			return [][][]byte{{putCut(3), epoch, c}} // no REQ delimiter
		case 4:
			return nil // hang up
		case 5:
			return snapshotReply(putCut(3), epoch, c, c, c)
		default:
			<-stop // never in time
			return nil
		}
	})
	t.Cleanup(func() { close(stop) }) // before the double's cleanup waits for this handler
	ctx := t.Context()
	s, err := FetchSnapshot(ctx, srv.endpoint(), SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Cut != 3 || s.Events() != 2 || !bytes.Equal(s.Epoch, epoch) {
		t.Errorf("snapshot = %+v", s)
	}
	mu.Lock()
	if len(lastReq) != 2 || len(lastReq[0]) != 0 || string(lastReq[1]) != "snapshot" {
		t.Errorf("request = %q, want [\"\" \"snapshot\"]", lastReq)
	}
	mu.Unlock()
	if _, err := FetchSnapshot(ctx, srv.endpoint(), SnapshotOptions{}); !errors.Is(err, ErrSnapshotUnavailable) {
		t.Errorf("cut -2: %v", err)
	}
	if _, err := FetchSnapshot(ctx, srv.endpoint(), SnapshotOptions{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("no delimiter: %v, want ErrMalformed", err)
	}
	if _, err := FetchSnapshot(ctx, srv.endpoint(), SnapshotOptions{}); err == nil {
		t.Error("hang-up: no error")
	}
	if _, err := FetchSnapshot(ctx, srv.endpoint(), SnapshotOptions{MaxReplyBytes: 2 * len(c)}); !errors.Is(err, zmtp.ErrMessageTooLarge) {
		t.Errorf("reply over MaxReplyBytes: %v, want zmtp.ErrMessageTooLarge", err)
	}
	start := time.Now()
	if _, err := FetchSnapshot(ctx, srv.endpoint(), SnapshotOptions{Timeout: 200 * time.Millisecond}); err == nil {
		t.Error("no reply within the timeout: no error")
	}
	if d := time.Since(start); d > 1500*time.Millisecond {
		t.Errorf("timed out after %v, want about 200ms", d)
	}
	if _, err := FetchSnapshot(ctx, "udp://x:1", SnapshotOptions{}); err == nil {
		t.Error("udp endpoint: no error")
	}
}

func TestFetchSnapshotLimits(t *testing.T) {
	epoch := newEpoch()
	c := chunk(t, "a")
	srv := newRouterDouble(t, func(n int, _ [][]byte) [][][]byte {
		return snapshotReply(putCut(3), epoch, c, c, c, c)
	})
	if _, err := FetchSnapshot(t.Context(), srv.endpoint(), SnapshotOptions{MaxChunks: 3}); !errors.Is(err, zmtp.ErrProtocol) {
		t.Errorf("4 chunks with MaxChunks 3: %v, want zmtp.ErrProtocol", err)
	}
	if _, err := FetchSnapshot(t.Context(), srv.endpoint(), SnapshotOptions{MaxFrame: len(c) - 1}); !errors.Is(err, zmtp.ErrFrameTooLarge) {
		t.Errorf("chunk over MaxFrame: %v, want zmtp.ErrFrameTooLarge", err)
	}
	if s, err := FetchSnapshot(t.Context(), srv.endpoint(), SnapshotOptions{MaxChunks: 4, MaxFrame: len(c)}); err != nil || s.Events() != 4 {
		t.Errorf("at the limits: %v", err)
	}
}

// TestReplaySnapshotFormat: a replay socket may answer with 24-byte
// sequence frames, heartbeats included; 8-byte ones carry heartbeats only
// with Decoder.AllowEmpty.
func TestReplaySnapshotFormat(t *testing.T) {
	epoch := newEpoch()
	st := newStream()
	p1, hb := st.payload(t, stored("a")), heartbeatPayload(t)
	var wide atomic.Bool // 24-byte frames
	wide.Store(true)
	srv := newRouterDouble(t, func(n int, _ [][]byte) [][][]byte {
		f := func(seq uint64) []byte {
			if wide.Load() {
				return PutSeqEpoch(seq, epoch)
			}
			return PutSeq(seq)
		}
		return [][][]byte{{nil, nil, f(1), p1}, {nil, nil, f(2), hb}, {nil, nil, PutSeq(EndSeq), nil}}
	})
	var got []Batch
	err := Replay(t.Context(), srv.endpoint(), 1, ReplayOptions{}, func(b Batch) error { got = append(got, b); return nil })
	if err != nil || len(got) != 2 || !got[1].Heartbeat() || !bytes.Equal(got[0].Epoch, epoch) || !got[1].Replayed {
		t.Fatalf("24-byte replay: %v, %+v", err, got)
	}
	wide.Store(false)
	if err := Replay(t.Context(), srv.endpoint(), 1, ReplayOptions{}, func(Batch) error { return nil }); !errors.Is(err, ErrMalformed) {
		t.Errorf("8-byte replay with a heartbeat, strict: %v, want ErrMalformed", err)
	}
	got = nil
	err = Replay(t.Context(), srv.endpoint(), 1, ReplayOptions{Decoder: Decoder{AllowEmpty: true}}, func(b Batch) error { got = append(got, b); return nil })
	if err != nil || len(got) != 2 || !got[1].Heartbeat() || got[0].Epoch != nil {
		t.Errorf("8-byte replay with AllowEmpty: %v, %+v", err, got)
	}
}

func TestAppendHeartbeat(t *testing.T) {
	enc := NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: "b", DPRank: 3}})
	p, err := enc.AppendHeartbeat(nil, 1_700_000_000_000)
	if err != nil {
		t.Fatal(err)
	}
	oracle(t, p)
	d := Decoder{AllowEmpty: true}
	b, err := d.DecodePayload(9, p)
	if err != nil || !b.Heartbeat() || b.DPRank != 3 || b.Timestamp != 1_700_000_000_000 {
		t.Errorf("heartbeat decodes to %+v, %v", b, err)
	}
	if _, err := enc.AppendHeartbeat(nil, -1); err == nil {
		t.Error("negative timestamp accepted")
	}
	if got := fmt.Sprintf("%x", mustHB(t)); got != "93cd03e89000" {
		t.Errorf("heartbeat bytes %s, want 93 cd03e8 90 00 ([1000, [], 0])", got)
	}
}

func mustHB(t *testing.T) []byte { return heartbeatPayload(t) }

// TestDecodeTopic: the topic frame must be Decoder.Topic — empty by
// default (the Mooncake contract), the gateway's --topic when set (llm-d's
// kv@<address:port>@<model>, snapshot format).
func TestDecodeTopic(t *testing.T) {
	epoch := newEpoch()
	good := payload(mpMap(validKVs(Stored, true, 1)))
	const topic = "kv@127.0.0.1:5557@model"
	var plain Decoder
	if _, err := plain.DecodeMessage([][]byte{[]byte(topic), PutSeqEpoch(1, epoch), good}); err == nil {
		t.Error("a topic accepted by a decoder that expects none")
	}
	d := Decoder{Topic: topic}
	if _, err := d.DecodeMessage([][]byte{[]byte(topic), PutSeqEpoch(1, epoch), good}); err != nil {
		t.Errorf("the configured topic: %v", err)
	}
	for _, other := range []string{"", "kv@127.0.0.1:5557@other"} {
		if _, err := d.DecodeMessage([][]byte{[]byte(other), PutSeqEpoch(2, epoch), good}); err == nil {
			t.Errorf("topic %q accepted, want %q", other, topic)
		}
	}
}
