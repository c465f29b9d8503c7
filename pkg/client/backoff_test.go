package client

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestCallBackoff checks call's retry schedule on synctest's fake clock:
// each wait is drawn from [d/2, d] with d doubling from Config.Backoff,
// Attempts bounds the tries, a permanent error is not retried, and a
// context that ends cuts a wait short.
func TestCallBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := &Client{s: &shared{cfg: Config{Attempts: 4, Backoff: time.Second}}}
		fail := func(err error) (at []time.Duration, got error) {
			start := time.Now()
			_, got = call(t.Context(), c, func(masterv1.ObjectServiceClient) (struct{}, error) {
				at = append(at, time.Since(start))
				return struct{}{}, err
			})
			return at, got
		}

		at, err := fail(status.Error(codes.Unavailable, "connection refused"))
		if status.Code(err) != codes.Unavailable || len(at) != 4 {
			t.Fatalf("a transient failure: %v after %d attempts, want UNAVAILABLE after 4", err, len(at))
		}
		for i, d := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
			if wait := at[i+1] - at[i]; wait < d/2 || wait > d {
				t.Errorf("wait %d: %v, want within [%v, %v]", i+1, wait, d/2, d)
			}
		}

		at, err = fail(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "gone"))
		if !errors.Is(err, ErrNotFound) || len(at) != 1 {
			t.Fatalf("a permanent failure: %v after %d attempts, want OBJECT_NOT_FOUND after 1", err, len(at))
		}

		// NOT_LEADER without a leader hint is retried on the same master.
		at, _ = fail(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "electing"))
		if len(at) != 4 {
			t.Fatalf("NOT_LEADER: %d attempts, want 4", len(at))
		}

		c.s.cfg.Backoff = time.Hour
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		start := time.Now()
		_, err = call(ctx, c, func(masterv1.ObjectServiceClient) (struct{}, error) {
			return struct{}{}, status.Error(codes.Unavailable, "down")
		})
		if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) != time.Minute {
			t.Fatalf("a 1 h backoff under a 1 min deadline: %v after %v", err, time.Since(start))
		}
	})
}
