package ctl

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/spf13/cobra"
)

// benchResult is what one bench phase measured.
type benchResult struct {
	Mode        string  `json:"mode"`
	ObjectSize  uint64  `json:"object_size"`
	Batch       int     `json:"batch"`
	Concurrency int     `json:"concurrency"`
	Seconds     float64 `json:"seconds"`
	Objects     int64   `json:"objects"`
	Errors      int64   `json:"errors"`
	ObjectsPerS float64 `json:"objects_per_s"`
	GBPerS      float64 `json:"gb_per_s"`
	P50Ms       float64 `json:"p50_ms"`
	P90Ms       float64 `json:"p90_ms"`
	P99Ms       float64 `json:"p99_ms"`
	MaxMs       float64 `json:"max_ms"`
	FirstError  string  `json:"first_error,omitempty"`
	// NotFound counts the calls that failed with OBJECT_NOT_FOUND: in get
	// and mixed mode, keys the cluster evicted after the populate.
	NotFound int64 `json:"not_found,omitempty"`
}

func benchCmd(e *env) *cobra.Command {
	var (
		mode        string
		size        = config.ByteSize(4 << 10)
		batch       int
		concurrency int
		duration    time.Duration
		keys        int
		replicas    int
		prefix      string
		keep        bool
		cpuprofile  string
		allocGet    bool
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Generate put/get load and report throughput and latency",
		Long: "bench writes (and reads back) objects of --size in calls of --batch objects from --concurrency\n" +
			"workers for --duration. get mode first stores --keys objects, then reads them at random.\n" +
			"Latency percentiles are per call (one batch).",
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if batch < 1 || concurrency < 1 || size < 1 || keys < 1 {
				return usagef("--batch, --concurrency, --size and --keys must be >= 1")
			}
			if mode != "put" && mode != "get" && mode != "mixed" {
				return usagef("--mode must be put, get or mixed")
			}
			if !cmd.Flags().Changed("prefix") {
				// A fresh namespace per run, so a run never trips over the
				// puts an earlier one left in flight at its deadline.
				prefix = fmt.Sprintf("%s%06x/", prefix, time.Now().UnixNano()&0xffffff)
			}
			c, err := e.client(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			if (mode == "get" || mode == "mixed") && !cmd.Flags().Changed("keys") {
				keys = fitKeys(ctx, e, c, keys, uint64(size), replicas)
			}
			c = c.Tenant(e.tenant)
			payload := make([]byte, size)
			_, _ = rand.Read(payload)
			key := func(i int) string { return fmt.Sprintf("%s%08d", prefix, i) }
			opts := []client.PutOption{client.WithReplicas(replicas), client.WithUpsert()}

			var results []benchResult
			if mode == "get" || mode == "mixed" {
				// Populate the key space once, in batches.
				for lo := 0; lo < keys; lo += 256 {
					items := make([]client.Item, 0, 256)
					for i := lo; i < min(lo+256, keys); i++ {
						items = append(items, client.Item{Key: key(i), Data: payload})
					}
					for _, err := range c.BatchPut(ctx, items, opts...) {
						if err != nil {
							return fmt.Errorf("populate: %w", err)
						}
					}
				}
			}
			if cpuprofile != "" {
				f, err := os.Create(cpuprofile)
				if err != nil {
					return err
				}
				defer f.Close()
				if err := pprof.StartCPUProfile(f); err != nil {
					return err
				}
				defer pprof.StopCPUProfile()
			}
			bar := newProgress(e.stderr, "bench "+mode, tty(e.stderr))
			var next atomic.Int64
			// Each worker reads into buffers of its own, reused call after
			// call (BatchGetInto/GetInto), as an engine reads KV blocks into
			// memory it owns; --alloc-get measures BatchGet/Get instead,
			// which allocate every object.
			bufs := make([][][]byte, concurrency)
			for w := range bufs {
				if mode == "put" || allocGet {
					break // nothing reads into them
				}
				bufs[w] = make([][]byte, batch)
				for i := range bufs[w] {
					bufs[w][i] = make([]byte, size)
				}
			}
			op := func(ctx context.Context, worker int, put bool) (int, error) {
				n := int(next.Add(int64(batch))) - batch
				// put mode writes fresh keys (a cache filling up, evicting
				// under pressure); get and mixed cycle over the key space.
				slot := func(i int) string {
					if mode == "put" {
						return key(i)
					}
					return key(i % keys)
				}
				if batch == 1 {
					k := slot(n)
					if put {
						return 1, c.Put(ctx, k, payload, opts...)
					}
					if allocGet {
						_, err := c.Get(ctx, k)
						return 1, err
					}
					_, err := c.GetInto(ctx, k, bufs[worker][0])
					return 1, err
				}
				if put {
					items := make([]client.Item, batch)
					for i := range items {
						items[i] = client.Item{Key: slot(n + i), Data: payload}
					}
					return batch, errors.Join(c.BatchPut(ctx, items, opts...)...)
				}
				ks := make([]string, batch)
				for i := range ks {
					ks[i] = slot(n + i)
				}
				var errs []error
				if allocGet {
					_, errs = c.BatchGet(ctx, ks)
				} else {
					_, errs = c.BatchGetInto(ctx, ks, bufs[worker])
				}
				return batch, errors.Join(errs...)
			}
			res := runBench(ctx, mode, concurrency, duration, func(ctx context.Context, i int) (int, error) {
				return op(ctx, i%concurrency, mode == "put" || (mode == "mixed" && i%2 == 0))
			}, bar)
			bar.done()
			res.ObjectSize, res.Batch = uint64(size), batch
			res.GBPerS = res.ObjectsPerS * float64(size) / 1e9
			results = append(results, res)
			if !keep {
				cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
				_, _, _ = c.RemoveByPrefix(cctx, prefix, true)
				cancel()
			}
			for _, r := range results {
				if e.json() {
					if err := e.printJSON(r); err != nil {
						return err
					}
					continue
				}
				fmt.Fprintf(e.stdout, "mode=%s size=%s batch=%d concurrency=%d duration=%.1fs\n", r.Mode, &size, r.Batch, r.Concurrency, r.Seconds)
				fmt.Fprintf(e.stdout, "  objects: %d (%d errors)  %.0f objects/s  %.3f GB/s\n", r.Objects, r.Errors, r.ObjectsPerS, r.GBPerS)
				fmt.Fprintf(e.stdout, "  latency per call: p50 %.3fms  p90 %.3fms  p99 %.3fms  max %.3fms\n", r.P50Ms, r.P90Ms, r.P99Ms, r.MaxMs)
				if r.FirstError != "" {
					fmt.Fprintf(e.stdout, "  first error: %s\n", r.FirstError)
				}
				if r.NotFound > 0 && r.Mode != "put" {
					fmt.Fprintf(e.stdout, "  %d calls found no object: the cluster evicted keys it was given (--keys %d of %s may not fit its memory); lower --keys\n", r.NotFound, keys, &size)
				}
			}
			if results[0].Objects == 0 && results[0].Errors > 0 {
				return errors.New("every call failed")
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&mode, "mode", "put", "put, get or mixed")
	f.Var(&size, "size", "object size (e.g. 4KiB, 1MiB)")
	f.IntVar(&batch, "batch", 1, "objects per call (1 = single Put/Get)")
	f.IntVar(&concurrency, "concurrency", 4, "concurrent workers")
	f.DurationVar(&duration, "duration", 10*time.Second, "how long to run")
	f.IntVar(&keys, "keys", 4096, "size of the key space read by get and mixed (put writes fresh keys)")
	f.IntVar(&replicas, "replicas", 1, "replicas per object")
	f.StringVar(&prefix, "prefix", "bench/", "key prefix (default: bench/<run id>/)")
	f.BoolVar(&keep, "keep", false, "keep the objects afterwards")
	f.StringVar(&cpuprofile, "cpuprofile", "", "write a CPU profile of the client side of the run to this file")
	f.BoolVar(&allocGet, "alloc-get", false, "read with BatchGet/Get, which allocate every object, instead of into reused buffers (BatchGetInto/GetInto)")
	return cmd
}

// runBench runs op from conc workers until d passes and aggregates latency.
func runBench(parent context.Context, mode string, conc int, d time.Duration, op func(context.Context, int) (int, error), bar *progress) benchResult {
	ctx, cancel := context.WithTimeout(parent, d)
	defer cancel()
	var (
		mu       sync.Mutex
		lats     []time.Duration
		objects  atomic.Int64
		errs     atomic.Int64
		firstErr atomic.Pointer[string]
		notFound atomic.Int64
	)
	start := time.Now()
	// A context's Err can lag its deadline when the machine is busy (the
	// timer has not fired yet), and calls made then fail at once with
	// DeadlineExceeded (the transfer path sets socket deadlines from it):
	// stop on the clock, not only on Err, and on the context's own
	// deadline, which is a little before start+d.
	end, _ := ctx.Deadline()
	over := func() bool { return ctx.Err() != nil || !time.Now().Before(end) }
	var wg sync.WaitGroup
	for w := 0; w < conc; w++ {
		wg.Go(func() {
			var local []time.Duration
			for i := w; !over(); i += conc {
				t0 := time.Now()
				// An op in flight at the deadline runs to its end (only
				// the caller's own cancel stops it), so that none is left
				// half done behind the run: a put abandoned between its
				// write and its commit could be committed after the
				// clean-up removed the run's objects (a put on a spare
				// exists at the master only from its commit).
				n, err := op(parent, i)
				if over() {
					break
				}
				local = append(local, time.Since(t0))
				if err != nil {
					errs.Add(1)
					if errors.Is(err, client.ErrNotFound) {
						notFound.Add(1)
					}
					msg := firstOf(err)
					firstErr.CompareAndSwap(nil, &msg)
					continue
				}
				objects.Add(int64(n))
				bar.update(int64(time.Since(start)), int64(d))
			}
			mu.Lock()
			lats = append(lats, local...)
			mu.Unlock()
		})
	}
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	slices.Sort(lats)
	pct := func(p float64) float64 {
		if len(lats) == 0 {
			return 0
		}
		return float64(lats[min(len(lats)-1, int(p*float64(len(lats))))]) / 1e6
	}
	first := ""
	if p := firstErr.Load(); p != nil {
		first = *p
	}
	return benchResult{
		FirstError: first, NotFound: notFound.Load(),
		Mode: mode, Concurrency: conc, Seconds: elapsed, Objects: objects.Load(), Errors: errs.Load(),
		ObjectsPerS: float64(objects.Load()) / elapsed, P50Ms: pct(0.50), P90Ms: pct(0.90), P99Ms: pct(0.99), MaxMs: pct(1),
	}
}

// firstOf describes a failed call by its first error: a batch call fails
// with one joined error per failed item, and a whole batch of them is not
// a readable report.
func firstOf(err error) string {
	j, ok := err.(interface{ Unwrap() []error })
	if !ok || len(j.Unwrap()) < 2 {
		return err.Error()
	}
	errs := j.Unwrap()
	return fmt.Sprintf("%v (and %d more in that call)", errs[0], len(errs)-1)
}

// fitKeys is the default key space of get and mixed, shrunk to half the
// cluster's capacity (GetClusterStatus) when it would not fit, so a run
// against a small cluster reads what it stored instead of keys the
// populate itself evicted. Without the status (an older master, a caller
// not allowed to ask) it is keys unchanged.
func fitKeys(ctx context.Context, e *env, c *client.Client, keys int, size uint64, replicas int) int {
	st, err := c.Admin().GetClusterStatus(ctx, &masterv1.GetClusterStatusRequest{})
	if err != nil || st.GetCapacityBytes() == 0 {
		return keys
	}
	fit := st.GetCapacityBytes() / 2 / (size * uint64(max(replicas, 1)))
	if fit >= uint64(keys) {
		return keys
	}
	n := int(max(fit, 1))
	capacity, sz := config.ByteSize(st.GetCapacityBytes()), config.ByteSize(size)
	fmt.Fprintf(e.stderr, "bench: --keys %d, not %d: %d objects of %s fill half the cluster's %s (set --keys to choose)\n", n, keys, n, &sz, &capacity)
	return n
}
