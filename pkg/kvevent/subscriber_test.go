package kvevent

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakePub is the shared scripted PUB endpoint (testutil.Publisher) with
// this file's test-failing helpers.
type fakePub struct {
	*testutil.Publisher
	t *testing.T
}

func newFakePub(t *testing.T) *fakePub {
	p, err := testutil.StartPublisher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return &fakePub{Publisher: p, t: t}
}

func (p *fakePub) endpoint() string { return p.Endpoint() }

func (p *fakePub) waitSub() {
	ctx, cancel := context.WithTimeout(p.t.Context(), 10*time.Second)
	defer cancel()
	if err := p.WaitSubscriber(ctx); err != nil {
		p.t.Fatal("no subscriber arrived")
	}
}

func (p *fakePub) send(frames ...[]byte) {
	if err := p.Send(frames...); err != nil {
		p.t.Errorf("fake pub write: %v", err)
	}
}

func (p *fakePub) dropConns() { p.DropConns() }

// fakeRouter serves replay requests from a fixed set of batches.
type fakeRouter struct {
	l       net.Listener
	wg      sync.WaitGroup
	legacy  bool
	mu      sync.Mutex // guards batches, requests
	batches map[uint64][]byte
	reqs    []uint64
}

func newFakeRouter(t *testing.T, legacy bool) *fakeRouter {
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &fakeRouter{l: l, legacy: legacy, batches: map[uint64][]byte{}}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				defer nc.Close()
				c, err := zmtp.Handshake(nc, zmq4.Router, true, 5*time.Second, zmtp.Limits{})
				if err != nil {
					return
				}
				m, err := c.ReadMessage()
				if err != nil || len(m.Frames) != 2 {
					return
				}
				from, _ := DecodeSeq(m.Frames[1])
				r.mu.Lock()
				r.reqs = append(r.reqs, from)
				var seqs []uint64
				for s := range r.batches {
					if s >= from {
						seqs = append(seqs, s)
					}
				}
				slices.Sort(seqs)
				var out []byte
				for _, s := range seqs {
					out = r.reply(out, PutSeq(s), r.batches[s])
				}
				r.mu.Unlock()
				out = r.reply(out, PutSeq(EndSeq), nil)
				_ = c.Write(out, 5*time.Second)
				_, _ = c.ReadMessage() // until the client hangs up
			}()
		}
	}()
	t.Cleanup(func() { l.Close(); r.wg.Wait() })
	return r
}

func (r *fakeRouter) reply(out, seq, payload []byte) []byte {
	if r.legacy {
		return zmtp.AppendMessage(out, nil, seq, payload)
	}
	return zmtp.AppendMessage(out, nil, nil, seq, payload)
}

func (r *fakeRouter) endpoint() string { return zmtp.Endpoint(r.l) }

// replace swaps the retained batches (a new publisher process).
func (r *fakeRouter) replace(batches map[uint64][]byte) {
	r.mu.Lock()
	r.batches = batches
	r.mu.Unlock()
}

func (r *fakeRouter) put(seq uint64, payload []byte) {
	r.mu.Lock()
	r.batches[seq] = payload
	r.mu.Unlock()
}

// stream builds numbered batches of one event each.
type stream struct {
	enc    *Encoder
	nextID uint64
}

func newStream() *stream {
	return &stream{enc: NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: "b"}, LegacyCompat: true, ObjectKey: true}), nextID: 1}
}

func (s *stream) payload(t *testing.T, evs ...Event) []byte {
	t.Helper()
	for i := range evs {
		evs[i].ID = s.nextID
		s.nextID++
	}
	p, err := s.enc.AppendBatch(nil, 1000, evs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func stored(key string) Event {
	return Event{Type: Stored, Tenant: "t", Key: key, Medium: MediumCPU}
}

// recorder collects what a subscriber delivers.
type recorder struct {
	mu   sync.Mutex
	seqs []uint64
	gaps []Gap
}

func (r *recorder) opts(o Options) Options {
	o.OnBatch = func(b Batch) { r.mu.Lock(); r.seqs = append(r.seqs, b.Seq); r.mu.Unlock() }
	o.OnGap = func(g Gap) { r.mu.Lock(); r.gaps = append(r.gaps, g); r.mu.Unlock() }
	return o
}

func (r *recorder) waitSeqs(t *testing.T, n int) []uint64 {
	t.Helper()
	var got []uint64
	testutil.Eventually(t, 10*time.Second, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		got = slices.Clone(r.seqs)
		return len(got) >= n
	}, "%d batches (delivered %v)", n, &got)
	return got
}

func (r *recorder) gapList() []Gap {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.gaps)
}

func subscribe(t *testing.T, ep string, o Options) *Subscriber {
	t.Helper()
	s, err := Subscribe(t.Context(), ep, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestSubscribeLiveAndIndex(t *testing.T) {
	pub := newFakePub(t)
	var rec recorder
	sub := subscribe(t, pub.endpoint(), rec.opts(Options{}))
	pub.waitSub()
	st := newStream()
	pub.send(nil, PutSeq(1), st.payload(t, stored("a"), stored("b"), Event{Type: Stored, Tenant: "u", Key: "x", Medium: MediumDisk}))
	pub.send(nil, PutSeq(2), st.payload(t, Event{Type: Removed, Tenant: "t", Key: "a", Medium: MediumCPU}))
	pub.send(nil, PutSeq(3), st.payload(t, Event{Type: Cleared, Tenant: "u"}))
	if got, want := rec.waitSeqs(t, 3), []uint64{1, 2, 3}; !slices.Equal(got, want) {
		t.Fatalf("seqs = %v, want %v", got, want)
	}
	if got, want := sub.Index().Keys(), []Key{{"t", "b", MediumCPU}}; !slices.Equal(got, want) {
		t.Errorf("index = %v, want %v", got, want)
	}
	if st := sub.Stats(); st.Events != 5 || st.MissingSeqs != 0 || st.LastSeq != 3 {
		t.Errorf("stats = %+v, want 5 events, no gaps, last 3", st)
	}
	if g := rec.gapList(); len(g) != 0 {
		t.Errorf("gaps = %+v, want none", g)
	}
}

func TestGapRepair(t *testing.T) {
	tests := []struct {
		name       string
		replay     bool
		legacy     bool
		retainFrom uint64 // router holds batches >= retainFrom
		wantSeqs   []uint64
		wantGaps   []Gap
		wantUnrep  uint64
	}{
		{"repaired", true, false, 1, []uint64{1, 2, 3, 4, 5}, nil, 0},
		{"repaired legacy dialect", true, true, 1, []uint64{1, 2, 3, 4, 5}, nil, 0},
		{"partly retained", true, false, 4, []uint64{1, 2, 4, 5}, []Gap{{From: 3, To: 4}}, 1},
		{"no replay endpoint", false, false, 1, []uint64{1, 2, 5}, []Gap{{From: 3, To: 5}}, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pub := newFakePub(t)
			router := newFakeRouter(t, tt.legacy)
			st := newStream()
			payloads := map[uint64][]byte{}
			for s := uint64(1); s <= 5; s++ {
				payloads[s] = st.payload(t, stored(string(rune('a'+s))))
				if s >= tt.retainFrom {
					router.put(s, payloads[s])
				}
			}
			var rec recorder
			o := Options{}
			if tt.replay {
				o.ReplayEndpoint = router.endpoint()
			}
			sub := subscribe(t, pub.endpoint(), rec.opts(o))
			pub.waitSub()
			for _, s := range []uint64{1, 2, 5} {
				pub.send(nil, PutSeq(s), payloads[s])
			}
			if got := rec.waitSeqs(t, len(tt.wantSeqs)); !slices.Equal(got, tt.wantSeqs) {
				t.Fatalf("seqs = %v, want %v", got, tt.wantSeqs)
			}
			gaps := rec.gapList()
			if len(gaps) != len(tt.wantGaps) {
				t.Fatalf("gaps = %+v, want %+v", gaps, tt.wantGaps)
			}
			for i, g := range gaps {
				if g.From != tt.wantGaps[i].From || g.To != tt.wantGaps[i].To || g.Reset {
					t.Errorf("gap %d = %+v, want %+v", i, g, tt.wantGaps[i])
				}
			}
			if s := sub.Stats(); s.MissingSeqs != 2 || s.Unrepaired != tt.wantUnrep {
				t.Errorf("stats missing %d unrepaired %d, want 2 and %d", s.MissingSeqs, s.Unrepaired, tt.wantUnrep)
			}
		})
	}
}

func TestResetDetected(t *testing.T) {
	pub := newFakePub(t)
	var rec recorder
	sub := subscribe(t, pub.endpoint(), rec.opts(Options{}))
	pub.waitSub()
	st := newStream()
	pub.send(nil, PutSeq(1), st.payload(t, stored("a")))
	pub.send(nil, PutSeq(2), st.payload(t, stored("b")))
	rec.waitSeqs(t, 2)
	// A new publisher process: sequence and event ids start again.
	st2 := newStream()
	pub.send(nil, PutSeq(1), st2.payload(t, stored("c")))
	rec.waitSeqs(t, 3)
	gaps := rec.gapList()
	if len(gaps) != 1 || !gaps[0].Reset {
		t.Fatalf("gaps = %+v, want one reset", gaps)
	}
	if got, want := sub.Index().Keys(), []Key{{"t", "c", MediumCPU}}; !slices.Equal(got, want) {
		t.Errorf("index after reset = %v, want %v", got, want)
	}
	// A restart that the sequence alone would not reveal: event_id goes back.
	st3 := newStream()
	pub.send(nil, PutSeq(2), st3.payload(t, stored("d")))
	rec.waitSeqs(t, 4)
	if s := sub.Stats(); s.Resets != 2 {
		t.Errorf("resets = %d, want 2", s.Resets)
	}
}

func TestCatchUpFromSeq(t *testing.T) {
	pub := newFakePub(t)
	router := newFakeRouter(t, false)
	st := newStream()
	var ps [][]byte
	for s := uint64(1); s <= 4; s++ {
		ps = append(ps, st.payload(t, stored(string(rune('a'+s)))))
	}
	for s := uint64(1); s <= 3; s++ {
		router.put(s, ps[s-1])
	}
	var rec recorder
	sub := subscribe(t, pub.endpoint(), rec.opts(Options{ReplayEndpoint: router.endpoint(), FromSeq: 1}))
	pub.waitSub()
	// Batch 3 arrives live too (it was in flight while the replay ran).
	pub.send(nil, PutSeq(3), ps[2])
	pub.send(nil, PutSeq(4), ps[3])
	if got, want := rec.waitSeqs(t, 4), []uint64{1, 2, 3, 4}; !slices.Equal(got, want) {
		t.Fatalf("seqs = %v, want %v", got, want)
	}
	if sub.Index().Len() != 4 {
		t.Errorf("index has %d entries, want 4", sub.Index().Len())
	}
	if g := rec.gapList(); len(g) != 0 {
		t.Errorf("gaps = %+v, want none", g)
	}
}

// TestCatchUpConfirmed: a batch published after a subscriber's catch-up
// but before its subscription took effect reached it neither way; with
// nothing published after it, the subscriber would wait for it forever.
// When the publisher answers the PING sent after the subscription, the
// subscriber replays once more and gets it (e2e TestCtlWatch once hung
// so).
func TestCatchUpConfirmed(t *testing.T) {
	pub := newFakePub(t)
	router := newFakeRouter(t, false)
	st := newStream()
	var ps [][]byte
	for s := uint64(1); s <= 4; s++ {
		ps = append(ps, st.payload(t, stored(string(rune('a'+s)))))
	}
	router.put(1, ps[0])
	router.put(2, ps[1])
	var rec recorder
	sub := subscribe(t, pub.endpoint(), rec.opts(Options{ReplayEndpoint: router.endpoint(), FromSeq: 1}))
	pub.waitSub()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := pub.WaitPing(ctx); err != nil {
		t.Fatal("the subscriber sent no PING after subscribing")
	}
	if got, want := rec.waitSeqs(t, 2), []uint64{1, 2}; !slices.Equal(got, want) {
		t.Fatalf("caught up %v, want %v", got, want)
	}
	router.put(3, ps[2]) // published while the subscription was not yet in effect
	if err := pub.Pong(); err != nil {
		t.Fatal(err)
	}
	if got, want := rec.waitSeqs(t, 3), []uint64{1, 2, 3}; !slices.Equal(got, want) {
		t.Fatalf("after the PONG: %v, want %v", got, want)
	}
	// Live from here: batch 3 again (skipped), then 4.
	router.put(4, ps[3])
	pub.send(nil, PutSeq(3), ps[2])
	pub.send(nil, PutSeq(4), ps[3])
	if got, want := rec.waitSeqs(t, 4), []uint64{1, 2, 3, 4}; !slices.Equal(got, want) {
		t.Fatalf("seqs = %v, want %v", got, want)
	}
	if g := rec.gapList(); len(g) != 0 {
		t.Errorf("gaps = %+v, want none", g)
	}
	if st := sub.Stats(); st.Resets != 0 || sub.Index().Len() != 4 {
		t.Errorf("resets %d, index %d entries; want 0 and 4", st.Resets, sub.Index().Len())
	}
}

func TestReconnectAndMalformed(t *testing.T) {
	pub := newFakePub(t)
	var rec recorder
	sub := subscribe(t, pub.endpoint(), rec.opts(Options{ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond}))
	pub.waitSub()
	st := newStream()
	pub.send(nil, PutSeq(1), st.payload(t, stored("a")))
	rec.waitSeqs(t, 1)
	pub.dropConns()
	pub.waitSub()
	pub.send(nil, PutSeq(2), []byte{0x93, 0xcb}) // malformed payload for seq 2
	pub.send(nil, PutSeq(3), st.payload(t, stored("b")))
	rec.waitSeqs(t, 2)
	s := sub.Stats()
	if s.Reconnects != 1 || s.Malformed != 1 || s.MissingSeqs != 1 || s.Unrepaired != 1 {
		t.Errorf("stats = %+v, want 1 reconnect, 1 malformed, 1 missing unrepaired", s)
	}
}

// TestResumeAfterReconnect: after a reconnect the subscriber asks the
// replay ring for its last batch again; the same batch means the same
// publisher (fill the outage), another means a restart (rebuild).
func TestResumeAfterReconnect(t *testing.T) {
	t.Run("same publisher", func(t *testing.T) {
		pub := newFakePub(t)
		router := newFakeRouter(t, false)
		st := newStream()
		ps := map[uint64][]byte{}
		for s := uint64(1); s <= 5; s++ {
			ps[s] = st.payload(t, stored(fmt.Sprint("k", s)))
			if s <= 4 {
				router.put(s, ps[s])
			}
		}
		var rec recorder
		sub := subscribe(t, pub.endpoint(), rec.opts(Options{ReplayEndpoint: router.endpoint(), ReconnectMin: time.Millisecond, ReconnectMax: 5 * time.Millisecond}))
		pub.waitSub()
		pub.send(nil, PutSeq(1), ps[1])
		pub.send(nil, PutSeq(2), ps[2])
		rec.waitSeqs(t, 2)
		pub.dropConns() // 3 and 4 are published while the subscriber is away
		pub.waitSub()
		rec.waitSeqs(t, 4)
		pub.send(nil, PutSeq(4), ps[4]) // also arrives live: a duplicate
		pub.send(nil, PutSeq(5), ps[5])
		if got, want := rec.waitSeqs(t, 5), []uint64{1, 2, 3, 4, 5}; !slices.Equal(got, want) {
			t.Fatalf("seqs = %v, want %v", got, want)
		}
		if s := sub.Stats(); s.Resets != 0 || s.Unrepaired != 0 || s.Replayed != 2 || sub.Index().Len() != 5 {
			t.Errorf("stats %+v index %d, want no reset, 2 replayed, 5 entries", s, sub.Index().Len())
		}
	})
	t.Run("restarted publisher", func(t *testing.T) {
		pub := newFakePub(t)
		router := newFakeRouter(t, false)
		old := newStream()
		var rec recorder
		sub := subscribe(t, pub.endpoint(), rec.opts(Options{ReplayEndpoint: router.endpoint(), ReconnectMin: time.Millisecond, ReconnectMax: 5 * time.Millisecond}))
		pub.waitSub()
		for s := uint64(1); s <= 3; s++ {
			p := old.payload(t, stored(fmt.Sprint("old", s)), stored(fmt.Sprint("x", s)))
			router.put(s, p)
			pub.send(nil, PutSeq(s), p)
		}
		rec.waitSeqs(t, 3)
		// A new process re-announces a different set, already past seq 3,
		// with event ids that never went backwards from the subscriber's view.
		nw := newStream()
		nw.nextID = 100
		fresh := map[uint64][]byte{}
		for s := uint64(1); s <= 5; s++ {
			fresh[s] = nw.payload(t, stored(fmt.Sprint("new", s)))
		}
		router.replace(fresh)
		pub.dropConns()
		pub.waitSub()
		rec.waitSeqs(t, 8)
		var want []Key
		for s := 1; s <= 5; s++ {
			want = append(want, Key{"t", fmt.Sprint("new", s), MediumCPU})
		}
		if got := sub.Index().Keys(); !slices.Equal(got, want) {
			t.Errorf("index after restart = %v, want only the new process's %v", got, want)
		}
		gaps := rec.gapList()
		if len(gaps) != 1 || !gaps[0].Reset {
			t.Errorf("gaps = %+v, want one reset", gaps)
		}
		if s := sub.Stats(); s.Resets != 1 || s.Unrepaired != 0 {
			t.Errorf("stats %+v, want one reset, nothing unrepaired", s)
		}
	})
}

func TestSubscribeErrors(t *testing.T) {
	if _, err := Subscribe(t.Context(), "udp://x:1", Options{}); err == nil {
		t.Error("Subscribe(udp://) succeeded")
	}
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := zmtp.Endpoint(l)
	l.Close()
	if _, err := Subscribe(t.Context(), ep, Options{DialTimeout: time.Second}); err == nil {
		t.Error("Subscribe to a closed port succeeded")
	}
	pub := newFakePub(t)
	ctx, cancel := context.WithCancel(t.Context())
	sub, err := Subscribe(ctx, pub.endpoint(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	<-sub.Done()
	if sub.Err() == nil {
		t.Error("Err() = nil after the context ended, want context.Canceled")
	}
	sub.Close()
}

func TestIndexApply(t *testing.T) {
	x := NewIndex()
	apply := func(evs ...Event) {
		for _, e := range evs {
			x.Apply(e)
		}
	}
	apply(
		Event{Type: Stored, Tenant: "t", Key: "a", Medium: MediumCPU, GroupID: "g"},
		Event{Type: Stored, Tenant: "t", Key: "a", Medium: MediumCPU, GroupID: "g"}, // idempotent
		Event{Type: Stored, Tenant: "t", Key: "a", Medium: MediumDisk},
		Event{Type: Removed, Tenant: "t", Key: "zz", Medium: MediumDisk}, // idempotent
		Event{Type: Stored, Tenant: "u", Key: "b", Medium: MediumCPU},
	)
	if x.Len() != 3 {
		t.Fatalf("Len = %d, want 3", x.Len())
	}
	if g, ok := x.Has(Key{"t", "a", MediumCPU}); !ok || g != "g" {
		t.Errorf("Has(t/a/cpu) = %q, %v; want g, true", g, ok)
	}
	apply(Event{Type: Removed, Tenant: "t", Key: "a", Medium: MediumCPU})
	if _, ok := x.Has(Key{"t", "a", MediumCPU}); ok {
		t.Error("t/a/cpu still present after removed")
	}
	apply(Event{Type: Cleared, Tenant: "t"})
	if got, want := x.Keys(), []Key{{"u", "b", MediumCPU}}; !slices.Equal(got, want) || x.Len() != 1 {
		t.Errorf("Keys = %v (len %d), want %v", got, x.Len(), want)
	}
}
