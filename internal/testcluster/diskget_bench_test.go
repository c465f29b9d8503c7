package testcluster_test

import (
	"bytes"
	"context"
	"flag"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
	"golang.org/x/sys/unix"
)

var (
	diskGetSize    = flag.Int("diskget-size", 1<<20, "object size of BenchmarkDiskGet")
	diskGetObjects = flag.Int("diskget-objects", 128, "objects per tier of BenchmarkDiskGet")
)

// BenchmarkDiskGet (issue 17): a get of an object held only on a disk
// segment, with the page cache warm and cold, against a get of objects of
// the same size from a memory segment, in the same iteration. One agent
// with a prefaulted memory segment and a disk segment in the test's
// temporary directory; -diskget-objects objects of -diskget-size bytes on
// each (promotion off, so reads leave them where they are). Each pass reads
// every object of a tier once through the SDK, one Get at a time, and
// checks its bytes. mem and warm are the second pass over their tier (the
// first is untimed); cold follows a posix_fadvise(DONTNEED) of every file
// under the agent's disk directory (the segment's data is synced, so the
// kernel drops its pages: the reads go to the device, as after a reboot).
// It reports MB/s per tier and warm/mem and cold/mem.
func BenchmarkDiskGet(b *testing.B) {
	size, n := *diskGetSize, *diskGetObjects
	var memD, warmD, coldD time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		var diskDir string
		mem := uint64(n*size)*2 + 64<<20
		c := testcluster.Start(b, testcluster.Options{
			Agents: 1, AgentMemory: mem, AgentDisk: mem,
			Agent:  func(_ int, c *agentapp.Config) { c.Prefault = true; diskDir = c.DiskDir },
			Master: func(c *masterapp.Config) { c.PromoteThreshold = 0 },
		})
		cl := c.Client(b)
		ctx := b.Context()
		putInto(ctx, b, cl, "m", n, size, 16, 2, client.WithPreferredSegments(memSegment(c, 0)))
		putInto(ctx, b, cl, "d", n, size, 16, 2, client.WithMedium(masterv1.Medium_MEDIUM_DISK))
		if got := c.Master().Store.SegmentReplicaCounts()[diskSegment(b, c, 0)]; got != uint64(n) {
			b.Fatalf("the disk segment holds %d objects, want %d", got, n)
		}
		readTier(ctx, b, cl, "m", n, size) // untimed: first touches
		readTier(ctx, b, cl, "d", n, size) // untimed: the page cache warms
		b.StartTimer()
		memD += readTier(ctx, b, cl, "m", n, size)
		warmD += readTier(ctx, b, cl, "d", n, size)
		b.StopTimer()
		dropPageCache(b, diskDir)
		b.StartTimer()
		coldD += readTier(ctx, b, cl, "d", n, size)
	}
	mb := func(d time.Duration) float64 { return float64(b.N*n*size) / 1e6 / d.Seconds() }
	b.ReportMetric(mb(memD), "mem-MB/s")
	b.ReportMetric(mb(warmD), "warm-MB/s")
	b.ReportMetric(mb(coldD), "cold-MB/s")
	b.ReportMetric(memD.Seconds()/warmD.Seconds(), "warm/mem")
	b.ReportMetric(memD.Seconds()/coldD.Seconds(), "cold/mem")
}

// readTier gets objects [0, n) under prefix one at a time, checks their
// bytes, and returns the time the gets took.
func readTier(ctx context.Context, tb testing.TB, cl *client.Client, prefix string, n, size int) time.Duration {
	tb.Helper()
	want := make([]byte, size)
	var took time.Duration
	for i := range n {
		start := time.Now()
		got, err := cl.Get(ctx, drainKey(prefix, i))
		took += time.Since(start)
		if err != nil {
			tb.Fatalf("get %s: %v", drainKey(prefix, i), err)
		}
		drainValue(want, i)
		if !bytes.Equal(got, want) {
			tb.Fatalf("get %s: %d bytes differ from the %d put", drainKey(prefix, i), len(got), size)
		}
	}
	return took
}

// dropPageCache asks the kernel to drop the cached pages of every file
// under dir (synced first, so none is dirty and all can go).
func dropPageCache(tb testing.TB, dir string) {
	tb.Helper()
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := unix.Fdatasync(int(f.Fd())); err != nil {
			return err
		}
		return unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	})
	if err != nil {
		tb.Fatalf("dropping the page cache of %s: %v", dir, err)
	}
}
