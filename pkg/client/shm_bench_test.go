package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// BenchmarkSharedMemory pairs, in every iteration and so in the same instant
// of a shared machine, a 1 MiB object's get and put through the same-host
// shared-memory path with the same through the bulk TCP path and with a
// plain 1 MiB memcpy (issue 18's baseline), on one in-process cluster whose
// agent shares its (prefaulted) memory. One goroutine, one call at a time.
// Reported, as GB/s and as ratios to memcpy: memcpy (copy() of 1 MiB
// between two warm buffers); memcpy+xxh (the same plus the object checksum, XXH3-64, of the
// copy, the floor of any get that verifies the checksum, as every SDK get
// does); shm-read and tcp-read (the data path of a get once the replica
// list is held: request, copy, checksum verification); shm-get and tcp-get
// (GetInto, the master's lookup included); shm-put and tcp-put (Put of a
// fresh key: PutStart, write, PutEnd with the agent's seal hashing the
// bytes); shm-batchget and tcp-batchget (BatchGetInto of shmBatch
// objects of 1 MiB into the caller's buffers: one master lookup for the
// batch, the objects read in parallel, as an engine loads a prefix of
// blocks), whose ratio to memcpy compares their bytes per second with
// memcpy's.
//
//	go test ./pkg/client -run '^$' -bench SharedMemory -benchtime 1000x -count 3
func BenchmarkSharedMemory(b *testing.B) {
	const size = 1 << 20
	sock := shmSocketB(b)
	h := testcluster.Start(b, testcluster.Options{Agents: 1, AgentMemory: 512 << 20, Agent: func(_ int, c *agentapp.Config) {
		c.Prefault = true
		c.ShmSocket = sock
	}})
	ctx := context.Background()
	viaShm := h.Client(b, func(c *client.Config) { c.SharedMemorySockets = []string{sock} })
	viaTCP := h.Client(b)
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i * 7)
	}
	dst := make([]byte, size)
	if err := viaTCP.Put(ctx, "bench/shm", src); err != nil {
		b.Fatal(err)
	}
	keys := make([]string, shmBatch)
	bufs := make([][]byte, shmBatch)
	for j := range keys {
		keys[j] = fmt.Sprintf("bench/shm-batch-%d", j)
		bufs[j] = make([]byte, size)
		if err := viaTCP.Put(ctx, keys[j], src); err != nil {
			b.Fatal(err)
		}
	}
	var t [10]time.Duration
	names := []string{"memcpy", "memcpy+xxh", "shm-read", "tcp-read", "shm-get", "tcp-get", "shm-put", "tcp-put", "shm-batchget", "tcp-batchget"}
	objects := []float64{1, 1, 1, 1, 1, 1, 1, 1, shmBatch, shmBatch} // per timed call
	timed := func(k int, f func() error) {
		start := time.Now()
		if err := f(); err != nil {
			b.Fatalf("%s: %v", names[k], err)
		}
		t[k] += time.Since(start)
	}
	var sink uint64
	reads := make([]func() error, 2)
	for i := 0; b.Loop(); i++ {
		timed(0, func() error { copy(dst, src); return nil })
		timed(1, func() error { copy(dst, src); sink += checksum.Sum(dst); return nil })
		for k, c := range []*client.Client{viaShm, viaTCP} {
			if i%64 == 0 {
				// A replica list (and its tokens) serves 64 reads, so
				// the data path is timed away from a master call's
				// aftermath; the gets below include one each.
				read, err := client.ReadPath(c, ctx, "bench/shm", dst)
				if err != nil {
					b.Fatal(err)
				}
				reads[k] = read
			}
			timed(2+k, reads[k])
			timed(4+k, func() error { _, err := c.GetInto(ctx, "bench/shm", dst); return err })
			key := fmt.Sprintf("bench/put-%d-%d", k, i)
			timed(6+k, func() error { return c.Put(ctx, key, src) })
			// Keep the agent's memory from filling (512 MiB, prefaulted).
			if err := c.Remove(ctx, key, true); err != nil {
				b.Fatal(err)
			}
			timed(8+k, func() error {
				_, errs := c.BatchGetInto(ctx, keys, bufs)
				return errors.Join(errs...)
			})
		}
	}
	if !bytes.Equal(dst, src) {
		b.Fatal("the last get returned other bytes")
	}
	for j := range bufs {
		if !bytes.Equal(bufs[j], src) {
			b.Fatalf("the last batch get returned other bytes for %s", keys[j])
		}
	}
	if r, w := client.ShmServed(viaShm); r == 0 || w == 0 {
		b.Fatalf("shared memory served %d reads, %d writes", r, w)
	}
	n := float64(b.N)
	gbs := func(k int) float64 { return objects[k] * float64(size) * n / t[k].Seconds() / 1e9 }
	for k, name := range names {
		b.ReportMetric(gbs(k), name+"-GB/s")
		if k > 0 {
			b.ReportMetric(gbs(k)/gbs(0), name+"/memcpy")
		}
	}
	b.ReportMetric(float64(t[3])/float64(t[2]), "shm-read/tcp-read")
	b.ReportMetric(float64(t[5])/float64(t[4]), "shm-get/tcp-get")
	b.ReportMetric(float64(t[7])/float64(t[6]), "shm-put/tcp-put")
	_ = sink
}

// shmBatch is the object count of BenchmarkSharedMemory's batch gets.
const shmBatch = 16

func shmSocketB(b *testing.B) string {
	b.Helper()
	dir := b.TempDir()
	if len(dir) > 80 {
		b.Skipf("temporary directory %s too long for a Unix socket path", dir)
	}
	return dir + "/a.sock"
}
