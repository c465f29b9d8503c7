package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// try is one try of a master call as the retry loop made it.
type try struct {
	at   time.Duration // since the call started
	addr string
}

// run runs m.do with op answering each try with answer(n, addr) and
// returns the tries and the call's error.
func run(ctx context.Context, m *masters, answer func(n int, addr string) error) ([]try, error) {
	start := time.Now()
	var tries []try
	err := m.do(ctx, func(addr string) error {
		tries = append(tries, try{time.Since(start), addr})
		return answer(len(tries), addr)
	})
	return tries, err
}

func notLeader(leader string) error {
	return rpcerr.Status(&rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, Msg: "standby", Metadata: map[string]string{"leader": leader}})
}

func addrsOf(tries []try) []string {
	var out []string
	for _, t := range tries {
		out = append(out, t.addr)
	}
	return out
}

// TestRetryLoop checks the master retry loop (masters.do) on synctest's
// fake clock: each wait is drawn from [d/2, d] with d doubling from
// Config.Backoff, Attempts bounds the tries of a transient failure, a
// permanent error is not retried, leader changes are retried for
// FailoverTimeout, a redirect is followed at once, an unreachable master
// of several hands over to the next, and a context that ends cuts a wait
// short.
func TestRetryLoop(t *testing.T) {
	cfg := &Config{Attempts: 4, Backoff: 100 * time.Millisecond, FailoverTimeout: 2 * time.Second}
	unavailable := status.Error(codes.Unavailable, "connection refused")

	t.Run("transient", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			at, err := run(t.Context(), newMasters(cfg, []string{"m1"}, nil), func(int, string) error { return unavailable })
			if status.Code(err) != codes.Unavailable || len(at) != 4 {
				t.Fatalf("a transient failure: %v after %d tries, want UNAVAILABLE after 4", err, len(at))
			}
			for i, d := range []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond} {
				if wait := at[i+1].at - at[i].at; wait < d/2 || wait > d {
					t.Errorf("wait %d: %v, want within [%v, %v]", i+1, wait, d/2, d)
				}
			}
		})
	})

	t.Run("permanent", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			at, err := run(t.Context(), newMasters(cfg, []string{"m1", "m2"}, nil), func(int, string) error {
				return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "gone"))
			})
			if !errors.Is(rpcerr.FromStatus(err), ErrNotFound) || len(at) != 1 {
				t.Fatalf("a permanent failure: %v after %d tries, want OBJECT_NOT_FOUND after 1", err, len(at))
			}
		})
	})

	t.Run("election outlasts the failover budget", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			at, err := run(t.Context(), newMasters(cfg, []string{"m1", "m2"}, nil), func(int, string) error { return notLeader("") })
			last := at[len(at)-1].at
			if rpcerr.Reason(err) != "NOT_LEADER" || last < cfg.FailoverTimeout || last > cfg.FailoverTimeout+maxBackoff {
				t.Fatalf("NOT_LEADER without a leader: %v, last try at %v; want NOT_LEADER, tries for %v", err, last, cfg.FailoverTimeout)
			}
			// Each master in turn, never the same twice in a row.
			for i := 1; i < len(at); i++ {
				if at[i].addr == at[i-1].addr {
					t.Fatalf("tries %v: the same master twice in a row", addrsOf(at))
				}
			}
		})
	})

	t.Run("failover", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			// m1 is gone; m2 and m3 elect m3, then m2 names it, and m3
			// recovers for a moment before it answers.
			m := newMasters(cfg, []string{"m1", "m2", "m3"}, nil)
			at, err := run(t.Context(), m, func(n int, addr string) error {
				switch {
				case addr == "m1":
					return unavailable
				case addr == "m2" && n < 5, addr == "m3" && n == 3:
					return notLeader("")
				case addr == "m2":
					return notLeader("m3")
				case n == 6:
					return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING, "x"))
				}
				return nil
			})
			want := []string{"m1", "m2", "m3", "m1", "m2", "m3", "m3"}
			if err != nil || !slices.Equal(addrsOf(at), want) {
				t.Fatalf("tries %v: %v; want %v, then success", addrsOf(at), err, want)
			}
			for i, wait := range []bool{true, true, true, true, false, true} {
				if got := at[i+1].at > at[i].at; got != wait {
					t.Errorf("try %d (%s) after %v, want a backoff: %v", i+2, at[i+1].addr, at[i+1].at-at[i].at, wait)
				}
			}
			// The next call goes straight to the leader.
			if at, err := run(t.Context(), m, func(int, string) error { return nil }); err != nil || at[0].addr != "m3" {
				t.Fatalf("the next call went to %v (%v), want m3", addrsOf(at), err)
			}
		})
	})

	t.Run("hints are bounded", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			long := *cfg
			long.FailoverTimeout = time.Hour
			m := newMasters(&long, []string{"m1"}, nil)
			at, err := run(t.Context(), m, func(n int, addr string) error {
				if addr == "m1" && n > 1 {
					return nil
				}
				return notLeader(fmt.Sprintf("h%d", n))
			})
			// m1 names h1, h1 names h2, ... up to maxHints; the next hint
			// is refused and the loop goes back to m1.
			if err != nil || len(at) != maxHints+2 || at[len(at)-1].addr != "m1" {
				t.Fatalf("tries %v: %v; want m1, h1..h%d, m1", addrsOf(at), err, maxHints)
			}
		})
	})

	t.Run("deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			slow := *cfg
			slow.Backoff = time.Hour
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			start := time.Now()
			_, err := run(ctx, newMasters(&slow, []string{"m1", "m2"}, nil), func(int, string) error { return unavailable })
			if !errors.Is(err, context.DeadlineExceeded) || status.Code(err) != codes.DeadlineExceeded || time.Since(start) != time.Minute {
				t.Fatalf("a 1 h backoff under a 1 min deadline: %v after %v", err, time.Since(start))
			}
		})
	})
}
