"""Errors: Crescent's reasons, and the Mooncake error codes they map to.

Crescent's servers answer with a gRPC status whose google.rpc.ErrorInfo
carries a reason (crescent.master.v1.ErrorReason without its prefix),
and batch calls with one ItemStatus (code, reason, message) per item.
`CrescentError` carries the same three, plus the ErrorInfo metadata (a
standby master's NOT_LEADER names the leader there).

The Mooncake-compatible store (crescent.store) returns Mooncake's
integer codes instead of raising; `mooncake_code` maps a reason to one.
The table is in clients/python/README.md.
"""

from __future__ import annotations

import grpc

__all__ = [
    "CrescentError",
    "ErrorCode",
    "mooncake_code",
    "from_rpc_error",
    "from_item",
]


class ErrorCode:
    """Mooncake Store's error codes (its docs: troubleshooting/error-code.md)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    UNAVAILABLE_IN_CURRENT_STATUS = -1010


# Crescent reason -> Mooncake code. Reasons not listed map by gRPC code
# (mooncake_code): a failure with no reason is the transport's.
_REASON_CODE = {
    "OBJECT_NOT_FOUND": ErrorCode.OBJECT_NOT_FOUND,
    "OBJECT_ALREADY_EXISTS": ErrorCode.OBJECT_ALREADY_EXISTS,
    "OBJECT_HAS_LEASE": ErrorCode.OBJECT_HAS_LEASE,
    "REPLICA_IS_NOT_READY": ErrorCode.REPLICA_IS_NOT_READY,
    "NO_AVAILABLE_HANDLE": ErrorCode.NO_AVAILABLE_HANDLE,
    "TENANT_QUOTA_EXCEEDED": ErrorCode.NO_AVAILABLE_HANDLE,
    "INVALID_PARAMS": ErrorCode.INVALID_PARAMS,
    "OBJECT_TOO_LARGE": ErrorCode.INVALID_PARAMS,
    "LIMIT_EXCEEDED": ErrorCode.INVALID_PARAMS,
    "NOT_LEADER": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "MASTER_RECOVERING": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "MASTER_SHUTTING_DOWN": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "MASTER_IS_LEADER": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "ILLEGAL_CLIENT": ErrorCode.INVALID_PARAMS,
    "OBJECT_BUSY": ErrorCode.REPLICA_IS_NOT_READY,
    "SEGMENT_NOT_FOUND": ErrorCode.SEGMENT_NOT_FOUND,
    "ALLOCATION_NOT_FOUND": ErrorCode.TRANSFER_FAIL,
    "INVALID_TOKEN": ErrorCode.TRANSFER_FAIL,
    "ALLOCATION_STATE": ErrorCode.TRANSFER_FAIL,
    "OUT_OF_BOUNDS": ErrorCode.TRANSFER_FAIL,
    "STALE_EPOCH": ErrorCode.TRANSFER_FAIL,
    "EPOCH_MISMATCH": ErrorCode.TRANSFER_FAIL,
    "AGENT_UNAVAILABLE": ErrorCode.TRANSFER_FAIL,
    "SEGMENT_UNAVAILABLE": ErrorCode.TRANSFER_FAIL,
    "CHECKSUM_MISMATCH": ErrorCode.CHECKSUM_MISMATCH,
    "PUT_EXPIRED": ErrorCode.LEASE_EXPIRED,
    "INTERNAL": ErrorCode.INTERNAL_ERROR,
    # Client-side reasons (never on the wire).
    "BUFFER_TOO_SMALL": ErrorCode.BUFFER_OVERFLOW,
    "FEWER_REPLICAS": ErrorCode.INVALID_REPLICA,
}


class CrescentError(Exception):
    """An error from Crescent (or from the client on its behalf).

    reason: an ErrorReason name without prefix ("OBJECT_NOT_FOUND"), "" when
    the failure carried none (a transport failure); code: the gRPC status
    code; metadata: ErrorInfo.metadata; first: for a get that failed twice
    (every replica of its list, then of a fresh list), the first round's
    error, which the message names too (a CHECKSUM_MISMATCH there with
    OBJECT_NOT_FOUND here: the only replica was bad and has been dropped),
    else None.
    """

    first: CrescentError | None = None

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None, metadata=None):
        self.reason = reason or ""
        self.message = message
        self.code = code if code is not None else _REASON_GRPC.get(self.reason, grpc.StatusCode.UNKNOWN)
        self.metadata = dict(metadata or {})
        super().__init__(f"{self.reason}: {message}" if self.reason else message)

    @property
    def mooncake_code(self) -> int:
        return mooncake_code(self)


_REASON_GRPC = {
    "OBJECT_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "OBJECT_ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "INVALID_PARAMS": grpc.StatusCode.INVALID_ARGUMENT,
    "BUFFER_TOO_SMALL": grpc.StatusCode.INVALID_ARGUMENT,
    "CHECKSUM_MISMATCH": grpc.StatusCode.DATA_LOSS,
    "AGENT_UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "REPLICA_IS_NOT_READY": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "FEWER_REPLICAS": grpc.StatusCode.UNAVAILABLE,
}


def mooncake_code(err: BaseException) -> int:
    """The Mooncake error code for err (always negative)."""
    if isinstance(err, CrescentError):
        c = _REASON_CODE.get(err.reason)
        if c is not None:
            return c
        return ErrorCode.RPC_FAIL
    if isinstance(err, (ValueError, TypeError, OverflowError)):
        return ErrorCode.INVALID_PARAMS
    if isinstance(err, OSError):
        return ErrorCode.TRANSFER_FAIL
    return ErrorCode.INTERNAL_ERROR


_GRPC_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def from_item(code: int, reason: str, message: str) -> CrescentError | None:
    """A batch item's status (ItemStatus / ItemResult) as an error; None for OK."""
    if code == 0:
        return None
    return CrescentError(reason, message, _GRPC_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN))


def from_rpc_error(e: grpc.RpcError) -> CrescentError:
    """A failed gRPC call as a CrescentError, with the reason and metadata
    of the status's ErrorInfo detail when it has one."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    msg = e.details() if hasattr(e, "details") else str(e)
    reason, md = "", {}
    try:
        trailers = e.trailing_metadata() or ()
    except Exception:  # a call that never started has none
        trailers = ()
    for k, v in trailers:
        if k == "grpc-status-details-bin" and isinstance(v, (bytes, bytearray)):
            try:
                reason, md = _error_info(bytes(v))
            except ValueError:
                reason, md = "", {}
    return CrescentError(reason, msg or "", code, md)


# --- google.rpc.Status / Any / ErrorInfo, decoded by hand --------------------
# The detail is network input: every length is checked against the bytes
# left before it is used, and nothing is allocated on a length's strength.

_ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo"


def _varint(b: bytes, i: int):
    x = 0
    for shift in range(0, 64, 7):
        if i >= len(b):
            raise ValueError("truncated varint")
        c = b[i]
        i += 1
        x |= (c & 0x7F) << shift
        if c < 0x80:
            return x, i
    raise ValueError("varint too long")


def _fields(b: bytes):
    """(field number, wire type, value) of a message's top-level fields."""
    i = 0
    while i < len(b):
        tag, i = _varint(b, i)
        num, typ = tag >> 3, tag & 7
        if typ == 0:
            v, i = _varint(b, i)
        elif typ == 2:
            n, i = _varint(b, i)
            if n > len(b) - i:
                raise ValueError("length past the end")
            v, i = b[i : i + n], i + n
        elif typ == 1:
            if i + 8 > len(b):
                raise ValueError("truncated fixed64")
            v, i = b[i : i + 8], i + 8
        elif typ == 5:
            if i + 4 > len(b):
                raise ValueError("truncated fixed32")
            v, i = b[i : i + 4], i + 4
        else:
            raise ValueError(f"wire type {typ}")
        yield num, typ, v


def _error_info(status: bytes):
    for num, typ, v in _fields(status):
        if num != 3 or typ != 2:
            continue
        url, value = "", b""
        for n2, t2, v2 in _fields(v):
            if n2 == 1 and t2 == 2:
                url = v2.decode("utf-8", "replace")
            elif n2 == 2 and t2 == 2:
                value = v2
        if url != _ERROR_INFO_URL:
            continue
        reason, md = "", {}
        for n3, t3, v3 in _fields(value):
            if n3 == 1 and t3 == 2:
                reason = v3.decode("utf-8", "replace")
            elif n3 == 3 and t3 == 2:
                k = val = ""
                for n4, t4, v4 in _fields(v3):
                    if n4 == 1 and t4 == 2:
                        k = v4.decode("utf-8", "replace")
                    elif n4 == 2 and t4 == 2:
                        val = v4.decode("utf-8", "replace")
                md[k] = val
        return reason, md
    return "", {}
