package rpcerr

import (
	"errors"
	"fmt"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestRoundTrip(t *testing.T) {
	tests := []struct {
		name   string
		err    error
		code   codes.Code
		reason string
	}{
		{"domain", Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "no %q", "k"), codes.NotFound, "OBJECT_NOT_FOUND"},
		{"wrapped", fmt.Errorf("ctx: %w", Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE, "leased")), codes.FailedPrecondition, "OBJECT_HAS_LEASE"},
		{"plain", errors.New("boom"), codes.Unknown, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wire := Status(tt.err)
			st, _ := status.FromError(wire)
			if got := st.Code(); got != tt.code {
				t.Fatalf("code: got %v, want %v", got, tt.code)
			}
			if got := Reason(wire); got != tt.reason {
				t.Fatalf("reason: got %q, want %q", got, tt.reason)
			}
			back := FromItem(Item(tt.err))
			if got := Reason(back); got != tt.reason {
				t.Fatalf("item reason: got %q, want %q", got, tt.reason)
			}
		})
	}
	if Item(nil).GetCode() != 0 || FromItem(Item(nil)) != nil {
		t.Fatal("nil error must round-trip as OK")
	}
	if got := FromStatus(Status(fmt.Errorf("put: %w", Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "no k")))).Error(); got != "OBJECT_NOT_FOUND: put: no k" {
		t.Fatalf("round-tripped message: got %q", got)
	}
	sentinel := &Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND}
	if !errors.Is(fmt.Errorf("x: %w", Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "")), sentinel) {
		t.Fatal("errors.Is must match on reason")
	}
}
