package kvevent_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"net"
	"sync"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
	"github.com/go-zeromq/zmq4"
)

// FetchSnapshot asks a publisher's snapshot socket for its state: the cut
// (the last sequence number folded in), the publisher epoch and the stored
// entries as chunks. Here the socket is a stand-in on a loopback port;
// against a gateway started with --snapshot-endpoint it is e.g.
// tcp://gateway:5559.
func ExampleFetchSnapshot() {
	epoch := bytes.Repeat([]byte{0xab}, kvevent.EpochLen)
	ep, stop := snapshotSocket(41, epoch, []kvevent.Event{
		{Type: kvevent.Stored, Tenant: "llama-70b", Key: "prefix/0", Medium: kvevent.MediumCPU, GroupID: "g1"},
		{Type: kvevent.Stored, Tenant: "llama-70b", Key: "prefix/1", Medium: kvevent.MediumDisk},
	})
	defer stop()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	snap, err := kvevent.FetchSnapshot(ctx, ep, kvevent.SnapshotOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("cut %d epoch %x… %d events\n", snap.Cut, snap.Epoch[:2], snap.Events())
	for _, b := range snap.Batches {
		for _, ev := range b.Events {
			fmt.Println(ev.Type, ev.Tenant, ev.Key, ev.Medium, ev.GroupID)
		}
	}
	// Live batches from sequence 42 on complete it.
	// Output:
	// cut 41 epoch abab… 2 events
	// stored llama-70b prefix/0 cpu g1
	// stored llama-70b prefix/1 disk
}

// With Options.SnapshotEndpoint a subscriber starts from the publisher's
// snapshot instead of an empty index, then applies the live batches above
// its cut; whenever it loses the stream's continuity (a gateway restart, a
// gap, a heartbeat timeout) it rebuilds from a fresh snapshot and reports
// a Gap with Rebuilt set. The publisher here speaks the snapshot stream
// format: 24-byte sequence frames carrying its epoch, and heartbeats.
func ExampleSubscribe_snapshot() {
	pub, err := testutil.StartPublisher()
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	epoch := bytes.Repeat([]byte{0xcd}, kvevent.EpochLen)
	// The publisher's state after sequence 2: t/a and t/b stored.
	snapEP, stop := snapshotSocket(2, epoch, []kvevent.Event{
		{Type: kvevent.Stored, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU},
		{Type: kvevent.Stored, Tenant: "t", Key: "b", Medium: kvevent.MediumCPU},
	})
	defer stop()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seen := make(chan string, 8)
	sub, err := kvevent.Subscribe(ctx, pub.Endpoint(), kvevent.Options{
		SnapshotEndpoint: snapEP, // e.g. tcp://gateway:5559
		OnBatch: func(b kvevent.Batch) {
			if b.Snapshot {
				seen <- fmt.Sprintf("snapshot at %d: %d events", b.Seq, len(b.Events))
				return
			}
			seen <- fmt.Sprintf("batch %d: %d events", b.Seq, len(b.Events))
		},
		OnGap: func(g kvevent.Gap) { seen <- fmt.Sprintf("rebuilt=%v: %v", g.Rebuilt, g.Err) },
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
		var payload []byte
		if len(evs) == 0 {
			payload, err = enc.AppendHeartbeat(nil, 1700000000000)
		} else {
			payload, err = enc.AppendBatch(nil, 1700000000000, evs)
		}
		if err != nil {
			log.Fatal(err)
		}
		if err := pub.Send(nil, kvevent.PutSeqEpoch(seq, epoch), payload); err != nil {
			log.Fatal(err)
		}
	}
	send(2, kvevent.Event{ID: 2, Type: kvevent.Stored, Tenant: "t", Key: "b", Medium: kvevent.MediumCPU}) // in the snapshot already
	send(3, kvevent.Event{ID: 3, Type: kvevent.Stored, Tenant: "t", Key: "c", Medium: kvevent.MediumDisk})
	send(4) // a heartbeat: the publisher is idle
	send(5, kvevent.Event{ID: 4, Type: kvevent.Removed, Tenant: "t", Key: "a", Medium: kvevent.MediumCPU})

	for range 3 {
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
	st := sub.Stats()
	fmt.Println("snapshots", st.Snapshots, "heartbeats", st.Heartbeats, "last", st.LastSeq, "synced", st.Synced)
	// Output:
	// snapshot at 2: 2 events
	// batch 3: 1 events
	// batch 5: 1 events
	// t b cpu
	// t c disk
	// snapshots 1 heartbeats 1 last 5 synced true
}

// snapshotSocket stands in for a publisher's snapshot ROUTER: every
// request gets [b"", cut, epoch, one chunk of evs] (the chunk's events
// carry event_id 0, as the gateway's do).
func snapshotSocket(cut int64, epoch []byte, evs []kvevent.Event) (endpoint string, stop func()) {
	chunk, err := kvevent.NewEncoder(kvevent.EncoderOptions{Envelope: kvevent.Envelope{BackendID: "gw"}, ObjectKey: true}).
		AppendBatch(nil, 1700000000000, evs)
	if err != nil {
		log.Fatal(err)
	}
	reply := zmtp.AppendMessage(nil, nil, binary.BigEndian.AppendUint64(nil, uint64(cut)), epoch, chunk)
	l, err := zmtp.Listen("tcp://127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	wg.Go(func() {
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[nc] = true
			mu.Unlock()
			wg.Go(func() {
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
					if m.Command == "" && c.Write(reply, 5*time.Second) != nil {
						return
					}
				}
			})
		}
	})
	return zmtp.Endpoint(l), func() {
		l.Close()
		mu.Lock()
		for nc := range conns {
			nc.Close()
		}
		mu.Unlock()
		wg.Wait()
	}
}
