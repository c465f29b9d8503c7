package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
)

// TestMasterFailover (issue 15): three masters electing a leader on etcd
// (run in the test's process), two agents, four clients putting without
// pause. The leader is killed with SIGKILL, rounds times
// (CRESCENT_E2E_FAILOVERS, default 2; the benchmark is 20), and
// started again as a standby. After each round: a new leader leads, puts
// are acknowledged through it again, and every put acknowledged so far
// (before, during and after the kill) reads back with its bytes. The time
// from the kill to the first acknowledged put that started after it is
// logged per round, with the median and maximum.
func TestMasterFailover(t *testing.T) {
	rounds := 2
	if s := os.Getenv("CRESCENT_E2E_FAILOVERS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("CRESCENT_E2E_FAILOVERS=%q", s)
		}
		rounds = n
	}
	c := StartCluster(t, Options{Masters: 3, MasterFlags: []string{"--etcd-lease-ttl", "2s", "--recovery-grace", "500ms"}})
	cl := c.Client("default")

	var (
		mu       sync.Mutex
		acked    = map[string][]byte{}
		ackStart []time.Time // start of each acknowledged put
		failed   atomic.Int64
		lastErr  atomic.Value
	)
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				key := fmt.Sprintf("w%d/%d", w, n)
				val := bytes.Repeat([]byte{byte(w), byte(n), byte(n >> 8)}, 300)
				start := time.Now()
				pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				err := cl.Put(pctx, key, val)
				cancel()
				if err != nil {
					if ctx.Err() == nil {
						failed.Add(1)
						lastErr.Store(err.Error())
					}
					continue
				}
				mu.Lock()
				acked[key] = val
				ackStart = append(ackStart, start)
				mu.Unlock()
			}
		})
	}
	defer func() { stop(); wg.Wait() }()

	readBack := func(step string) {
		t.Helper()
		mu.Lock()
		keys := make([]string, 0, len(acked))
		for k := range acked {
			keys = append(keys, k)
		}
		mu.Unlock()
		for len(keys) > 0 {
			batch := keys[:min(len(keys), 256)]
			keys = keys[len(batch):]
			rctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			vals, errs := cl.BatchGet(rctx, batch)
			cancel()
			for i, k := range batch {
				mu.Lock()
				want := acked[k]
				mu.Unlock()
				if errs[i] != nil || !bytes.Equal(vals[i], want) {
					t.Fatalf("%s: acknowledged %q does not read back: %v", step, k, errs[i])
				}
			}
		}
	}

	var took []time.Duration
	for round := range rounds {
		lead := c.WaitLeader()
		time.Sleep(time.Second) // puts flowing through it
		killed := time.Now()
		lead.Kill()
		next := c.WaitLeader()
		if next == lead {
			t.Fatalf("round %d: the killed master still leads", round)
		}
		var d time.Duration
		testutil.Eventually(t, 30*time.Second, func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, s := range slices.Backward(ackStart) {
				if s.After(killed) {
					d = time.Since(killed)
					return true
				}
			}
			return false
		}, "round %d: a put acknowledged after the kill", round)
		took = append(took, d)
		t.Logf("round %d: %s killed, %s leads; puts acknowledged again within %v", round, lead.Name, next.Name, d.Round(10*time.Millisecond))
		lead.start() // back as a standby
		readBack(fmt.Sprintf("round %d", round))
	}
	stop()
	wg.Wait()
	readBack("the end")
	slices.Sort(took)
	mu.Lock()
	n := len(acked)
	mu.Unlock()
	t.Logf("%d failovers: puts acknowledged again after median %v, max %v (lease TTL 2s, recovery grace 500ms); %d puts acknowledged and read back, %d failed (last: %v)",
		rounds, took[len(took)/2].Round(10*time.Millisecond), took[len(took)-1].Round(10*time.Millisecond), n, failed.Load(), lastErr.Load())
}
