// Package rpcerr is the one place where Crescent turns a failure into a gRPC
// status carrying a machine-readable reason (google.rpc.ErrorInfo), and back.
//
// Domain packages never choose a gRPC code: they return an *Error built with
// Errorf or Wrap, which carries only a reason (a masterv1.ErrorReason), a
// message and optional metadata, and keeps the error it wraps (errors.Is and
// errors.As see through it). The gRPC code of each reason is fixed by one
// table, Code, which agrees with the comments in errors.proto. The server edge
// (the gRPC adapters) converts with Status and Item; the SDK and other
// receivers convert back with FromStatus and FromItem, so errors.Is against a
// reason sentinel works on both sides of the wire.
//
// Reasons are the names of masterv1.ErrorReason without their prefix.
//
// Only Crescent's own packages import rpcerr (it is internal); SDK users see
// its errors through pkg/client's sentinels and status.Code.
package rpcerr

import (
	"errors"
	"fmt"
	"net"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Domain is ErrorInfo.domain on every Crescent error.
const Domain = "crescent.dev"

// codeOf is the one table from reason to gRPC code. Every value of
// masterv1.ErrorReason but UNSPECIFIED has exactly one entry (a test walks
// the enum), and errors.proto documents the same code next to each reason.
var codeOf = map[masterv1.ErrorReason]codes.Code{
	masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND:      codes.NotFound,
	masterv1.ErrorReason_ERROR_REASON_OBJECT_ALREADY_EXISTS: codes.AlreadyExists,
	masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE:      codes.FailedPrecondition,
	masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY:  codes.Unavailable,
	masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE:   codes.ResourceExhausted,
	masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED: codes.ResourceExhausted,
	masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS:        codes.InvalidArgument,
	masterv1.ErrorReason_ERROR_REASON_NOT_LEADER:            codes.Unavailable,
	masterv1.ErrorReason_ERROR_REASON_ILLEGAL_CLIENT:        codes.PermissionDenied,
	masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY:           codes.FailedPrecondition,
	masterv1.ErrorReason_ERROR_REASON_REVISION_COMPACTED:    codes.OutOfRange,
	masterv1.ErrorReason_ERROR_REASON_EPOCH_MISMATCH:        codes.FailedPrecondition,
	masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND:     codes.NotFound,
	masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND:  codes.NotFound,
	masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN:         codes.PermissionDenied,
	masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE:      codes.FailedPrecondition,
	masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS:         codes.OutOfRange,
	masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH:     codes.DataLoss,
	masterv1.ErrorReason_ERROR_REASON_STALE_EPOCH:           codes.FailedPrecondition,
	masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE:     codes.Unavailable,
	masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE:   codes.FailedPrecondition,
	masterv1.ErrorReason_ERROR_REASON_PUT_EXPIRED:           codes.NotFound,
	masterv1.ErrorReason_ERROR_REASON_INTERNAL:              codes.Internal,
	masterv1.ErrorReason_ERROR_REASON_MASTER_RECOVERING:     codes.Unavailable,
	masterv1.ErrorReason_ERROR_REASON_OBJECT_TOO_LARGE:      codes.InvalidArgument,
	masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED:        codes.ResourceExhausted,
	masterv1.ErrorReason_ERROR_REASON_MASTER_SHUTTING_DOWN:  codes.Unavailable,
	masterv1.ErrorReason_ERROR_REASON_SESSION_REPLACED:      codes.Aborted,
	masterv1.ErrorReason_ERROR_REASON_MASTER_IS_LEADER:      codes.FailedPrecondition,
}

// Code is the gRPC code that goes with reason r: the one place Crescent
// chooses a code for a domain failure. UNSPECIFIED and reasons this build does
// not know are UNKNOWN.
func Code(r masterv1.ErrorReason) codes.Code {
	if c, ok := codeOf[r]; ok {
		return c
	}
	return codes.Unknown
}

// ReasonName returns the wire reason for r ("OBJECT_NOT_FOUND").
func ReasonName(r masterv1.ErrorReason) string {
	if r == masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		return ""
	}
	return strings.TrimPrefix(r.String(), "ERROR_REASON_")
}

// parseReason is ReasonName's inverse; UNSPECIFIED for "" and for reasons
// this build does not know.
func parseReason(name string) masterv1.ErrorReason {
	if name == "" {
		return masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED
	}
	return masterv1.ErrorReason(masterv1.ErrorReason_value["ERROR_REASON_"+name])
}

// Error is a domain error: a reason, a message, optional ErrorInfo metadata
// and the error it wraps, if any. Domain packages return (or wrap) these;
// the edge turns them into statuses with Status and Item.
//
// A *Error made by FromStatus or FromItem also remembers the code it
// arrived with, so a failure that carried no reason (a transport error, a
// cancelled call) keeps its code on the receiving side.
type Error struct {
	Reason   masterv1.ErrorReason
	Msg      string
	Metadata map[string]string

	cause error      // the wrapped error (Wrap); nil for Errorf
	wire  codes.Code // the code received on the wire; OK for local errors
}

// Errorf builds an *Error with reason r and a formatted message.
func Errorf(r masterv1.ErrorReason, format string, args ...any) *Error {
	return &Error{Reason: r, Msg: fmt.Sprintf(format, args...)}
}

// Wrap builds an *Error with reason r whose message is the formatted text,
// ": " and cause's text, and which unwraps to cause (errors.Is and
// errors.As see through it; the outer reason decides the code).
func Wrap(r masterv1.ErrorReason, cause error, format string, args ...any) *Error {
	msg := fmt.Sprintf(format, args...)
	if cause != nil {
		msg += ": " + cause.Error()
	}
	return &Error{Reason: r, Msg: msg, cause: cause}
}

func (e *Error) Error() string {
	if r := ReasonName(e.Reason); r != "" {
		return r + ": " + e.Msg
	}
	return e.Msg
}

// Unwrap returns the error e wraps (nil unless built by Wrap).
func (e *Error) Unwrap() error { return e.cause }

// Code is e's gRPC code: the one it arrived with when it came from the wire,
// else the table's code for its reason.
func (e *Error) Code() codes.Code {
	if e.wire != codes.OK {
		return e.wire
	}
	return Code(e.Reason)
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
	return e.status(e.Msg)
}

func (e *Error) status(msg string) *status.Status {
	st := status.New(e.Code(), msg)
	if e.Reason == masterv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		return st
	}
	if ds, err := st.WithDetails(&errdetails.ErrorInfo{Reason: ReasonName(e.Reason), Domain: Domain, Metadata: e.Metadata}); err == nil {
		return ds
	}
	return st
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
	if info := errorInfo(err); info != nil {
		return info.GetReason()
	}
	return ""
}

// Metadata returns ErrorInfo.metadata of err (nil when absent).
func Metadata(err error) map[string]string {
	var e *Error
	if errors.As(err, &e) {
		return e.Metadata
	}
	if info := errorInfo(err); info != nil {
		return info.GetMetadata()
	}
	return nil
}

// errorInfo is the ErrorInfo detail of a status error, or nil.
func errorInfo(err error) *errdetails.ErrorInfo {
	st, ok := status.FromError(err)
	if !ok {
		return nil
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info
		}
	}
	return nil
}

// Status converts any error to a gRPC status error: the edge. An *Error
// anywhere in err's chain gets its reason's code (Code) and an ErrorInfo;
// errors that already are statuses pass unchanged; context errors keep their
// codes (CANCELLED, DEADLINE_EXCEEDED); anything else is UNKNOWN.
func Status(err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		// The reason travels in ErrorInfo; keep it out of the message so a
		// receiver that prefixes it (Error.Error) does not print it twice.
		return e.status(strings.Replace(err.Error(), e.Error(), e.Msg, 1)).Err()
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.FromContextError(err).Err()
}

// Item converts an error to a batch ItemStatus (OK for nil), with the same
// code, reason and message Status gives it.
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
	return &Error{Reason: parseReason(it.GetReason()), Msg: it.GetMessage(), wire: codes.Code(it.GetCode())}
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
	out := &Error{Msg: st.Message(), wire: st.Code()}
	if info := errorInfo(err); info != nil {
		out.Reason = parseReason(info.GetReason())
		out.Metadata = info.GetMetadata()
	}
	return out
}

// LeaderKey is the ErrorInfo metadata key of a NOT_LEADER answer that
// names the leader's advertised gRPC address (issue 15, HA).
const LeaderKey = "leader"

// NotLeader is a standby master's answer: NOT_LEADER, naming the leader
// when known ("" during an election).
func NotLeader(leader string) *Error {
	e := Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "this master is not the leader (leader: %q)", leader)
	e.Metadata = map[string]string{LeaderKey: leader}
	return e
}

// LeaderHint reports whether err is a NOT_LEADER answer and the leader it
// names ("" when none is known or the name is not host:port).
func LeaderHint(err error) (hint string, notLeader bool) {
	if Reason(err) != ReasonName(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER) {
		return "", false
	}
	hint = Metadata(err)[LeaderKey]
	if host, port, err := net.SplitHostPort(hint); err != nil || host == "" || port == "" {
		return "", true
	}
	return hint, true
}
