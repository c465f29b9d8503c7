package publisher

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// BenchmarkPublishToSubscriber is the gateway's own share of the path:
// events handed to the publisher (as the source does, a watch response at
// a time) until decoded by a kvevent subscriber over loopback TCP.
func BenchmarkPublishToSubscriber(b *testing.B) {
	p, err := New(testConfig(), testutil.Logger())
	if err != nil {
		b.Fatal(err)
	}
	ctx := b.Context()
	done := make(chan error, 1)
	if err := p.Listen(); err != nil {
		b.Fatal(err)
	}
	runCtx, stop := context.WithCancel(context.Background())
	go func() { done <- p.Run(runCtx) }()
	defer func() { stop(); <-done }()
	var got atomic.Int64
	sub, err := kvevent.Subscribe(ctx, p.PubEndpoint(), kvevent.Options{Logger: testutil.Logger(), DisableIndex: true,
		OnBatch: func(bt kvevent.Batch) { got.Add(int64(len(bt.Events))) }})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	testutil.Eventually(b, 20*time.Second, func() bool { return p.Stats().Subscribers > 0 }, "the subscriber")
	const chunk = 1024
	evs := make([]kvevent.Event, 0, chunk)
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		typ := kvevent.Stored
		if i%2 == 1 {
			typ = kvevent.Removed
		}
		evs = append(evs, kvevent.Event{Type: typ, Tenant: "t", Key: "bench/" + strconv.Itoa(i/2), Medium: kvevent.MediumCPU})
		if len(evs) == chunk || i == b.N-1 {
			if err := p.EnqueueWait(ctx, evs...); err != nil {
				b.Fatal(err)
			}
			evs = evs[:0]
			// A subscriber that keeps up: stay within its queue bound.
			for int64(i)-got.Load() > 1<<15 {
				time.Sleep(50 * time.Microsecond)
			}
		}
	}
	for got.Load() < int64(b.N) {
		if p.Stats().SubscriberDroppedBatches > 0 {
			b.Fatal("the subscriber's queue dropped batches")
		}
		time.Sleep(100 * time.Microsecond)
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
	st := p.Stats()
	b.ReportMetric(float64(st.PublishedEvents)/float64(max(st.PublishedBatches, 1)), "events/batch")
	b.ReportMetric(float64(sub.Stats().MissingSeqs), "seq-gaps")
}

// BenchmarkQueue is the queue's share of an event: pushes of 128 events (a
// watch response, with its master position), taken 64 at a time as the
// publishing goroutine does.
func BenchmarkQueue(b *testing.B) {
	q := newQueue(65536)
	items := make([]item, 128)
	for i := range items {
		items[i] = item{typ: kvevent.Stored, tenant: "t", key: "bench/" + strconv.Itoa(i), medium: kvevent.MediumCPU}
	}
	dst := make([]item, 0, 64)
	b.ReportAllocs()
	for i := 0; i < b.N; i += len(items) {
		q.push(items, statedir.Position{Epoch: 1, Revision: uint64(i)})
		for q.len() > 0 {
			dst, _, _ = q.take(dst[:0], 64)
		}
	}
}

// BenchmarkPublishBatch is the publishing goroutine's own work for one
// full batch of 64 events (take, encode, frame in place, copy out, ring),
// with no subscriber: in each format, with and without a topic.
func BenchmarkPublishBatch(b *testing.B) {
	for _, tc := range []struct {
		name   string
		format Format
		topic  string
	}{
		{"mooncake", FormatMooncake, ""},
		{"snapshot", FormatSnapshot, ""},
		{"snapshot_topic", FormatSnapshot, "kv@127.0.0.1:5557@e2e-model"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			cfg := testConfig()
			cfg.Format, cfg.Topic = tc.format, tc.topic
			cfg.ReplayBuffer = 1024
			p, err := New(cfg, testutil.Logger())
			if err != nil {
				b.Fatal(err)
			}
			pub := newPubSocket(testutil.Logger(), nil, cfg.Topic, 1, 1, 1, time.Second, 0)
			evs := make([]kvevent.Event, kvevent.MaxEventsPerBatch)
			for i := range evs {
				evs[i] = kvevent.Event{Type: kvevent.Stored, Tenant: "t", Key: "bench/" + strconv.Itoa(i), Medium: kvevent.MediumCPU}
			}
			b.ReportAllocs()
			for b.Loop() {
				p.Enqueue(evs...)
				p.publishNext(pub)
			}
		})
	}
}
