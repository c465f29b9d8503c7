package statedir

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// BenchmarkCheckpoint1M writes (tmp file, fsync, rename) and loads a
// checkpoint of 1M entries: 100 tenants of 10000 keys of ~50 bytes, half
// of them on disk. Reported per checkpoint: write-ms and load-ms (wall),
// write-cpu-ms and load-cpu-ms (process CPU), and the file's MB.
func BenchmarkCheckpoint1M(b *testing.B) {
	const tenants, keys = 100, 10000
	evs := make([]kvevent.Event, 0, tenants*keys)
	for t := range tenants {
		tenant := fmt.Sprintf("tenant-%03d", t)
		for k := range keys {
			evs = append(evs, kvevent.Event{
				Type:    kvevent.Stored,
				Tenant:  tenant,
				Key:     fmt.Sprintf("model-%d/layer/%016x/%06d", k%7, uint64(k)*0x9e3779b97f4a7c15, k),
				Medium:  []kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}[k%2],
				GroupID: fmt.Sprintf("group-%d", k%13),
			})
		}
	}
	d, err := Open(b.TempDir(), Options{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	h := Header{PublisherEpoch: NewEpoch(), Seq: 1 << 20, Subscribers: 4}
	var write, load, writeCPU, loadCPU time.Duration
	n := 0
	for b.Loop() {
		c0 := cpuTime(b)
		t0 := time.Now()
		if err := d.WriteCheckpoint(h, slices.Values(evs)); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		c1 := cpuTime(b)
		count := 0
		got, found, err := d.LoadCheckpoint(func(kvevent.Event) error {
			count++
			return nil
		})
		if err != nil || !found || count != len(evs) || got.Entries != uint64(len(evs)) {
			b.Fatalf("load: %d entries (header %d), found %v, %v", count, got.Entries, found, err)
		}
		load += time.Since(t1)
		loadCPU += cpuTime(b) - c1
		write += t1.Sub(t0)
		writeCPU += c1 - c0
		n++
	}
	st, err := os.Stat(filepath.Join(d.Path(), checkpointName))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(write.Milliseconds())/float64(n), "write-ms")
	b.ReportMetric(float64(load.Milliseconds())/float64(n), "load-ms")
	// Process CPU time (all threads, GC included): the wall times above
	// include waiting for a CPU on a busy machine.
	b.ReportMetric(float64(writeCPU.Milliseconds())/float64(n), "write-cpu-ms")
	b.ReportMetric(float64(loadCPU.Milliseconds())/float64(n), "load-cpu-ms")
	b.ReportMetric(float64(st.Size())/(1<<20), "MB")
}

// cpuTime is the process's user and system CPU time.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
