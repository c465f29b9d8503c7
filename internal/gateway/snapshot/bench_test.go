package snapshot

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// benchEvents is a batch of 64 stored events of realistic shape: 21-byte
// keys, a tenant, a group.
func benchEvents() []kvevent.Event {
	evs := make([]kvevent.Event, kvevent.MaxEventsPerBatch)
	for i := range evs {
		evs[i] = kvevent.Event{ID: uint64(i + 1), Type: kvevent.Stored, Tenant: "tenant-01",
			Key: fmt.Sprintf("model/layer/%09d", i), Medium: kvevent.MediumCPU, GroupID: "group-7"}
	}
	return evs
}

// BenchmarkRecord is the publisher's cost of handing the recorder one
// 64-event batch (Record only; the queue is folded outside the timer).
func BenchmarkRecord(b *testing.B) {
	r, _ := newRecorder(b, testConfig(), Deps{})
	evs := benchEvents()
	var seq uint64
	b.ReportAllocs()
	for b.Loop() {
		seq++
		r.Record(seq, statedir.Position{Epoch: 1, Revision: seq}, seq*64, evs)
		if seq%1024 == 0 {
			b.StopTimer()
			r.drain()
			b.StartTimer()
		}
	}
	if r.Stats().Failed {
		b.Fatal("recorder failed")
	}
}

// BenchmarkFold is the recorder's cost of folding one 64-event batch into
// a set of a million entries (the rate it sustains behind the publisher):
// batches that store 65536 new keys, then remove them, and again.
func BenchmarkFold(b *testing.B) {
	r, _ := newRecorder(b, testConfig(), Deps{})
	set := announced.New()
	fillSet(set, 1_000_000)
	r.Restore(testEpoch, 1, statedir.Position{}, 0, set)
	const rounds = 1024
	keys := make([]string, rounds*kvevent.MaxEventsPerBatch)
	for i := range keys {
		keys[i] = fmt.Sprintf("fold/layer/%010d", i)
	}
	evs := benchEvents()
	seq := uint64(1)
	b.ReportAllocs()
	for b.Loop() {
		round := int(seq-1) % rounds
		typ := kvevent.Stored
		if (seq-1)/rounds%2 == 1 {
			typ = kvevent.Removed
		}
		for i := range evs {
			evs[i].Type, evs[i].Key = typ, keys[round*kvevent.MaxEventsPerBatch+i]
		}
		seq++
		r.Record(seq, statedir.Position{}, 0, evs)
		r.drain()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*kvevent.MaxEventsPerBatch), "ns/event")
}

// fillSet stores n entries over 8 tenants, 21-byte keys, both media.
func fillSet(set *announced.Set, n int) {
	media := [2]kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}
	for i := range n {
		set.Store(fmt.Sprint("tenant-0", i%8), fmt.Sprintf("model/layer/%09d", i), media[i/8%2], fmt.Sprint("group-", i%16))
	}
}

// BenchmarkSnapshot1M builds the reply of a set of a million entries (the
// default envelope, legacy fields on): build time, reply bytes, and the
// throughput a late joiner's bootstrap budget (3 s end to end) leaves.
// Builds after the first reuse the previous one's buffers.
func BenchmarkSnapshot1M(b *testing.B) {
	for _, legacy := range []bool{true, false} {
		b.Run(fmt.Sprint("legacy=", legacy), func(b *testing.B) {
			cfg := testConfig()
			cfg.Encoder.LegacyCompat = legacy
			cfg.MaxReplyBytes = 1 << 30
			r, _ := newRecorder(b, cfg, Deps{})
			set := announced.New()
			fillSet(set, 1_000_000)
			r.Restore(testEpoch, 1, statedir.Position{}, 0, set)
			b.ReportAllocs()
			c0 := cpuTime()
			for b.Loop() {
				// Each build is remembered as the last reply and not
				// held by any request, so the next one reuses its
				// buffers (a server's steady state, reply.go).
				frames, bufs, err := r.build()
				if err != nil {
					b.Fatal(err)
				}
				r.remember(frames, bufs)
			}
			frames := r.last.frames
			b.ReportMetric(float64((cpuTime()-c0).Milliseconds())/float64(b.N), "cpu-ms/op")
			size := 0
			for _, f := range frames {
				size += len(f)
			}
			b.ReportMetric(float64(size), "reply-bytes")
			b.ReportMetric(float64(len(frames)-2), "chunks")
			b.SetBytes(int64(size))
		})
	}
}

// BenchmarkSetAll1M is the floor under BenchmarkSnapshot1M: iterating the
// announced set of a million entries without encoding anything (its
// records are read in hash order, a cache miss each).
func BenchmarkSetAll1M(b *testing.B) {
	set := announced.New()
	fillSet(set, 1_000_000)
	b.ReportAllocs()
	c0 := cpuTime()
	for b.Loop() {
		n := 0
		for ev := range set.All() {
			n += len(ev.Key)
		}
		if n == 0 {
			b.Fatal("empty")
		}
	}
	b.ReportMetric(float64((cpuTime()-c0).Milliseconds())/float64(b.N), "cpu-ms/op")
}

// BenchmarkDecode1M is the consumer's side of the same reply: decoding
// every chunk with pkg/kvevent's strict decoder (after renumbering the
// event_ids, see strictChunk) and applying it to an index.
func BenchmarkDecode1M(b *testing.B) {
	cfg := testConfig()
	cfg.MaxReplyBytes = 1 << 30
	r, _ := newRecorder(b, cfg, Deps{})
	set := announced.New()
	fillSet(set, 1_000_000)
	r.Restore(testEpoch, 1, statedir.Position{}, 0, set)
	frames, _, err := r.build()
	if err != nil {
		b.Fatal(err)
	}
	chunks := make([][]byte, 0, len(frames)-2)
	for _, c := range frames[2:] {
		rc, _ := renumber(c)
		chunks = append(chunks, rc)
	}
	b.ReportAllocs()
	c0 := cpuTime()
	for b.Loop() {
		var d kvevent.Decoder
		idx := make(map[string]string, 1_000_000)
		for _, c := range chunks {
			batch, err := d.DecodePayload(1, c)
			if err != nil {
				b.Fatal(err)
			}
			for _, e := range batch.Events {
				idx[e.Key] = e.GroupID
			}
		}
		if len(idx) != 1_000_000 {
			b.Fatalf("%d entries", len(idx))
		}
	}
	b.ReportMetric(float64((cpuTime()-c0).Milliseconds())/float64(b.N), "cpu-ms/op")
}

// cpuTime is the process's user and system CPU time (garbage collection
// included), steadier than wall time on a shared machine.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
