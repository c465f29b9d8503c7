package client_test

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestAgentClockSkew: token expiries are the master's clock. An agent whose
// clock ran a minute ahead found every read token (a 10 s lease) expired
// on arrival, so every get of its replicas failed; one a minute behind
// accepted tokens long after their lease. Each agent now checks expiries
// against its clock moved by its measured difference from the master's.
func TestAgentClockSkew(t *testing.T) {
	skew := []time.Duration{time.Minute, -time.Minute}
	h := start(t, testcluster.Options{Agents: 2, Agent: func(i int, c *agentapp.Config) {
		c.Clock = func() time.Time { return time.Now().Add(skew[i]) }
	}})
	c := h.client(t, client.Config{DisableSpares: true})
	ctx := t.Context()
	for i := range skew {
		key := fmt.Sprintf("k%d", i)
		data := make([]byte, 8192)
		_, _ = rand.Read(data)
		if err := c.Put(ctx, key, data, client.WithPreferLocal(fmt.Sprintf("host-%d", i))); err != nil {
			t.Fatalf("put on the agent %v off: %v", skew[i], err)
		}
		h.replicaOn(t, "default", key, fmt.Sprintf("host-%d", i))
		if got, err := c.Get(ctx, key); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("get from the agent %v off: %d bytes, %v", skew[i], len(got), err)
		}
		// The agent measured the master's clock at its Settings.
		var off float64
		for _, line := range strings.Split(testutil.Metrics(t, h.Agent(i).AdminAddr()), "\n") {
			if v, ok := strings.CutPrefix(line, "crescent_agent_master_clock_offset_seconds "); ok {
				off, _ = strconv.ParseFloat(v, 64)
			}
		}
		if want := -skew[i].Seconds(); off < want-1 || off > want+1 {
			t.Fatalf("agent %d's crescent_agent_master_clock_offset_seconds = %v, want about %v", i, off, want)
		}
	}
}
