package client_test

import (
	"context"
	"fmt"
	"regexp"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// BenchmarkClusterTLS is the cluster table's workloads (crescentctl bench:
// batches of 128 objects of 4 KiB by 8 workers, objects of 1 MiB by 4)
// through the SDK on two in-process clusters started side by side, one
// plaintext and one with mTLS on every link (testcluster Options.TLS: the
// masters' gRPC, the agents' DataService and transfer listeners). Each
// iteration runs one round of calls on each, plaintext first, so that
// tls/plain compares them in the same instant of a shared machine
// (issue 14). Puts write fresh keys (the masters evict under pressure, as
// with crescentctl bench); gets read a stored set into reused buffers.
//
//	go test ./pkg/client -run '^$' -bench ClusterTLS -benchtime 3s -count 3
func BenchmarkClusterTLS(b *testing.B) {
	for _, w := range []struct {
		name           string
		workers, batch int
		size           int
		put            bool
	}{
		{"put-4KiB-batch128", 8, 128, 4 << 10, true},
		{"get-4KiB-batch128", 8, 128, 4 << 10, false},
		{"put-1MiB", 4, 1, 1 << 20, true},
		{"get-1MiB", 4, 1, 1 << 20, false},
	} {
		b.Run(w.name, func(b *testing.B) { benchClusterTLS(b, w.workers, w.batch, w.size, w.put) })
	}
}

func benchClusterTLS(b *testing.B, workers, batch, size int, put bool) {
	// Prefaulted, as make run's agents are: fresh keys keep landing on
	// memory never touched before.
	opts := testcluster.Options{AgentMemory: 256 << 20, Agent: func(_ int, c *agentapp.Config) { c.Prefault = true }}
	plain := testcluster.Start(b, opts)
	opts.TLS = true
	secure := testcluster.Start(b, opts)
	ctx := context.Background()
	clients := []*client.Client{plain.Client(b), secure.Client(b)}

	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	// Per worker: the keys it reads, their buffers, and items to put.
	keys := make([][]string, workers)
	items := make([][]client.Item, workers)
	bufs := make([][][]byte, workers)
	for w := range workers {
		for i := range batch {
			k := fmt.Sprintf("get-%d-%d", w, i)
			keys[w] = append(keys[w], k)
			items[w] = append(items[w], client.Item{Key: k, Data: data})
			bufs[w] = append(bufs[w], make([]byte, size))
		}
	}
	var seq atomic.Int64
	call := func(c *client.Client, w int) error {
		switch {
		case put && batch == 1:
			return c.Put(ctx, fmt.Sprintf("put-%d", seq.Add(1)), data)
		case put:
			its := make([]client.Item, batch)
			n := seq.Add(1)
			for i := range its {
				its[i] = client.Item{Key: fmt.Sprintf("put-%d-%d", n, i), Data: data}
			}
			for _, err := range c.BatchPut(ctx, its) {
				if err != nil {
					return err
				}
			}
		case batch == 1:
			_, err := c.GetInto(ctx, keys[w][0], bufs[w][0])
			return err
		default:
			_, errs := c.BatchGetInto(ctx, keys[w], bufs[w])
			for _, err := range errs {
				if err != nil {
					return err
				}
			}
		}
		return nil
	}
	round := func(c *client.Client) {
		var wg sync.WaitGroup
		errs := make([]error, workers)
		for w := range workers {
			wg.Go(func() { errs[w] = call(c, w) })
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, c := range clients {
		if !put {
			for w := range workers {
				for _, err := range c.BatchPut(ctx, items[w]) {
					if err != nil {
						b.Fatal(err)
					}
				}
			}
		}
		round(c) // warm up: connections, the first touch of the buffers
	}

	var d [2]time.Duration
	b.ResetTimer()
	for b.Loop() {
		for i, c := range clients {
			t0 := time.Now()
			round(c)
			d[i] += time.Since(t0)
		}
	}
	b.StopTimer()
	objs := float64(workers*batch) * float64(b.N)
	for i, name := range []string{"plain", "tls"} {
		if batch > 1 {
			b.ReportMetric(objs/d[i].Seconds(), name+"-obj/s")
		} else {
			b.ReportMetric(objs*float64(size)/float64(d[i].Nanoseconds()), name+"-GB/s")
		}
	}
	b.ReportMetric(float64(d[0])/float64(d[1]), "tls/plain")
}

// The same calls on their own, one RPC each (BenchmarkSingleOps); and,
// as "sdk-shm", through the agents' shared memory (agent --shm-socket,
// Config.SharedMemorySockets) instead of the bulk TCP path: an extra
// configuration, never the "sdk" number; "sdk-shm-granted" is sdk-shm
// asking the agent for every read (DisableMappedReads), its A/B;
// "sdk-unary" and "sdk-shm-unary" send the coalesced lookups as unary
// calls instead of on the master's CallStream (DisableCallStream), the
// stream's A/B in the same rounds; "sdk-stream" and "sdk-shm-stream"
// keep the lookups on the stream instead of the master's lookup listener
// (DisableLookupListener), the listener's. The agents serve sockets only when
// -single-clients selects one of the shm configurations.
func init() {
	singleClients["sdk-uncoalesced"] = func(c *client.Config) { c.DisableCoalescing = true }
	singleClients["sdk-unary"] = func(c *client.Config) { c.DisableCallStream = true }
	singleClients["sdk-stream"] = func(c *client.Config) { c.DisableLookupListener = true }
	var dir string
	var sockets []string
	singleAgent = func(b *testing.B, i int, c *agentapp.Config) {
		if ok, _ := regexp.MatchString(*singleOnly, "sdk-shm"); !ok {
			return
		}
		if dir == "" {
			if dir = b.TempDir(); len(dir) > 80 {
				b.Skipf("temporary directory %s too long for a Unix socket path", dir)
			}
		}
		c.ShmSocket = fmt.Sprintf("%s/a%d.sock", dir, i)
		sockets = append(sockets, c.ShmSocket)
	}
	singleClients["sdk-shm"] = func(c *client.Config) { c.SharedMemorySockets = sockets }
	singleClients["sdk-shm-granted"] = func(c *client.Config) { c.SharedMemorySockets, c.DisableMappedReads = sockets, true }
	singleClients["sdk-shm-unary"] = func(c *client.Config) { c.SharedMemorySockets, c.DisableCallStream = sockets, true }
	singleClients["sdk-shm-stream"] = func(c *client.Config) { c.SharedMemorySockets, c.DisableLookupListener = sockets, true }
	singleCoalesced = func(c *client.Client, op string) (batches, items int) {
		n := c.Coalesced()[op]
		return n[0], n[1]
	}
}
