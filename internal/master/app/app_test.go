package app

import (
	"context"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// running is a master serving cfg on loopback (runMaster), with a
// plaintext connection to it.
type running struct {
	m      *Master
	cc     *grpc.ClientConn
	cancel context.CancelFunc
	done   chan error
}

// runMaster starts a master of cfg and dials it; the test's end stops it
// if the test did not (stop).
func runMaster(t *testing.T, cfg Config) *running {
	t.Helper()
	m, err := New(cfg, testutil.Logger())
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Server.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{m: m, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- m.Run(ctx) }()
	if r.cc, err = grpc.NewClient(m.Server.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		cancel()
		<-r.done
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.cc.Close()
		if r.done != nil {
			r.stop(t, time.Minute)
		}
	})
	return r
}

// stop cancels the master and waits for Run, failing the test if it
// errs or outlasts within; it returns how long Run took to return.
func (r *running) stop(t *testing.T, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	r.cancel()
	select {
	case err := <-r.done:
		r.done = nil
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(within):
		t.Fatalf("Run did not return %v after cancel", within)
	}
	return time.Since(start)
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Config)
		ok   bool
	}{
		{"defaults", func(*Config) {}, true},
		{"no grpc addr", func(c *Config) { c.GRPCAddr = "" }, false},
		{"suspect before heartbeat", func(c *Config) { c.SuspectAfter = c.HeartbeatInterval }, false},
		{"unmount before suspect", func(c *Config) { c.UnmountAfter = c.SuspectAfter }, false},
		{"watermarks inverted", func(c *Config) { c.LowWatermark, c.HighWatermark = 0.9, 0.8 }, false},
		{"tiny changelog", func(c *Config) { c.ChangelogRetention = 10 }, false},
		{"evict policy drop", func(c *Config) { c.EvictPolicy = "drop" }, true},
		{"evict policy unknown", func(c *Config) { c.EvictPolicy = "spill" }, false},
		{"zero lease", func(c *Config) { c.LeaseTTL = 0 }, false},
		{"gc percent", func(c *Config) { c.GCPercent = 1 }, false},
		{"negative recovery grace", func(c *Config) { c.RecoveryGrace = -time.Second }, false},
		{"put timeout past reserved grace", func(c *Config) { c.PutTimeout = c.ReservedGrace }, false},
		{"promotion off", func(c *Config) { c.PromoteThreshold = 0 }, true},
		{"promote threshold past the sketch", func(c *Config) { c.PromoteThreshold = 256 }, false},
		{"no promote rate", func(c *Config) { c.PromoteRate = 0 }, false},
		{"no promote queue", func(c *Config) { c.PromoteQueue = 0 }, false},
		{"max object size at the cap", func(c *Config) { c.MaxObjectSize = 64 << 30 }, true},
		{"max object size above the cap", func(c *Config) { c.MaxObjectSize = 64<<30 + 1 }, false},
		// Rotation >= 2 x (max(lease, write token TTL) + activation).
		{"no key rotation", func(c *Config) { c.TokenKeyRotation = 0 }, false},
		{"key rotation at the minimum", func(c *Config) { c.TokenKeyRotation = 2 * (5*time.Minute + 10*time.Second) }, true},
		{"key rotation below the minimum", func(c *Config) { c.TokenKeyRotation = 2*(5*time.Minute+10*time.Second) - time.Second }, false},
		{"key rotation below the write token TTL", func(c *Config) { c.WriteTokenTTL = 2 * time.Hour }, false},
		{"short tokens, fast rotation", func(c *Config) {
			c.LeaseTTL, c.WriteTokenTTL, c.TokenKeyRotation = 900*time.Millisecond, 900*time.Millisecond, 2*time.Second
		}, true},
		{"short tokens, too fast rotation", func(c *Config) {
			c.LeaseTTL, c.WriteTokenTTL, c.TokenKeyRotation = 900*time.Millisecond, 900*time.Millisecond, 1999*time.Millisecond
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			tt.mod(&c)
			if err := c.Validate(); (err == nil) != tt.ok {
				t.Fatalf("Validate: got %v, want ok=%v", err, tt.ok)
			}
		})
	}
}

// TestRunServesAndStops starts the wired master on loopback, calls every
// service once, and checks that cancelling the context stops it promptly.
func TestRunServesAndStops(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	// Long enough that a loaded CI machine still makes the first calls
	// below within it (500 ms was not, once).
	cfg.RecoveryGrace = 2 * time.Second
	r := runMaster(t, cfg)
	cc := r.cc
	rctx, rcancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer rcancel()
	st, err := masterv1.NewAdminServiceClient(cc).GetClusterStatus(rctx, &masterv1.GetClusterStatusRequest{}, grpc.WaitForReady(true))
	if err != nil || !st.GetLeader() || st.GetEpoch() == 0 {
		t.Fatalf("GetClusterStatus: %v, %v", st, err)
	}
	// ObjectService and ChangeService wait out the recovery grace (a get
	// must not answer OBJECT_NOT_FOUND for an object whose agent is still
	// re-registering), then serve.
	exist := func() error {
		_, err := masterv1.NewObjectServiceClient(cc).Exist(rctx, &masterv1.ExistRequest{Key: "k"})
		return err
	}
	if err := exist(); rpcerr.Reason(err) != "MASTER_RECOVERING" {
		t.Fatalf("Exist right after start: got %v, want MASTER_RECOVERING", err)
	}
	snapshot := func() error {
		st, err := masterv1.NewChangeServiceClient(cc).Snapshot(rctx, &masterv1.SnapshotRequest{})
		if err == nil {
			_, err = st.Recv()
		}
		return err
	}
	if err := snapshot(); rpcerr.Reason(err) != "MASTER_RECOVERING" {
		t.Fatalf("Snapshot right after start: got %v, want MASTER_RECOVERING", err)
	}
	testutil.EventuallyNoError(t, 10*time.Second, snapshot)
	if err := exist(); err != nil {
		t.Fatalf("Exist after the recovery: %v", err)
	}
	cc.Close()
	if d := r.stop(t, 10*time.Second); d > 5*time.Second {
		t.Fatalf("shutdown took %v", d)
	}
}
