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

// TestClassify: an error with a reason is judged by its reason alone,
// whatever code it arrived with; one without by its code, and an
// unreachable master is a failover only when there is another to try.
func TestClassify(t *testing.T) {
	item := func(c codes.Code, reason string) error {
		return rpcerr.FromItem(&masterv1.ItemStatus{Code: int32(c), Reason: reason, Message: "m"})
	}
	notLeader := func(leader string) error {
		return rpcerr.Status(&rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, Msg: "standby", Metadata: map[string]string{"leader": leader}})
	}
	transport := status.Error(codes.Unavailable, "connection refused")
	tests := []struct {
		name       string
		err        error
		several    bool
		want       verdict
		wantLeader string
	}{
		{"not leader, leader known", notLeader("m2:50051"), false, redirect, "m2:50051"},
		{"not leader, election", notLeader(""), true, failover, ""},
		{"not leader, no metadata", rpcerr.FromStatus(rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "x"))), false, failover, ""},
		{"recovering", rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING, "x")), true, recovering, ""},
		{"shutting down", rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_SHUTTING_DOWN, "x")), false, failover, ""},
		{"agent unavailable", item(codes.Unavailable, "AGENT_UNAVAILABLE"), true, again, ""},
		{"segment unavailable sent as UNAVAILABLE by an older master", item(codes.Unavailable, "SEGMENT_UNAVAILABLE"), false, final, ""},
		{"segment unavailable", item(codes.FailedPrecondition, "SEGMENT_UNAVAILABLE"), false, final, ""},
		{"replica not ready", item(codes.Unavailable, "REPLICA_IS_NOT_READY"), false, final, ""},
		{"transport, one master", transport, false, again, ""},
		{"transport, several masters", transport, true, failover, ""},
		{"deadline", rpcerr.FromStatus(status.Error(codes.DeadlineExceeded, "slow")), true, final, ""},
		{"wrapped", fmt.Errorf("get: %w", item(codes.Unavailable, "AGENT_UNAVAILABLE")), false, again, ""},
		{"not a status", errors.New("plain"), true, final, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got, leader := classify(tt.err, tt.several); got != tt.want || leader != tt.wantLeader {
				t.Fatalf("classify(%v, %v) = %v, %q; want %v, %q", tt.err, tt.several, got, leader, tt.want, tt.wantLeader)
			}
		})
	}
}
