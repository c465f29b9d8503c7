package publisher

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// testTopic has the form llm-d's snapshot consumer requires.
const testTopic = "kv@127.0.0.1:5557@e2e-model"

func topicConfig(topic string) Config {
	cfg := testConfig()
	cfg.Format = FormatSnapshot
	cfg.Epoch = testEpoch
	cfg.Topic = topic
	return cfg
}

// TestTopicValidate: a topic only in the snapshot format, at most 255
// bytes, printable ASCII.
func TestTopicValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		format Format
		topic  string
		want   string // in the error; "" accepts
	}{
		{"mooncake, empty", FormatMooncake, "", ""},
		{"snapshot, empty", FormatSnapshot, "", ""},
		{"snapshot, llm-d's form", FormatSnapshot, testTopic, ""},
		{"snapshot, 255 bytes", FormatSnapshot, strings.Repeat("k", 255), ""},
		{"snapshot, space and tilde", FormatSnapshot, " kv@~", ""},
		{"mooncake with a topic", FormatMooncake, testTopic, "snapshot stream format"},
		{"256 bytes", FormatSnapshot, strings.Repeat("k", 256), "at most 255"},
		{"newline", FormatSnapshot, "kv@a\n", "printable ASCII"},
		{"NUL", FormatSnapshot, "kv\x00", "printable ASCII"},
		{"DEL", FormatSnapshot, "kv\x7f", "printable ASCII"},
		{"UTF-8", FormatSnapshot, "kv@é", "printable ASCII"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig()
			cfg.Format, cfg.Topic = tc.format, tc.topic
			err := cfg.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Validate = %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Validate = %v, want an error containing %q", err, tc.want)
			}
			if _, err := New(cfg, testutil.Logger()); (err == nil) != (tc.want == "") {
				t.Errorf("New: %v", err)
			}
		})
	}
}

// TestFrameMessage: the in-place framing equals zmtp.AppendMessage for
// every topic length (short frame) and payload header size.
func TestFrameMessage(t *testing.T) {
	for _, topic := range []string{"", "k", testTopic, strings.Repeat("t", MaxTopicLen)} {
		for _, n := range []int{0, 1, 255, 256, 70000} {
			payload := bytes.Repeat([]byte("p"), n)
			for _, suffix := range [][]byte{nil, testEpoch[:]} {
				buf := append(make([]byte, headroom(topic)), payload...)
				got := frameMessage(buf, topic, 0x0102030405060708, suffix)
				want := zmtp.AppendMessage(nil, []byte(topic), append(kvevent.PutSeq(0x0102030405060708), suffix...), payload)
				if !bytes.Equal(got, want) {
					t.Errorf("topic %d bytes, payload %d bytes, suffix %d bytes: frameMessage differs from zmtp.AppendMessage", len(topic), n, len(suffix))
				}
			}
		}
	}
}

// TestTopicFrames: with a topic, live messages and heartbeats are
// [topic, seq8 || epoch, payload] (on the wire, in the ring, journaled
// payload unchanged, restored batches too), replays are
// [b"", topic, seq8, payload] ([b"", seq8, payload] in the legacy
// dialect) and end with the usual marker, whose topic is empty.
func TestTopicFrames(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		name := "replay"
		if legacy {
			name = "legacy replay"
		}
		t.Run(name, func(t *testing.T) {
			cfg := topicConfig(testTopic)
			cfg.ReplayLegacy = legacy
			cfg.HeartbeatInterval = 20 * time.Millisecond
			cfg.StartSeq = 5
			restored, err := kvevent.NewEncoder(cfg.Encoder).AppendBatch(nil, 1000, []kvevent.Event{{ID: 1, Type: kvevent.Stored, Tenant: "t", Key: "restored", Medium: kvevent.MediumCPU}})
			if err != nil {
				t.Fatal(err)
			}
			j := &fakeJournal{}
			p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) {
				p.SetJournal(j)
				if err := p.RestoreRing([]statedir.Record{{Seq: 5, LastEventID: 1, UnixMilli: 1000, Payload: restored}}); err != nil {
					t.Fatal(err)
				}
			})
			sub := rawSub(t, p)
			seqOf := func(f [][]byte) uint64 {
				t.Helper()
				if len(f) != 3 || string(f[0]) != testTopic || len(f[1]) != 24 || !bytes.Equal(f[1][8:], testEpoch[:]) {
					t.Fatalf("frames %q: want [topic, seq8||epoch, payload]", f)
				}
				return binary.BigEndian.Uint64(f[1][:8])
			}
			hb := read(t, sub)
			hbSeq := seqOf(hb)
			if !isHeartbeat(t, hb[2]) {
				t.Fatalf("first message %x is not a heartbeat", hb[2])
			}
			// Enough events for a long payload frame (9-byte header).
			p.Enqueue(ev(1), ev(2), ev(3), ev(4))
			var f [][]byte
			for {
				if f = read(t, sub); !isHeartbeat(t, f[2]) {
					break
				}
			}
			seq := seqOf(f)
			if len(f[2]) <= 255 {
				t.Fatalf("payload of %d bytes, want a long frame", len(f[2]))
			}
			b, err := new(kvevent.Decoder).DecodePayload(seq, f[2])
			if err != nil || len(b.Events) != 4 {
				t.Fatalf("event batch %d = %+v, %v; want 4 events", seq, b, err)
			}
			testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PublishedEvents == 4 }, "the events counted")
			for _, e := range p.ring.from(0) {
				if e.seq == seq {
					if want := zmtp.AppendMessage(nil, []byte(testTopic), f[1], f[2]); !bytes.Equal(e.wire, want) {
						t.Errorf("ring wire %x, want %x", e.wire, want)
					}
				}
			}
			for _, r := range j.records() {
				if r.Seq == seq && !bytes.Equal(r.Payload, f[2]) {
					t.Errorf("journaled payload differs from the published one")
				}
			}

			// Replay from the restored batch: every message carries the
			// topic (not in the legacy dialect), the payload as published.
			d, err := zmtp.Dial(t.Context(), p.ReplayEndpoint(), zmq4.Dealer, 5*time.Second, zmtp.Limits{MaxFrame: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			if err := d.Write(zmtp.AppendMessage(nil, nil, kvevent.PutSeq(5)), time.Second); err != nil {
				t.Fatal(err)
			}
			payloads := map[uint64][]byte{}
			last := uint64(4)
			for {
				m := read(t, d)
				if len(m) == 0 || len(m[0]) != 0 {
					t.Fatalf("replayed %q: want the empty delimiter first", m)
				}
				var seqF, payload []byte
				switch {
				case !legacy && len(m) == 4 && len(m[1]) == 0: // the end marker
					seqF, payload = m[2], m[3]
				case !legacy && len(m) == 4 && string(m[1]) == testTopic:
					seqF, payload = m[2], m[3]
				case legacy && len(m) == 3:
					seqF, payload = m[1], m[2]
				default:
					t.Fatalf("replayed %q: want [b\"\", topic, seq8, payload] (legacy %v: [b\"\", seq8, payload])", m, legacy)
				}
				s, err := kvevent.DecodeSeq(seqF)
				if err != nil {
					t.Fatal(err)
				}
				if s == kvevent.EndSeq {
					if len(payload) != 0 || (!legacy && len(m[1]) != 0) {
						t.Fatalf("end marker %q: want an empty topic and payload", m)
					}
					break
				}
				if s <= last || (!legacy && len(m[1]) == 0) {
					t.Fatalf("replayed %q after sequence %d", m, last)
				}
				last = s
				payloads[s] = payload
			}
			for s, want := range map[uint64][]byte{5: restored, hbSeq: hb[2], seq: f[2]} {
				if !bytes.Equal(payloads[s], want) {
					t.Errorf("replayed batch %d: payload %x, want %x", s, payloads[s], want)
				}
			}
		})
	}
}

// TestTopicSubscriptions: a PUB subscription matches when it is a prefix
// of the topic (llm-d subscribes "kv@"); others never count.
func TestTopicSubscriptions(t *testing.T) {
	cfg := topicConfig(testTopic)
	cfg.HeartbeatInterval = 10 * time.Millisecond
	p := newStarted(t, cfg, testutil.Logger(), nil)
	dial := func() *zmtp.Conn {
		t.Helper()
		c, err := zmtp.Dial(t.Context(), p.PubEndpoint(), zmq4.Sub, 5*time.Second, zmtp.Limits{MaxFrame: 4 << 20})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	send := func(c *zmtp.Conn, on bool, prefix string) {
		t.Helper()
		flag := byte(0)
		if on {
			flag = 1
		}
		if err := c.Write(zmtp.AppendMessage(nil, append([]byte{flag}, prefix...)), time.Second); err != nil {
			t.Fatal(err)
		}
	}
	subscribers := func(n int) {
		t.Helper()
		testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Subscribers == n }, "%d subscribers", n)
	}
	// llm-d's filter: subscribed, receives heartbeats with the topic.
	llmd := dial()
	send(llmd, true, "kv@")
	subscribers(1)
	if f := read(t, llmd); string(f[0]) != testTopic {
		t.Fatalf("received %q, want the topic", f)
	}
	// The whole topic matches too.
	whole := dial()
	send(whole, true, testTopic)
	subscribers(2)
	// Prefixes of no message are not subscriptions: after them, one
	// matching subscription and its cancel leave the connection out.
	other := dial()
	send(other, true, "vllm")
	send(other, true, testTopic+"!")
	send(other, true, "")
	subscribers(3)
	send(other, false, "")
	subscribers(2)
	// Cancelling the llm-d filter unsubscribes it.
	send(llmd, false, "kv@")
	subscribers(1)
}

// TestSubscriptionsCount: counts per prefix, as libzmq's PUB.
func TestSubscriptionsCount(t *testing.T) {
	type op struct {
		on      bool
		prefix  string
		changed bool
		total   int32
	}
	for _, tc := range []struct {
		topic string
		ops   []op
	}{
		{"", []op{
			{false, "", false, 0}, // a cancel of nothing
			{true, "kv@", false, 0},
			{true, "", true, 1},
			{true, "", true, 2},
			{false, "", true, 1},
			{false, "kv@", false, 1},
			{false, "", true, 0},
			{false, "", false, 0},
		}},
		{testTopic, []op{
			{true, "kv@", true, 1},
			{true, "kv@", true, 2},
			{false, "kv@", true, 1},
			{false, "kv", false, 1}, // a matching prefix never subscribed
			{false, "", false, 1},
			{true, "vllm", false, 1},
			{true, testTopic + "@", false, 1},
			{true, testTopic, true, 2},
			{true, "", true, 3},
			{false, testTopic, true, 2},
			{false, "kv@", true, 1},
			{false, "kv@", false, 1},
			{false, "", true, 0},
		}},
	} {
		s := newSubscriptions(tc.topic)
		for i, o := range tc.ops {
			if changed := s.apply(o.on, []byte(o.prefix)); changed != o.changed || s.total != o.total {
				t.Errorf("topic %q, op %d (on %v, %q): changed %v total %d, want %v %d", tc.topic, i, o.on, o.prefix, changed, s.total, o.changed, o.total)
			}
		}
	}
}
