package kvevent_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// DecodeMessage turns the three frames of one PUB message (empty topic,
// big-endian sequence, msgpack payload) into a Batch, refusing anything
// the contract does not allow.
func ExampleDecodeMessage() {
	// A publisher's side: what the gateway sends.
	enc := kvevent.NewEncoder(kvevent.EncoderOptions{
		Envelope:  kvevent.Envelope{BackendID: "crescent-gw-1", ModelName: "llama-70b"},
		ObjectKey: true,
	})
	payload, err := enc.AppendBatch(nil, 1700000000000, []kvevent.Event{
		{ID: 41, Type: kvevent.Stored, Tenant: "llama-70b", Key: "prefix/0", Medium: kvevent.MediumCPU, GroupID: "g1"},
		{ID: 42, Type: kvevent.Removed, Tenant: "llama-70b", Key: "prefix/9", Medium: kvevent.MediumDisk},
	})
	if err != nil {
		log.Fatal(err)
	}
	frames := [][]byte{{}, kvevent.PutSeq(7), payload}

	// A subscriber's side.
	b, err := kvevent.DecodeMessage(frames)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("seq", b.Seq, "events", len(b.Events))
	for _, ev := range b.Events {
		fmt.Println(ev.ID, ev.Type, ev.Tenant, ev.Key, ev.Medium, ev.GroupID, ev.Envelope.ModelName)
	}

	// Two frames are not a message of the contract.
	_, err = kvevent.DecodeMessage(frames[1:])
	fmt.Println(err != nil)
	// Output:
	// seq 7 events 2
	// 41 stored llama-70b prefix/0 cpu g1 llama-70b
	// 42 removed llama-70b prefix/9 disk  llama-70b
	// true
}

// Subscribe follows a gateway's PUB socket and keeps the index of readable
// (tenant, key, medium) a scheduler routes with. Here the gateway is a
// scripted publisher on a loopback port (internal/testutil); against a
// cluster the endpoint is the gateway's, e.g. tcp://gateway:5557, with
// Options.ReplayEndpoint tcp://gateway:5558 to repair gaps.
func ExampleSubscribe() {
	pub, err := testutil.StartPublisher()
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The callbacks run on the subscriber's goroutine, in stream order.
	seen := make(chan string, 8)
	sub, err := kvevent.Subscribe(ctx, pub.Endpoint(), kvevent.Options{
		OnBatch: func(b kvevent.Batch) { seen <- fmt.Sprintf("batch %d: %d events", b.Seq, len(b.Events)) },
		OnGap:   func(g kvevent.Gap) { seen <- fmt.Sprintf("gap [%d, %d)", g.From, g.To) },
	})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	if err := pub.WaitSubscriber(ctx); err != nil {
		log.Fatal(err)
	}

	enc := kvevent.NewEncoder(kvevent.EncoderOptions{Envelope: kvevent.Envelope{BackendID: "gw"}, ObjectKey: true})
	send := func(seq uint64, evs ...kvevent.Event) {
		payload, err := enc.AppendBatch(nil, 1700000000000, evs)
		if err != nil {
			log.Fatal(err)
		}
		if err := pub.Send(nil, kvevent.PutSeq(seq), payload); err != nil {
			log.Fatal(err)
		}
	}
	send(1,
		kvevent.Event{ID: 1, Type: kvevent.Stored, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU},
		kvevent.Event{ID: 2, Type: kvevent.Stored, Tenant: "t", Key: "b", Medium: kvevent.MediumCPU})
	send(2, kvevent.Event{ID: 3, Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU})
	send(4, kvevent.Event{ID: 5, Type: kvevent.Stored, Tenant: "t", Key: "c", Medium: kvevent.MediumDisk}) // 3 went missing

	for range 4 {
		select {
		case s := <-seen:
			fmt.Println(s)
		case <-ctx.Done():
			log.Fatal("no batch")
		}
	}
	for _, k := range sub.Index().Keys() {
		fmt.Println(k.Tenant, k.Key, k.Medium)
	}
	_, inB := sub.Index().Has(kvevent.Key{Tenant: "t", Key: "b", Medium: kvevent.MediumCPU})
	fmt.Println(inB, sub.Stats().MissingSeqs)
	// Output:
	// batch 1: 2 events
	// batch 2: 1 events
	// gap [3, 4)
	// batch 4: 1 events
	// t b cpu
	// t c disk
	// true 1
}
