package testcluster_test

import (
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/config"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
	"golang.org/x/sys/unix"
)

var (
	offloadSize   = flag.Int("offload-size", 1<<20, "object size of BenchmarkOffload")
	offloadMemMiB = flag.Int("offload-mem", 256, "MiB of BenchmarkOffload's memory segment (its disk segment is twice that)")
)

// BenchmarkOffload (issue 17 item 3): offload on eviction against a plain
// sequential write to the same filesystem. One agent with a memory segment
// of -offload-mem MiB (prefaulted, as crescent-agent is by default) and a
// disk segment twice that in the test's temporary directory; the master's
// watermarks at 0.9 and 0.1. Puts of -offload-size objects fill memory to
// just below the high watermark (untimed); one more put crosses it, and
// the master's background check offloads memory down to the low
// watermark, 80 % of the segment: the agent copies each object from its
// memory segment into its disk segment over its own bulk transfer
// listener (pwrite; the seal of each chunk of 256 makes it durable with an
// fdatasync of the data and of the journal). Timed from that put to the
// last offloaded object leaving memory at the master (polled every
// millisecond). Just before, the same bytes are written to a file in the
// same filesystem in 1 MiB writes with one fdatasync at the end (raw). It
// reports MB/s, obj/s, raw-MB/s and ratio = MB/s / raw-MB/s. Every object
// is read back and checked afterwards (untimed).
func BenchmarkOffload(b *testing.B) {
	size := *offloadSize
	mem := uint64(*offloadMemMiB) << 20
	slots := int(mem) / size
	fill := slots * 9 / 10 // below the high watermark; one more crosses it
	if fill*10 >= slots*9 {
		fill--
	}
	low := slots / 10 // what stays in memory
	var offD, rawD time.Duration
	var moved, rawBytes int
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		c := testcluster.Start(b, testcluster.Options{
			Agents: 1, AgentMemory: mem, AgentDisk: 2 * mem,
			Agent:  func(_ int, c *agentapp.Config) { c.Prefault = true; c.Memory = config.ByteSize(mem) },
			Master: func(c *masterapp.Config) { c.HighWatermark, c.LowWatermark = 0.9, 0.1 },
		})
		cl := c.Client(b)
		ctx := b.Context()
		src, disk := memSegment(c, 0), diskSegment(b, c, 0)
		putInto(ctx, b, cl, "o", fill, size, 1, 1, client.WithPreferredSegments(src))
		st := c.Master().Store
		if got := st.SegmentReplicaCounts()[src]; got != uint64(fill) {
			b.Fatalf("memory holds %d objects before the crossing put, want %d (nothing evicted yet)", got, fill)
		}
		rawD += rawFileWrite(b, (fill+1-low)*size)
		rawBytes += (fill + 1 - low) * size
		b.StartTimer()
		start := time.Now()
		v := make([]byte, size)
		drainValue(v, fill)
		if err := cl.Put(ctx, drainKey("o", fill), v, client.WithPreferredSegments(src)); err != nil {
			b.Fatal(err)
		}
		for st.SegmentReplicaCounts()[src] > uint64(low) {
			if time.Since(start) > 5*time.Minute {
				b.Fatalf("memory still holds %d objects", st.SegmentReplicaCounts()[src])
			}
			time.Sleep(time.Millisecond)
		}
		offD += time.Since(start)
		b.StopTimer()
		counts := st.SegmentReplicaCounts()
		if counts[src]+counts[disk] != uint64(fill+1) {
			b.Fatalf("replicas: %v, want %d in all (nothing dropped)", counts, fill+1)
		}
		moved += int(counts[disk])
		checkDrained(ctx, b, c, cl, "o", "", fill+1, size)
	}
	bytes := float64(moved) * float64(size)
	b.ReportMetric(bytes/1e6/offD.Seconds(), "MB/s")
	b.ReportMetric(float64(moved)/offD.Seconds(), "obj/s")
	b.ReportMetric(float64(rawBytes)/1e6/rawD.Seconds(), "raw-MB/s")
	b.ReportMetric((bytes/offD.Seconds())/(float64(rawBytes)/rawD.Seconds()), "ratio")
}

// rawFileWrite writes n bytes to a new file in the test's temporary
// directory in 1 MiB writes, then fdatasyncs it, and returns the time it
// took: the baseline an offload is held to.
func rawFileWrite(tb testing.TB, n int) time.Duration {
	tb.Helper()
	f, err := os.Create(filepath.Join(tb.TempDir(), "raw"))
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	drainValue(buf, 1)
	start := time.Now()
	for left := n; left > 0; left -= len(buf) {
		if _, err := f.Write(buf[:min(left, len(buf))]); err != nil {
			tb.Fatal(err)
		}
	}
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		tb.Fatal(err)
	}
	return time.Since(start)
}
