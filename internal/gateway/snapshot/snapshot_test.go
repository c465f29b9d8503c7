package snapshot

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var testEpoch = statedir.Epoch{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}

func testConfig() Config {
	cfg := DefaultConfig()
	cfg.Epoch = testEpoch
	cfg.Encoder.Envelope = kvevent.Envelope{BackendID: "backend-a", ModelName: "m", BlockSize: 16, DPRank: 3}
	return cfg
}

// countingHandler counts records by level.
type countingHandler struct {
	errors, warns atomic.Int64
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	switch {
	case r.Level >= slog.LevelError:
		h.errors.Add(1)
	case r.Level >= slog.LevelWarn:
		h.warns.Add(1)
	}
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func newRecorder(t testing.TB, cfg Config, deps Deps) (*Recorder, *countingHandler) {
	t.Helper()
	h := &countingHandler{}
	r, err := New(cfg, deps, slog.New(h))
	if err != nil {
		t.Fatal(err)
	}
	return r, h
}

// start runs r until the test ends.
func start(t testing.TB, r *Recorder) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

type entry struct {
	tenant, key string
	medium      kvevent.Medium
}

// model is the reference: the set as a plain map.
type model map[entry]string

func (m model) apply(evs []kvevent.Event) {
	for _, e := range evs {
		switch e.Type {
		case kvevent.Stored:
			m[entry{e.Tenant, e.Key, e.Medium}] = e.GroupID
		case kvevent.Removed:
			delete(m, entry{e.Tenant, e.Key, e.Medium})
		case kvevent.Cleared:
			for k := range m {
				if k.tenant == e.Tenant {
					delete(m, k)
				}
			}
		}
	}
}

// randomBatch returns 0..64 random events over a small key space (so
// removes and overwrites hit).
func randomBatch(rng *rand.Rand, nextID *uint64) []kvevent.Event {
	evs := make([]kvevent.Event, rng.IntN(kvevent.MaxEventsPerBatch+1))
	for i := range evs {
		*nextID++
		e := kvevent.Event{ID: *nextID, Tenant: fmt.Sprint("tenant-", rng.IntN(4))}
		switch p := rng.IntN(100); {
		case p < 60:
			e.Type = kvevent.Stored
		case p < 99:
			e.Type = kvevent.Removed
		default:
			e.Type = kvevent.Cleared
		}
		if e.Type != kvevent.Cleared {
			e.Key = fmt.Sprintf("obj/%03d", rng.IntN(300))
			e.Medium = []kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}[rng.IntN(2)]
			if g := rng.IntN(4); g > 0 {
				e.GroupID = fmt.Sprint("g", g)
			}
		}
		evs[i] = e
	}
	return evs
}

// reply is a decoded snapshot reply.
type reply struct {
	cut    int64
	epoch  statedir.Epoch
	chunks []kvevent.Batch
	set    model
}

// decodeReply checks a reply's frames and decodes every chunk with
// pkg/kvevent's strict decoder (see strictChunk).
func decodeReply(t testing.TB, frames [][]byte, opts kvevent.EncoderOptions) reply {
	t.Helper()
	if len(frames) < 2 || len(frames[0]) != 8 || len(frames[1]) != statedir.EpochLen {
		t.Fatalf("malformed reply: %d frames", len(frames))
	}
	rep := reply{cut: int64(binary.BigEndian.Uint64(frames[0])), set: model{}}
	copy(rep.epoch[:], frames[1])
	var ts int64 = -1
	for i, c := range frames[2:] {
		b := strictChunk(t, c)
		if len(b.Events) < 1 || len(b.Events) > kvevent.MaxEventsPerBatch {
			t.Fatalf("chunk %d: %d events", i, len(b.Events))
		}
		if i < len(frames)-3 && len(b.Events) != kvevent.MaxEventsPerBatch {
			t.Fatalf("chunk %d of %d: %d events, want full chunks but the last", i, len(frames)-2, len(b.Events))
		}
		if ts >= 0 && b.Timestamp != ts {
			t.Fatalf("chunk %d: timestamp %d, want %d (one for the whole reply)", i, b.Timestamp, ts)
		}
		ts = b.Timestamp
		if b.DPRank != opts.Envelope.DPRank {
			t.Fatalf("chunk %d: dp_rank %d, want %d", i, b.DPRank, opts.Envelope.DPRank)
		}
		for _, e := range b.Events {
			if e.Type != kvevent.Stored {
				t.Fatalf("chunk %d: %s event", i, e.Type)
			}
			if e.Envelope != opts.Envelope || e.Legacy != opts.LegacyCompat {
				t.Fatalf("chunk %d: envelope %+v legacy %v, want %+v %v", i, e.Envelope, e.Legacy, opts.Envelope, opts.LegacyCompat)
			}
			k := entry{e.Tenant, e.Key, e.Medium}
			if _, dup := rep.set[k]; dup {
				t.Fatalf("chunk %d: %v twice", i, k)
			}
			rep.set[k] = e.GroupID
		}
		rep.chunks = append(rep.chunks, b)
	}
	return rep
}

var eventIDZero = []byte("\xa8event_id\x00")

// strictChunk decodes a chunk with pkg/kvevent's strict decoder. Every
// event of a chunk carries event_id 0, which that decoder rejects in a
// payload of two or more events (event_ids must rise), so it decodes a
// renumbered copy (see renumber) and checks there was one event_id 0 per
// event.
func strictChunk(t testing.TB, chunk []byte) kvevent.Batch {
	t.Helper()
	b, n := renumber(chunk)
	var d kvevent.Decoder
	batch, err := d.DecodePayload(1, b)
	if err != nil {
		t.Fatalf("chunk (%d bytes) rejected by the strict decoder: %v", len(chunk), err)
	}
	if n != len(batch.Events) {
		t.Fatalf("chunk has %d events and %d event_id 0", len(batch.Events), n)
	}
	for i, e := range batch.Events {
		if e.ID != uint64(i+1) {
			t.Fatalf("event %d: renumbered event_id %d", i, e.ID)
		}
	}
	return batch
}

// renumber returns a copy of chunk whose event_id 0 values are 1, 2, … in
// order (one byte each, so nothing else moves), and how many there were.
func renumber(chunk []byte) ([]byte, int) {
	b := bytes.Clone(chunk)
	n := 0
	for off := 0; ; {
		i := bytes.Index(b[off:], eventIDZero)
		if i < 0 {
			return b, n
		}
		off += i + len(eventIDZero)
		n++
		b[off-1] = byte(n) // a positive fixint while n ≤ 127
	}
}

func (m model) equal(t testing.TB, got model) {
	t.Helper()
	if len(got) != len(m) {
		t.Errorf("%d entries, want %d", len(got), len(m))
	}
	for k, g := range m {
		if gg, ok := got[k]; !ok || gg != g {
			t.Fatalf("%v: got %q (present %v), want %q", k, gg, ok, g)
		}
	}
}

// TestFoldMatchesModel records random batches (heartbeats and burned
// sequence numbers among them) and checks snapshots against a reference
// map along the way: the set, the cut and the epoch.
func TestFoldMatchesModel(t *testing.T) {
	for _, legacy := range []bool{true, false} {
		t.Run(fmt.Sprint("legacy=", legacy), func(t *testing.T) {
			cfg := testConfig()
			cfg.Encoder.LegacyCompat = legacy
			r, _ := newRecorder(t, cfg, Deps{})
			start(t, r)
			rng := rand.New(rand.NewPCG(1, 2))
			ref := model{}

			frames, err := r.Snapshot(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if rep := decodeReply(t, frames, cfg.Encoder); rep.cut != -1 || len(rep.chunks) != 0 || rep.epoch != testEpoch {
				t.Fatalf("empty recorder: cut %d, %d chunks, epoch %x", rep.cut, len(rep.chunks), rep.epoch)
			}

			var seq, id uint64
			for round := range 20 {
				for range 1 + rng.IntN(200) {
					seq += 1 + uint64(rng.IntN(2)) // a burned number now and then
					evs := randomBatch(rng, &id)
					ref.apply(evs)
					r.Record(seq, statedir.Position{Epoch: 1, Revision: seq}, id, evs)
					// Record copied evs: scribbling over them changes nothing.
					for i := range evs {
						evs[i] = kvevent.Event{Type: kvevent.Cleared, Tenant: "tenant-0"}
					}
				}
				frames, err := r.Snapshot(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				rep := decodeReply(t, frames, cfg.Encoder)
				if rep.cut != int64(seq) {
					t.Fatalf("round %d: cut %d, want %d", round, rep.cut, seq)
				}
				if rep.epoch != testEpoch {
					t.Fatalf("epoch %x, want %x", rep.epoch, testEpoch)
				}
				ref.equal(t, rep.set)
				if want := (len(ref) + 63) / 64; len(rep.chunks) != want {
					t.Fatalf("%d chunks for %d entries, want %d", len(rep.chunks), len(ref), want)
				}
				st := r.Stats()
				if st.Cut != int64(seq) || st.Entries != len(ref) || st.Failed {
					t.Fatalf("stats %+v", st)
				}
			}
		})
	}
}

// TestChunkEventIDs pins what the live decoding path of pkg/kvevent says
// of chunks: a chunk of one event (event_id 0) decodes; one of more is
// rejected only for its equal event_ids, so consumers decode chunks with
// rules of their own (and these tests renumber them, see strictChunk).
func TestChunkEventIDs(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	start(t, r)
	r.Record(1, statedir.Position{}, 1, []kvevent.Event{{ID: 1, Type: kvevent.Stored, Tenant: "t", Key: "k1", Medium: kvevent.MediumCPU}})
	frames, err := r.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	b, err := kvevent.DecodeMessage([][]byte{nil, kvevent.PutSeq(1), frames[2]})
	if err != nil || len(b.Events) != 1 || b.Events[0].ID != 0 {
		t.Fatalf("one-event chunk: %v, %+v", err, b)
	}
	r.Record(2, statedir.Position{}, 2, []kvevent.Event{{ID: 2, Type: kvevent.Stored, Tenant: "t", Key: "k2", Medium: kvevent.MediumCPU}})
	if frames, err = r.Snapshot(t.Context()); err != nil {
		t.Fatal(err)
	}
	_, err = kvevent.DecodeMessage([][]byte{nil, kvevent.PutSeq(2), frames[2]})
	if err == nil || !errors.Is(err, kvevent.ErrMalformed) || !strings.Contains(err.Error(), "event_id 0 not above the previous 0") {
		t.Fatalf("two-event chunk: %v; the strict decoder's rule changed", err)
	}
	t.Logf("strict decoder on a chunk of two events: %v", err)
}

// TestSnapshotCoalesces holds the recorder's goroutine (in a checkpoint)
// while requests arrive: they are all answered by one build, with the very
// same frames; requests that arrive during a build wait for the next one,
// which, as a batch was recorded meanwhile, is a new build at a new cut
// (see TestSnapshotReuse for a request after a build with no batch since).
func TestSnapshotCoalesces(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.CheckpointInterval = time.Second
		cp := &fakeCheckpointer{block: make(chan struct{})}
		var inBuild atomic.Bool
		building, release := make(chan struct{}), make(chan struct{})
		now := func() time.Time {
			if inBuild.Load() {
				inBuild.Store(false)
				building <- struct{}{}
				<-release
			}
			return time.Now()
		}
		r, _ := newRecorder(t, cfg, Deps{Checkpointer: cp, Now: now})
		stop := start(t, r)
		defer stop()
		for i := range 100 {
			r.Record(uint64(i+1), statedir.Position{}, uint64(i+1), []kvevent.Event{{ID: uint64(i + 1), Type: kvevent.Stored, Tenant: "t", Key: fmt.Sprint(i), Medium: kvevent.MediumCPU}})
		}
		time.Sleep(cfg.CheckpointInterval)
		synctest.Wait() // Run is in WriteCheckpoint, blocked

		const n = 20
		results := make([][][]byte, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				f, release, err := r.Reply(context.Background()) // not copied: sharing shows
				if err != nil {
					t.Error(err)
					return
				}
				t.Cleanup(release)
				results[i] = f
			})
		}
		synctest.Wait()
		r.Record(101, statedir.Position{}, 101, nil) // queued before the requests are taken: folded first
		inBuild.Store(true)
		close(cp.block)
		<-building // the first build has its requests and is in progress

		late := make(chan [][]byte, 1)
		go func() {
			f, release, err := r.Reply(context.Background())
			if err != nil {
				t.Error(err)
			} else {
				t.Cleanup(release)
			}
			late <- f
		}()
		synctest.Wait()
		r.Record(102, statedir.Position{}, 102, []kvevent.Event{{ID: 102, Type: kvevent.Stored, Tenant: "t", Key: "late", Medium: kvevent.MediumCPU}})
		release <- struct{}{}
		wg.Wait()
		for i := range results {
			if &results[i][0][0] != &results[0][0][0] || len(results[i]) != len(results[0]) {
				t.Fatalf("request %d got another reply", i)
			}
		}
		if rep := decodeReply(t, results[0], cfg.Encoder); rep.cut != 101 || len(rep.set) != 100 {
			t.Fatalf("cut %d, %d entries", rep.cut, len(rep.set))
		}
		f := <-late
		if &f[0][0] == &results[0][0][0] {
			t.Fatal("a request that arrived during a build shared it")
		}
		if rep := decodeReply(t, f, cfg.Encoder); rep.cut != 102 || len(rep.set) != 101 {
			t.Fatalf("late request: cut %d, %d entries", rep.cut, len(rep.set))
		}
		st := r.Stats()
		if st.SnapshotsBuilt != 2 || st.SnapshotRequests != n+1 || st.SnapshotErrors != 0 { // one build for the n, one for the late one
			t.Fatalf("stats %+v", st)
		}
	})
}

// TestMaxWaiting: with MaxWaiting requests waiting, one more fails at
// once; a request whose context ends stops waiting and frees its place.
func TestMaxWaiting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.MaxWaiting = 3
		cfg.CheckpointInterval = time.Second
		cp := &fakeCheckpointer{block: make(chan struct{})}
		r, _ := newRecorder(t, cfg, Deps{Checkpointer: cp})
		stop := start(t, r)
		r.Record(1, statedir.Position{}, 0, nil)
		time.Sleep(time.Second)
		synctest.Wait() // Run is in WriteCheckpoint

		ctx, cancel := context.WithCancel(context.Background())
		errs := make(chan error, cfg.MaxWaiting)
		for i := range cfg.MaxWaiting {
			c := context.Background()
			if i == 0 {
				c = ctx
			}
			go func() {
				_, err := r.Snapshot(c)
				errs <- err
			}()
		}
		synctest.Wait()
		if _, err := r.Snapshot(context.Background()); !errors.Is(err, ErrBusy) {
			t.Fatalf("request %d: %v, want ErrBusy", cfg.MaxWaiting+1, err)
		}
		cancel()
		if err := <-errs; !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled request: %v", err)
		}
		go func() {
			_, err := r.Snapshot(context.Background())
			errs <- err
		}()
		synctest.Wait()
		close(cp.block)
		for range cfg.MaxWaiting {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		st := r.Stats()
		if st.SnapshotsBuilt != 1 || st.SnapshotRequests != uint64(cfg.MaxWaiting)+2 || st.SnapshotErrors != 2 {
			t.Fatalf("stats %+v", st)
		}
		stop()
		if _, err := r.Snapshot(context.Background()); !errors.Is(err, ErrStopped) {
			t.Fatalf("after Run: %v", err)
		}
	})
}

// TestMaxReplyBytes: a reply over the limit is an error, not a reply; one
// within it is fine.
func TestMaxReplyBytes(t *testing.T) {
	cfg := testConfig()
	r, _ := newRecorder(t, cfg, Deps{})
	start(t, r)
	recordEntries(r, 1, 1000)
	frames, err := r.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	size := 0
	for _, f := range frames {
		size += len(f)
	}
	if st := r.Stats(); st.LastReplyBytes != size {
		t.Fatalf("LastReplyBytes %d, reply %d", st.LastReplyBytes, size)
	}

	for _, limit := range []int{size - 1, size / 3, frameHeaderBytes} {
		cfg.MaxReplyBytes = limit
		r2, h := newRecorder(t, cfg, Deps{})
		start(t, r2)
		recordEntries(r2, 1, 1000)
		if _, err := r2.Snapshot(t.Context()); !errors.Is(err, ErrTooLarge) {
			t.Fatalf("limit %d for %d bytes: %v, want ErrTooLarge", limit, size, err)
		}
		if st := r2.Stats(); st.SnapshotErrors != 1 || st.SnapshotsBuilt != 0 || st.Failed {
			t.Fatalf("stats %+v", st)
		}
		if h.warns.Load() != 1 {
			t.Fatalf("%d warnings", h.warns.Load())
		}
	}
	cfg.MaxReplyBytes = size
	r3, _ := newRecorder(t, cfg, Deps{})
	start(t, r3)
	recordEntries(r3, 1, 1000)
	if _, err := r3.Snapshot(t.Context()); err != nil {
		t.Fatalf("limit %d for %d bytes: %v", size, size, err)
	}
}

// recordEntries records batches of 64 new entries from seq on, n entries
// in all, and returns the next sequence number.
func recordEntries(r *Recorder, seq uint64, n int) uint64 {
	evs := make([]kvevent.Event, 0, kvevent.MaxEventsPerBatch)
	for i := range n {
		evs = append(evs, kvevent.Event{ID: uint64(i + 1), Type: kvevent.Stored, Tenant: fmt.Sprint("tenant-", i%3),
			Key: fmt.Sprintf("object/%08d", i), Medium: kvevent.MediumDisk, GroupID: "g"})
		if len(evs) == cap(evs) || i == n-1 {
			r.Record(seq, statedir.Position{Epoch: 1, Revision: seq}, uint64(i+1), evs)
			seq++
			evs = evs[:0]
		}
	}
	return seq
}

// TestOverflowFails: a full queue fails the recorder without blocking
// Record (nothing drains it here), logs once, and from then on snapshots
// fail and no checkpoint is written, not even at stop.
func TestOverflowFails(t *testing.T) {
	cfg := testConfig()
	cfg.QueueBatches = 8
	cp := &fakeCheckpointer{}
	r, h := newRecorder(t, cfg, Deps{Checkpointer: cp})
	evs := []kvevent.Event{{Type: kvevent.Stored, Tenant: "t", Key: "k", Medium: kvevent.MediumCPU}}
	for i := range 100000 { // Run is not running: only the bound saves us
		r.Record(uint64(i+1), statedir.Position{}, 0, evs)
	}
	st := r.Stats()
	if !st.Failed || st.QueueDepth != 0 {
		t.Fatalf("stats %+v", st)
	}
	if h.errors.Load() != 1 {
		t.Fatalf("%d error logs, want 1", h.errors.Load())
	}
	stop := start(t, r)
	if _, err := r.Snapshot(t.Context()); !errors.Is(err, ErrFailed) {
		t.Fatalf("snapshot: %v, want ErrFailed", err)
	}
	stop()
	if n := cp.count(); n != 0 {
		t.Fatalf("%d checkpoints by a failed recorder", n)
	}
}

// TestFailWhileWaiting: requests waiting when the recorder fails get
// ErrFailed.
func TestFailWhileWaiting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.QueueBatches = 2
		cfg.CheckpointInterval = time.Second
		cp := &fakeCheckpointer{block: make(chan struct{})}
		r, _ := newRecorder(t, cfg, Deps{Checkpointer: cp})
		defer start(t, r)()
		r.Record(1, statedir.Position{}, 0, nil)
		time.Sleep(time.Second)
		synctest.Wait() // Run is in WriteCheckpoint
		errc := make(chan error)
		go func() {
			_, err := r.Snapshot(context.Background())
			errc <- err
		}()
		synctest.Wait()
		for i := range 3 {
			r.Record(uint64(i+2), statedir.Position{}, 0, nil)
		}
		close(cp.block)
		if err := <-errc; !errors.Is(err, ErrFailed) {
			t.Fatalf("%v, want ErrFailed", err)
		}
	})
}

// TestSequenceMustRise: a sequence number that does not rise fails the
// recorder (its set would no longer be the set after the cut).
func TestSequenceMustRise(t *testing.T) {
	r, h := newRecorder(t, testConfig(), Deps{})
	r.Record(5, statedir.Position{}, 0, nil)
	r.Record(7, statedir.Position{}, 0, nil)
	if r.Stats().Failed {
		t.Fatal("a gap failed the recorder")
	}
	r.Record(7, statedir.Position{}, 0, nil)
	if !r.Stats().Failed || h.errors.Load() != 1 {
		t.Fatalf("stats %+v, %d error logs", r.Stats(), h.errors.Load())
	}
}

type checkpoint struct {
	h       statedir.Header
	entries model
}

// fakeCheckpointer keeps checkpoints in memory. With block set, each
// WriteCheckpoint first waits until it is closed; err fails the calls
// while set.
type fakeCheckpointer struct {
	block chan struct{}
	mu    sync.Mutex
	cps   []checkpoint
	err   error
}

func (f *fakeCheckpointer) WriteCheckpoint(h statedir.Header, entries iter.Seq[kvevent.Event]) error {
	if f.block != nil {
		<-f.block
	}
	m := model{}
	for e := range entries {
		m[entry{e.Tenant, e.Key, e.Medium}] = e.GroupID
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return f.err
	}
	f.cps = append(f.cps, checkpoint{h, m})
	return nil
}

func (f *fakeCheckpointer) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.cps)
}

func (f *fakeCheckpointer) last() checkpoint {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cps[len(f.cps)-1]
}

func (f *fakeCheckpointer) setErr(err error) {
	f.mu.Lock()
	f.err = err
	f.mu.Unlock()
}

// TestCheckpoints: on synctest's clock, a checkpoint every interval in
// which the cut advanced, with the header of the cut; a failed one is
// counted and retried at the next interval; a last one at stop, after the
// queue is folded.
func TestCheckpoints(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.CheckpointInterval = 10 * time.Second
		cp := &fakeCheckpointer{}
		var subs atomic.Int64
		r, h := newRecorder(t, cfg, Deps{Checkpointer: cp, Subscribers: func() int { return int(subs.Load()) }})
		stop := start(t, r)
		defer stop()
		t0 := time.Now()

		ref := model{}
		rng := rand.New(rand.NewPCG(7, 8))
		var seq, id uint64
		recordSome := func() {
			for range 50 {
				seq++
				evs := randomBatch(rng, &id)
				ref.apply(evs)
				r.Record(seq, statedir.Position{Epoch: 2, Revision: 100 + seq}, id, evs)
			}
		}
		var written time.Time // of the last checkpoint
		check := func(n int) {
			t.Helper()
			if got := cp.count(); got != n {
				t.Fatalf("%d checkpoints, want %d", got, n)
			}
			c := cp.last()
			want := statedir.Header{PublisherEpoch: testEpoch, Seq: seq, Master: statedir.Position{Epoch: 2, Revision: 100 + seq},
				LastEventID: id, WrittenUnixMilli: written.UnixMilli(), Subscribers: int(subs.Load()), Entries: uint64(len(ref))}
			if c.h != want {
				t.Fatalf("header %+v, want %+v", c.h, want)
			}
			ref.equal(t, c.entries)
			if st := r.Stats(); st.Checkpoints != uint64(n) || st.LastCheckpointUnixMilli != want.WrittenUnixMilli {
				t.Fatalf("stats %+v", st)
			}
		}

		time.Sleep(25 * time.Second)
		synctest.Wait()
		if cp.count() != 0 {
			t.Fatal("checkpoint of nothing")
		}
		recordSome()
		subs.Store(2)
		time.Sleep(time.Until(t0.Add(30 * time.Second)))
		synctest.Wait()
		written = time.Now()
		check(1)
		time.Sleep(20 * time.Second) // nothing new: no checkpoint
		synctest.Wait()
		check(1)

		recordSome()
		cp.setErr(errors.New("disk full"))
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if st := r.Stats(); st.CheckpointErrors != 1 || st.Checkpoints != 1 || h.errors.Load() != 1 {
			t.Fatalf("stats %+v, %d error logs", st, h.errors.Load())
		}
		cp.setErr(nil)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		written = time.Now()
		check(2)

		recordSome() // folded at stop, then written
		stop()
		written = time.Now()
		check(3)
	})
}

// TestCheckpointOnlyAtStop: interval 0 writes one checkpoint, at stop.
func TestCheckpointOnlyAtStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.CheckpointInterval = 0
		cp := &fakeCheckpointer{}
		r, _ := newRecorder(t, cfg, Deps{Checkpointer: cp})
		stop := start(t, r)
		next := recordEntries(r, 1, 500)
		time.Sleep(time.Hour)
		synctest.Wait()
		if cp.count() != 0 {
			t.Fatal("checkpoint before stop")
		}
		stop()
		if c := cp.last(); cp.count() != 1 || c.h.Seq != next-1 || len(c.entries) != 500 || c.h.Entries != 500 {
			t.Fatalf("%d checkpoints, last %+v with %d entries", cp.count(), c.h, len(c.entries))
		}
	})
}

// TestRestore: a restored recorder serves the restored set, epoch and cut,
// checkpoints it (the state directory may hold an older checkpoint plus a
// journal), and continues with the next batches.
func TestRestore(t *testing.T) {
	cfg := testConfig()
	cp := &fakeCheckpointer{}
	set := announced.New()
	ref := model{}
	for i := range 300 {
		e := entry{fmt.Sprint("t", i%2), fmt.Sprint("k", i), kvevent.MediumCPU}
		set.Store(e.tenant, e.key, e.medium, "g")
		ref[e] = "g"
	}
	restored := statedir.Epoch{0xee}
	r, _ := newRecorder(t, cfg, Deps{Checkpointer: cp})
	r.Restore(restored, 41, statedir.Position{Epoch: 3, Revision: 9}, 1234, set)
	if r.Epoch() != restored {
		t.Fatalf("epoch %x", r.Epoch())
	}
	stop := start(t, r)
	frames, err := r.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	rep := decodeReply(t, frames, cfg.Encoder)
	if rep.cut != 41 || rep.epoch != restored {
		t.Fatalf("cut %d epoch %x", rep.cut, rep.epoch)
	}
	ref.equal(t, rep.set)

	r.Record(41, statedir.Position{}, 0, nil) // not above the restored cut
	if !r.Stats().Failed {
		t.Fatal("sequence 41 after a restore at 41 accepted")
	}
	stop()

	// Again, continuing properly.
	set = announced.New()
	for e, g := range ref {
		set.Store(e.tenant, e.key, e.medium, g)
	}
	r, _ = newRecorder(t, cfg, Deps{Checkpointer: cp})
	r.Restore(restored, 41, statedir.Position{Epoch: 3, Revision: 9}, 1234, set)
	stop = start(t, r)
	evs := []kvevent.Event{
		{ID: 1235, Type: kvevent.Removed, Tenant: "t0", Key: "k0", Medium: kvevent.MediumCPU},
		{ID: 1236, Type: kvevent.Cleared, Tenant: "t1"},
		{ID: 1237, Type: kvevent.Stored, Tenant: "t2", Key: "new", Medium: kvevent.MediumDisk, GroupID: "g2"},
	}
	ref.apply(evs)
	r.Record(43, statedir.Position{Epoch: 3, Revision: 12}, 1237, evs)
	if frames, err = r.Snapshot(t.Context()); err != nil {
		t.Fatal(err)
	}
	rep = decodeReply(t, frames, cfg.Encoder)
	if rep.cut != 43 || rep.epoch != restored {
		t.Fatalf("cut %d epoch %x", rep.cut, rep.epoch)
	}
	ref.equal(t, rep.set)
	stop()
	c := cp.last()
	if c.h.Seq != 43 || c.h.PublisherEpoch != restored || c.h.LastEventID != 1237 || c.h.Master != (statedir.Position{Epoch: 3, Revision: 12}) {
		t.Fatalf("checkpoint %+v", c.h)
	}
	ref.equal(t, c.entries)
}

// TestRestoreNothingFolded: Restore at sequence 0 (nothing published) keeps
// the cut at -1; Restore of entries at sequence 0 (a reply of cut -1 must
// have no chunks) and Restore after Run panic.
func TestRestoreNothingFolded(t *testing.T) {
	r, _ := newRecorder(t, testConfig(), Deps{})
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("Restore of entries at sequence 0 did not panic")
			}
		}()
		set := announced.New()
		set.Store("t", "k", kvevent.MediumCPU, "")
		r.Restore(testEpoch, 0, statedir.Position{}, 0, set)
	}()
	r.Restore(testEpoch, 0, statedir.Position{}, 0, nil)
	stop := start(t, r)
	frames, err := r.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if cut := int64(binary.BigEndian.Uint64(frames[0])); cut != -1 {
		t.Fatalf("cut %d", cut)
	}
	stop()
	defer func() {
		if recover() == nil {
			t.Fatal("Restore after Run did not panic")
		}
	}()
	r.Restore(testEpoch, 0, statedir.Position{}, 0, nil)
}

// TestRecordDuringBuild: Record keeps queueing (and returns) while a build
// is in progress; those batches are in the next reply.
func TestRecordDuringBuild(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		var hold atomic.Bool
		inBuild, release := make(chan struct{}), make(chan struct{})
		now := func() time.Time {
			if hold.Swap(false) {
				inBuild <- struct{}{}
				<-release
			}
			return time.Now()
		}
		r, _ := newRecorder(t, cfg, Deps{Now: now})
		defer start(t, r)()
		next := recordEntries(r, 1, 100)
		hold.Store(true)
		got := make(chan [][]byte)
		go func() {
			f, err := r.Snapshot(context.Background())
			if err != nil {
				t.Error(err)
			}
			got <- f
		}()
		<-inBuild
		next = recordEntries(r, next, 1000) // returns although Run is busy
		if d := r.Stats().QueueDepth; d != 16 {
			t.Fatalf("queue depth %d during the build", d)
		}
		release <- struct{}{}
		if rep := decodeReply(t, <-got, cfg.Encoder); rep.cut != 2 || len(rep.set) != 100 {
			t.Fatalf("cut %d, %d entries", rep.cut, len(rep.set))
		}
		f, err := r.Snapshot(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if rep := decodeReply(t, f, cfg.Encoder); rep.cut != int64(next-1) || len(rep.set) != 1000 {
			t.Fatalf("cut %d, %d entries", rep.cut, len(rep.set))
		}
	})
}

func TestConfigValidate(t *testing.T) {
	if _, err := New(Config{}, Deps{}, nil); err == nil {
		t.Fatal("zero Config accepted")
	}
	cfg := testConfig()
	cfg.CheckpointInterval = -1
	if _, err := New(cfg, Deps{}, nil); err == nil {
		t.Fatal("negative interval accepted")
	}
	cfg.CheckpointInterval = 0
	if _, err := New(cfg, Deps{}, nil); err != nil {
		t.Fatal(err)
	}
}

// TestRecordReusesBlocks: a steady state recycles the queue's blocks and
// keeps its strings alive no longer than the fold.
func TestRecordReusesBlocks(t *testing.T) {
	r, _ := newRecorder(t, testConfig(), Deps{})
	evs := make([]kvevent.Event, kvevent.MaxEventsPerBatch)
	for i := range evs {
		evs[i] = kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: fmt.Sprint(i), Medium: kvevent.MediumCPU}
	}
	seq := uint64(0)
	for range 3 {
		for range 200 {
			seq++
			r.Record(seq, statedir.Position{}, 0, evs)
		}
		r.drain()
	}
	allocs := testing.AllocsPerRun(10, func() {
		for range 200 {
			seq++
			r.Record(seq, statedir.Position{}, 0, evs)
		}
		r.drain()
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per 200 batches in steady state", allocs)
	}
	for _, b := range r.free {
		for _, e := range b[:cap(b)] {
			if e != (rec{}) {
				t.Fatal("a free block holds an event")
			}
		}
	}
}
