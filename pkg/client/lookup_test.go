package client_test

import (
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestLookupListener (issue 18, item 1): a client's lookups go on the
// master's lookup listener once its CallStream named it, with the answers
// the stream gives (found, missing, batched from many goroutines); after a
// master restart (a new listener port) they follow the new master; a
// listener the client cannot reach sends them back to the stream; a
// client with the listener off never uses it. A listener that accepts
// and never answers (a wrong port, a load balancer without a backend)
// holds no lookup up: the client probes it off the calls' path.
func TestLookupListener(t *testing.T) {
	for _, tc := range []struct {
		name      string
		advertise string // the master's --advertise-lookup-addr
		silent    bool   // advertise a port that accepts and never answers
		off       bool   // Config.DisableLookupListener
		want      bool   // lookups on the listener
	}{
		{name: "on", want: true},
		{name: "unreachable", advertise: "127.0.0.1:1"},
		{name: "silent", silent: true},
		{name: "off", off: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.silent {
				tc.advertise = silentListener(t)
			}
			cl := testcluster.Start(t, testcluster.Options{Master: func(c *masterapp.Config) { c.AdvertiseLookupAddr = tc.advertise }})
			c := cl.Client(t, func(cfg *client.Config) { cfg.DisableLookupListener = tc.off })
			ctx := t.Context()
			for i := range 8 {
				if err := c.Put(ctx, fmt.Sprintf("lk-%d", i), []byte(fmt.Sprintf("value %d", i))); err != nil {
					t.Fatal(err)
				}
			}
			check := func(round string) {
				t.Helper()
				errs := make(chan error, 16)
				for g := range 16 {
					go func() {
						start := time.Now()
						k := fmt.Sprintf("lk-%d", g%8)
						b, err := c.Get(ctx, k)
						if err == nil && string(b) != fmt.Sprintf("value %d", g%8) {
							err = fmt.Errorf("get %s: %q", k, b)
						}
						if err == nil {
							var ok bool
							if ok, err = c.Exist(ctx, "lk-missing"); ok {
								err = fmt.Errorf("lk-missing exists")
							}
						}
						// No lookup waits for a listener that does not
						// answer (before the probe, one waited for the
						// call's timeout, 30 s, every backoff).
						if d := time.Since(start); err == nil && tc.silent && d > time.Second {
							err = fmt.Errorf("a get and an exist took %v", d)
						}
						errs <- err
					}()
				}
				for range 16 {
					if err := <-errs; err != nil {
						t.Fatalf("%s: %v", round, err)
					}
				}
			}
			// The first lookups open the stream, which names the listener;
			// the next go there.
			check("first")
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) && (cl.Master().LookupStats().Calls == 0) == tc.want {
				check("more")
			}
			if tc.silent {
				// Past a probe's timeout, and a backoff or two after it.
				for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
					check("while the listener does not answer")
				}
			}
			if got := cl.Master().LookupStats().Calls > 0; got != tc.want {
				t.Fatalf("lookups on the listener: %v, want %v (%+v)", got, tc.want, cl.Master().LookupStats())
			}
			if !tc.want {
				return
			}
			if st := cl.Master().LookupStats(); st.Pings == 0 {
				t.Fatalf("lookups on the listener without a probe first (%+v)", st)
			}
			cl.RestartMaster()
			check("after the restart")
			testutil.Eventually(t, 10*time.Second, func() bool {
				check("after the restart")
				return cl.Master().LookupStats().Calls > 0
			}, "lookups on the new master's listener")
		})
	}
}

// silentListener is a port that accepts connections, reads what comes and
// never answers; it closes them when the test ends.
func silentListener(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			nc, err := lis.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, nc)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(io.Discard, nc) })
		}
	})
	t.Cleanup(func() {
		_ = lis.Close()
		mu.Lock()
		for _, nc := range conns {
			_ = nc.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return lis.Addr().String()
}
