package client

import (
	"errors"
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestSentinelsSurviveTheWire: each sentinel matches an error of its reason
// received as a status or a batch item, wrapped further by the caller, and
// no other sentinel matches it.
func TestSentinelsSurviveTheWire(t *testing.T) {
	sentinels := map[string]error{
		"ErrNotFound": ErrNotFound, "ErrExists": ErrExists, "ErrLeased": ErrLeased, "ErrBusy": ErrBusy,
		"ErrNotReady": ErrNotReady, "ErrNoSpace": ErrNoSpace, "ErrQuotaExceeded": ErrQuotaExceeded,
		"ErrInvalid": ErrInvalid, "ErrChecksum": ErrChecksum, "ErrTooLarge": ErrTooLarge, "ErrPutExpired": ErrPutExpired,
	}
	for name, s := range sentinels {
		r := s.(*rpcerr.Error).Reason
		sent := rpcerr.Errorf(r, "from the server")
		for how, got := range map[string]error{
			"status": rpcerr.FromStatus(rpcerr.Status(sent)),
			"item":   rpcerr.FromItem(rpcerr.Item(sent)),
		} {
			got = fmt.Errorf("put %q: %w", "k", got)
			for other, o := range sentinels {
				if want := other == name; errors.Is(got, o) != want {
					t.Errorf("%s via %s: errors.Is(%v, %s) = %v, want %v", name, how, got, other, !want, want)
				}
			}
			if c := status.Code(got); c != rpcerr.Code(r) {
				t.Errorf("%s via %s: code %v, want the table's %v", name, how, c, rpcerr.Code(r))
			}
		}
	}
}

// TestRetryableByReason: an error with a reason is retried by its reason
// alone, whatever code it arrived with; one without by its code.
func TestRetryableByReason(t *testing.T) {
	item := func(c codes.Code, reason string) error {
		return rpcerr.FromItem(&masterv1.ItemStatus{Code: int32(c), Reason: reason, Message: "m"})
	}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"not leader", rpcerr.FromStatus(rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "x"))), true},
		{"agent unavailable", item(codes.Unavailable, "AGENT_UNAVAILABLE"), true},
		{"segment unavailable sent as UNAVAILABLE by an older master", item(codes.Unavailable, "SEGMENT_UNAVAILABLE"), false},
		{"segment unavailable", item(codes.FailedPrecondition, "SEGMENT_UNAVAILABLE"), false},
		{"replica not ready", item(codes.Unavailable, "REPLICA_IS_NOT_READY"), false},
		{"transport", rpcerr.FromStatus(status.Error(codes.Unavailable, "connection refused")), true},
		{"deadline", rpcerr.FromStatus(status.Error(codes.DeadlineExceeded, "slow")), false},
		{"wrapped", fmt.Errorf("get: %w", item(codes.Unavailable, "AGENT_UNAVAILABLE")), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := retryable(tt.err); got != tt.want {
				t.Fatalf("retryable(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}
