// Package rpcerr is the one place where Crescent turns a failure into a gRPC
// status carrying a machine-readable reason (google.rpc.ErrorInfo), and back.
// Reasons are the names of masterv1.ErrorReason without their prefix; each
// reason has a fixed gRPC code, documented in errors.proto.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package rpcerr

import (
	"errors"
	"fmt"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Domain is ErrorInfo.domain on every Crescent error.
const Domain = "crescent.dev"

// ReasonName returns the wire reason for r ("OBJECT_NOT_FOUND").
func ReasonName(r masterv1.ErrorReason) string {
	if r == masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		return ""
	}
	return strings.TrimPrefix(r.String(), "ERROR_REASON_")
}

// Error is a domain error with its gRPC code and reason. Domain packages
// return (or wrap) these; adapters turn them into statuses with Status.
type Error struct {
	Code     codes.Code
	Reason   masterv1.ErrorReason
	Msg      string
	Metadata map[string]string
}

func (e *Error) Error() string {
	if r := ReasonName(e.Reason); r != "" {
		return r + ": " + e.Msg
	}
	return e.Msg
}

// Is makes errors.Is(err, sentinel) match on the reason, so sentinels like
// ErrNotFound match any error carrying that reason.
func (e *Error) Is(target error) bool {
	var t *Error
	if errors.As(target, &t) {
		return t.Reason != masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED && t.Reason == e.Reason
	}
	return false
}

// GRPCStatus lets status.FromError and grpc handlers see the code and reason.
func (e *Error) GRPCStatus() *status.Status {
	st := status.New(e.Code, e.Msg)
	if ds, err := st.WithDetails(&errdetails.ErrorInfo{Reason: ReasonName(e.Reason), Domain: Domain, Metadata: e.Metadata}); err == nil {
		return ds
	}
	return st
}

// New builds an *Error with a formatted message.
func New(code codes.Code, reason masterv1.ErrorReason, format string, args ...any) *Error {
	return &Error{Code: code, Reason: reason, Msg: fmt.Sprintf(format, args...)}
}

// Reason extracts the reason of err, whether it is an *Error, wraps one, or is
// a gRPC status received from the network. "" when none is present.
func Reason(err error) string {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return ReasonName(e.Reason)
	}
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// Metadata returns ErrorInfo.metadata of err (nil when absent).
func Metadata(err error) map[string]string {
	var e *Error
	if errors.As(err, &e) {
		return e.Metadata
	}
	st, ok := status.FromError(err)
	if !ok {
		return nil
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetMetadata()
		}
	}
	return nil
}

// Status converts any error to a gRPC status error. Errors that carry no code
// become INTERNAL with reason INTERNAL; context errors keep their codes.
func Status(err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		// The reason travels in ErrorInfo; keep it out of the message so a
		// receiver that prefixes it (Error.Error) does not print it twice.
		msg := strings.Replace(err.Error(), e.Error(), e.Msg, 1)
		st := status.New(e.Code, msg)
		if ds, derr := st.WithDetails(&errdetails.ErrorInfo{Reason: ReasonName(e.Reason), Domain: Domain, Metadata: e.Metadata}); derr == nil {
			return ds.Err()
		}
		return st.Err()
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.FromContextError(err).Err()
}

// Item converts an error to a batch ItemStatus (OK for nil).
func Item(err error) *masterv1.ItemStatus {
	if err == nil {
		return &masterv1.ItemStatus{}
	}
	st := status.Convert(Status(err))
	return &masterv1.ItemStatus{Code: int32(st.Code()), Reason: Reason(err), Message: st.Message()}
}

// FromItem turns a batch ItemStatus back into an error (nil for OK) that
// Reason, status.FromError and errors.Is understand.
func FromItem(it *masterv1.ItemStatus) error {
	if it == nil || codes.Code(it.GetCode()) == codes.OK {
		return nil
	}
	r := masterv1.ErrorReason(masterv1.ErrorReason_value["ERROR_REASON_"+it.GetReason()])
	return &Error{Code: codes.Code(it.GetCode()), Reason: r, Msg: it.GetMessage()}
}

// FromStatus converts an error received from the network into an *Error
// (so errors.Is against reason sentinels works) when it is a gRPC status;
// other errors are returned unchanged.
func FromStatus(err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	out := &Error{Code: st.Code(), Msg: st.Message()}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			out.Reason = masterv1.ErrorReason(masterv1.ErrorReason_value["ERROR_REASON_"+info.GetReason()])
			out.Metadata = info.GetMetadata()
		}
	}
	return out
}
