package rpcerr

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestTableCoversEveryReason walks every value of ErrorReason in
// errors.proto: each but UNSPECIFIED has exactly one code in the table, a
// real one, and keeps reason and code through Status→FromStatus and
// Item→FromItem.
func TestTableCoversEveryReason(t *testing.T) {
	values := masterv1.ErrorReason(0).Descriptor().Values()
	seen := 0
	for i := range values.Len() {
		r := masterv1.ErrorReason(values.Get(i).Number())
		if r == masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
			if _, ok := codeOf[r]; ok {
				t.Fatal("UNSPECIFIED must have no code in the table")
			}
			continue
		}
		seen++
		t.Run(ReasonName(r), func(t *testing.T) {
			want, ok := codeOf[r]
			if !ok {
				t.Fatalf("reason %v has no code in the table", r)
			}
			if want == codes.OK || want == codes.Unknown {
				t.Fatalf("reason %v maps to %v, want a specific error code", r, want)
			}
			if got := Code(r); got != want {
				t.Fatalf("Code(%v) = %v, want %v", r, got, want)
			}
			err := fmt.Errorf("ctx: %w", Errorf(r, "msg %d", 1))

			wire := Status(err)
			if got := status.Code(wire); got != want {
				t.Fatalf("Status code = %v, want %v", got, want)
			}
			back := FromStatus(wire)
			if got := Reason(back); got != ReasonName(r) {
				t.Fatalf("FromStatus reason = %q, want %q", got, ReasonName(r))
			}
			if got := status.Code(back); got != want {
				t.Fatalf("FromStatus code = %v, want %v", got, want)
			}
			if !errors.Is(back, &Error{Reason: r}) {
				t.Fatalf("errors.Is(FromStatus, sentinel %v) = false", r)
			}

			it := Item(err)
			if got := codes.Code(it.GetCode()); got != want {
				t.Fatalf("Item code = %v, want %v", got, want)
			}
			back = FromItem(it)
			if got := Reason(back); got != ReasonName(r) {
				t.Fatalf("FromItem reason = %q, want %q", got, ReasonName(r))
			}
			if got := status.Code(back); got != want {
				t.Fatalf("FromItem code = %v, want %v", got, want)
			}
			if !errors.Is(back, &Error{Reason: r}) {
				t.Fatalf("errors.Is(FromItem, sentinel %v) = false", r)
			}
		})
	}
	if len(codeOf) != seen {
		t.Fatalf("table has %d entries for %d reasons: it names a reason errors.proto lacks", len(codeOf), seen)
	}
}

func TestWrapKeepsTheChain(t *testing.T) {
	base := io.ErrUnexpectedEOF
	inner := Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent gone")
	err := fmt.Errorf("outer: %w", Wrap(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, fmt.Errorf("mid: %w: %w", inner, base), "segment %q", "s1"))

	for _, target := range []error{
		&Error{Reason: masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE}, // the outer reason
		&Error{Reason: masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE},   // a reason in the cause
		base, // a plain error in the cause
	} {
		if !errors.Is(err, target) {
			t.Errorf("errors.Is(%v, %v) = false, want true", err, target)
		}
	}
	if errors.Is(err, &Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND}) {
		t.Error("errors.Is matched a reason that is not in the chain")
	}
	// The outermost reason decides the reason and the code.
	if got, want := Reason(err), "SEGMENT_UNAVAILABLE"; got != want {
		t.Errorf("Reason = %q, want %q", got, want)
	}
	if got, want := status.Code(Status(err)), codes.FailedPrecondition; got != want {
		t.Errorf("Status code = %v, want %v", got, want)
	}
	// The message keeps the cause's text, as %v formatting did.
	if got, want := Reason(err)+": "+status.Convert(Status(err)).Message(), "SEGMENT_UNAVAILABLE: outer: segment \"s1\": mid: AGENT_UNAVAILABLE: agent gone: unexpected EOF"; got != want {
		t.Errorf("message = %q, want %q", got, want)
	}
	if Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, nil, "x").Unwrap() != nil || Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "x").Unwrap() != nil {
		t.Error("an error without a cause must unwrap to nil")
	}
}

// TestErrorsWithoutReason covers failures that carry no ErrorInfo: context
// errors keep their codes at the edge, and a received status keeps its
// code on the SDK side.
func TestErrorsWithoutReason(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want codes.Code
	}{
		{"canceled", fmt.Errorf("read: %w", context.Canceled), codes.Canceled},
		{"deadline", context.DeadlineExceeded, codes.DeadlineExceeded},
		{"plain", errors.New("boom"), codes.Unknown},
		{"status", status.Error(codes.Unavailable, "conn refused"), codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wire := Status(tt.err)
			if got := status.Code(wire); got != tt.want {
				t.Fatalf("Status code = %v, want %v", got, tt.want)
			}
			if got := Reason(wire); got != "" {
				t.Fatalf("Reason = %q, want none", got)
			}
			back := FromStatus(wire)
			var e *Error
			if !errors.As(back, &e) || e.Code() != tt.want || e.Reason != masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
				t.Fatalf("FromStatus = %#v, want an *Error with code %v and no reason", back, tt.want)
			}
			if got := status.Code(back); got != tt.want {
				t.Fatalf("status.Code(FromStatus) = %v, want %v", got, tt.want)
			}
			if got := codes.Code(FromItem(Item(tt.err)).(*Error).Code()); got != tt.want {
				t.Fatalf("Item round trip code = %v, want %v", got, tt.want)
			}
		})
	}
	// A reason this build does not know (a newer server) keeps its code.
	back := FromItem(&masterv1.ItemStatus{Code: int32(codes.Aborted), Reason: "FROM_THE_FUTURE", Message: "m"})
	if got := status.Code(back); got != codes.Aborted {
		t.Fatalf("unknown reason code = %v, want %v", got, codes.Aborted)
	}
}
