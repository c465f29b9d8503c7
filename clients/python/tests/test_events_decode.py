"""The strict decoder of crescent.events against pkg/kvevent's golden files
and decode_test.go's vectors, hostile inputs, snapshot replies and the index.

The golden files pin the payload the Go encoder writes, types included;
they are re-encoded here with the msgpack library (an encoder independent
of both decoders) and must decode to exactly the golden events.
"""

import os
import re
import struct
import sys
import time

import msgpack
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))  # the _events_* helpers, whatever the import mode

from crescent import events  # noqa: E402
from _events_vectors import (  # noqa: E402
    NIL, TS, accept_vectors, ev, mp_arr, mp_map, mp_str, mp_uint, msg, payload, reject_vectors, seq, set_kv,
    valid_kvs,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GOLDEN = os.path.join(REPO, "pkg", "kvevent", "testdata", "golden")


# --- golden files -------------------------------------------------------------

_TOKEN = re.compile(r'\s*(\[\]|\[|\]|\{|\}|nil|int -?\d+|str "(?:[^"\\]|\\.)*"|[A-Za-z_]+:)')


def parse_golden(text):
    """Parses golden_test.go's describe() rendering back into Python values
    (ints, strs, None, lists, dicts with keys in file order)."""
    toks = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, "golden parse error at %r" % text[pos:pos + 40]
        toks.append(m.group(1))
        pos = m.end()
    it = iter(toks)

    def value(t):
        if t == "nil":
            return None
        if t == "[]":
            return []
        if t.startswith("int "):
            return int(t[4:])
        if t.startswith("str "):
            return bytes(t[5:-1], "utf-8").decode("unicode_escape")
        if t == "[":
            out = []
            for t2 in it:
                if t2 == "]":
                    return out
                out.append(value(t2))
        if t == "{":
            out = {}
            for t2 in it:
                if t2 == "}":
                    return out
                out[t2[:-1]] = value(next(it))
        raise AssertionError("unexpected golden token %r" % t)

    return value(next(it))


def golden_files():
    names = sorted(n for n in os.listdir(GOLDEN) if n.endswith(".txt"))
    assert len(names) == 4, names
    return names


# golden_test.go's goldenEvents with goldenEnvelope.
GOLDEN_ENVELOPE = events.Envelope(backend_id="gw-1", model_name="llama-3-8b", block_size=16, dp_rank=2)
GOLDEN_EVENTS = [
    (7, events.STORED, "t1", "k/0001", events.CPU, "g1"),
    (8, events.REMOVED, "t1", "k/0001", events.DISK, None),
    (9, events.CLEARED, "t1", None, None, None),
]


@pytest.mark.parametrize("name", golden_files())
def test_golden_accepted_verbatim(name):
    legacy = "legacy_true" in name
    object_key = "objectkey_true" in name
    with open(os.path.join(GOLDEN, name)) as f:
        value = parse_golden(f.read())
    ts = 1_700_000_000_123
    assert value[0] == ts and value[2] == 2
    want = [e for e in GOLDEN_EVENTS if object_key or e[1] == events.CLEARED]
    for use_bin_type in (True, False):  # str8 vs fixstr/str16 choices differ; both are msgpack str
        raw = msgpack.packb(value, use_bin_type=use_bin_type)
        b = events.decode_message([b"", events.put_seq(5), raw])
        assert (b.seq, b.timestamp, b.dp_rank, len(b.events)) == (5, ts, 2, len(want))
        for got, (ev_id, typ, tenant, key, medium, group) in zip(b.events, want):
            assert got == events.Event(ev_id, ts, typ, tenant, key, medium, group, GOLDEN_ENVELOPE, legacy)
    # Each key of each event is required (or forbidden) exactly as Go says:
    # dropping any one is a rejection (except a cleared event's legacy
    # "type", which leaves a valid non-legacy cleared event), and so is
    # adding any unknown one.
    for i, m in enumerate(value[1]):
        for k in list(m):
            broken = [dict(x) for x in value[1]]
            del broken[i][k]
            frames = [b"", events.put_seq(5), msgpack.packb([ts, broken, 2])]
            if k == "type" and m["event_type"] == "cleared":
                assert not events.decode_message(frames).events[i].legacy
                continue
            with pytest.raises(events.MalformedError):
                events.decode_message(frames)
        extra = [dict(x) for x in value[1]]
        extra[i]["zzz"] = None
        with pytest.raises(events.MalformedError, match="unknown key"):
            events.decode_message([b"", events.put_seq(5), msgpack.packb([ts, extra, 2])])
        assert events.Decoder(allow_unknown_keys=True).decode_message(
            [b"", events.put_seq(5), msgpack.packb([ts, extra, 2])]).events


# --- decode_test.go's vectors -------------------------------------------------

@pytest.mark.parametrize("name,frames,kw", accept_vectors(), ids=[v[0] for v in accept_vectors()])
def test_accepts(name, frames, kw):
    b = events.Decoder(**kw).decode_message(frames)
    assert b.events


@pytest.mark.parametrize("name,frames", reject_vectors(), ids=[v[0] for v in reject_vectors()])
def test_rejects(name, frames):
    with pytest.raises(events.MalformedError) as e:
        events.decode_message(frames)
    assert str(e.value)  # a reason, not an empty error


def test_decoded_values():
    kvs = set_kv(set_kv(valid_kvs("stored", False, 42, key="a/b\x00c", tenant="ten"), "group_id", mp_str("g")),
                 "model_name", mp_str("m"))
    kvs = set_kv(set_kv(kvs, "block_size", mp_uint(16)), "dp_rank", mp_uint(3))
    b = events.decode_message([b"", seq(9), payload(mp_map(kvs), dp=3)])
    e = b.events[0]
    assert (b.seq, b.dp_rank, b.epoch, b.heartbeat) == (9, 3, None, False)
    assert e == events.Event(42, TS, "stored", "ten", "a/b\x00c", "cpu", "g",
                             events.Envelope("b", "m", None, None, 16, 3), False)
    # A key that is not UTF-8 is kept byte for byte.
    b = events.decode_message(ev(set_kv(valid_kvs("stored", False, 1), "object_key", b"\xa2\xff\xfe")))
    assert b.events[0].key.encode("utf-8", "surrogateescape") == b"\xff\xfe"


def test_snapshot_format_frames():
    epoch = bytes(range(16))
    d = events.Decoder()
    hb = d.decode_message([b"", events.put_seq_epoch(0, epoch), msg(b"\x93" + mp_uint(TS) + mp_arr() + b"\x00")[2]])
    assert hb.heartbeat and hb.epoch == epoch and hb.seq == 0
    with pytest.raises(events.MalformedError):  # no heartbeats in the Mooncake format
        d.decode_message([b"", seq(3), b"\x93" + mp_uint(TS) + mp_arr() + b"\x00"])
    assert events.Decoder(allow_empty=True).decode_payload(3, b"\x93" + mp_uint(TS) + mp_arr() + b"\x00").heartbeat
    with pytest.raises(events.MalformedError, match="topic"):
        events.Decoder(topic="kv@x@m").decode_message(ev(valid_kvs("stored", False, 1)))
    frames = ev(valid_kvs("stored", False, 1))
    frames[0] = b"kv@x@m"
    assert events.Decoder(topic="kv@x@m").decode_message(frames).events


# --- hostile inputs -----------------------------------------------------------

def test_hostile_inputs_are_cheap():
    """Lying lengths are refused before anything is built for them, deep
    nesting is bounded, and big garbage is rejected in linear time."""
    t0 = time.monotonic()
    for frames in [
        msg(b"\xdd\xff\xff\xff\xff" + b"\x00" * 100),
        msg(b"\x93" + mp_uint(TS) + b"\xdd\xff\xff\xff\xff" + b"\x00" * 100),
        ev(set_kv(valid_kvs("stored", False, 1), "object_key", b"\xdb\xff\xff\xff\xff" + b"x" * 100)),
        msg(b"\xc1" * (8 << 20)),
        msg(payload(mp_map(valid_kvs("stored", False, 1))) * 1000),
        # Many small containers from few bytes (what a parse-then-check
        # decoder would build first): 64 x 64 empty arrays.
        msg(b"\x93\x00\xdc\x00\x40" + (b"\xdc\x00\x40" + b"\x90" * 64) * 64 + b"\x00"),
        msg(b"\x93\x00\x91" + b"\x91" * 200_000 + b"\x90\x00"),
    ]:
        with pytest.raises(events.MalformedError):
            events.decode_message(frames)
    # Nesting in an unknown key's value: 32 levels are skipped, 33 refused,
    # 100000 refused without recursion.
    d = events.Decoder(allow_unknown_keys=True)
    for depth, ok in ((32, True), (33, False), (100_000, False)):
        v = b"\x91" * depth + NIL
        frames = ev(set_kv(valid_kvs("cleared", False, 1), "future", v))
        if ok:
            assert d.decode_message(frames).events
        else:
            with pytest.raises(events.MalformedError, match="nesting"):
                d.decode_message(frames)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("frames", [
    [], [b""], [b"", seq(1)], [b"", seq(1), b"\x93", b""], [b""] * 100,
])
def test_wrong_frame_counts(frames):
    with pytest.raises(events.MalformedError, match="frames"):
        events.decode_message(frames)


def test_truncation_at_every_byte():
    full = payload(*[mp_map(valid_kvs(t, legacy, i + 1))
                     for i, (t, legacy) in enumerate([("stored", True), ("removed", False), ("cleared", True)])])
    assert len(events.decode_message(msg(full)).events) == 3
    for n in range(len(full)):
        with pytest.raises(events.MalformedError):
            events.decode_message(msg(full[:n]))


def test_frames_of_any_buffer_type():
    p = payload(mp_map(valid_kvs("stored", False, 1)))
    for conv in (bytes, bytearray, memoryview):
        assert events.decode_message([conv(b""), conv(seq(1)), conv(p)]).events


# --- snapshot replies ---------------------------------------------------------

def chunk(*kvss):
    return payload(*[mp_map(k) for k in kvss])


def test_snapshot_reply():
    epoch = b"E" * 16
    cut = struct.pack(">q", 41)
    s = events.decode_snapshot_reply([cut, epoch, chunk(valid_kvs("stored", True, 0, key="a"), valid_kvs("stored", True, 0, key="b")),
                                      chunk(valid_kvs("stored", False, 0, key="c", medium="disk"))])
    assert (s.cut, s.epoch, s.events) == (41, epoch, 3)
    assert all(b.snapshot and b.seq == 41 and b.epoch == epoch for b in s.batches)
    assert events.decode_snapshot_reply([struct.pack(">q", -1), epoch]).batches == []
    with pytest.raises(events.SnapshotUnavailable):
        events.decode_snapshot_reply([struct.pack(">q", -2), epoch])
    for frames in [
        [cut],
        [cut[:7], epoch],
        [cut, epoch[:15]],
        [struct.pack(">q", -3), epoch],
        [struct.pack(">q", -2), epoch, chunk(valid_kvs("stored", True, 0))],
        [struct.pack(">q", -1), epoch, chunk(valid_kvs("stored", True, 0))],
        [cut, epoch, chunk(valid_kvs("stored", True, 1))],       # event_id must be 0
        [cut, epoch, chunk(valid_kvs("removed", True, 0))],      # stored only
        [cut, epoch, b"\x93" + mp_uint(TS) + mp_arr() + b"\x00"],  # no empty chunk
    ]:
        with pytest.raises(events.MalformedError):
            events.decode_snapshot_reply(frames)


# --- the index ----------------------------------------------------------------

def E(t, tenant, key=None, medium=None, group=None, i=1):
    return events.Event(i, TS, t, tenant, key, medium, group, events.Envelope("b"), False)


def test_index():
    x = events.Index()
    x.apply(E("stored", "t", "k1", "cpu", "g"))
    x.apply(E("stored", "t", "k1", "cpu", "g"))  # idempotent
    x.apply(E("stored", "t", "k1", "disk"))
    x.apply(E("stored", "u", "k1", "cpu"))
    assert len(x) == 3 and ("t", "k1", "cpu") in x and x.group("t", "k1", "cpu") == "g"
    assert x.media("t", "k1") == ["cpu", "disk"]
    x.apply(E("removed", "t", "k1", "cpu"))
    x.apply(E("removed", "t", "nope", "cpu"))  # idempotent
    assert x.keys() == [events.Key("t", "k1", "disk"), events.Key("u", "k1", "cpu")]
    x.apply(E("cleared", "t"))
    assert x.keys() == [events.Key("u", "k1", "cpu")] and len(x) == 1
    x.clear()
    assert len(x) == 0 and x.keys() == []


# --- the fast path ------------------------------------------------------------

def test_fast_path_never_accepts_more_than_the_strict_reader():
    """Decoder's msgpack fast path only accepts, and only what the strict
    reader (itself checked against Go in test_events_go_differential.py)
    accepts, with the same result."""
    from _events_vectors import mutations, structured
    if events._unpackb is None:
        pytest.skip("python3-msgpack missing: the strict reader runs alone")
    corpus = [f[2] for _, f, _ in accept_vectors()] + [f[2] for _, f in reject_vectors() if len(f) == 3]
    corpus += mutations(seed=7, n=3000) + structured(seed=7, n=3000)
    d = events.Decoder()
    both = strict_only = 0
    for p in corpus:
        for kind in (events._KIND_LIVE, events._KIND_HEARTBEAT_OK, events._KIND_CHUNK):
            fast = events._decode_payload_fast(3, p, kind)
            try:
                strict = d._decode_payload_strict(3, p, kind)
            except events.MalformedError:
                strict = None
            if fast is not None:
                assert strict == fast, p.hex()
                both += 1
            elif strict is not None:
                strict_only += 1
    print("fast and strict accepted %d; strict alone %d" % (both, strict_only))
    assert both > 1000 and strict_only == 0
