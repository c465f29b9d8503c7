package publisher

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func testConfig() Config {
	c := DefaultConfig()
	c.PubEndpoint = "tcp://127.0.0.1:0"
	c.ReplayEndpoint = "tcp://127.0.0.1:0"
	c.Encoder.Envelope = kvevent.Envelope{BackendID: "test"}
	return c
}

// start runs a publisher until the test ends.
func start(t *testing.T, cfg Config) *Publisher {
	t.Helper()
	p, err := New(cfg, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return p
}

// collector subscribes with the kvevent library and records batches.
type collector struct {
	mu      sync.Mutex
	batches []kvevent.Batch
	n       int // events delivered
	sub     *kvevent.Subscriber
}

// collect subscribes; with keep false it only counts (so it holds no memory).
func collect(t *testing.T, p *Publisher, opts kvevent.Options) *collector {
	return collectKeep(t, p, opts, true)
}

func collectKeep(t *testing.T, p *Publisher, opts kvevent.Options, keep bool) *collector {
	t.Helper()
	c := &collector{}
	opts.OnBatch = func(b kvevent.Batch) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.n += len(b.Events)
		if keep {
			c.batches = append(c.batches, b)
		}
	}
	opts.Logger = testutil.Logger()
	before := p.Stats().Subscribers
	sub, err := kvevent.Subscribe(t.Context(), p.PubEndpoint(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	c.sub = sub
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Subscribers > before }, "subscription")
	return c
}

func (c *collector) events() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

func (c *collector) snapshot() []kvevent.Batch {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.batches)
}

func ev(i int) kvevent.Event {
	return kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: fmt.Sprintf("k%06d", i), Medium: kvevent.MediumCPU}
}

func TestSequenceBatchingAndEventIDs(t *testing.T) {
	p := start(t, testConfig())
	c := collect(t, p, kvevent.Options{})
	const n = 5000
	for i := range n {
		p.Enqueue(ev(i))
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == n }, "all events")
	var wantID uint64 = 1
	for i, b := range c.snapshot() {
		if got, want := b.Seq, uint64(i+1); got != want {
			t.Fatalf("batch %d seq = %d, want %d (gap-free from 1)", i, got, want)
		}
		if len(b.Events) == 0 || len(b.Events) > 64 {
			t.Fatalf("batch %d has %d events, want 1..64", i, len(b.Events))
		}
		for _, e := range b.Events {
			if e.ID != wantID {
				t.Fatalf("event_id = %d, want %d (consecutive)", e.ID, wantID)
			}
			if want := fmt.Sprintf("k%06d", wantID-1); e.Key != want {
				t.Fatalf("event %d key = %q, want %q (order kept)", wantID, e.Key, want)
			}
			wantID++
		}
	}
	s := p.Stats()
	if s.PublishedEvents != n || s.DroppedEvents != 0 || s.PublishedBatches != uint64(len(c.snapshot())) || s.LastSequence != s.PublishedBatches {
		t.Errorf("stats = %+v, want %d events, no drops, batches = last sequence", s, n)
	}
}

func TestFlush(t *testing.T) {
	t.Run("lone event flushed by the interval", func(t *testing.T) {
		cfg := testConfig()
		cfg.FlushInterval = time.Millisecond
		p := start(t, cfg)
		c := collect(t, p, kvevent.Options{})
		p.Enqueue(ev(1))
		testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 1 }, "the lone event")
	})
	t.Run("full batch flushed without waiting", func(t *testing.T) {
		cfg := testConfig()
		cfg.FlushInterval = time.Hour
		p := start(t, cfg)
		c := collect(t, p, kvevent.Options{})
		evs := make([]kvevent.Event, 64)
		for i := range evs {
			evs[i] = ev(i)
		}
		p.Enqueue(evs...)
		testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 64 }, "the full batch")
		if b := c.snapshot(); len(b) != 1 || len(b[0].Events) != 64 {
			t.Errorf("got %d batches, want one of 64 events", len(b))
		}
	})
}

func TestQueueDropsOldestAndBurnsSequences(t *testing.T) {
	cfg := testConfig()
	cfg.QueueCapacity = 10
	cfg.FlushInterval = 0
	p := start(t, cfg)
	var gaps []kvevent.Gap
	var mu sync.Mutex
	c := collect(t, p, kvevent.Options{OnGap: func(g kvevent.Gap) { mu.Lock(); gaps = append(gaps, g); mu.Unlock() }})
	sub := c.sub

	p.Enqueue(ev(0)) // seq 1
	testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 1 }, "first event")
	// One push of 100 into a queue of 10: the 90 oldest are dropped while
	// the push holds the queue, deterministically.
	burst := make([]kvevent.Event, 100)
	for i := range burst {
		burst[i] = ev(1 + i)
	}
	p.Enqueue(burst...)
	testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 1+10 }, "survivors")

	s := p.Stats()
	if s.DroppedEvents != 90 {
		t.Fatalf("dropped_events = %d, want 90", s.DroppedEvents)
	}
	bs := c.snapshot()
	var missing uint64
	for i := 1; i < len(bs); i++ {
		missing += bs[i].Seq - bs[i-1].Seq - 1
	}
	if missing != s.DroppedEvents {
		t.Errorf("sequence gaps = %d, want dropped_events = %d", missing, s.DroppedEvents)
	}
	if got := bs[1].Events[0].Key; got != "k000091" {
		t.Errorf("first survivor = %q, want k000091 (the oldest are dropped)", got)
	}
	if bs[1].Seq != 1+90+1 {
		t.Errorf("first batch after the drop has seq %d, want %d", bs[1].Seq, 92)
	}
	if st := sub.Stats(); st.MissingSeqs != 90 {
		t.Errorf("subscriber saw %d missing sequences, want 90", st.MissingSeqs)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(gaps) != 1 || gaps[0].From != 2 || gaps[0].To != 92 {
		t.Errorf("gaps = %+v, want one gap [2, 92)", gaps)
	}
}

func TestObjectKeyOffPublishesOnlyCleared(t *testing.T) {
	cfg := testConfig()
	cfg.Encoder.ObjectKey = false
	p := start(t, cfg)
	c := collect(t, p, kvevent.Options{})
	p.Enqueue(ev(1), kvevent.Event{Type: kvevent.Removed, Tenant: "t", Key: "k", Medium: kvevent.MediumDisk}, kvevent.Event{Type: kvevent.Cleared, Tenant: "t"})
	testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 1 }, "cleared")
	if b := c.snapshot(); b[0].Events[0].Type != kvevent.Cleared {
		t.Errorf("published %v, want only cleared", b[0].Events[0].Type)
	}
	if s := p.Stats(); s.SkippedKeylessEvents != 2 || s.PublishedEvents != 1 {
		t.Errorf("stats = %+v, want 2 skipped, 1 published", s)
	}
}

func TestInvalidEventsSkipped(t *testing.T) {
	p := start(t, testConfig())
	c := collect(t, p, kvevent.Options{})
	p.Enqueue(kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: "k"}, kvevent.Event{Tenant: "t"}, ev(1))
	testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 1 }, "the valid event")
}

func TestReplay(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			cfg := testConfig()
			cfg.ReplayLegacy = legacy
			cfg.ReplayBuffer = 5
			cfg.FlushInterval = 0
			p := start(t, cfg)
			c := collect(t, p, kvevent.Options{})
			for i := range 10 {
				p.Enqueue(ev(i))
				testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == i+1 }, "batch") // one batch each
			}
			// Raw DEALER: frame layout of each dialect and the end marker.
			d, err := zmtp.Dial(t.Context(), p.ReplayEndpoint(), zmq4.Dealer, 5*time.Second, zmtp.Limits{MaxFrame: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			if err := d.Write(zmtp.AppendMessage(nil, nil, kvevent.PutSeq(8)), time.Second); err != nil {
				t.Fatal(err)
			}
			var seqs []uint64
			for {
				m, err := d.ReadMessage()
				if err != nil {
					t.Fatal(err)
				}
				want := 4
				if legacy {
					want = 3
				}
				if len(m.Frames) != want || len(m.Frames[0]) != 0 || (!legacy && len(m.Frames[1]) != 0) {
					t.Fatalf("reply frames = %q, want %d with an empty delimiter (and topic)", m.Frames, want)
				}
				seq, _ := kvevent.DecodeSeq(m.Frames[want-2])
				payload := m.Frames[want-1]
				if seq == kvevent.EndSeq {
					if len(payload) != 0 {
						t.Fatalf("end marker payload has %d bytes", len(payload))
					}
					break
				}
				if _, err := kvevent.DecodeMessage([][]byte{nil, m.Frames[want-2], payload}); err != nil {
					t.Fatalf("replayed batch %d: %v", seq, err)
				}
				seqs = append(seqs, seq)
			}
			if want := []uint64{8, 9, 10}; !slices.Equal(seqs, want) {
				t.Errorf("replay from 8 = %v, want %v", seqs, want)
			}
			// A single 8-byte frame works too, and the ring keeps only the last 5.
			if err := d.Write(zmtp.AppendMessage(nil, kvevent.PutSeq(1)), time.Second); err != nil {
				t.Fatal(err)
			}
			n := 0
			for {
				m, err := d.ReadMessage()
				if err != nil {
					t.Fatal(err)
				}
				if seq, _ := kvevent.DecodeSeq(m.Frames[len(m.Frames)-2]); seq == kvevent.EndSeq {
					break
				}
				n++
			}
			if n != 5 {
				t.Errorf("replay from 1 returned %d batches, want the 5 retained", n)
			}
			// The library client understands the dialect.
			var got []uint64
			err = kvevent.Replay(t.Context(), p.ReplayEndpoint(), 7, kvevent.ReplayOptions{}, func(b kvevent.Batch) error {
				got = append(got, b.Seq)
				return nil
			})
			if err != nil || !slices.Equal(got, []uint64{7, 8, 9, 10}) {
				t.Errorf("kvevent.Replay from 7 = %v, %v; want [7 8 9 10]", got, err)
			}
			// An invalid request is ignored; the connection keeps serving.
			if err := d.Write(zmtp.AppendMessage(nil, []byte("bad"), []byte("x"), []byte("y")), time.Second); err != nil {
				t.Fatal(err)
			}
			if err := d.Write(zmtp.AppendMessage(nil, nil, kvevent.PutSeq(10)), time.Second); err != nil {
				t.Fatal(err)
			}
			m, err := d.ReadMessage()
			if err != nil {
				t.Fatal(err)
			}
			if seq, _ := kvevent.DecodeSeq(m.Frames[len(m.Frames)-2]); seq != 10 {
				t.Errorf("after an invalid request, replay from 10 starts at %d", seq)
			}
		})
	}
}

// TestSlowSubscriber: a SUB that connects and stops reading neither stalls
// a fast subscriber nor grows the gateway's memory; what it loses is
// counted, and the gaps it sees when it reads again equal that count.
func TestSlowSubscriber(t *testing.T) {
	cfg := testConfig()
	cfg.QueueCapacity = 4096
	cfg.SubQueueBatches = 64
	cfg.SubQueueBytes = 256 << 10
	cfg.ReplayBufferBytes = 1 << 20
	p := start(t, cfg)
	fast := collectKeep(t, p, kvevent.Options{DisableIndex: true}, false)

	slow, err := zmtp.Dial(t.Context(), p.PubEndpoint(), zmq4.Sub, 5*time.Second, zmtp.Limits{MaxFrame: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	if err := slow.Write(zmtp.AppendMessage(nil, []byte{1}), time.Second); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Subscribers == 2 }, "both subscribers")

	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	const (
		keyBytes = 1024
		total    = 48 << 20 // bytes of keys pushed through
		n        = total / keyBytes
	)
	pad := strings.Repeat("x", keyBytes-8)
	var peak uint64
	chunk := make([]kvevent.Event, 0, 64)
	for i := range n {
		chunk = append(chunk, kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: fmt.Sprintf("%08d", i) + pad, Medium: kvevent.MediumCPU})
		if len(chunk) == cap(chunk) {
			if err := p.EnqueueWait(t.Context(), chunk...); err != nil {
				t.Fatal(err)
			}
			chunk = chunk[:0]
			// The fast subscriber keeps up (the test paces itself on it);
			// the slow one reads nothing.
			testutil.Eventually(t, 20*time.Second, func() bool { return fast.events() == i+1 }, "the fast subscriber")
		}
		if i%(n/8) == 0 {
			peak = max(peak, heap())
		}
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return fast.events() == n }, "the fast subscriber to receive everything")
	peak = max(peak, heap())
	growth := int64(peak) - int64(before)
	t.Logf("pushed %d MiB; heap before %d KiB, peak %d KiB (growth %d KiB); subscriber queue dropped %d batches",
		total>>20, before>>10, peak>>10, growth>>10, p.Stats().SubscriberDroppedBatches)
	// Bound: event queue (4096 x 1 KiB) + replay ring (1 MiB) + two
	// subscriber queues with a write in flight (4 x 256 KiB) + slack.
	if limit := int64(16 << 20); growth > limit {
		t.Errorf("heap grew by %d MiB while a subscriber did not read, want < %d MiB", growth>>20, limit>>20)
	}
	if fs := fast.sub.Stats(); fs.MissingSeqs != 0 {
		t.Errorf("the fast subscriber missed %d sequences, want 0", fs.MissingSeqs)
	}
	dropped := p.Stats().SubscriberDroppedBatches
	if dropped == 0 {
		t.Fatal("no subscriber drops counted although one subscriber never read")
	}
	if s := p.Stats(); s.DroppedEvents != 0 {
		t.Errorf("dropped_events = %d; the event queue should not drop here", s.DroppedEvents)
	}

	// The slow subscriber now reads everything up to the last sequence: its
	// gaps equal the drops counted for it.
	last := p.Stats().LastSequence
	var prev, gaps, got uint64
	for prev != last {
		m, err := slow.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		b, err := kvevent.DecodeMessage(m.Frames)
		if err != nil {
			t.Fatal(err)
		}
		gaps += b.Seq - prev - 1
		prev = b.Seq
		got++
	}
	if gaps != dropped {
		t.Errorf("slow subscriber saw %d missing sequences, want the %d batches dropped for it", gaps, dropped)
	}
	t.Logf("slow subscriber received %d of %d batches, %d missing", got, last, gaps)
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Config)
	}{
		{"bad pub endpoint", func(c *Config) { c.PubEndpoint = "udp://x" }},
		{"bad replay endpoint", func(c *Config) { c.ReplayEndpoint = "tcp://nohost" }},
		{"zero queue", func(c *Config) { c.QueueCapacity = 0 }},
		{"batch above 64", func(c *Config) { c.MaxBatch = 65 }},
		{"negative flush", func(c *Config) { c.FlushInterval = -1 }},
		{"no backend id", func(c *Config) { c.Encoder.Envelope.BackendID = "" }},
		{"no replay conns per peer", func(c *Config) { c.ReplayMaxConnsPerPeer = 0 }},
		{"no replay idle timeout", func(c *Config) { c.ReplayIdleTimeout = 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := testConfig()
			tt.mod(&c)
			if err := c.Validate(); err == nil {
				t.Errorf("Validate() = nil, want an error")
			}
		})
	}
	if err := testConfig().Validate(); err != nil {
		t.Errorf("Validate(default) = %v", err)
	}
}

func TestQueueBurnAccounting(t *testing.T) {
	q := newQueue(3)
	mk := func(n int) []item {
		out := make([]item, n)
		for i := range out {
			out[i] = item{key: fmt.Sprint(i)}
		}
		return out
	}
	q.push(mk(5), statedir.Position{}) // drops 0, 1
	got, burned, _ := q.take(nil, 2)
	if burned != 2 || len(got) != 2 || got[0].key != "2" {
		t.Fatalf("take = %v burned %d, want [2 3] burned 2", got, burned)
	}
	_, burned, _ = q.take(nil, 2)
	if burned != 0 {
		t.Errorf("second take burned %d, want 0", burned)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	q.push(mk(3), statedir.Position{})
	if err := q.pushWait(ctx, mk(1), statedir.Position{}); err == nil {
		t.Error("pushWait into a full queue returned nil before its context ended")
	}
	if _, dropped, _ := q.counts(); dropped != 2 {
		t.Errorf("dropped = %d, want 2 (pushWait never drops)", dropped)
	}
}

func TestFrameInPlace(t *testing.T) {
	for _, n := range []int{0, 1, 254, 255, 256, 300, 70000} {
		payload := []byte(strings.Repeat("p", n))
		buf := append(make([]byte, wireHeadroom), payload...)
		got := frameInPlace(buf, 0x0102030405060708)
		want := zmtp.AppendMessage(nil, nil, kvevent.PutSeq(0x0102030405060708), payload)
		if !slices.Equal(got, want) {
			t.Errorf("payload %d bytes: frameInPlace differs from zmtp.AppendMessage", n)
		}
	}
}

// TestPongConfirmsSubscription: the PUB answers a PING with a PONG that
// echoes its context (at most 16 bytes), once the subscription sent before
// it is in effect: a batch published after the PONG reaches the
// subscriber live, and one published before it is in the replay ring
// (pkg/kvevent's subscriber replays after the PONG).
func TestPongConfirmsSubscription(t *testing.T) {
	p := start(t, testConfig())
	if err := p.EnqueueWait(t.Context(), kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: "before", Medium: kvevent.MediumCPU}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().ReplayBatches == 1 }, "the first batch in the ring")
	c, err := zmtp.Dial(t.Context(), p.PubEndpoint(), zmq4.Sub, 5*time.Second, zmtp.Limits{MaxFrame: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	long := []byte(strings.Repeat("c", 100))
	msg := zmtp.AppendMessage(nil, []byte{1})
	msg = zmtp.AppendCommand(msg, "PING", append([]byte{0, 0}, "ctx-1"...))
	msg = zmtp.AppendCommand(msg, "PING", append([]byte{0, 0}, long...))
	if err := c.Write(msg, time.Second); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	var pongs []string
	for len(pongs) < 2 {
		m, err := c.ReadMessage()
		if err != nil {
			t.Fatalf("after %d PONGs: %v", len(pongs), err)
		}
		switch {
		case m.Command == "PONG":
			pongs = append(pongs, string(m.Frames[0]))
		case m.Command == "":
			t.Fatalf("a data message before the PONGs (only one published before the subscription exists): %q", m.Frames)
		}
	}
	if pongs[0] != "ctx-1" || pongs[1] != string(long[:16]) {
		t.Fatalf("PONG contexts %q, want ctx-1 and 16 bytes of the long one", pongs)
	}
	if err := p.EnqueueWait(t.Context(), kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: "after", Medium: kvevent.MediumCPU}); err != nil {
		t.Fatal(err)
	}
	frames := read(t, c)
	if seq, _, err := kvevent.DecodeSeqFrame(frames[1]); err != nil || seq != 2 {
		t.Fatalf("live after the PONG: seq %d, %v; want 2", seq, err)
	}
}
