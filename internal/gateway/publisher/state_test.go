package publisher

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
	"github.com/shamaton/msgpack/v2"
)

// rawSub is a SUB connection that reads the stream's frames as they are.
func rawSub(t *testing.T, p *Publisher) *zmtp.Conn {
	t.Helper()
	before := p.Stats().Subscribers
	c, err := zmtp.Dial(t.Context(), p.PubEndpoint(), zmq4.Sub, 5*time.Second, zmtp.Limits{MaxFrame: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.Write(zmtp.AppendMessage(nil, []byte{1}), time.Second); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Subscribers > before }, "the raw subscription")
	return c
}

// read reads the next data message within 20s.
func read(t *testing.T, c *zmtp.Conn) [][]byte {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	for {
		m, err := c.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		if m.Command == "" {
			return m.Frames
		}
	}
}

// newStarted is start with a hook to configure the publisher before Run.
func newStarted(t *testing.T, cfg Config, lg *slog.Logger, before func(*Publisher)) *Publisher {
	t.Helper()
	p, err := New(cfg, lg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Listen(); err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(p)
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

var testEpoch = statedir.Epoch{0xe0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0xef}

// fixedNow pins the batch timestamps.
func fixedNow() time.Time { return time.UnixMilli(1_700_000_000_123) }

// TestMooncakeWireUnchanged: in the default format, a published message is
// exactly [b"", seq8, payload] with the encoder's payload, on the wire and
// in the replay ring, and no heartbeat is ever sent (checked against a
// snapshot-format publisher with the same short interval that sends them).
func TestMooncakeWireUnchanged(t *testing.T) {
	cfg := testConfig()
	cfg.HeartbeatInterval = 5 * time.Millisecond
	p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) { p.now = fixedNow })
	sub := rawSub(t, p)
	evs := []kvevent.Event{ev(1), {Type: kvevent.Removed, Tenant: "t", Key: "k", Medium: kvevent.MediumDisk, GroupID: "g"}, {Type: kvevent.Cleared, Tenant: "t"}}
	p.Enqueue(evs...)
	got := read(t, sub)

	for i := range evs {
		evs[i].ID = uint64(i + 1)
	}
	payload, err := kvevent.NewEncoder(cfg.Encoder).AppendBatch(nil, fixedNow().UnixMilli(), evs)
	if err != nil {
		t.Fatal(err)
	}
	if want := [][]byte{{}, kvevent.PutSeq(1), payload}; !slices.EqualFunc(got, want, bytes.Equal) {
		t.Fatalf("frames = %x, want %x", got, want)
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PublishedBatches == 1 }, "the batch counted")
	if wire, want := p.ring.from(1)[0].wire, zmtp.AppendMessage(nil, nil, kvevent.PutSeq(1), payload); !bytes.Equal(wire, want) {
		t.Fatalf("wire = %x, want %x", wire, want)
	}

	snapCfg := testConfig()
	snapCfg.Format = FormatSnapshot
	snapCfg.HeartbeatInterval = 5 * time.Millisecond
	q := newStarted(t, snapCfg, testutil.Logger(), nil)
	testutil.Eventually(t, 20*time.Second, func() bool { return q.Stats().HeartbeatsSent >= 3 }, "heartbeats of the snapshot-format publisher")
	if s := p.Stats(); s.HeartbeatsSent != 0 || s.LastSequence != 1 || s.Format != FormatMooncake {
		t.Errorf("mooncake stats = %+v, want no heartbeat, last sequence 1", s)
	}
}

// TestSnapshotFormatFramesAndHeartbeats: in FormatSnapshot every sequence
// frame is seq8 || epoch; an idle publisher sends [ts, [], dp_rank] batches
// that take the next sequence numbers, are retained for replay (with 8-byte
// sequences, as vLLM answers) and journaled and recorded like any batch.
func TestSnapshotFormatFramesAndHeartbeats(t *testing.T) {
	cfg := testConfig()
	cfg.Format = FormatSnapshot
	cfg.Epoch = testEpoch
	cfg.HeartbeatInterval = 10 * time.Millisecond
	cfg.Encoder.Envelope.DPRank = 3
	cfg.StartSeq, cfg.StartEventID = 100, 500
	j, rec := &fakeJournal{}, &fakeRecorder{}
	p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) { p.SetJournal(j); p.SetRecorder(rec) })
	sub := rawSub(t, p)

	seqOf := func(f [][]byte) uint64 {
		t.Helper()
		if len(f) != 3 || len(f[0]) != 0 || len(f[1]) != 24 || !bytes.Equal(f[1][8:], testEpoch[:]) {
			t.Fatalf("frames %x: want [b\"\", seq8||epoch, payload]", f)
		}
		return binary.BigEndian.Uint64(f[1][:8])
	}
	// Heartbeats first (nothing is queued).
	hb := read(t, sub)
	first := seqOf(hb)
	var batch []any
	if err := msgpack.Unmarshal(hb[2], &batch); err != nil {
		t.Fatal(err)
	}
	if len(batch) != 3 || fmt.Sprint(batch[1]) != "[]" || fmt.Sprint(batch[2]) != "3" || hb[2][0] != 0x93 {
		t.Fatalf("heartbeat payload %x = %v, want [ts, [], 3]", hb[2], batch)
	}
	if ts, ok := batch[0].(uint64); !ok || ts < uint64(time.Now().Add(-time.Hour).UnixMilli()) {
		t.Fatalf("heartbeat timestamp %T %v, want an integer of Unix milliseconds", batch[0], batch[0])
	}
	if second := seqOf(read(t, sub)); first <= 100 || second != first+1 {
		t.Fatalf("heartbeat sequences %d, %d: want consecutive after the start sequence 100", first, second)
	}
	// An event takes the next number; its payload is the contract's.
	p.Enqueue(ev(1))
	var f [][]byte
	for {
		if f = read(t, sub); !isHeartbeat(t, f[2]) {
			break
		}
	}
	seq := seqOf(f)
	b, err := new(kvevent.Decoder).DecodePayload(seq, f[2])
	if err != nil || len(b.Events) != 1 || b.Events[0].ID != 501 || b.DPRank != 3 {
		t.Fatalf("event batch %d = %+v, %v; want event_id 501, dp_rank 3", seq, b, err)
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PublishedEvents == 1 }, "the event counted")
	if s := p.Stats(); s.Epoch != testEpoch || s.Format != FormatSnapshot || s.HeartbeatsSent < 2 || s.PublishedBatches < seq-100 {
		t.Errorf("stats %+v: want the epoch, heartbeats counted as batches", s)
	}
	// Journal and recorder saw every batch, heartbeats with no events and
	// the last event id before them.
	testutil.Eventually(t, 20*time.Second, func() bool { return len(rec.batches()) >= int(seq-100) }, "the recorder")
	recs := j.records()
	for i, r := range recs[:seq-100] {
		if r.Seq != uint64(101+i) {
			t.Fatalf("journal record %d has seq %d, want %d", i, r.Seq, 101+i)
		}
		wantID := uint64(500)
		if r.Seq == seq {
			wantID = 501
			if !bytes.Equal(r.Payload, f[2]) {
				t.Errorf("journaled payload differs from the published one")
			}
		} else if !isHeartbeat(t, r.Payload) {
			t.Errorf("record %d: payload %x is not a heartbeat", r.Seq, r.Payload)
		}
		if r.LastEventID != wantID {
			t.Errorf("record %d: last event id %d, want %d", r.Seq, r.LastEventID, wantID)
		}
	}
	for _, rb := range rec.batches() {
		if n := len(rb.evs); (rb.seq == seq) != (n == 1) {
			t.Errorf("recorded batch %d has %d events", rb.seq, n)
		}
	}

	// Replay serves heartbeats and events with 8-byte sequences.
	d, err := zmtp.Dial(t.Context(), p.ReplayEndpoint(), zmq4.Dealer, 5*time.Second, zmtp.Limits{MaxFrame: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Write(zmtp.AppendMessage(nil, nil, kvevent.PutSeq(seq-1)), time.Second); err != nil {
		t.Fatal(err)
	}
	for _, want := range []uint64{seq - 1, seq} {
		m := read(t, d)
		if len(m) != 4 || len(m[0]) != 0 || len(m[1]) != 0 || !bytes.Equal(m[2], kvevent.PutSeq(want)) {
			t.Fatalf("replayed %x, want [b\"\", b\"\", seq %d, payload]", m, want)
		}
		if want == seq && !bytes.Equal(m[3], f[2]) {
			t.Errorf("replayed payload differs from the published one")
		}
	}
}

// TestStartSequenceAndEventID: a restored publisher continues the sequence
// and the event ids.
func TestStartSequenceAndEventID(t *testing.T) {
	cfg := testConfig()
	cfg.StartSeq, cfg.StartEventID = 41, 1000
	p := start(t, cfg)
	if s := p.Stats(); s.LastSequence != 41 || s.NextSequence != 42 {
		t.Fatalf("before publishing: last %d next %d, want 41, 42", s.LastSequence, s.NextSequence)
	}
	c := collect(t, p, kvevent.Options{})
	p.Enqueue(ev(0), ev(1))
	testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 2 }, "the events")
	b := c.snapshot()[0]
	if b.Seq != 42 || b.Events[0].ID != 1001 || b.Events[1].ID != 1002 {
		t.Errorf("first batch seq %d ids %d,%d; want 42 and 1001,1002", b.Seq, b.Events[0].ID, b.Events[1].ID)
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PublishedBatches == 1 }, "the batch counted")
	if s := p.Stats(); s.NextSequence != 43 {
		t.Errorf("next sequence %d, want 43", s.NextSequence)
	}
	var zero statedir.Epoch
	if p.Stats().Epoch == zero {
		t.Error("no epoch drawn for a zero Config.Epoch")
	}
}

// TestRestoreRing: journaled batches put back into the ring are replayed,
// framed as they were published, before the batches of the new run.
func TestRestoreRing(t *testing.T) {
	for _, format := range []Format{FormatMooncake, FormatSnapshot} {
		t.Run(format.String(), func(t *testing.T) {
			cfg := testConfig()
			cfg.Format = format
			cfg.Epoch = testEpoch
			cfg.StartSeq, cfg.StartEventID = 7, 3
			cfg.HeartbeatInterval = time.Hour
			enc := kvevent.NewEncoder(cfg.Encoder)
			var recs []statedir.Record
			for i, seq := range []uint64{4, 6, 7} { // 5 was burned
				e := ev(i)
				e.ID = uint64(i + 1)
				payload, err := enc.AppendBatch(nil, 1000, []kvevent.Event{e})
				if err != nil {
					t.Fatal(err)
				}
				recs = append(recs, statedir.Record{Seq: seq, LastEventID: e.ID, UnixMilli: 1000, Payload: payload})
			}
			p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) {
				if err := p.RestoreRing(recs[:1]); err != nil {
					t.Fatal(err)
				}
				for _, bad := range [][]statedir.Record{recs[:1], {{Seq: 8}}, {recs[2], recs[1]}} {
					if err := p.RestoreRing(bad); err == nil {
						t.Errorf("RestoreRing(seqs %d...) = nil, want an error", bad[0].Seq)
					}
				}
				if err := p.RestoreRing(recs[1:]); err != nil {
					t.Fatal(err)
				}
			})
			testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Enabled }, "Run")
			if err := p.RestoreRing(nil); err == nil {
				t.Error("RestoreRing after Run = nil, want an error")
			}
			seqFrame := kvevent.PutSeq(6)
			if format == FormatSnapshot {
				seqFrame = append(seqFrame, testEpoch[:]...)
			}
			if got, want := p.ring.from(6)[0].wire, zmtp.AppendMessage(nil, nil, seqFrame, recs[1].Payload); !bytes.Equal(got, want) {
				t.Errorf("restored wire %x, want %x", got, want)
			}
			c := rawSub(t, p)
			p.Enqueue(ev(9))
			f := read(t, c)
			if len(f[1]) < 8 || binary.BigEndian.Uint64(f[1]) != 8 {
				t.Fatalf("first live batch %x, want seq 8", f[1])
			}
			testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().ReplayBatches == 4 }, "batch 8 in the ring")
			var seqs []uint64
			var ids []uint64
			err := kvevent.Replay(t.Context(), p.ReplayEndpoint(), 1, kvevent.ReplayOptions{}, func(b kvevent.Batch) error {
				seqs = append(seqs, b.Seq)
				ids = append(ids, b.Events[0].ID)
				return nil
			})
			if err != nil || !slices.Equal(seqs, []uint64{4, 6, 7, 8}) || !slices.Equal(ids, []uint64{1, 2, 3, 4}) {
				t.Errorf("replay from 1 = seqs %v ids %v, %v; want [4 6 7 8], [1 2 3 4]", seqs, ids, err)
			}
		})
	}
}

// fakeJournal records what it is handed; fail decides which appends fail.
type fakeJournal struct {
	mu     sync.Mutex
	recs   []statedir.Record
	fail   func(statedir.Record) bool
	before func(statedir.Record) // called first, on the publishing goroutine
}

func (j *fakeJournal) Append(r statedir.Record) error {
	if j.before != nil {
		j.before(r)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.recs = append(j.recs, r)
	if j.fail != nil && j.fail(r) {
		return errors.New("disk full")
	}
	return nil
}

func (j *fakeJournal) records() []statedir.Record {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.recs)
}

type recorded struct {
	seq, lastID uint64
	pos         statedir.Position
	evs         []kvevent.Event
}

// fakeRecorder copies what it is handed (evs is valid only during the call).
type fakeRecorder struct {
	mu  sync.Mutex
	got []recorded
}

func (r *fakeRecorder) Record(seq uint64, pos statedir.Position, lastEventID uint64, evs []kvevent.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, recorded{seq, lastEventID, pos, slices.Clone(evs)})
}

func (r *fakeRecorder) batches() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// TestJournal: every batch is appended before any subscriber can have it,
// with its sequence, master position, last event id and the exact payload
// sent; failed appends are counted, logged once per run of failures, and
// the batches are published all the same.
func TestJournal(t *testing.T) {
	cfg := testConfig()
	var logs testutil.LogBuffer
	lg := slog.New(slog.NewTextHandler(&logs, nil))
	var p *Publisher
	var c *collector
	j := &fakeJournal{fail: func(r statedir.Record) bool { return r.Seq == 2 || r.Seq == 3 || r.Seq == 5 }}
	j.before = func(r statedir.Record) {
		if s := p.Stats(); s.LastSequence >= r.Seq || s.ReplayBatches >= int(r.Seq) {
			t.Errorf("batch %d journaled after it was published (%+v)", r.Seq, s)
		}
		if bs := c.snapshot(); len(bs) > 0 && bs[len(bs)-1].Seq >= r.Seq {
			t.Errorf("batch %d journaled after a subscriber received it", r.Seq)
		}
	}
	p = newStarted(t, cfg, lg, func(p *Publisher) { p.SetJournal(j) })
	c = collect(t, p, kvevent.Options{})
	raw := rawSub(t, p)
	for i := range 6 {
		p.EnqueueAt(statedir.Position{Epoch: 9, Revision: uint64(10 + i)}, ev(i))
		testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == i+1 }, "batch %d", i+1)
	}
	recs := j.records()
	if len(recs) != 6 {
		t.Fatalf("%d records, want 6", len(recs))
	}
	for i, r := range recs {
		f := read(t, raw)
		if r.Seq != uint64(i+1) || r.Master != (statedir.Position{Epoch: 9, Revision: uint64(10 + i)}) || r.LastEventID != uint64(i+1) || !bytes.Equal(r.Payload, f[2]) {
			t.Errorf("record %d = seq %d pos %+v last id %d, payload equal %v; want seq %d, revision %d, id %d, the published payload",
				i, r.Seq, r.Master, r.LastEventID, bytes.Equal(r.Payload, f[2]), i+1, 10+i, i+1)
		}
		if r.UnixMilli <= 0 {
			t.Errorf("record %d has no timestamp", i)
		}
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PublishedBatches == 6 }, "6 batches counted")
	if s := p.Stats(); s.JournalErrors != 3 {
		t.Errorf("stats %+v: want 3 journal errors and all 6 batches published", s)
	}
	if n := logs.Count("journal append failed"); n != 2 {
		t.Errorf("logged %d journal failures, want 2 (one per run of failures)", n)
	}
}

// TestPositions: the batch that publishes the last event of an EnqueueAt
// call carries its position; the events before it inherit the previous
// batch's; a call without events advances the next batch's position, or a
// heartbeat's; a resync diff (chunks at the previous position, the last at
// the new one) moves the position only with its last batch.
func TestPositions(t *testing.T) {
	pos := func(r uint64) statedir.Position { return statedir.Position{Epoch: 1, Revision: r} }
	evs := func(from, n int) []kvevent.Event {
		out := make([]kvevent.Event, n)
		for i := range out {
			out[i] = ev(from + i)
		}
		return out
	}
	cfg := testConfig()
	cfg.Format = FormatSnapshot
	cfg.HeartbeatInterval = time.Hour
	cfg.ResumeSubscribers, cfg.ResumeHold = 1, time.Hour // queue everything first: batches are then deterministic
	rec := &fakeRecorder{}
	p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) { p.SetRecorder(rec) })
	ctx := t.Context()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	// Batches of 64 events: [0,64) [64,128) [128,192) [192,256) [256,269).
	p.EnqueueAt(pos(5), evs(0, 10)...)                                     // ends in batch 1
	must(p.EnqueueWaitAt(ctx, pos(5), evs(10, 64)...))                     // a diff: chunks at the previous position...
	must(p.EnqueueWaitAt(ctx, pos(5), evs(74, 54)...))                     // (both end in batch 2)
	must(p.EnqueueWaitAt(ctx, pos(9), evs(128, 20)...))                    // ...the last at the new one (batch 3)
	p.EnqueueAt(pos(11))                                                   // no events: marks the last queued one (batch 3)
	p.EnqueueAt(statedir.Position{}, evs(148, 120)...)                     // no position: batch 4 inherits batch 3's
	p.Enqueue(evs(268, 1)...)                                              // batch 5
	p.EnqueueAt(pos(12), kvevent.Event{Type: kvevent.Stored, Tenant: "t"}) // invalid, skipped: its position still counts
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Holding }, "the hold")
	if s := p.Stats(); s.PublishedBatches != 0 {
		t.Fatalf("stats %+v: want nothing published while holding", s)
	}
	c := rawSub(t, p)
	testutil.Eventually(t, 20*time.Second, func() bool { return len(rec.batches()) == 5 }, "5 batches")
	want := []statedir.Position{pos(5), pos(5), pos(11), pos(11), pos(12)}
	if n := len(rec.batches()[4].evs); n != 13 {
		t.Fatalf("batch 5 has %d events, want 13", n)
	}
	for i, b := range rec.batches() {
		if b.seq != uint64(i+1) || b.pos != want[i] {
			t.Errorf("batch %d (%d events) at %+v, want seq %d at %+v", b.seq, len(b.evs), b.pos, i+1, want[i])
		}
	}
	if got := p.Stats().Position; got != pos(12) {
		t.Errorf("Stats.Position = %+v, want %+v", got, pos(12))
	}
	for range 5 {
		read(t, c)
	}
	// Nothing queued: a position alone is pending until the next batch.
	p.EnqueueAt(pos(13))
	p.Enqueue(ev(300))
	testutil.Eventually(t, 20*time.Second, func() bool { return len(rec.batches()) == 6 }, "batch 6")
	if b := rec.batches(); b[5].pos != pos(13) {
		t.Errorf("batch after a lone position at %+v, want %+v", b[5].pos, pos(13))
	}
}

// isHeartbeat decodes payload (with another msgpack implementation) and
// reports whether its event array is empty.
func isHeartbeat(t *testing.T, payload []byte) bool {
	t.Helper()
	var batch []any
	if err := msgpack.Unmarshal(payload, &batch); err != nil || len(batch) != 3 {
		t.Fatalf("payload %x: %v, want a 3-element array", payload, err)
	}
	evs, ok := batch[1].([]any)
	if !ok {
		t.Fatalf("payload %x: events are %T", payload, batch[1])
	}
	return len(evs) == 0
}

// TestHeartbeatTakesPendingPosition: a heartbeat carries a position handed
// over without events.
func TestHeartbeatTakesPendingPosition(t *testing.T) {
	cfg := testConfig()
	cfg.Format = FormatSnapshot
	cfg.HeartbeatInterval = 5 * time.Millisecond
	rec := &fakeRecorder{}
	p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) { p.SetRecorder(rec) })
	testutil.Eventually(t, 20*time.Second, func() bool { return len(rec.batches()) >= 1 }, "a heartbeat")
	want := statedir.Position{Epoch: 2, Revision: 77}
	p.EnqueueAt(want)
	testutil.Eventually(t, 20*time.Second, func() bool {
		b := rec.batches()
		return b[len(b)-1].pos == want
	}, "a heartbeat at the position")
	if s := p.Stats(); s.PublishedEvents != 0 || s.Position != want {
		t.Errorf("stats %+v: want no events, position %+v", s, want)
	}
}

// TestResumeHold: a restored publisher publishes nothing until
// ResumeSubscribers subscribers are back, or ResumeHold passed.
func TestResumeHold(t *testing.T) {
	t.Run("subscribers", func(t *testing.T) {
		cfg := testConfig()
		cfg.ResumeSubscribers, cfg.ResumeHold = 2, time.Hour
		var logs testutil.LogBuffer
		p := newStarted(t, cfg, slog.New(slog.NewTextHandler(&logs, nil)), nil)
		testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Holding }, "the hold")
		p.Enqueue(ev(0))
		a := collect(t, p, kvevent.Options{})
		if s := p.Stats(); !s.Holding || s.PublishedBatches != 0 || s.QueueDepth != 1 {
			t.Fatalf("stats %+v with one of two subscribers: want holding, one event queued", s)
		}
		b := collect(t, p, kvevent.Options{})
		for _, c := range []*collector{a, b} {
			testutil.Eventually(t, 20*time.Second, func() bool { return c.events() == 1 }, "the held event")
			if bs := c.snapshot(); bs[0].Seq != 1 {
				t.Errorf("held event published as %d, want 1", bs[0].Seq)
			}
		}
		if logs.Count("resume hold ended: the subscribers reconnected") != 1 || p.Stats().Holding {
			t.Errorf("hold not ended by the subscribers; log:\n%s", logs.String())
		}
	})
	t.Run("timeout", func(t *testing.T) {
		cfg := testConfig()
		cfg.ResumeSubscribers, cfg.ResumeHold = 5, 50*time.Millisecond
		var logs testutil.LogBuffer
		p := newStarted(t, cfg, slog.New(slog.NewTextHandler(&logs, nil)), nil)
		p.Enqueue(ev(0))
		testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PublishedEvents == 1 }, "the hold to pass")
		if logs.Count("resume hold ended: the hold time passed") != 1 {
			t.Errorf("hold not ended by its time; log:\n%s", logs.String())
		}
	})
}

// fakeSource serves fixed frames, an error, or blocks until its context
// ends; it counts replies handed out and released.
type fakeSource struct {
	frames [][]byte
	err    error
	block  bool
	calls  chan struct{}

	served, released atomic.Int64
}

func (s *fakeSource) Reply(ctx context.Context) ([][]byte, func(), error) {
	if s.calls != nil {
		s.calls <- struct{}{}
	}
	if s.block {
		<-ctx.Done()
		return nil, nil, ctx.Err()
	}
	if s.err != nil {
		return nil, nil, s.err
	}
	s.served.Add(1)
	var once atomic.Bool
	return s.frames, func() {
		if once.Swap(true) {
			panic("fakeSource: released twice")
		}
		s.released.Add(1)
	}, nil
}

func cutFrame(cut int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(cut)) }

func dialSnapshot(t *testing.T, p *Publisher, typ zmq4.SocketType) *zmtp.Conn {
	t.Helper()
	c, err := zmtp.Dial(t.Context(), p.SnapshotEndpoint(), typ, 5*time.Second, zmtp.Limits{MaxFrame: 1 << 20, MaxFrames: 1 << 12})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func snapshotConfig() Config {
	cfg := testConfig()
	cfg.SnapshotEndpoint = "tcp://127.0.0.1:0"
	cfg.Epoch = testEpoch
	return cfg
}

// TestSnapshotSocket: any request gets one multipart reply, the source's
// frames after the request's envelope; large replies (long frames, more
// frames than one vectored write) arrive whole.
func TestSnapshotSocket(t *testing.T) {
	frames := [][]byte{cutFrame(41), testEpoch[:]}
	for i := range 600 {
		frames = append(frames, bytes.Repeat([]byte{byte(i)}, 200+i)) // short and long frame headers
	}
	src := &fakeSource{frames: frames}
	p := newStarted(t, snapshotConfig(), testutil.Logger(), func(p *Publisher) { p.SetSnapshotSource(src) })
	if p.SnapshotEndpoint() == "" {
		t.Fatal("no snapshot endpoint")
	}
	for _, tc := range []struct {
		name    string
		typ     zmq4.SocketType
		request [][]byte
		env     [][]byte
	}{
		{"REQ", zmq4.Req, [][]byte{{}, []byte("snapshot")}, [][]byte{{}}},
		{"DEALER with identities", zmq4.Dealer, [][]byte{[]byte("id"), {}, []byte("x")}, [][]byte{[]byte("id"), {}}},
		{"DEALER without delimiter", zmq4.Dealer, [][]byte{[]byte("snapshot")}, [][]byte{{}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dialSnapshot(t, p, tc.typ)
			for range 2 { // a connection may ask again
				if err := c.Write(zmtp.AppendMessage(nil, tc.request...), time.Second); err != nil {
					t.Fatal(err)
				}
				want := append(slices.Clone(tc.env), frames...)
				if got := read(t, c); !slices.EqualFunc(got, want, bytes.Equal) {
					t.Fatalf("reply of %d frames, want %d: envelope then the source's frames", len(got), len(want))
				}
			}
		})
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().SnapshotsServed == 6 }, "6 snapshots served")
	if s := p.Stats(); s.SnapshotRequests != 6 || s.SnapshotErrors != 0 {
		t.Errorf("stats %+v: want 6 requests served", s)
	}
	// Every reply is released once it was written, so the source may
	// reuse its buffers.
	if got, want := src.released.Load(), src.served.Load(); got != want || got != 6 {
		t.Errorf("released %d of %d replies, want all 6", got, want)
	}
}

// TestSnapshotUnavailable: a failed, malformed, missing or timed-out
// snapshot is answered [b"", -2, epoch].
func TestSnapshotUnavailable(t *testing.T) {
	unavailable := [][]byte{{}, cutFrame(-2), testEpoch[:]}
	for _, tc := range []struct {
		name string
		src  SnapshotSource
		mod  func(*Config)
	}{
		{"error", &fakeSource{err: errors.New("recorder failed")}, nil},
		{"malformed", &fakeSource{frames: [][]byte{cutFrame(1)}}, nil},
		{"no source", nil, nil},
		{"timeout", &fakeSource{block: true}, func(c *Config) { c.SnapshotTimeout = 20 * time.Millisecond }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := snapshotConfig()
			if tc.mod != nil {
				tc.mod(&cfg)
			}
			p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) {
				if tc.src != nil {
					p.SetSnapshotSource(tc.src)
				}
			})
			c := dialSnapshot(t, p, zmq4.Req)
			if err := c.Write(zmtp.AppendMessage(nil, nil, []byte("snapshot")), time.Second); err != nil {
				t.Fatal(err)
			}
			if got := read(t, c); !slices.EqualFunc(got, unavailable, bytes.Equal) {
				t.Fatalf("reply %x, want %x", got, unavailable)
			}
			if s := p.Stats(); s.SnapshotRequests != 1 || s.SnapshotErrors != 1 || s.SnapshotsServed != 0 {
				t.Errorf("stats %+v: want one request answered -2", s)
			}
			if src, ok := tc.src.(*fakeSource); ok && src.released.Load() != src.served.Load() {
				t.Errorf("released %d of %d replies (a malformed one too)", src.released.Load(), src.served.Load())
			}
		})
	}
}

// TestSnapshotHostilePeers: a peer sending an oversized frame or too many
// frames is dropped and counted; a snapshot being built when the publisher
// stops is abandoned; other peers are served meanwhile.
func TestSnapshotHostilePeers(t *testing.T) {
	src := &fakeSource{frames: [][]byte{cutFrame(-1), testEpoch[:]}}
	cfg := snapshotConfig()
	cfg.ReplayMaxConnsPerPeer = 1024
	p := newStarted(t, cfg, testutil.Logger(), func(p *Publisher) { p.SetSnapshotSource(src) })
	good := dialSnapshot(t, p, zmq4.Dealer)
	ask := func() {
		t.Helper()
		if err := good.Write(zmtp.AppendMessage(nil, nil, []byte("snapshot")), time.Second); err != nil {
			t.Fatal(err)
		}
		if got := read(t, good); len(got) != 3 || !bytes.Equal(got[1], cutFrame(-1)) {
			t.Fatalf("reply %x, want [b\"\", -1, epoch]", got)
		}
	}
	ask()
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"frame over 256 bytes", zmtp.AppendMessage(nil, nil, bytes.Repeat([]byte("s"), 257))},
		{"five frames", zmtp.AppendMessage(nil, nil, nil, nil, nil, []byte("snapshot"))},
		{"1 GiB frame", append(ready("DEALER"), long(0x00, 1<<30)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dropped := p.Stats().PeersDropped
			in := tc.msg
			if !bytes.HasPrefix(in, ready("DEALER")) {
				in = append(ready("DEALER"), in...)
			}
			if !hostile(t, p.SnapshotEndpoint(), "", append(greeting(), in...)) {
				t.Fatal("the gateway kept the connection open")
			}
			testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().PeersDropped == dropped+1 }, "the drop to be counted")
			ask()
		})
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().SnapshotsServed == 4 }, "4 snapshots served")
	if s := p.Stats(); s.SnapshotRequests != 4 {
		t.Errorf("stats %+v: want only the good peer's 4 requests", s)
	}
}

// TestSnapshotStopWhileBuilding: stopping the publisher ends a snapshot
// being built (its context) instead of waiting for SnapshotTimeout.
func TestSnapshotStopWhileBuilding(t *testing.T) {
	src := &fakeSource{block: true, calls: make(chan struct{}, 1)}
	p, err := New(snapshotConfig(), testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	p.SetSnapshotSource(src)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	testutil.Eventually(t, 20*time.Second, func() bool { return p.Stats().Enabled }, "the publisher to run")
	c := dialSnapshot(t, p, zmq4.Req)
	if err := c.Write(zmtp.AppendMessage(nil, nil, []byte("snapshot")), time.Second); err != nil {
		t.Fatal(err)
	}
	<-src.calls
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return while a snapshot was being built")
	}
}

// TestQueuePositions: the queue's position marks, including drops.
func TestQueuePositions(t *testing.T) {
	pos := func(r uint64) statedir.Position { return statedir.Position{Epoch: 1, Revision: r} }
	mk := func(n int) []item { return make([]item, n) }
	q := newQueue(4)
	q.push(mk(3), pos(1))
	q.push(mk(2), statedir.Position{}) // drops one; no position
	if _, _, p := q.take(nil, 1); p != (statedir.Position{}) {
		t.Errorf("take of an unmarked item = %+v, want zero", p)
	}
	if _, _, p := q.take(nil, 1); p != pos(1) {
		t.Errorf("take of the marked item = %+v, want %+v", p, pos(1))
	}
	if _, _, p := q.take(nil, 2); p != (statedir.Position{}) {
		t.Errorf("take of unmarked items = %+v, want zero", p)
	}
	q.push(nil, pos(2)) // marks the last queued item
	if _, _, p := q.take(nil, 9); p != pos(2) {
		t.Errorf("take = %+v, want %+v", p, pos(2))
	}
	q.push(nil, pos(3)) // empty queue: pending
	q.push(nil, pos(4))
	if _, _, p := q.take(nil, 0); p != pos(4) {
		t.Errorf("pending position = %+v, want %+v", p, pos(4))
	}
	if _, _, p := q.take(nil, 0); p != (statedir.Position{}) {
		t.Errorf("pending position taken twice: %+v", p)
	}
	q.push(mk(1), pos(5))
	q.push(mk(4), pos(6)) // drops the item marked 5
	if got, burned, p := q.take(nil, 9); len(got) != 4 || burned != 1 || p != pos(6) {
		t.Errorf("take = %d items, %d burned, %+v; want 4, 1, %+v", len(got), burned, p, pos(6))
	}
	if err := q.pushWait(t.Context(), nil, pos(7)); err != nil {
		t.Fatal(err)
	}
	if _, _, p := q.take(nil, 0); p != pos(7) {
		t.Errorf("pushWait without items: pending %+v, want %+v", p, pos(7))
	}
}

func TestFrameSeqWithEpoch(t *testing.T) {
	for _, n := range []int{0, 1, 255, 256, 70000} {
		payload := bytes.Repeat([]byte("p"), n)
		buf := append(make([]byte, wireHeadroom), payload...)
		got := frameSeq(buf, 0x0102030405060708, testEpoch[:])
		want := zmtp.AppendMessage(nil, nil, append(kvevent.PutSeq(0x0102030405060708), testEpoch[:]...), payload)
		if !bytes.Equal(got, want) {
			t.Errorf("payload %d bytes: frameSeq differs from zmtp.AppendMessage", n)
		}
	}
}

func TestParseFormat(t *testing.T) {
	for _, f := range []Format{FormatMooncake, FormatSnapshot} {
		if got, err := ParseFormat(f.String()); err != nil || got != f {
			t.Errorf("ParseFormat(%q) = %v, %v", f.String(), got, err)
		}
	}
	if _, err := ParseFormat("vllm"); err == nil {
		t.Error("ParseFormat(vllm) = nil error")
	}
	c := testConfig()
	c.Format = 7
	if c.Validate() == nil {
		t.Error("Validate accepted an unknown format")
	}
}
