package client_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestSparesDroppedWithTheirMaster: after a master restart, the first put
// that finds its spare gone (the new master never leased it) drops the
// client's other spares, of every size, instead of writing into each
// before its put falls back; the puts then lease the new master's.
func TestSparesDroppedWithTheirMaster(t *testing.T) {
	cl := testcluster.Start(t, testcluster.Options{})
	c := cl.Client(t)
	ctx := t.Context()
	sizes := []int{3000, 5000}
	n := 0
	put := func(size int) {
		t.Helper()
		n++
		if err := c.Put(ctx, fmt.Sprintf("sp-%d", n), make([]byte, size)); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() bool {
		for _, s := range sizes {
			put(s)
		}
		return client.SparesHeld(c, 3000) > 0 && client.SparesHeld(c, 5000) > 0
	}, "spares of both sizes")
	cl.RestartMaster()
	put(3000) // its spare is gone: PUT_EXPIRED or an unknown key at the agent
	if got := client.SparesHeld(c, 5000); got != 0 {
		t.Fatalf("%d spares of the old master's kept for another size", got)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { put(5000); return client.SparesHeld(c, 5000) > 0 }, "the new master's spares")
}
