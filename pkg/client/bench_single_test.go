package client_test

import (
	"context"
	"flag"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// singleClients are the SDK configurations BenchmarkSingleOps measures,
// by name; bench_test.go adds the ones this file cannot name (it also
// builds against older trees, for A/B runs).
var singleClients = map[string]func(*client.Config){"sdk": nil}

// singleCoalesced, when set (bench_test.go), is how many batch RPCs a
// client's coalescer of op has sent and how many calls they carried.
var singleCoalesced func(c *client.Client, op string) (batches, items int)

// singleProfile, when set, is a directory where BenchmarkSingleOps writes
// one CPU profile per timed round of the "sdk" configuration, or of the
// only one -single-clients selects (not the baseline's, not the warm-up's), named op-cN-round.prof: the whole
// process's CPU while only those calls run — client, master and agents —
// to be merged with go tool pprof dir/get-c64-*.prof.
// singleOnly, when set, is a regular expression for the names of the SDK
// configurations to measure (the baseline always runs).
var singleOnly = flag.String("single-clients", "", "regexp of the SDK configurations BenchmarkSingleOps measures")

// singleAgent, when set (bench_test.go), configures agent i of the
// cluster further.
var singleAgent func(b *testing.B, i int, c *agentapp.Config)

var singleProfile = flag.String("single-cpuprofile", "", "directory for CPU profiles of the sdk rounds of BenchmarkSingleOps")

// BenchmarkSingleOps is single calls (issue 18, item 1) through the SDK
// from 1 and from 64 goroutines against an in-process cluster, each round
// paired with the empty-unary-call baseline of the same instant: the gRPC
// health check of the same master, from as many goroutines, on a
// connection of its own. Metrics: ops/s of each SDK configuration and of
// the baseline, their ratio, and p50 latency (µs). Gets and puts move
// 4 KiB objects; gets read a stored set.
//
//	go test ./pkg/client -run '^$' -bench SingleOps -benchtime 20x -count 3
func BenchmarkSingleOps(b *testing.B) {
	names := make([]string, 0, len(singleClients))
	for n := range singleClients {
		if ok, err := regexp.MatchString(*singleOnly, n); err != nil {
			b.Fatal(err)
		} else if ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	opts := testcluster.Options{AgentMemory: 256 << 20, Agent: func(i int, c *agentapp.Config) {
		c.Prefault = true
		if singleAgent != nil {
			singleAgent(b, i, c)
		}
	}}
	cl := testcluster.Start(b, opts)
	ctx := context.Background()
	clients := make([]*client.Client, len(names))
	for i, n := range names {
		if m := singleClients[n]; m != nil {
			clients[i] = cl.Client(b, m)
		} else {
			clients[i] = cl.Client(b)
		}
	}
	cc, err := grpc.NewClient(cl.MasterAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cc.Close() })
	health := healthpb.NewHealthClient(cc)

	const size, stored = 4 << 10, 1024
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	keys := make([]string, stored)
	items := make([]client.Item, stored)
	for i := range keys {
		keys[i] = fmt.Sprintf("single-%d", i)
		items[i] = client.Item{Key: keys[i], Data: data}
	}
	for _, err := range clients[0].BatchPut(ctx, items) {
		if err != nil {
			b.Fatal(err)
		}
	}
	var seq atomic.Int64
	ops := map[string]func(c *client.Client, i int) error{
		"get": func(c *client.Client, i int) error {
			_, err := c.Get(ctx, keys[i%stored])
			return err
		},
		"exist": func(c *client.Client, i int) error {
			ok, err := c.Exist(ctx, keys[i%stored])
			if err == nil && !ok {
				err = fmt.Errorf("%s does not exist", keys[i%stored])
			}
			return err
		},
		"replicalist": func(c *client.Client, i int) error { return c.ReplicaList(ctx, keys[i%stored]) },
		"put": func(c *client.Client, _ int) error {
			return c.Put(ctx, fmt.Sprintf("single-put-%d", seq.Add(1)), data)
		},
	}
	baseline := func(_ *client.Client, _ int) error {
		_, err := health.Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	for _, op := range []string{"get", "exist", "replicalist", "put"} {
		for _, conc := range []int{1, 64} {
			b.Run(fmt.Sprintf("%s-c%d", op, conc), func(b *testing.B) {
				per := max(16, 256/conc) // calls per goroutine per round
				run := append([]func(*client.Client, int) error{baseline}, make([]func(*client.Client, int) error, len(clients))...)
				for i := range clients {
					run[i+1] = ops[op]
				}
				cls := append([]*client.Client{nil}, clients...)
				d := make([]time.Duration, len(run))
				cpu := make([]time.Duration, len(run)) // process CPU (user+sys) during the rounds
				lat := make([][]time.Duration, len(run))
				rounds := 0
				round := func(k int, keep bool) {
					if keep && *singleProfile != "" && k > 0 && (names[k-1] == "sdk" || len(names) == 1) {
						rounds++
						defer testutil.StartCPUProfile(b, filepath.Join(*singleProfile, fmt.Sprintf("%s-c%d-%d.prof", op, conc, rounds)))()
					}
					var wg sync.WaitGroup
					var mu sync.Mutex
					errs := make([]error, conc)
					c0 := testutil.ProcessCPU()
					t0 := time.Now()
					for g := range conc {
						wg.Go(func() {
							mine := make([]time.Duration, 0, per)
							for j := range per {
								s := time.Now()
								if err := run[k](cls[k], g*per+j); err != nil {
									errs[g] = err
									return
								}
								mine = append(mine, time.Since(s))
							}
							if keep {
								mu.Lock()
								lat[k] = append(lat[k], mine...)
								mu.Unlock()
							}
						})
					}
					wg.Wait()
					if keep {
						d[k] += time.Since(t0)
						cpu[k] += testutil.ProcessCPU() - c0
					}
					for _, err := range errs {
						if err != nil {
							b.Fatal(err)
						}
					}
				}
				for k := range run {
					round(k, false) // warm up
				}
				type sent struct{ batches, items int }
				before := make([]sent, len(clients))
				if singleCoalesced != nil {
					for i, c := range clients {
						before[i].batches, before[i].items = singleCoalesced(c, op)
					}
				}
				b.ResetTimer()
				for b.Loop() {
					for k := range run {
						round(k, true)
					}
				}
				b.StopTimer()
				calls := float64(conc*per) * float64(b.N)
				base := calls / d[0].Seconds()
				b.ReportMetric(base, "health-ops/s")
				b.ReportMetric(p50(lat[0]), "health-p50-µs")
				b.ReportMetric(float64(cpu[0].Microseconds())/calls, "health-cpu-µs/op")
				for i, n := range names {
					rate := calls / d[i+1].Seconds()
					b.ReportMetric(rate, n+"-ops/s")
					b.ReportMetric(rate/base, n+"/health")
					b.ReportMetric(p50(lat[i+1]), n+"-p50-µs")
					b.ReportMetric(float64(cpu[i+1].Microseconds())/calls, n+"-cpu-µs/op")
					if singleCoalesced != nil && op != "put" {
						// The share of the calls that went in batches, and
						// their mean batch (warm-up rounds included).
						bs, is := singleCoalesced(clients[i], op)
						if bs -= before[i].batches; bs > 0 {
							is -= before[i].items
							b.ReportMetric(float64(is)/calls, n+"-batched")
							b.ReportMetric(float64(is)/float64(bs), n+"-items/batch")
						}
					}
				}
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

func p50(ds []time.Duration) float64 {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return float64(ds[len(ds)/2].Nanoseconds()) / 1e3
}
