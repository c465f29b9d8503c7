package client_test

import (
	"fmt"
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
// client with the listener off never uses it.
func TestLookupListener(t *testing.T) {
	for _, tc := range []struct {
		name      string
		advertise string // the master's --advertise-lookup-addr
		off       bool   // Config.DisableLookupListener
		want      bool   // lookups on the listener
	}{
		{name: "on", want: true},
		{name: "unreachable", advertise: "127.0.0.1:1"},
		{name: "off", off: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
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
			if got := cl.Master().LookupStats().Calls > 0; got != tc.want {
				t.Fatalf("lookups on the listener: %v, want %v (%+v)", got, tc.want, cl.Master().LookupStats())
			}
			if !tc.want {
				return
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
