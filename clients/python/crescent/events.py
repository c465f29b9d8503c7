"""KV events for Python: the twin of Crescent's Go package ``pkg/kvevent``.

The gateway publishes Mooncake-compatible KV events on a ZMQ PUB socket
(docs/kv-events-contract.md, normative). This module is a consumer of that
stream:

* a **strict decoder** (:class:`Decoder`, :func:`decode_message`) that accepts
  exactly what ``pkg/kvevent``'s decoder accepts and rejects every contract
  violation with :class:`MalformedError`. The reference is a one-pass,
  bounds-checked msgpack reader written for the contract (every length is
  checked against the bytes that remain before anything is built for it,
  nesting is bounded), a line-by-line port of ``reader.go``/``decode.go``. A
  fast path parses small payloads with msgpack's C unpacker and checks the
  result; it may only accept, and only what the reader accepts, with the
  same result -- anything else goes to the reader, which decides;
* :func:`replay` (the gateway's replay ROUTER) and :func:`fetch_snapshot`
  (its snapshot ROUTER);
* :class:`Index`, the (tenant, key, medium) set a scheduler routes with;
* :class:`Subscriber`, which connects a SUB socket, detects sequence gaps,
  repairs them through replay, notices publisher restarts (after a
  reconnect it asks the replay ring whether the same process continued),
  and with ``snapshot_endpoint`` bootstraps from a snapshot and rebuilds
  from a fresh one whenever continuity is lost -- the same decisions as
  ``kvevent.Subscribe``, in the same order.

Differences from the Go package, all deliberate:

* A nil string on the wire (``model_name``, ``group_id``, ...) is ``None``;
  Go folds nil and "" into "". Strings are decoded as UTF-8 with
  ``surrogateescape``, so a key that is not valid UTF-8 is still accepted (as
  Go accepts it) and ``key.encode("utf-8", "surrogateescape")`` gives its
  bytes back.
* :func:`replay` is a generator; stop the exchange by leaving the loop (Go:
  return ``ErrStopReplay`` from the callback).
* The transport is libzmq (pyzmq), which reconnects by itself. The
  subscriber watches the socket's monitor events to learn of a reconnect
  (Go owns its ZMTP connection). libzmq assembles a whole multipart message
  before handing it over, so ``max_frame`` bounds each frame (libzmq's
  ``ZMQ_MAXMSGSIZE``: a larger frame drops the connection) and the frame count
  is checked when the message is read; the number of frames libzmq buffers
  for one message is libzmq's own business.

Needs Debian's ``python3-zmq``; ``python3-msgpack`` makes decoding 3-4x faster
(without it the strict reader does everything).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

__all__ = [
    "STORED", "REMOVED", "CLEARED", "CPU", "DISK",
    "MAX_EVENTS_PER_BATCH", "END_SEQ", "EPOCH_LEN", "CUT_NONE", "CUT_UNAVAILABLE",
    "MalformedError", "ProtocolError", "SnapshotUnavailable", "ReplayError",
    "Envelope", "Event", "Batch", "Snapshot", "Key", "Gap", "Stats",
    "Decoder", "decode_message", "decode_seq", "decode_seq_frame", "decode_snapshot_reply",
    "put_seq", "put_seq_epoch", "Index", "replay", "fetch_snapshot", "Subscriber",
]

log = logging.getLogger("crescent.events")

# Event types (event_type on the wire).
STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
# Media: "cpu" for memory replicas, "disk" for every other class, None on cleared.
CPU = "cpu"
DISK = "disk"

#: The contract's bound on events in one message.
MAX_EVENTS_PER_BATCH = 64
#: Sequence number of the replay end marker (its payload is empty).
END_SEQ = 0xFFFFFFFFFFFFFFFF
#: Length of a publisher epoch (snapshot stream format, snapshot replies).
EPOCH_LEN = 16
#: Snapshot cut: nothing has been published yet (the snapshot is empty).
CUT_NONE = -1
#: Snapshot cut: the publisher cannot serve a snapshot now (no chunks follow).
CUT_UNAVAILABLE = -2

_MAX_U32 = 0xFFFFFFFF
_MAX_I64 = 0x7FFFFFFFFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF
# Nesting bound when skipping the values of unknown keys (allow_unknown_keys).
_MAX_DEPTH = 32


class MalformedError(ValueError):
    """A contract violation (Go: an error wrapping kvevent.ErrMalformed)."""


class ProtocolError(MalformedError):
    """The peer broke a limit (frame size, frame count, reply size) or the
    socket-level shape of an exchange."""


class SnapshotUnavailable(Exception):
    """A snapshot reply whose cut is -2: the publisher is up but cannot serve
    one now (Go: kvevent.ErrSnapshotUnavailable). Retry later."""


class ReplayError(ConnectionError):
    """A replay or snapshot exchange failed at the transport: unreachable,
    timed out, or the connection dropped."""


# ---------------------------------------------------------------------------
# Data types


class Envelope(NamedTuple):
    """The per-publisher part of every event. ``None`` where the wire had nil."""
    backend_id: str
    model_name: Optional[str] = None
    additional_salt: Optional[str] = None
    lora_name: Optional[str] = None
    block_size: Optional[int] = None
    dp_rank: int = 0


class Event(NamedTuple):
    """One KV event as decoded."""
    id: int                 # event_id, monotonic per publisher process
    timestamp: int          # Unix ms, equal to the batch's
    type: str               # STORED, REMOVED or CLEARED
    tenant: str
    key: Optional[str]      # object_key, verbatim (None on cleared)
    medium: Optional[str]   # CPU or DISK (None on cleared)
    group_id: Optional[str]  # None when nil (and on cleared)
    envelope: Envelope
    legacy: bool            # the event carried the legacy-compat fields


@dataclass
class Batch:
    """One PUB message: a sequence number and its events."""
    seq: int
    timestamp: int
    dp_rank: int
    #: 1 to 64 events; none in a heartbeat (snapshot stream format).
    events: list
    #: Set on batches fetched from the replay socket.
    replayed: bool = False
    #: The 16-byte publisher epoch of a snapshot-format sequence frame; None
    #: in the Mooncake format.
    epoch: Optional[bytes] = None
    #: Set on the chunks of a snapshot; their seq is the snapshot's cut.
    snapshot: bool = False

    @property
    def heartbeat(self) -> bool:
        """A heartbeat of the snapshot stream format: no events."""
        return not self.events


@dataclass
class Snapshot:
    """The publisher's state at a sequence number (see :func:`fetch_snapshot`)."""
    #: Last sequence folded in; CUT_NONE (-1) when nothing was published.
    cut: int
    epoch: bytes
    #: Decoded chunks: stored events with event_id 0, seq = cut, snapshot set.
    batches: list

    @property
    def events(self) -> int:
        return sum(len(b.events) for b in self.batches)


class Key(NamedTuple):
    """One readable (tenant, key, medium)."""
    tenant: str
    key: str
    medium: str


@dataclass(frozen=True)
class Gap:
    """Sequences the subscriber did not receive: [from_seq, to_seq); to_seq 0
    when unknown. See kvevent.Gap for the exact meaning of each flag."""
    from_seq: int = 0
    to_seq: int = 0
    #: A publisher restart was detected; the index was cleared.
    reset: bool = False
    #: Why the gap was not repaired (None without a replay endpoint); for a
    #: rebuild, why continuity was lost.
    err: Optional[BaseException] = None
    #: (snapshot_endpoint) the index was rebuilt from a fresh snapshot;
    #: reported once that snapshot is installed. Nothing is missing after it.
    rebuilt: bool = False


@dataclass
class Stats:
    """The subscriber's counters (kvevent.Stats)."""
    batches: int = 0
    events: int = 0
    replayed: int = 0
    missing_seqs: int = 0
    unrepaired: int = 0
    resets: int = 0
    reconnects: int = 0
    malformed: int = 0
    protocol_errors: int = 0
    last_seq: int = 0
    heartbeats: int = 0
    snapshots: int = 0
    snapshot_failures: int = 0
    epoch: str = ""
    synced: bool = False


# ---------------------------------------------------------------------------
# The strict msgpack reader (pkg/kvevent/reader.go)


def _type_name(c: int) -> str:
    if c <= 0x7F or c >= 0xE0 or 0xCC <= c <= 0xD3:
        return "integer"
    if c <= 0x8F or c in (0xDE, 0xDF):
        return "map"
    if c <= 0x9F or c in (0xDC, 0xDD):
        return "array"
    if c <= 0xBF or 0xD9 <= c <= 0xDB:
        return "string"
    if c == 0xC0:
        return "nil"
    if c in (0xC2, 0xC3):
        return "bool"
    if 0xC4 <= c <= 0xC6:
        return "binary"
    if c in (0xCA, 0xCB):
        return "float"
    if c == 0xC1:
        return "never-used byte 0xc1"
    return "extension"


class _Reader:
    """A bounds-checked msgpack cursor over bytes."""

    __slots__ = ("b", "off", "n")

    def __init__(self, b: bytes):
        self.b = b
        self.off = 0
        self.n = len(b)

    def _need(self, k: int) -> None:
        if k < 0 or self.n - self.off < k:
            raise MalformedError("truncated at byte %d (need %d more)" % (self.off, k))

    def _be(self, k: int) -> int:
        off = self.off
        if self.n - off < k:
            raise MalformedError("truncated at byte %d (need %d more)" % (off, k))
        self.off = off + k
        return int.from_bytes(self.b[off:off + k], "big")

    def _byte(self) -> int:
        off = self.off
        if off >= self.n:
            raise MalformedError("truncated at byte %d (need 1 more)" % off)
        self.off = off + 1
        return self.b[off]

    def nil_next(self) -> bool:
        """Consumes a nil if one is next."""
        if self.off < self.n and self.b[self.off] == 0xC0:
            self.off += 1
            return True
        return False

    def uint(self, maximum: int) -> int:
        """A non-negative integer <= maximum in any msgpack integer encoding."""
        c = self._byte()
        if c <= 0x7F:
            v = c
        elif c >= 0xE0:
            raise MalformedError("negative integer %d" % (c - 0x100))
        elif 0xCC <= c <= 0xCF:
            v = self._be(1 << (c - 0xCC))
        elif 0xD0 <= c <= 0xD3:
            size = 1 << (c - 0xD0)
            v = self._be(size)
            if v >> (size * 8 - 1):
                raise MalformedError("negative integer")
        else:
            raise MalformedError("got %s, want a non-negative integer" % _type_name(c))
        if v > maximum:
            raise MalformedError("integer %d out of range (max %d)" % (v, maximum))
        return v

    def raw_str(self) -> bytes:
        """A msgpack str (never bin), as bytes."""
        off = self.off
        if off >= self.n:
            raise MalformedError("truncated at byte %d (need 1 more)" % off)
        c = self.b[off]
        if 0xA0 <= c <= 0xBF:
            k = c & 0x1F
            off += 1
        elif c == 0xD9:
            self.off = off + 1
            k = self._be(1)
            off = self.off
        elif c == 0xDA:
            self.off = off + 1
            k = self._be(2)
            off = self.off
        elif c == 0xDB:
            self.off = off + 1
            k = self._be(4)
            off = self.off
        else:
            raise MalformedError("got %s, want a string" % _type_name(c))
        end = off + k
        if end > self.n:
            self.off = off
            raise MalformedError("truncated at byte %d (need %d more)" % (off, k))
        self.off = end
        return self.b[off:end]

    def str(self) -> str:
        return self.raw_str().decode("utf-8", "surrogateescape")

    def nullable_str(self) -> Optional[str]:
        if self.nil_next():
            return None
        return self.str()

    def _coll_len(self, fix: int, c16: int, c32: int, what: str) -> int:
        c = self._byte()
        if c & 0xF0 == fix:
            k = c & 0x0F
        elif c == c16:
            k = self._be(2)
        elif c == c32:
            k = self._be(4)
        else:
            raise MalformedError("got %s, want %s" % (_type_name(c), what))
        # Every element takes at least one byte: a length beyond the
        # remaining bytes is a lie, rejected before anything is built for it.
        if k > self.n - self.off:
            raise MalformedError("%s of %d elements in %d remaining bytes" % (what, k, self.n - self.off))
        return k

    def array_len(self) -> int:
        return self._coll_len(0x90, 0xDC, 0xDD, "an array")

    def map_len(self) -> int:
        return self._coll_len(0x80, 0xDE, 0xDF, "a map")

    def skip(self, depth: int = 0) -> None:
        """Consumes one value of any type (iteratively: no recursion limit is
        involved; nesting is bounded by _MAX_DEPTH as in Go)."""
        # Each stack entry is the number of values still to skip at that level.
        stack = [1]
        while stack:
            if stack[-1] == 0:
                stack.pop()
                continue
            stack[-1] -= 1
            level = depth + len(stack) - 1
            if level > _MAX_DEPTH:
                raise MalformedError("nesting deeper than %d" % _MAX_DEPTH)
            c = self._byte()
            k = 0
            if c <= 0x7F or c >= 0xE0 or c in (0xC0, 0xC2, 0xC3):
                continue
            elif c <= 0x8F:
                stack.append(2 * (c & 0x0F))
                continue
            elif c <= 0x9F:
                stack.append(c & 0x0F)
                continue
            elif c <= 0xBF:
                k = c & 0x1F
            elif c in (0xC4, 0xD9):
                k = self._be(1)
            elif c in (0xC5, 0xDA):
                k = self._be(2)
            elif c in (0xC6, 0xDB):
                k = self._be(4)
            elif c in (0xC7, 0xC8, 0xC9):
                k = self._be(1 << (c - 0xC7)) + 1  # the ext type byte
            elif c == 0xCA:
                k = 4
            elif c == 0xCB:
                k = 8
            elif 0xCC <= c <= 0xD3:
                k = 1 << ((c - 0xCC) & 3)
            elif 0xD4 <= c <= 0xD8:
                k = 1 + (1 << (c - 0xD4))
            elif c in (0xDC, 0xDD, 0xDE, 0xDF):
                m = self._be(2 << ((c - 0xDC) & 1))
                if c >= 0xDE:
                    m *= 2
                if m > self.n - self.off:
                    raise MalformedError("collection of %d elements in %d remaining bytes" % (m, self.n - self.off))
                stack.append(m)
                continue
            else:
                raise MalformedError("got %s" % _type_name(c))
            if k > self.n - self.off:
                raise MalformedError("truncated value")
            self.off += k


# ---------------------------------------------------------------------------
# The strict decoder (pkg/kvevent/decode.go)

_FIELDS = (
    "event_id", "timestamp", "event_type", "model_name", "block_size",
    "additional_salt", "lora_name", "tenant_id", "backend_id", "medium",
    "dp_rank", "type", "group_id", "object_key", "seq_hashes",
    "base_block_idx", "parent_hash", "token_ids", "block_hashes",
    "parent_block_hash",
)
(_F_EVENT_ID, _F_TIMESTAMP, _F_EVENT_TYPE, _F_MODEL_NAME, _F_BLOCK_SIZE,
 _F_ADDITIONAL_SALT, _F_LORA_NAME, _F_TENANT_ID, _F_BACKEND_ID, _F_MEDIUM,
 _F_DP_RANK, _F_TYPE, _F_GROUP_ID, _F_OBJECT_KEY, _F_SEQ_HASHES,
 _F_BASE_BLOCK_IDX, _F_PARENT_HASH, _F_TOKEN_IDS, _F_BLOCK_HASHES,
 _F_PARENT_BLOCK_HASH) = range(len(_FIELDS))
_NUM_FIELDS = len(_FIELDS)
# How each field's value is read.
_K_UINT = 0    # a non-negative integer up to _FIELD_MAX[f]
_K_NSTR = 1    # a string or nil
_K_STR = 2     # a string
_K_NIL = 3     # nil only
_K_EMPTY = 4   # an empty array only
_K_ENUM = 5    # a string from _ENUMS[f] (medium: or nil)
_K_RAW = 6     # a string kept as bytes (the legacy "type")
_K_BLOCK = 7   # block_size: nil or 1..2^32-1
_FIELD_KIND = {
    _F_EVENT_ID: _K_UINT, _F_TIMESTAMP: _K_UINT, _F_DP_RANK: _K_UINT,
    _F_MODEL_NAME: _K_NSTR, _F_ADDITIONAL_SALT: _K_NSTR, _F_LORA_NAME: _K_NSTR, _F_GROUP_ID: _K_NSTR,
    _F_TENANT_ID: _K_STR, _F_BACKEND_ID: _K_STR, _F_OBJECT_KEY: _K_STR,
    _F_BASE_BLOCK_IDX: _K_NIL, _F_PARENT_HASH: _K_NIL, _F_TOKEN_IDS: _K_NIL, _F_PARENT_BLOCK_HASH: _K_NIL,
    _F_SEQ_HASHES: _K_EMPTY, _F_BLOCK_HASHES: _K_EMPTY,
    _F_EVENT_TYPE: _K_ENUM, _F_MEDIUM: _K_ENUM, _F_TYPE: _K_RAW, _F_BLOCK_SIZE: _K_BLOCK,
}
# key bytes -> (field, its bit, its kind)
_FIELD_BY_NAME = {name.encode(): (i, 1 << i, _FIELD_KIND[i]) for i, name in enumerate(_FIELDS)}


def _set_of(*fs: int) -> int:
    s = 0
    for f in fs:
        s |= 1 << f
    return s


def _names(s: int) -> str:
    return ",".join(name for i, name in enumerate(_FIELDS) if s >> i & 1)


_ENVELOPE_SET = _set_of(_F_EVENT_ID, _F_TIMESTAMP, _F_EVENT_TYPE, _F_MODEL_NAME, _F_BLOCK_SIZE,
                        _F_ADDITIONAL_SALT, _F_LORA_NAME, _F_TENANT_ID, _F_BACKEND_ID, _F_MEDIUM, _F_DP_RANK)
_REMOVED_SET = _ENVELOPE_SET | _set_of(_F_GROUP_ID, _F_OBJECT_KEY, _F_SEQ_HASHES, _F_BASE_BLOCK_IDX)
_STORED_SET = _REMOVED_SET | _set_of(_F_PARENT_HASH, _F_TOKEN_IDS)
# (event_type, legacy) -> the exact field set.
_EXPECTED = {
    (STORED, False): _STORED_SET,
    (STORED, True): _STORED_SET | _set_of(_F_TYPE, _F_BLOCK_HASHES, _F_PARENT_BLOCK_HASH),
    (REMOVED, False): _REMOVED_SET,
    (REMOVED, True): _REMOVED_SET | _set_of(_F_TYPE, _F_BLOCK_HASHES),
    (CLEARED, False): _ENVELOPE_SET,
    (CLEARED, True): _ENVELOPE_SET | _set_of(_F_TYPE),
}
_LEGACY_NAME = {STORED: b"BlockStored", REMOVED: b"BlockRemoved", CLEARED: b"AllBlocksCleared"}
_EVENT_TYPES = {b"stored": STORED, b"removed": REMOVED, b"cleared": CLEARED}
_MEDIA = {b"cpu": CPU, b"disk": DISK}
_ENUMS = {_F_EVENT_TYPE: _EVENT_TYPES, _F_MEDIUM: _MEDIA}
_FIELD_MAX = {_F_EVENT_ID: _MAX_U64, _F_TIMESTAMP: _MAX_I64, _F_DP_RANK: _MAX_U32}
_BIT_TYPE = 1 << _F_TYPE
# medium was nil on the wire (None means the key was absent).
_NIL_MEDIUM = object()

# Rules DecodePayload applies to the event array.
_KIND_LIVE = 0           # 1..64 events with increasing event ids (the contract)
_KIND_HEARTBEAT_OK = 1   # _KIND_LIVE, or no events at all (snapshot format)
_KIND_CHUNK = 2          # a snapshot chunk: 1..64 stored events with event_id 0


def _frame_bytes(f) -> bytes:
    """bytes of a frame given as bytes, bytearray, memoryview or zmq.Frame."""
    if type(f) is bytes:
        return f
    if hasattr(f, "bytes"):  # zmq.Frame
        return f.bytes
    return bytes(f)


def decode_seq(b) -> int:
    """A Mooncake-format sequence frame: exactly 8 bytes, big-endian."""
    b = _frame_bytes(b)
    if len(b) != 8:
        raise MalformedError("sequence frame has %d bytes, want 8" % len(b))
    return int.from_bytes(b, "big")


def decode_seq_frame(b) -> tuple:
    """(seq, epoch) from a sequence frame of either format: 8 bytes (epoch
    None) or 24 bytes, the sequence and the 16-byte publisher epoch."""
    b = _frame_bytes(b)
    if len(b) == 8:
        return int.from_bytes(b, "big"), None
    if len(b) == 8 + EPOCH_LEN:
        return int.from_bytes(b[:8], "big"), b[8:]
    raise MalformedError("sequence frame has %d bytes, want 8 (or 24 with an epoch)" % len(b))


def put_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame."""
    return seq.to_bytes(8, "big")


def put_seq_epoch(seq: int, epoch: bytes) -> bytes:
    """The 24-byte sequence frame of the snapshot stream format."""
    if len(epoch) != EPOCH_LEN:
        raise ValueError("epoch has %d bytes, want %d" % (len(epoch), EPOCH_LEN))
    return seq.to_bytes(8, "big") + bytes(epoch)


class Decoder:
    """The contract's strict decoder. Not thread-safe (it remembers the last
    epoch, as Go's does); use one per thread.

    ``allow_unknown_keys`` accepts (and skips) event keys the contract does
    not define. ``allow_empty`` makes :meth:`decode_payload` accept an empty
    event array (a heartbeat) where no sequence frame tells the format.
    ``topic`` is the topic frame the stream carries (bytes or str): empty in
    the Mooncake format; in the snapshot format the gateway's ``--topic``.
    """

    def __init__(self, allow_unknown_keys: bool = False, allow_empty: bool = False, topic=b""):
        self.allow_unknown_keys = allow_unknown_keys
        self.allow_empty = allow_empty
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._epoch: Optional[bytes] = None

    def _intern_epoch(self, epoch: bytes) -> bytes:
        if self._epoch != epoch:
            self._epoch = bytes(epoch)
        return self._epoch

    def decode_message(self, frames: Sequence) -> Batch:
        """Decodes the three frames of one PUB message: topic, sequence frame,
        payload. Mooncake format (8-byte sequence): the sequence is neither 0
        nor the end marker and the payload holds 1 to 64 events. Snapshot
        format (24 bytes, with the epoch): 0 is allowed, a heartbeat (no
        events) too, and ``Batch.epoch`` is set."""
        if len(frames) != 3:
            raise MalformedError("got %d frames, want 3 (topic, seq, payload)" % len(frames))
        topic = _frame_bytes(frames[0])
        if topic != self.topic:
            raise MalformedError("topic frame %r, want %r" % (topic, self.topic))
        seq, epoch = decode_seq_frame(frames[1])
        if seq == END_SEQ or (seq == 0 and epoch is None):
            raise MalformedError("sequence %#x is not a publishable sequence" % seq)
        b = self._decode_payload(seq, _frame_bytes(frames[2]), _KIND_LIVE if epoch is None else _KIND_HEARTBEAT_OK)
        if epoch is not None:
            b.epoch = self._intern_epoch(epoch)
        return b

    def decode_payload(self, seq: int, payload) -> Batch:
        """Decodes ``[timestamp_ms, [event_map, ...], dp_rank]``: exactly one
        msgpack value, no trailing bytes, 1..64 events (0 too with
        ``allow_empty``), each with exactly its type's field set."""
        return self._decode_payload(seq, _frame_bytes(payload), _KIND_HEARTBEAT_OK if self.allow_empty else _KIND_LIVE)

    def _decode_payload(self, seq: int, payload: bytes, kind: int) -> Batch:
        if _unpackb is not None and not self.allow_unknown_keys:
            b = _decode_payload_fast(seq, payload, kind)
            if b is not None:
                return b
        return self._decode_payload_strict(seq, payload, kind)

    def _decode_payload_strict(self, seq: int, payload: bytes, kind: int) -> Batch:
        r = _Reader(payload)
        try:
            n = r.array_len()
        except MalformedError as e:
            raise MalformedError("payload: %s" % e) from None
        if n != 3:
            raise MalformedError("payload array has %d elements, want 3" % n)
        try:
            ts = r.uint(_MAX_I64)
        except MalformedError as e:
            raise MalformedError("timestamp_ms: %s" % e) from None
        try:
            nev = r.array_len()
        except MalformedError as e:
            raise MalformedError("events: %s" % e) from None
        if not (nev == 0 and kind == _KIND_HEARTBEAT_OK) and (nev == 0 or nev > MAX_EVENTS_PER_BATCH):
            raise MalformedError("events array has %d events, want 1..%d" % (nev, MAX_EVENTS_PER_BATCH))
        events = []
        prev_id = -1
        for i in range(nev):
            try:
                ev = self._decode_event(r)
            except MalformedError as e:
                raise MalformedError("event %d: %s" % (i, e)) from None
            if ev.timestamp != ts:
                raise MalformedError("event %d: timestamp %d differs from the batch's %d" % (i, ev.timestamp, ts))
            if kind == _KIND_CHUNK:
                if ev.type != STORED or ev.id != 0:
                    raise MalformedError("event %d: %s event with event_id %d in a snapshot chunk, want stored with event_id 0"
                                         % (i, ev.type, ev.id))
            elif i > 0 and ev.id <= prev_id:
                raise MalformedError("event %d: event_id %d not above the previous %d" % (i, ev.id, prev_id))
            prev_id = ev.id
            events.append(ev)
        try:
            dp = r.uint(_MAX_U32)
        except MalformedError as e:
            raise MalformedError("dp_rank: %s" % e) from None
        if r.off != r.n:
            raise MalformedError("%d trailing bytes after the payload" % (r.n - r.off))
        return Batch(seq=seq, timestamp=ts, dp_rank=dp, events=events)

    def _decode_event(self, r: _Reader) -> Event:
        # One pass over the map. Each field is read by its kind; the common
        # encodings (nil, fixstr, positive fixint, fixarray) are read inline,
        # everything else through the reader, which reports what is wrong.
        n = r.map_len()
        b = r.b
        blen = r.n
        vals = [None] * _NUM_FIELDS
        seen = 0
        for _ in range(n):
            # Keys: almost always a fixstr that fits.
            off = r.off
            c = b[off] if off < blen else -1
            if 0xA0 <= c <= 0xBF and off + 1 + (c & 0x1F) <= blen:
                end = off + 1 + (c & 0x1F)
                k = b[off + 1:end]
                r.off = end
            else:
                try:
                    k = r.raw_str()
                except MalformedError as e:
                    raise MalformedError("map key: %s" % e) from None
            ent = _FIELD_BY_NAME.get(k)
            if ent is None:
                if not self.allow_unknown_keys:
                    raise MalformedError("unknown key %r" % k.decode("utf-8", "surrogateescape"))
                try:
                    r.skip(0)
                except MalformedError as e:
                    raise MalformedError("%r: %s" % (k.decode("utf-8", "surrogateescape"), e)) from None
                continue
            f, bit, kind = ent
            if seen & bit:
                raise MalformedError("duplicate key %r" % k.decode())
            seen |= bit
            off = r.off
            c = b[off] if off < blen else -1
            try:
                if kind == _K_NSTR or kind == _K_STR:
                    if c == 0xC0 and kind == _K_NSTR:
                        r.off = off + 1
                    elif 0xA0 <= c <= 0xBF and off + 1 + (c & 0x1F) <= blen:
                        end = off + 1 + (c & 0x1F)
                        vals[f] = b[off + 1:end].decode("utf-8", "surrogateescape")
                        r.off = end
                    else:
                        vals[f] = r.str()
                elif kind == _K_NIL:
                    if c != 0xC0:
                        raise MalformedError("want nil")
                    r.off = off + 1
                elif kind == _K_UINT:
                    if 0 <= c <= 0x7F:
                        vals[f] = c
                        r.off = off + 1
                    else:
                        vals[f] = r.uint(_FIELD_MAX[f])
                elif kind == _K_EMPTY:
                    if c == 0x90:
                        r.off = off + 1
                    else:
                        m = r.array_len()
                        if m != 0:
                            raise MalformedError("array of %d, want [] (keys are never interpreted)" % m)
                elif kind == _K_ENUM:
                    if c == 0xC0 and f == _F_MEDIUM:
                        r.off = off + 1
                        vals[f] = _NIL_MEDIUM
                    else:
                        raw = r.raw_str()
                        v = _ENUMS[f].get(raw)
                        if v is None:
                            if f == _F_EVENT_TYPE:
                                raise MalformedError("unknown event_type %r" % raw.decode("utf-8", "surrogateescape"))
                            raise MalformedError("%r, want cpu, disk or nil" % raw.decode("utf-8", "surrogateescape"))
                        vals[f] = v
                elif kind == _K_RAW:  # the legacy "type"
                    vals[f] = r.raw_str()
                else:  # _K_BLOCK: block_size, nil or 1..2^32-1
                    if c == 0xC0:
                        r.off = off + 1
                    else:
                        v = r.uint(_MAX_U32)
                        if v == 0:
                            raise MalformedError("0, want nil for an unset block size")
                        vals[f] = v
            except MalformedError as e:
                raise MalformedError("%s: %s" % (_FIELDS[f], e)) from None
        ev_type = vals[_F_EVENT_TYPE]
        if ev_type is None:
            raise MalformedError("missing key event_type")
        legacy = bool(seen & _BIT_TYPE)
        want = _EXPECTED[(ev_type, legacy)]
        if seen != want:
            missing = want & ~seen
            if missing:
                raise MalformedError("%s event: missing keys %s" % (ev_type, _names(missing)))
            raise MalformedError("%s event: unexpected keys %s" % (ev_type, _names(seen & ~want)))
        if legacy and vals[_F_TYPE] != _LEGACY_NAME[ev_type]:
            raise MalformedError("type %r does not match event_type %r"
                                 % (vals[_F_TYPE].decode("utf-8", "surrogateescape"), ev_type))
        medium = vals[_F_MEDIUM]
        if ev_type == CLEARED:
            if medium is not _NIL_MEDIUM:
                raise MalformedError("cleared event with medium %s, want nil" % medium)
            medium = None
        elif medium is _NIL_MEDIUM:
            raise MalformedError("%s event with nil medium" % ev_type)
        return Event(vals[_F_EVENT_ID], vals[_F_TIMESTAMP], ev_type, vals[_F_TENANT_ID], vals[_F_OBJECT_KEY],
                     medium, vals[_F_GROUP_ID],
                     Envelope(vals[_F_BACKEND_ID], vals[_F_MODEL_NAME], vals[_F_ADDITIONAL_SALT],
                              vals[_F_LORA_NAME], vals[_F_BLOCK_SIZE], vals[_F_DP_RANK]), legacy)

    def decode_snapshot_reply(self, frames: Sequence) -> Snapshot:
        """Decodes the frames of a snapshot reply after the REQ envelope:
        cut (int64 BE, signed), epoch (16 bytes), then chunks. A cut of -2
        raises :class:`SnapshotUnavailable`; any other violation
        :class:`MalformedError`."""
        if len(frames) < 2:
            raise MalformedError("snapshot reply has %d frames, want at least 2 (cut, epoch)" % len(frames))
        cut_f, epoch = _frame_bytes(frames[0]), _frame_bytes(frames[1])
        if len(cut_f) != 8:
            raise MalformedError("snapshot cut frame has %d bytes, want 8" % len(cut_f))
        if len(epoch) != EPOCH_LEN:
            raise MalformedError("snapshot epoch frame has %d bytes, want %d" % (len(epoch), EPOCH_LEN))
        cut = int.from_bytes(cut_f, "big", signed=True)
        chunks = frames[2:]
        if cut == CUT_UNAVAILABLE and not chunks:
            raise SnapshotUnavailable("snapshot unavailable (publisher epoch %s)" % epoch.hex())
        if cut < CUT_NONE:
            raise MalformedError("snapshot cut %d (with %d chunks)" % (cut, len(chunks)))
        if cut == CUT_NONE and chunks:
            raise MalformedError("snapshot cut -1 (nothing published) with %d chunks" % len(chunks))
        snap = Snapshot(cut=cut, epoch=bytes(epoch), batches=[])
        for i, c in enumerate(chunks):
            try:
                b = self._decode_payload(cut & _MAX_U64, _frame_bytes(c), _KIND_CHUNK)
            except MalformedError as e:
                raise MalformedError("snapshot chunk %d: %s" % (i, e)) from None
            b.epoch, b.snapshot = snap.epoch, True
            snap.batches.append(b)
        return snap


# The fast path: msgpack's C unpacker parses, Python checks the result
# against the contract. It only ever *accepts*: on any doubt it returns None
# and the strict reader above decides (and explains the rejection). It
# accepts nothing the strict reader rejects, and decodes what it accepts to
# the same values (test_events_decode.py checks both on every vector and on
# thousands of mutations; the strict reader is checked against Go).
try:  # Debian: python3-msgpack
    from msgpack import unpackb as _unpackb
except ImportError:  # the strict reader alone is complete
    _unpackb = None

_EXPECTED_KEYS = {k: frozenset(name for i, name in enumerate(_FIELDS) if v >> i & 1) for k, v in _EXPECTED.items()}
_LEGACY_STR = {t: n.decode() for t, n in _LEGACY_NAME.items()}
_MEDIA_STR = (CPU, DISK)


# The fast path builds Python objects before it checks them: it takes only
# payloads this small (a full batch of 64 events with 100-byte keys is about
# 25 KiB), so that what a hostile payload can make it allocate stays small;
# no array may exceed 64 elements and no map 20 pairs (the largest event),
# so that one byte of input makes at most a few objects.
_FAST_MAX_PAYLOAD = 256 << 10


def _decode_payload_fast(seq: int, payload: bytes, kind: int) -> Optional[Batch]:
    if len(payload) > _FAST_MAX_PAYLOAD:
        return None
    try:
        # A map arrives as a tuple of pairs (object_pairs_hook=tuple), so a
        # repeated key cannot hide in a dict.
        top = _unpackb(payload, raw=False, unicode_errors="surrogateescape", strict_map_key=True,
                       object_pairs_hook=tuple, use_list=True, max_array_len=MAX_EVENTS_PER_BATCH,
                       max_map_len=_NUM_FIELDS, max_ext_len=0, max_bin_len=0)
    except Exception:
        return None
    if type(top) is not list or len(top) != 3:
        return None
    ts, evs, dp = top
    if (type(ts) is not int or ts < 0 or ts > _MAX_I64 or type(dp) is not int or dp < 0 or dp > _MAX_U32
            or type(evs) is not list):
        return None
    nev = len(evs)
    if nev > MAX_EVENTS_PER_BATCH or (nev == 0 and kind != _KIND_HEARTBEAT_OK):
        return None
    out = []
    prev = -1
    str_ = str
    int_ = int
    for pairs in evs:
        if type(pairs) is not tuple:
            return None
        d = dict(pairs)
        if len(d) != len(pairs):
            return None
        t = d.get("event_type")
        if t != STORED and t != REMOVED and t != CLEARED or type(t) is not str_:
            return None
        legacy = "type" in d
        if d.keys() != _EXPECTED_KEYS[(t, legacy)]:
            return None
        ev_id = d["event_id"]
        if type(ev_id) is not int_ or ev_id < 0 or ev_id > _MAX_U64:
            return None
        if d["timestamp"] != ts or type(d["timestamp"]) is not int_:
            return None
        model, salt, lora = d["model_name"], d["additional_salt"], d["lora_name"]
        if ((model is not None and type(model) is not str_) or (salt is not None and type(salt) is not str_)
                or (lora is not None and type(lora) is not str_)):
            return None
        bs = d["block_size"]
        if bs is not None and (type(bs) is not int_ or bs < 1 or bs > _MAX_U32):
            return None
        tenant, backend, rank = d["tenant_id"], d["backend_id"], d["dp_rank"]
        if type(tenant) is not str_ or type(backend) is not str_ or type(rank) is not int_ or rank < 0 or rank > _MAX_U32:
            return None
        medium = d["medium"]
        if legacy and d["type"] != _LEGACY_STR[t]:
            return None
        if t == CLEARED:
            if medium is not None:
                return None
            key = group = None
        else:
            if medium not in _MEDIA_STR or type(medium) is not str_:
                return None
            key, group = d["object_key"], d["group_id"]
            if type(key) is not str_ or (group is not None and type(group) is not str_):
                return None
            if d["seq_hashes"] != [] or type(d["seq_hashes"]) is not list or d["base_block_idx"] is not None:
                return None
            if legacy and (d["block_hashes"] != [] or type(d["block_hashes"]) is not list):
                return None
            if t == STORED and (d["parent_hash"] is not None or d["token_ids"] is not None
                                or (legacy and d["parent_block_hash"] is not None)):
                return None
        if kind == _KIND_CHUNK:
            if t != STORED or ev_id != 0:
                return None
        elif ev_id <= prev:
            return None
        prev = ev_id
        out.append(Event(ev_id, ts, t, tenant, key, medium, group,
                         Envelope(backend, model, salt, lora, bs, rank), legacy))
    return Batch(seq=seq, timestamp=ts, dp_rank=dp, events=out)


def decode_message(frames: Sequence) -> Batch:
    """Decodes one PUB message with a fresh strict :class:`Decoder`."""
    return Decoder().decode_message(frames)


def decode_snapshot_reply(frames: Sequence) -> Snapshot:
    """Decodes a snapshot reply with a fresh strict :class:`Decoder`."""
    return Decoder().decode_snapshot_reply(frames)


# ---------------------------------------------------------------------------
# The index (pkg/kvevent/index.go)


class Index:
    """The set of readable (tenant, key, medium) a stream describes, with each
    entry's group. Applying every event of a gap-free stream in order yields
    the publisher's readable set. Thread-safe."""

    def __init__(self):
        # _mu guards _tenants and _n.
        self._mu = threading.Lock()
        self._tenants: dict = {}
        self._n = 0

    def apply(self, ev: Event) -> None:
        """stored adds (idempotent), removed deletes (idempotent), cleared
        drops the tenant."""
        with self._mu:
            self._apply_locked(ev)

    def apply_batch(self, b: Batch) -> None:
        """Applies every event of b in order under one lock."""
        with self._mu:
            for ev in b.events:
                self._apply_locked(ev)

    def _apply_locked(self, ev: Event) -> None:
        t = ev.type
        if t == STORED:
            m = self._tenants.get(ev.tenant)
            if m is None:
                m = self._tenants[ev.tenant] = {}
            k = (ev.key, ev.medium)
            if k not in m:
                self._n += 1
            m[k] = ev.group_id
        elif t == REMOVED:
            m = self._tenants.get(ev.tenant)
            if m is not None and m.pop((ev.key, ev.medium), _ABSENT) is not _ABSENT:
                self._n -= 1
                if not m:
                    del self._tenants[ev.tenant]
        elif t == CLEARED:
            m = self._tenants.pop(ev.tenant, None)
            if m:
                self._n -= len(m)

    def clear(self) -> None:
        with self._mu:
            self._tenants.clear()
            self._n = 0

    def __len__(self) -> int:
        with self._mu:
            return self._n

    def has(self, tenant: str, key: str, medium: str) -> bool:
        """Whether (tenant, key, medium) is readable."""
        with self._mu:
            return (key, medium) in self._tenants.get(tenant, ())

    def __contains__(self, k) -> bool:
        tenant, key, medium = k
        return self.has(tenant, key, medium)

    def group(self, tenant: str, key: str, medium: str, default=None):
        """The entry's group_id (None when nil), or default when absent."""
        with self._mu:
            return self._tenants.get(tenant, {}).get((key, medium), default)

    def media(self, tenant: str, key: str) -> list:
        """The media (CPU before DISK) on which the object is readable."""
        with self._mu:
            m = self._tenants.get(tenant)
            if not m:
                return []
            return [md for md in (CPU, DISK) if (key, md) in m]

    def keys(self) -> list:
        """Every entry, sorted by tenant, key, medium."""
        with self._mu:
            out = [Key(t, k, md) for t, m in self._tenants.items() for (k, md) in m]
        out.sort()
        return out


_ABSENT = object()


# ---------------------------------------------------------------------------
# ZMQ exchanges: replay and snapshot (pkg/kvevent/replay.go, snapshot.go)

_DEFAULT_MAX_FRAME = 64 << 20
# How often a wait looks at close() (the subscriber's loop when idle, replays).
_TICK = 0.1
_MAX_LIVE_FRAMES = 8  # a live message has 3 (replay replies 4): more is a protocol error


def _zmq():
    import zmq  # Debian: python3-zmq
    return zmq


def _recv_frames(sock, max_frames: int, max_bytes: int, flags: int = 0) -> list:
    """Receives one multipart message frame by frame, keeping at most
    max_frames frames and max_bytes bytes; past either the rest of the
    message is drained and ProtocolError raised."""
    zmq = _zmq()
    frames = []
    total = 0
    err = None
    while True:
        f = sock.recv(flags, copy=True)
        flags &= ~zmq.NOBLOCK  # the rest of a message is already there
        if err is None:
            total += len(f)
            if len(frames) >= max_frames:
                err = ProtocolError("message has more than %d frames" % max_frames)
            elif total > max_bytes:
                err = ProtocolError("message larger than %d bytes" % max_bytes)
            else:
                frames.append(f)
        if not sock.getsockopt(zmq.RCVMORE):
            break
    if err is not None:
        raise err
    return frames


def _is_end_seq(f: bytes) -> bool:
    try:
        seq, _ = decode_seq_frame(f)
    except MalformedError:
        return False
    return seq == END_SEQ


def replay(endpoint: str, from_seq: int, *, timeout: float = 10.0, max_frame: int = _DEFAULT_MAX_FRAME,
           max_message: int = _DEFAULT_MAX_FRAME, decoder: Optional[Decoder] = None,
           context=None, _cancel: Optional[threading.Event] = None) -> Iterator[Batch]:
    """Asks the replay ROUTER at endpoint (e.g. ``tcp://gateway:5558``) for every
    retained batch from ``from_seq`` and yields each decoded batch in order
    until the end marker. Both reply dialects are understood
    (``[b"", topic, seq, payload]`` and ``[b"", seq, payload]``). The first
    batch may start after from_seq when the publisher no longer retains it.
    Leave the loop to stop early. ``timeout`` bounds the whole exchange;
    a transport failure raises :class:`ReplayError`, a bad reply
    :class:`MalformedError`."""
    zmq = _zmq()
    dec = decoder if decoder is not None else Decoder()
    ctx = context or zmq.Context.instance()
    deadline = time.monotonic() + timeout
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.connect(endpoint)
        # Queued until connected; bounded by the deadline below.
        if not sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise ReplayError("replay %s: cannot send the request within %.1fs" % (endpoint, timeout))
        sock.send_multipart([b"", put_seq(from_seq)])
        last, seen = 0, False
        while True:
            # In slices, so that a closing subscriber is not held up.
            while True:
                if _cancel is not None and _cancel.is_set():
                    raise ReplayError("replay %s: cancelled" % endpoint)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReplayError("replay %s: no answer within %.1fs" % (endpoint, timeout))
                if sock.poll(max(1, int(min(left, _TICK) * 1000)), zmq.POLLIN):
                    break
            m = _recv_frames(sock, _MAX_LIVE_FRAMES, max_message, zmq.NOBLOCK)
            if len(m) == 4 and not m[0] and m[1] == dec.topic:
                seq_f, payload = m[2], m[3]
            elif len(m) == 4 and not m[0] and not m[1] and _is_end_seq(m[2]):
                # The end marker's topic is empty whatever the stream's.
                seq_f, payload = m[2], m[3]
            elif len(m) == 3 and not m[0]:
                seq_f, payload = m[1], m[2]
            else:
                raise MalformedError('replay reply with %d frames (or another topic than %r), want [b"", topic, seq, payload] '
                                     'or [b"", seq, payload]' % (len(m), dec.topic))
            seq, epoch = decode_seq_frame(seq_f)
            if seq == END_SEQ:
                if payload:
                    raise MalformedError("replay end marker with a %d-byte payload" % len(payload))
                return
            # Sequences increase; 0 is a sequence only in the snapshot format.
            if (seq == 0 and epoch is None) or (seen and seq <= last):
                raise MalformedError("replay sequence %d after %d" % (seq, last))
            last, seen = seq, True
            kind = _KIND_HEARTBEAT_OK if (epoch is not None or dec.allow_empty) else _KIND_LIVE
            b = dec._decode_payload(seq, payload, kind)
            if epoch is not None:
                b.epoch = dec._intern_epoch(epoch)
            b.replayed = True
            yield b
    finally:
        sock.close(0)


class _SnapshotRequest:
    """One snapshot exchange on a REQ socket, pollable from a loop."""

    def __init__(self, ctx, endpoint: str, timeout: float, max_reply_bytes: int, max_frame: int,
                 max_chunks: int, decoder: Decoder):
        zmq = _zmq()
        self.endpoint, self.decoder = endpoint, decoder
        self.max_reply_bytes, self.max_chunks = max_reply_bytes, max_chunks
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, min(max_frame, max_reply_bytes))
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.connect(endpoint)
        # A REQ socket queues the request until it is connected.
        self.sock.send(b"snapshot", zmq.NOBLOCK)

    def result(self) -> Snapshot:
        """Reads the reply, which must be ready (poll the socket first)."""
        zmq = _zmq()
        frames = _recv_frames(self.sock, self.max_chunks + 2, self.max_reply_bytes, zmq.NOBLOCK)
        return self.decoder.decode_snapshot_reply(frames)

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def close(self) -> None:
        self.sock.close(0)


def fetch_snapshot(endpoint: str, *, timeout: float = 10.0, max_reply_bytes: int = 256 << 20,
                   max_frame: int = _DEFAULT_MAX_FRAME, max_chunks: int = 1 << 20,
                   decoder: Optional[Decoder] = None, context=None) -> Snapshot:
    """Asks the snapshot ROUTER at endpoint (e.g. ``tcp://gateway:5559``) for
    the publisher's state: a REQ sends ``snapshot`` and reads one reply
    ``[cut, epoch, chunk...]``. A cut of -2 raises
    :class:`SnapshotUnavailable`; a bad reply :class:`MalformedError`;
    no reply within ``timeout`` :class:`ReplayError`."""
    zmq = _zmq()
    req = _SnapshotRequest(context or zmq.Context.instance(), endpoint, timeout, max_reply_bytes,
                           max_frame, max_chunks, decoder if decoder is not None else Decoder())
    try:
        if not req.sock.poll(max(1, int(timeout * 1000)), zmq.POLLIN):
            raise ReplayError("snapshot %s: no answer within %.1fs" % (endpoint, timeout))
        return req.result()
    finally:
        req.close()


# ---------------------------------------------------------------------------
# The subscriber (pkg/kvevent/subscriber.go, subscriber_snapshot.go)


class _Backoff:
    """Jittered exponential backoff (internal/retry): each delay is drawn from
    [cur/2, cur], then cur doubles up to hi."""

    def __init__(self, lo: float, hi: float):
        self.lo = max(lo, 0.001)
        self.hi = max(hi, self.lo)
        self.cur = self.lo

    def reset(self) -> None:
        self.cur = self.lo

    def next(self) -> float:
        d = self.cur / 2 + random.random() * self.cur / 2
        self.cur = min(self.cur * 2, self.hi)
        return d


def _fingerprint(b: Batch) -> tuple:
    """Identifies a batch of one publisher process: a restarted publisher
    reusing the sequence number will not reproduce it."""
    if b.heartbeat:
        return (b.seq, b.timestamp, 0, 0, 0)
    return (b.seq, b.timestamp, b.events[0].id, b.events[-1].id, len(b.events))


# Snapshot-mode phases (subscriber_snapshot.go).
_NEED_FETCH, _FETCHING, _WAITING, _INSTALLED = range(4)


class Subscriber:
    """A live subscription to a KV event PUB socket (``kvevent.Subscribe``).

    Events are decoded strictly and applied to :attr:`index` in sequence
    order on the subscriber's own thread; ``on_batch(batch)`` and
    ``on_gap(gap)`` are called there too (an exception they raise is logged
    and ignored). Gaps are repaired through ``replay_endpoint`` when set and
    reported otherwise. ``from_seq`` (with replay_endpoint) first replays
    every retained batch from that sequence (1: since the publisher
    started). With ``snapshot_endpoint`` the index starts from the
    publisher's snapshot and is rebuilt from a fresh one whenever continuity
    is lost (an epoch change, a heartbeat timeout, the sequence going back,
    a gap replay cannot fill, a reconnect after which replay cannot prove
    the publisher continued); each rebuild is reported to on_gap with
    ``Gap.rebuilt`` set and :meth:`stats` ``.synced`` tells whether the
    index mirrors the publisher. Both stream formats are followed.

    Durations are in seconds. Use as a context manager, or call
    :meth:`start` and :meth:`close`.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: Optional[str] = None, from_seq: int = 0,
                 snapshot_endpoint: Optional[str] = None, heartbeat_timeout: float = 5.0,
                 snapshot_timeout: float = 10.0, max_snapshot_bytes: int = 256 << 20,
                 snapshot_buffer_messages: int = 4096, snapshot_buffer_bytes: int = 64 << 20,
                 rebuild_min: float = 1.0, rebuild_max: float = 30.0,
                 on_batch: Optional[Callable[[Batch], None]] = None,
                 on_gap: Optional[Callable[[Gap], None]] = None,
                 logger: Optional[logging.Logger] = None, dial_timeout: float = 5.0,
                 replay_timeout: float = 10.0, reconnect_min: float = 0.05, reconnect_max: float = 5.0,
                 max_frame: int = _DEFAULT_MAX_FRAME, max_message: int = _DEFAULT_MAX_FRAME,
                 allow_unknown_keys: bool = False, topic=b"", disable_index: bool = False,
                 rcv_hwm: int = 100_000, context=None):
        for name, ep in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint),
                         ("snapshot_endpoint", snapshot_endpoint)):
            if ep is not None and (not isinstance(ep, str) or ep.split("://", 1)[0] not in ("tcp", "ipc", "inproc")
                                   or "://" not in ep):
                raise ValueError("%s %r: want tcp://HOST:PORT" % (name, ep))
        if snapshot_endpoint and from_seq > 0:
            raise ValueError("from_seq and snapshot_endpoint exclude each other (a snapshot replaces the catch-up)")
        if from_seq < 0:
            raise ValueError("from_seq must be >= 0")
        self.endpoint = endpoint
        self._replay_ep = replay_endpoint or None
        self._snapshot_ep = snapshot_endpoint or None
        self._from_seq = from_seq
        self._hb_timeout = heartbeat_timeout if heartbeat_timeout > 0 else 5.0
        self._snapshot_timeout = snapshot_timeout if snapshot_timeout > 0 else 10.0
        self._max_snapshot_bytes = max_snapshot_bytes if max_snapshot_bytes > 0 else 256 << 20
        self._buf_msgs = snapshot_buffer_messages if snapshot_buffer_messages > 0 else 4096
        self._buf_bytes_max = snapshot_buffer_bytes if snapshot_buffer_bytes > 0 else 64 << 20
        rebuild_min = rebuild_min if rebuild_min > 0 else 1.0
        self._rebuild_backoff = _Backoff(rebuild_min, rebuild_max if rebuild_max >= rebuild_min else max(30.0, rebuild_min))
        self._dial_timeout = dial_timeout if dial_timeout > 0 else 5.0
        self._replay_timeout = replay_timeout if replay_timeout > 0 else 10.0
        self._reconnect_min = reconnect_min if reconnect_min > 0 else 0.05
        self._reconnect_max = reconnect_max if reconnect_max >= self._reconnect_min else max(5.0, self._reconnect_min)
        self._max_frame = max_frame if max_frame > 0 else _DEFAULT_MAX_FRAME
        self._max_message = max_message if max_message > 0 else _DEFAULT_MAX_FRAME
        self._allow_unknown = allow_unknown_keys
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._disable_index = disable_index
        self._rcv_hwm = rcv_hwm
        self._on_batch, self._on_gap = on_batch, on_gap
        self._lg = logger or log
        self._own_ctx = context is None
        self._ctx = context

        self.index = Index()
        self._stats = Stats()
        self._stop = threading.Event()
        self._started_ev = threading.Event()
        self._start_err: Optional[BaseException] = None
        #: Set when the subscription has stopped.
        self.done = threading.Event()
        #: Why the loop stopped on its own (an unexpected exception), else None.
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

        # Owned by the loop thread.
        self._dec = Decoder(allow_unknown_keys=allow_unknown_keys, topic=self._topic)
        self._sub = None
        self._mon = None
        self._connected = False
        self._ever_connected = False
        self._disconnected = False  # a reconnect is pending
        self._early_events: list = []  # monitor events after the first handshake, before the loop
        self._last_recv = 0.0
        self._started = False
        self._expected = 0
        self._last_event_id = 0
        self._have_id = False
        self._last_fp: tuple = (0, 0, 0, 0, 0)
        self._dup_lo = self._dup_hi = 0
        self._epoch: Optional[bytes] = None
        self._epoch_known = False
        # Snapshot mode.
        self._phase = _NEED_FETCH
        self._fetch: Optional[_SnapshotRequest] = None
        self._buf: list = []
        self._buf_bytes = 0
        self._retry_at: Optional[float] = None
        self._pending: Optional[Gap] = None
        self._installed_once = False
        self._cut = 0
        self._spliced = False
        self._live_epochs = False

    # -- public -------------------------------------------------------------

    def start(self) -> "Subscriber":
        """Connects and returns once the connection to the publisher is
        established (ConnectionError after dial_timeout)."""
        if self._thread is not None:
            return self
        zmq = _zmq()
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._main, name="crescent-events", daemon=True)
        self._thread.start()
        self._started_ev.wait()
        if self._start_err is not None:
            self._thread.join()
            raise self._start_err
        return self

    def close(self) -> None:
        """Stops the subscription and waits for its thread. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "Subscriber":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> Stats:
        """A copy of the counters."""
        s = self._stats
        return Stats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def wait(self, predicate: Callable[["Subscriber"], bool], timeout: float) -> bool:
        """Polls predicate(self) until it holds or timeout passes (a helper for
        tests and start-up code); returns the last answer."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self):
                return True
            if time.monotonic() >= deadline or self.done.is_set():
                return predicate(self)
            self.done.wait(0.02)

    # -- socket handling ----------------------------------------------------

    def _open(self) -> None:
        zmq = _zmq()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        sub.setsockopt(zmq.RCVHWM, self._rcv_hwm)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(self._reconnect_min * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self._reconnect_max * 1000)))
        # Subscribe to every topic (the stream's topic is checked per message).
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        sub.connect(self.endpoint)
        self._sub, self._mon = sub, mon
        self._connected = False
        self._last_recv = time.monotonic()

    def _close_sockets(self) -> None:
        if self._sub is not None:
            try:
                self._sub.disable_monitor()
            except Exception:  # already closed context, nothing to stop
                pass
            self._mon.close(0)
            self._sub.close(0)
            self._sub = self._mon = None
        self._connected = False

    def _reopen(self, why: str) -> None:
        """Drops the connection and dials again (Go: close, then dial with
        backoff; libzmq does the backoff)."""
        self._lg.warning("kv event subscription lost; reconnecting: %s", why)
        self._close_sockets()
        self._open()
        self._disconnected = True

    def _monitor_events(self) -> list:
        from zmq.utils.monitor import recv_monitor_message
        zmq = _zmq()
        out = []
        while True:
            try:
                out.append(recv_monitor_message(self._mon, zmq.NOBLOCK)["event"])
            except zmq.Again:
                return out

    def _main(self) -> None:
        zmq = _zmq()
        try:
            self._open()
            deadline = time.monotonic() + self._dial_timeout
            while not self._connected:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise ConnectionError("subscribe %s: not connected within %.1fs" % (self.endpoint, self._dial_timeout))
                if self._mon.poll(max(1, int(min(left, _TICK) * 1000)), zmq.POLLIN):
                    for ev in self._monitor_events():
                        if self._connected:
                            # After the handshake (a disconnect, say): the
                            # loop's business.
                            self._early_events.append(ev)
                        elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            self._connected = self._ever_connected = True
                        elif ev == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                            self._stats.protocol_errors += 1
        except BaseException as e:  # report to start()
            self._start_err = e
            self._close_sockets()
            self._term()
            self.done.set()
            self._started_ev.set()
            return
        self._started_ev.set()
        try:
            self._loop()
        except BaseException as e:
            self.error = e
            self._lg.exception("kv event subscriber stopped")
        finally:
            if self._fetch is not None:
                self._fetch.close()
                self._fetch = None
            self._close_sockets()
            self._term()
            self.done.set()

    def _term(self) -> None:
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _loop(self) -> None:
        zmq = _zmq()
        snap_mode = self._snapshot_ep is not None
        if snap_mode:
            self._connected_hook(first=True)
        elif self._from_seq > 0 and self._replay_ep:
            self._catch_up(self._from_seq)
        for ev in self._early_events:
            if self._on_monitor(ev):
                break
        self._early_events = []
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = _TICK
            hb_due = self._live_epochs if snap_mode else self._epoch is not None
            if hb_due:
                timeout = min(timeout, self._last_recv + self._hb_timeout - now)
            if snap_mode and self._connected and self._retry_at is not None:
                timeout = min(timeout, self._retry_at - now)
            if self._fetch is not None:
                timeout = min(timeout, self._fetch.deadline - now)
            poller = zmq.Poller()
            poller.register(self._mon, zmq.POLLIN)
            poller.register(self._sub, zmq.POLLIN)
            if self._fetch is not None:
                poller.register(self._fetch.sock, zmq.POLLIN)
            ready = dict(poller.poll(max(0, int(timeout * 1000))))
            if self._mon in ready:
                for ev in self._monitor_events():
                    if self._on_monitor(ev):
                        break  # the socket was replaced: the rest is the old one's
            if self._sub in ready:
                self._drain_sub()
            if self._fetch is not None and (self._fetch.sock in ready or self._fetch.expired()):
                self._fetch_done()
            now = time.monotonic()
            if snap_mode and self._connected and self._retry_at is not None and now >= self._retry_at:
                self._retry_at = None
                self._start_fetch()
            hb_due = self._live_epochs if snap_mode else self._epoch is not None
            # Not silence if the loop itself was busy (a replay) while
            # messages waited.
            if hb_due and now - self._last_recv >= self._hb_timeout and not self._sub.poll(0):
                err = ReplayError("nothing received for %.1fs (heartbeat timeout)" % self._hb_timeout)
                if snap_mode:
                    # The publisher is gone or the connection half-open:
                    # reconnect, then rebuild.
                    self._begin_rebuild(Gap(err=err))
                    self._abandon_fetch()
                self._reopen(str(err))

    def _on_monitor(self, ev: int) -> bool:
        """Handles one monitor event; True when the socket was replaced."""
        zmq = _zmq()
        if ev == zmq.EVENT_DISCONNECTED:
            # What the connection delivered before it dropped is read first.
            self._drain_sub(limit=None)
            self._connected = False
            if self._snapshot_ep is not None:
                # Buffered messages of this connection cannot be spliced with
                # those of the next one: an attempt in flight starts over.
                self._abandon_fetch()
            # Dial again on a fresh socket, as Go's subscriber does: libzmq
            # reconnects by itself after a connection error but gives the
            # endpoint up after a protocol error (a frame over max_frame,
            # say), which would leave the subscription silently dead.
            self._reopen("disconnected")
            return True
        elif ev == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._stats.protocol_errors += 1
        elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
            self._last_recv = time.monotonic()
            if self._disconnected:
                self._disconnected = False
                self._stats.reconnects += 1
                if self._snapshot_ep is not None:
                    self._connected_hook(first=False)
                else:
                    self._resume()
        return False

    def _drain_sub(self, limit: Optional[int] = 1024) -> None:
        """Reads what the SUB socket holds: at most limit messages (then the
        loop looks at the monitor again), or all of it."""
        zmq = _zmq()
        n = 0
        while limit is None or n < limit:
            n += 1
            try:
                frames = _recv_frames(self._sub, _MAX_LIVE_FRAMES, self._max_message, zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as e:
                self._stats.protocol_errors += 1
                self._lg.warning("kv event message over a limit dropped: %s", e)
                continue
            self._last_recv = time.monotonic()
            if self._snapshot_ep is not None:
                self._on_live(frames)
            else:
                self._on_message(frames)

    # -- callbacks ----------------------------------------------------------

    def _report(self, g: Gap) -> None:
        self._lg.warning("kv event gap: from=%d to=%d reset=%s rebuilt=%s err=%s",
                         g.from_seq, g.to_seq, g.reset, g.rebuilt, g.err)
        if self._on_gap is not None:
            try:
                self._on_gap(g)
            except Exception:
                self._lg.exception("on_gap raised")

    def _call_on_batch(self, b: Batch) -> None:
        if self._on_batch is not None:
            try:
                self._on_batch(b)
            except Exception:
                self._lg.exception("on_batch raised")

    # -- Mooncake-format logic (subscriber.go) ------------------------------

    def _decode(self, frames: list):
        """(batch, None, None), or, for a malformed message, (None, its
        sequence number or None when it has none to read, the error); a
        malformed message is counted and logged here."""
        try:
            return self._dec.decode_message(frames), None, None
        except MalformedError as err:
            self._stats.malformed += 1
            self._lg.warning("malformed kv event message: %s", err)
            if len(frames) != 3:
                return None, None, err
            try:
                seq, _ = decode_seq_frame(frames[1])
            except MalformedError:
                return None, None, err
            return None, seq, err

    def _on_message(self, frames: list) -> None:
        b, seq, err = self._decode(frames)
        if b is None:
            if seq is not None and self._started and seq >= self._expected and seq != END_SEQ:
                n = seq + 1 - self._expected
                self._stats.missing_seqs += n
                self._stats.unrepaired += n
                self._report(Gap(self._expected, seq + 1, err=err))
                self._expected = seq + 1
            return
        self._handle(b)

    def _handle(self, b: Batch) -> None:
        if self._dup_hi > 0:
            if self._dup_lo <= b.seq <= self._dup_hi and self._replayed_already(b):
                return  # already delivered by a replay
            self._dup_lo = self._dup_hi = 0
        if not self._started:
            self._started = True
            self._expected = b.seq
        if (self._epoch_known and b.epoch != self._epoch) or b.seq < self._expected or self._id_backwards(b):
            # The publisher restarted: its epoch changed, or its sequence or
            # its per-process event_id went backwards.
            self._stats.resets += 1
            self.index.clear()
            self._report(Gap(reset=True))
            self._expected, self._last_event_id, self._have_id = 1, 0, False
        self._set_epoch(b.epoch)
        if b.seq > self._expected:
            self._repair(self._expected, b.seq)
        self._deliver(b)

    def _replay(self, from_seq: int) -> Iterator[Batch]:
        dec = Decoder(allow_unknown_keys=self._allow_unknown, allow_empty=self._heartbeat_stream(), topic=self._topic)
        return replay(self._replay_ep, from_seq, timeout=self._replay_timeout, max_frame=self._max_frame,
                      max_message=self._max_message, decoder=dec, context=self._ctx, _cancel=self._stop)

    def _heartbeat_stream(self) -> bool:
        if self._snapshot_ep is not None:
            return self._live_epochs
        return self._epoch is not None

    def _repair(self, frm: int, to: int) -> None:
        """Fills [frm, to) from the replay socket, reporting what it cannot."""
        self._stats.missing_seqs += to - frm
        if not self._replay_ep:
            self._stats.unrepaired += to - frm
            self._report(Gap(frm, to))
            self._expected = to
            return
        nxt, err = frm, None
        try:
            for rb in self._replay(frm):
                if rb.seq >= to:
                    break
                if rb.seq > nxt:
                    self._stats.unrepaired += rb.seq - nxt
                    self._report(Gap(nxt, rb.seq, err=ReplayError("no longer retained by the replay ring")))
                self._stats.replayed += 1
                self._deliver(rb)
                nxt = rb.seq + 1
        except (ReplayError, MalformedError) as e:
            err = e
        if nxt < to:
            if err is None:
                err = ReplayError("the replay ring does not hold these sequences")
            self._stats.unrepaired += to - nxt
            self._report(Gap(nxt, to, err=err))
        self._expected = to

    def _catch_up(self, frm: int) -> None:
        """Replays everything retained from frm before live delivery; live
        batches it already delivered are then skipped."""
        self._started, self._expected = True, frm
        try:
            for rb in self._replay(frm):
                self._fill(rb)
        except (ReplayError, MalformedError) as e:
            self._report(Gap(self._expected, err=ReplayError("replay from %d: %s" % (frm, e))))
        if self._expected > frm:
            self._dup_lo, self._dup_hi = frm, self._expected - 1

    def _fill(self, rb: Batch) -> None:
        if rb.seq > self._expected:
            n = rb.seq - self._expected
            self._stats.missing_seqs += n
            self._stats.unrepaired += n
            self._report(Gap(self._expected, rb.seq, err=ReplayError("no longer retained by the replay ring")))
        self._stats.replayed += 1
        self._deliver(rb)

    def _replayed_already(self, b: Batch) -> bool:
        return b.heartbeat or (self._have_id and b.events[0].id <= self._last_event_id)

    def _id_backwards(self, b: Batch) -> bool:
        return not b.heartbeat and self._have_id and b.events[0].id <= self._last_event_id

    def _resume(self) -> None:
        """After a reconnect: ask the replay ring for the last batch delivered
        again. The same batch means the same process, and what follows it
        fills the outage; anything else means a restart, and the index is
        rebuilt from the new process's ring. (Snapshot stream format: the
        epoch and heartbeats tell, nothing is asked.)"""
        if not self._started or not self._have_id or not self._replay_ep or self._epoch is not None:
            return
        last = self._last_fp
        same = decided = False
        err = None
        try:
            for rb in self._replay(last[0]):
                if not decided:
                    decided = True
                    if rb.seq == last[0] and _fingerprint(rb) == last:
                        same = True
                        continue  # delivered before the outage
                    break
                self._fill(rb)
        except (ReplayError, MalformedError) as e:
            err = e
        if same:
            if self._expected > last[0] + 1:
                self._dup_lo, self._dup_hi = last[0] + 1, self._expected - 1
            return
        if err is not None and not decided:
            # The replay socket is unreachable: keep going on the live heuristics.
            self._lg.warning("cannot verify kv event stream continuity after reconnect: %s", err)
            return
        self._stats.resets += 1
        self.index.clear()
        self._report(Gap(reset=True))
        self._last_event_id, self._have_id = 0, False
        self._catch_up(1)

    def _set_epoch(self, e: Optional[bytes]) -> None:
        if self._epoch_known and self._epoch == e:
            return
        self._epoch, self._epoch_known = e, True
        self._stats.epoch = e.hex() if e else ""

    def _deliver(self, b: Batch) -> None:
        st = self._stats
        if b.heartbeat:
            st.heartbeats += 1
            st.last_seq = b.seq
            self._expected = b.seq + 1
            return
        if not self._disable_index:
            self.index.apply_batch(b)
        st.batches += 1
        st.events += len(b.events)
        st.last_seq = b.seq
        self._expected = b.seq + 1
        self._last_event_id, self._have_id = b.events[-1].id, True
        self._last_fp = _fingerprint(b)
        self._call_on_batch(b)

    # -- snapshot-mode logic (subscriber_snapshot.go) -----------------------
    #
    # Why the splice is exact: the publisher folds every batch into its
    # snapshot state before sending it, and folds everything pending before
    # it replies. Every live message received before the request was sent is
    # therefore at or below the cut; everything after it is buffered; so
    # dropping what is at or below the cut and requiring cut+1, cut+2, ...
    # leaves nothing out.

    def _connected_hook(self, first: bool) -> None:
        if not first:
            self._resume_snapshot()
        if self._phase == _NEED_FETCH:
            self._start_fetch()

    def _on_live(self, frames: list) -> None:
        if len(frames) == 3:
            n = len(frames[1])
            if n == 8:
                self._live_epochs = False
            elif n == 8 + EPOCH_LEN:
                self._live_epochs = True
        if self._phase == _FETCHING:
            size = sum(len(f) for f in frames)
            if len(self._buf) >= self._buf_msgs or size > self._buf_bytes_max - self._buf_bytes:
                self._attempt_failed(ProtocolError("more than %d live messages or %d bytes arrived while the snapshot was fetched"
                                                   % (self._buf_msgs, self._buf_bytes_max)))
                return
            self._buf.append(frames)
            self._buf_bytes += size
        elif self._phase == _INSTALLED:
            self._apply_live(frames)
        # Waiting: the next snapshot covers what arrives now.

    def _apply_live(self, frames: list) -> None:
        b, seq, err = self._decode(frames)
        if b is None:
            # A batch the index needed and cannot have: rebuild.
            if seq is not None and seq != END_SEQ and seq >= self._expected:
                self._stats.missing_seqs += seq + 1 - self._expected
                self._rebuild(Gap(self._expected, seq + 1, err=err))
            return
        self._apply_batch(b)

    def _apply_batch(self, b: Batch) -> None:
        if b.epoch is not None and b.epoch != self._epoch:
            self._rebuild(Gap(reset=True, err=MalformedError("publisher epoch changed from %s to %s"
                                                             % ((self._epoch or b"").hex(), b.epoch.hex()))))
            return
        if self._dup_hi > 0:
            if self._dup_lo <= b.seq <= self._dup_hi and self._replayed_already(b):
                return
            self._dup_lo = self._dup_hi = 0
        if not self._spliced:
            if self._cut >= 0 and b.seq <= self._cut:
                return  # covered by the snapshot
            if self._cut == CUT_NONE and b.seq >= 1:
                # Nothing was published before the snapshot: this contract's
                # publisher starts at 1 (vLLM's at 0, which expected already is).
                self._expected = 1
        if b.seq < self._expected:
            self._rebuild(Gap(reset=True, err=MalformedError("sequence went back to %d (expected %d)" % (b.seq, self._expected))))
            return
        if b.epoch is None and self._id_backwards(b):
            self._rebuild(Gap(reset=True, err=MalformedError("event_id went back from %d to %d"
                                                             % (self._last_event_id, b.events[0].id))))
            return
        if b.seq > self._expected and not self._repair_snapshot(self._expected, b.seq):
            return
        if not self._spliced:
            self._spliced = True
            self._rebuild_backoff.reset()  # the snapshot joined the live stream
        self._deliver(b)

    def _repair_snapshot(self, frm: int, to: int) -> bool:
        self._stats.missing_seqs += to - frm
        if not self._replay_ep:
            self._rebuild(Gap(frm, to, err=ReplayError("sequence gap and no replay endpoint")))
            return False
        nxt, err = frm, None
        try:
            for rb in self._replay(frm):
                if rb.seq >= to:
                    break
                if rb.seq != nxt:
                    raise ReplayError("the replay ring no longer holds sequence %d" % nxt)
                if rb.epoch is not None and rb.epoch != self._epoch:
                    raise ReplayError("the replay socket answered for publisher epoch %s" % rb.epoch.hex())
                self._stats.replayed += 1
                self._deliver(rb)
                nxt = rb.seq + 1
        except (ReplayError, MalformedError) as e:
            err = e
        if nxt < to:
            if err is None:
                err = ReplayError("the replay ring does not hold these sequences")
            self._rebuild(Gap(nxt, to, err=err))
            return False
        return True

    def _resume_snapshot(self) -> None:
        """After a reconnect, Mooncake format: ask the replay ring for the last
        batch again; when that does not prove the same process continued,
        rebuild from a snapshot."""
        if self._phase != _INSTALLED or self._live_epochs:
            return
        if not self._replay_ep or not self._have_id:
            self._rebuild(Gap(err=ReplayError("reconnected and cannot verify the stream continued (Mooncake format: "
                                              "no replay endpoint or no batch since the snapshot)")))
            return
        last = self._last_fp
        same = decided = False
        nxt = last[0] + 1
        err = None
        try:
            for rb in self._replay(last[0]):
                if not decided:
                    decided = True
                    if rb.seq == last[0] and _fingerprint(rb) == last:
                        same = True
                        continue
                    break
                if rb.seq != nxt:
                    raise ReplayError("the replay ring no longer holds sequence %d" % nxt)
                self._stats.replayed += 1
                self._deliver(rb)
                nxt = rb.seq + 1
        except (ReplayError, MalformedError) as e:
            err = e
        if same and err is None:
            if self._expected > last[0] + 1:
                self._dup_lo, self._dup_hi = last[0] + 1, self._expected - 1
        elif err is None:
            self._rebuild(Gap(reset=True, err=ReplayError("the publisher restarted while disconnected (its replay ring "
                                                          "no longer holds the last batch delivered)")))
        else:
            self._rebuild(Gap(err=ReplayError("reconnected and cannot verify the stream continued: %s" % err)))

    def _rebuild(self, g: Gap) -> None:
        """Drops the index and requests a snapshot: now when a live batch had
        been spliced onto the last one, else after the backoff."""
        joined = self._spliced
        self._begin_rebuild(g)
        if joined:
            self._start_fetch()
        else:
            self._attempt_failed(g.err)

    def _begin_rebuild(self, g: Gap) -> None:
        self._abandon_fetch()
        self._retry_at = None
        g = Gap(g.from_seq, g.to_seq, g.reset, g.err, rebuilt=True)
        if g.reset:
            self._stats.resets += 1
        self._lg.warning("kv event stream lost continuity; rebuilding from a snapshot: %s (reset=%s from=%d to=%d)",
                         g.err, g.reset, g.from_seq, g.to_seq)
        self.index.clear()
        self._stats.synced = False
        if self._installed_once and self._pending is None:
            self._pending = g
        self._phase, self._spliced = _NEED_FETCH, False
        self._dup_lo = self._dup_hi = 0

    def _start_fetch(self) -> None:
        self._abandon_fetch()
        self._retry_at = None
        dec = Decoder(allow_unknown_keys=self._allow_unknown, topic=self._topic)
        self._fetch = _SnapshotRequest(self._ctx, self._snapshot_ep, self._snapshot_timeout, self._max_snapshot_bytes,
                                       self._max_frame, 1 << 20, dec)
        self._phase = _FETCHING
        self._stats.synced = False

    def _abandon_fetch(self) -> None:
        if self._fetch is not None:
            self._fetch.close()
            self._fetch = None
            if self._phase == _FETCHING:
                self._phase = _NEED_FETCH
        self._buf, self._buf_bytes = [], 0

    def _attempt_failed(self, err) -> None:
        self._abandon_fetch()
        self._stats.snapshot_failures += 1
        d = self._rebuild_backoff.next()
        self._lg.warning("kv event snapshot failed; retrying in %.2fs: %s", d, err)
        self._phase = _WAITING
        self._retry_at = time.monotonic() + d

    def _fetch_done(self) -> None:
        req, self._fetch = self._fetch, None
        try:
            if not req.sock.poll(0):
                raise ReplayError("snapshot %s: no answer within %.1fs" % (req.endpoint, req.timeout))
            snap = req.result()
        except (ReplayError, MalformedError, SnapshotUnavailable) as e:
            self._attempt_failed(e)
            return
        finally:
            req.close()
        self._install(snap)

    def _install(self, snap: Snapshot) -> None:
        buf = self._buf
        self._buf, self._buf_bytes = [], 0
        self.index.clear()
        self._set_epoch(snap.epoch)
        self._cut, self._spliced, self._phase, self._installed_once = snap.cut, False, _INSTALLED, True
        self._started, self._have_id, self._last_event_id = True, False, 0
        self._dup_lo = self._dup_hi = 0
        self._expected = snap.cut + 1  # 0 after CUT_NONE
        if snap.cut >= 0:
            self._stats.last_seq = snap.cut
        self._lg.info("kv event snapshot installed: cut=%d epoch=%s events=%d buffered=%d",
                      snap.cut, snap.epoch.hex(), snap.events, len(buf))
        if self._pending is not None:
            g, self._pending = self._pending, None
            self._report(g)
        for b in snap.batches:
            if not self._disable_index:
                self.index.apply_batch(b)
            self._stats.batches += 1
            self._stats.events += len(b.events)
            self._call_on_batch(b)
        # The index now mirrors the publisher at the cut; the buffered batches
        # bring it forward (a rebuild among them clears synced again).
        self._stats.snapshots += 1
        self._stats.synced = True
        for m in buf:
            if self._phase != _INSTALLED:
                break  # a rebuild began; its snapshot covers the rest
            self._apply_live(m)
