"""Hand-made (and deliberately broken) KV event messages for the tests of
crescent.events: a small msgpack builder and the accept/reject vectors of
pkg/kvevent/decode_test.go, ported case by case, plus a seeded mutator.

The builder writes bytes by hand (not through the msgpack library) so that
wire-level choices -- integer widths, str vs bin, lying lengths -- are
explicit.
"""

import random
import struct

TS = 1_700_000_000_000
END_SEQ = 0xFFFFFFFFFFFFFFFF


def seq(n):
    return n.to_bytes(8, "big")


def mp_str(s):
    b = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else bytes(s)
    n = len(b)
    if n < 32:
        return bytes([0xA0 | n]) + b
    if n < 256:
        return bytes([0xD9, n]) + b
    if n < 65536:
        return b"\xda" + struct.pack(">H", n) + b
    return b"\xdb" + struct.pack(">I", n) + b


def mp_uint(v):
    if v < 128:
        return bytes([v])
    if v < 256:
        return bytes([0xCC, v])
    if v < 65536:
        return b"\xcd" + struct.pack(">H", v)
    if v < 1 << 32:
        return b"\xce" + struct.pack(">I", v)
    return b"\xcf" + struct.pack(">Q", v)


def mp_int64(v):
    return b"\xd3" + struct.pack(">q", v)


def mp_float64(f):
    return b"\xcb" + struct.pack(">d", f)


def mp_float32(f):
    return b"\xca" + struct.pack(">f", f)


def mp_bin(s):
    b = s.encode()
    return bytes([0xC4, len(b)]) + b


NIL = b"\xc0"
TRUE = b"\xc3"


def mp_arr(*elts):
    n = len(elts)
    if n < 16:
        h = bytes([0x90 | n])
    elif n < 65536:
        h = b"\xdc" + struct.pack(">H", n)
    else:
        h = b"\xdd" + struct.pack(">I", n)
    return h + b"".join(elts)


def mp_map(kvs):
    n = len(kvs)
    if n < 16:
        h = bytes([0x80 | n])
    elif n < 65536:
        h = b"\xde" + struct.pack(">H", n)
    else:
        h = b"\xdf" + struct.pack(">I", n)
    return h + b"".join(k + v for k, v in kvs)


LEGACY = {"stored": "BlockStored", "removed": "BlockRemoved", "cleared": "AllBlocksCleared"}
ENVELOPE_KEYS = ["event_id", "timestamp", "event_type", "model_name", "block_size",
                 "additional_salt", "lora_name", "tenant_id", "backend_id", "medium", "dp_rank"]


def valid_kvs(t, legacy, ev_id, key="k", tenant="t", medium="cpu", ts=TS):
    """The (encoded key, encoded value) pairs of a valid event (decode_test.go validKVs)."""
    s = lambda k, v: (mp_str(k), v)  # noqa: E731
    kvs = [
        s("event_id", mp_uint(ev_id)),
        s("timestamp", mp_uint(ts)),
        s("event_type", mp_str(t)),
        s("model_name", NIL),
        s("block_size", NIL),
        s("additional_salt", NIL),
        s("lora_name", NIL),
        s("tenant_id", mp_str(tenant)),
        s("backend_id", mp_str("b")),
        s("dp_rank", mp_uint(0)),
    ]
    if t == "cleared":
        kvs.append(s("medium", NIL))
    else:
        kvs += [s("medium", mp_str(medium)), s("group_id", NIL), s("object_key", mp_str(key)),
                s("seq_hashes", mp_arr()), s("base_block_idx", NIL)]
    if t == "stored":
        kvs += [s("parent_hash", NIL), s("token_ids", NIL)]
    if legacy:
        kvs.append(s("type", mp_str(LEGACY[t])))
        if t != "cleared":
            kvs.append(s("block_hashes", mp_arr()))
        if t == "stored":
            kvs.append(s("parent_block_hash", NIL))
    return kvs


def set_kv(kvs, k, v):
    out = list(kvs)
    for i, (kk, _) in enumerate(out):
        if kk == mp_str(k):
            out[i] = (kk, v)
            return out
    return out + [(mp_str(k), v)]


def del_kv(kvs, k):
    return [(kk, v) for kk, v in kvs if kk != mp_str(k)]


def payload(*events, ts=TS, dp=0):
    return b"\x93" + mp_uint(ts) + mp_arr(*events) + mp_uint(dp)


def msg(p, n=1):
    return [b"", seq(n), p]


def ev(kvs):
    return msg(payload(mp_map(kvs)))


def accept_vectors():
    """(name, frames, decoder kwargs) the Go decoder accepts (TestDecodeAcceptsValid)."""
    rev = list(reversed(valid_kvs("stored", True, 1)))
    return [
        ("stored legacy", ev(valid_kvs("stored", True, 1)), {}),
        ("stored", ev(valid_kvs("stored", False, 1)), {}),
        ("removed legacy", ev(valid_kvs("removed", True, 1)), {}),
        ("removed", ev(valid_kvs("removed", False, 1)), {}),
        ("cleared legacy", ev(valid_kvs("cleared", True, 1)), {}),
        ("cleared", ev(valid_kvs("cleared", False, 1)), {}),
        ("signed int64 event_id", ev(set_kv(valid_kvs("stored", True, 1), "event_id", mp_int64(99))), {}),
        ("disk medium", ev(set_kv(valid_kvs("removed", True, 1), "medium", mp_str("disk"))), {}),
        ("strings for nullables", ev(set_kv(set_kv(valid_kvs("stored", True, 1), "model_name", mp_str("m")),
                                            "group_id", mp_str("g"))), {}),
        ("key order free", ev(rev), {}),
        ("64 events", msg(payload(*[mp_map(valid_kvs("cleared", True, i + 1)) for i in range(64)])), {}),
        ("unknown key allowed", ev(set_kv(valid_kvs("stored", True, 1), "future",
                                          mp_arr(mp_str("x"), mp_float64(1)))), {"allow_unknown_keys": True}),
        ("event_id u64 max", ev(set_kv(valid_kvs("stored", True, 1), "event_id", mp_uint(2**64 - 1))), {}),
        ("str8 key and value", ev(set_kv(valid_kvs("stored", False, 1), "object_key", b"\xd9\x01k")), {}),
        ("non-utf8 key", ev(set_kv(valid_kvs("stored", False, 1), "object_key", b"\xa2\xff\xfe")), {}),
        ("long key 70000", ev(set_kv(valid_kvs("removed", False, 1), "object_key", mp_str("k" * 70000))), {}),
        ("uint8 timestamp width", msg(b"\x93" + b"\xcf" + struct.pack(">Q", 5)
                                      + mp_arr(mp_map(valid_kvs("cleared", False, 1, ts=5))) + b"\x00"), {}),
    ]


def reject_vectors():
    """(name, frames) the Go decoder rejects (TestDecodeRejects)."""
    good = mp_map(valid_kvs("stored", True, 1))
    st = valid_kvs("stored", True, 1)
    rm = valid_kvs("removed", True, 1)
    cl = valid_kvs("cleared", True, 1)
    z = lambda n: bytes(n)  # noqa: E731
    v = [
        ("2 frames", [seq(1), payload(good)]),
        ("4 frames", [b"", seq(1), payload(good), b""]),
        ("topic not empty", [b"kv", seq(1), payload(good)]),
        ("seq 7 bytes", [b"", z(7), payload(good)]),
        ("seq 9 bytes", [b"", z(9), payload(good)]),
        ("seq 0", [b"", seq(0), payload(good)]),
        ("seq end marker", [b"", seq(END_SEQ), payload(good)]),
        ("empty payload", msg(b"")),
        ("payload map", msg(mp_map([]))),
        ("payload 2 elements", msg(mp_arr(mp_uint(1), mp_arr(good)))),
        ("payload 4 elements", msg(mp_arr(mp_uint(1), mp_arr(good), mp_uint(0), mp_uint(0)))),
        ("timestamp float64", msg(mp_arr(mp_float64(TS), mp_arr(good), mp_uint(0)))),
        ("timestamp float32", msg(mp_arr(mp_float32(1), mp_arr(good), mp_uint(0)))),
        ("timestamp negative", msg(mp_arr(mp_int64(-1), mp_arr(good), mp_uint(0)))),
        ("timestamp string", msg(mp_arr(mp_str("1"), mp_arr(good), mp_uint(0)))),
        ("events not array", msg(mp_arr(mp_uint(TS), good, mp_uint(0)))),
        ("0 events", msg(mp_arr(mp_uint(TS), mp_arr(), mp_uint(0)))),
        ("65 events", msg(payload(*[mp_map(valid_kvs("cleared", True, i + 1)) for i in range(65)]))),
        ("dp_rank float", msg(mp_arr(mp_uint(TS), mp_arr(good), mp_float64(0)))),
        ("dp_rank negative", msg(mp_arr(mp_uint(TS), mp_arr(good), b"\xff"))),
        ("dp_rank over u32", msg(mp_arr(mp_uint(TS), mp_arr(good), mp_uint(1 << 32)))),
        ("dp_rank nil", msg(mp_arr(mp_uint(TS), mp_arr(good), NIL))),
        ("trailing byte", msg(payload(good) + b"\xc0")),
        ("truncated", msg(payload(good)[:40])),
        ("array length lies", msg(b"\xdd\xff\xff\xff\xff")),
        ("event not a map", msg(payload(mp_arr()))),
        ("duplicate key", ev(st + [(mp_str("tenant_id"), mp_str("t"))])),
        ("non-string key", ev(st + [(mp_uint(1), NIL)])),
        ("binary key", ev(st + [(mp_bin("x"), NIL)])),
        ("unknown key", ev(set_kv(st, "extra", NIL))),
        ("unknown event_type", ev(set_kv(st, "event_type", mp_str("evicted")))),
        ("event_type int", ev(set_kv(st, "event_type", mp_uint(1)))),
        ("event_id float", ev(set_kv(st, "event_id", mp_float64(1)))),
        ("event_id negative", ev(set_kv(st, "event_id", mp_int64(-5)))),
        ("event_id string", ev(set_kv(st, "event_id", mp_str("1")))),
        ("event timestamp float", ev(set_kv(st, "timestamp", mp_float64(TS)))),
        ("event timestamp differs", ev(set_kv(st, "timestamp", mp_uint(TS + 1)))),
        ("model_name int", ev(set_kv(st, "model_name", mp_uint(1)))),
        ("model_name binary", ev(set_kv(st, "model_name", mp_bin("m")))),
        ("block_size 0", ev(set_kv(st, "block_size", mp_uint(0)))),
        ("block_size float", ev(set_kv(st, "block_size", mp_float64(16)))),
        ("block_size over u32", ev(set_kv(st, "block_size", mp_uint(1 << 32)))),
        ("additional_salt int", ev(set_kv(st, "additional_salt", mp_uint(1)))),
        ("lora_name bool", ev(set_kv(st, "lora_name", TRUE))),
        ("tenant_id nil", ev(set_kv(st, "tenant_id", NIL))),
        ("backend_id nil", ev(set_kv(st, "backend_id", NIL))),
        ("dp_rank field nil", ev(set_kv(st, "dp_rank", NIL))),
        ("dp_rank field negative", ev(set_kv(st, "dp_rank", mp_int64(-1)))),
        ("medium gpu", ev(set_kv(st, "medium", mp_str("gpu")))),
        ("medium memory", ev(set_kv(st, "medium", mp_str("MEMORY")))),
        ("stored medium nil", ev(set_kv(st, "medium", NIL))),
        ("removed medium nil", ev(set_kv(rm, "medium", NIL))),
        ("cleared medium cpu", ev(set_kv(cl, "medium", mp_str("cpu")))),
        ("event_ids not increasing", msg(payload(mp_map(valid_kvs("cleared", True, 2)),
                                                 mp_map(valid_kvs("cleared", True, 2))))),
        ("stored missing object_key", ev(del_kv(st, "object_key"))),
        ("stored missing group_id", ev(del_kv(st, "group_id"))),
        ("stored missing parent_hash", ev(del_kv(st, "parent_hash"))),
        ("stored missing token_ids", ev(del_kv(st, "token_ids"))),
        ("stored missing seq_hashes", ev(del_kv(st, "seq_hashes"))),
        ("stored missing base_block_idx", ev(del_kv(st, "base_block_idx"))),
        ("object_key nil", ev(set_kv(st, "object_key", NIL))),
        ("object_key binary", ev(set_kv(st, "object_key", mp_bin("k")))),
        ("group_id int", ev(set_kv(st, "group_id", mp_uint(3)))),
        ("seq_hashes non-empty", ev(set_kv(st, "seq_hashes", mp_arr(mp_uint(1))))),
        ("seq_hashes nil", ev(set_kv(st, "seq_hashes", NIL))),
        ("block_hashes non-empty", ev(set_kv(st, "block_hashes", mp_arr(mp_uint(1))))),
        ("base_block_idx 0", ev(set_kv(st, "base_block_idx", mp_uint(0)))),
        ("parent_hash set", ev(set_kv(st, "parent_hash", mp_uint(7)))),
        ("token_ids list", ev(set_kv(st, "token_ids", mp_arr()))),
        ("parent_block_hash set", ev(set_kv(st, "parent_block_hash", mp_str("x")))),
        ("removed with parent_hash", ev(set_kv(rm, "parent_hash", NIL))),
        ("removed with token_ids", ev(set_kv(rm, "token_ids", NIL))),
        ("removed with parent_block_hash", ev(set_kv(rm, "parent_block_hash", NIL))),
        ("cleared with object_key", ev(set_kv(cl, "object_key", mp_str("k")))),
        ("cleared with group_id nil", ev(set_kv(cl, "group_id", NIL))),
        ("cleared with seq_hashes", ev(set_kv(cl, "seq_hashes", mp_arr()))),
        ("cleared with block_hashes", ev(set_kv(cl, "block_hashes", mp_arr()))),
        ("cleared with base_block_idx", ev(set_kv(cl, "base_block_idx", NIL))),
        ("type without block_hashes", ev(del_kv(st, "block_hashes"))),
        ("type without parent_block_hash", ev(del_kv(st, "parent_block_hash"))),
        ("block_hashes without type", ev(del_kv(st, "type"))),
        ("type mismatch", ev(set_kv(st, "type", mp_str("BlockRemoved")))),
        ("type unknown", ev(set_kv(cl, "type", mp_str("Cleared")))),
        ("type int", ev(set_kv(cl, "type", mp_uint(1)))),
        # Hostile sizes: lengths that lie about what follows.
        ("str32 of 4 GiB", ev(set_kv(st, "object_key", b"\xdb\xff\xff\xff\xff"))),
        ("map32 of 2^32-1", msg(payload(b"\xdf\xff\xff\xff\xff"))),
        ("array16 events lie", msg(b"\x93" + mp_uint(TS) + b"\xdc\xff\xff" + mp_uint(0))),
        ("seq_hashes array32 lie", ev(set_kv(st, "seq_hashes", b"\xdd\x7f\xff\xff\xff"))),
        ("ext value", ev(set_kv(st, "model_name", b"\xd4\x01\x00"))),
        ("never-used byte", ev(set_kv(st, "model_name", b"\xc1"))),
    ]
    for f in ENVELOPE_KEYS:
        for t in ("stored", "removed", "cleared"):
            v.append(("missing %s on %s" % (f, t), ev(del_kv(valid_kvs(t, True, 1), f))))
    return v


def mutations(seed, n):
    """n seeded mutations of valid payloads: byte flips, truncations,
    insertions, deletions and splices. Their verdicts are not known in
    advance; the differential test asks Go."""
    rng = random.Random(seed)
    bases = []
    for t in ("stored", "removed", "cleared"):
        for legacy in (True, False):
            bases.append(payload(mp_map(valid_kvs(t, legacy, 1))))
    bases.append(payload(*[mp_map(valid_kvs("stored", False, i + 1, key="key/%d" % i)) for i in range(3)]))
    interesting = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xCA, 0xCB,
                   0xCC, 0xCF, 0xD0, 0xD3, 0xD4, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0xFF]
    out = []
    for _ in range(n):
        b = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(6)
            if not b:
                break
            i = rng.randrange(len(b))
            if op == 0:
                b[i] = rng.randrange(256)
            elif op == 1:
                b[i] = rng.choice(interesting)
            elif op == 2:
                del b[i:]
            elif op == 3:
                b.insert(i, rng.choice(interesting))
            elif op == 4:
                del b[i]
            else:
                j = rng.randrange(len(b))
                b[i:i] = b[j:j + rng.randint(1, 8)]
        out.append(bytes(b))
    return out


def _enc_uint(rng, v):
    """v in a random valid msgpack integer encoding."""
    opts = []
    if v < 128:
        opts.append(bytes([v]))
    for code, fmt, lim in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64),
                           (0xD0, ">b", 1 << 7), (0xD1, ">h", 1 << 15), (0xD2, ">i", 1 << 31), (0xD3, ">q", 1 << 63)):
        if v < lim:
            opts.append(bytes([code]) + struct.pack(fmt, v))
    return rng.choice(opts)


def _enc_str(rng, s):
    b = s.encode("utf-8", "surrogateescape")
    n = len(b)
    opts = [bytes([0xD9, n]) + b if n < 256 else None, b"\xda" + struct.pack(">H", n) + b,
            b"\xdb" + struct.pack(">I", n) + b]
    if n < 32:
        opts.append(bytes([0xA0 | n]) + b)
    return rng.choice([o for o in opts if o is not None])


def _enc_empty_arr(rng):
    return rng.choice([b"\x90", b"\xdc\x00\x00", b"\xdd\x00\x00\x00\x00"])


_WRONG = [b"\xc0", b"\xc2", b"\xcb" + struct.pack(">d", 1.0), b"\xff", b"\xd3" + struct.pack(">q", -3),
          b"\xc4\x01x", b"\x91\x01", b"\x80", b"\xa1x", b"\x07", b"\xd4\x00\x00"]


def structured(seed, n, p_wrong=0.02):
    """n payloads built field by field with random valid encodings (integer
    widths, str8/16/32, empty arrays of every header, key order, legacy on or
    off), each field replaced by a wrong value with probability p_wrong and
    keys dropped, added or repeated now and then. About half come out valid."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ts = rng.choice([0, 5, 200, 70000, TS, 2**63 - 1])
        nev = rng.choice([1, 1, 2, 3])
        evs = []
        ev_id = rng.choice([0, 1, 300, 2**40])
        for _ in range(nev):
            t = rng.choice(["stored", "removed", "cleared"])
            legacy = rng.random() < 0.5
            fields = [
                ("event_id", _enc_uint(rng, ev_id)),
                ("timestamp", _enc_uint(rng, ts) if rng.random() > 0.03 else _enc_uint(rng, ts ^ 1)),
                ("event_type", _enc_str(rng, t)),
                ("model_name", rng.choice([NIL, _enc_str(rng, "m")])),
                ("block_size", rng.choice([NIL, _enc_uint(rng, 16), _enc_uint(rng, 2**32 - 1)])),
                ("additional_salt", rng.choice([NIL, _enc_str(rng, "")])),
                ("lora_name", rng.choice([NIL, _enc_str(rng, "l")])),
                ("tenant_id", _enc_str(rng, rng.choice(["", "t", "x" * 40]))),
                ("backend_id", _enc_str(rng, "b")),
                ("dp_rank", _enc_uint(rng, rng.choice([0, 7, 2**32 - 1]))),
                ("medium", NIL if t == "cleared" else _enc_str(rng, rng.choice(["cpu", "disk"]))),
            ]
            if t != "cleared":
                fields += [("group_id", rng.choice([NIL, _enc_str(rng, "g")])),
                           ("object_key", _enc_str(rng, rng.choice(["k", "a/b", "", "\udcff"]))),
                           ("seq_hashes", _enc_empty_arr(rng)), ("base_block_idx", NIL)]
            if t == "stored":
                fields += [("parent_hash", NIL), ("token_ids", NIL)]
            if legacy:
                fields.append(("type", _enc_str(rng, LEGACY[t])))
                if t != "cleared":
                    fields.append(("block_hashes", _enc_empty_arr(rng)))
                if t == "stored":
                    fields.append(("parent_block_hash", NIL))
            fields = [(k, rng.choice(_WRONG) if rng.random() < p_wrong else v) for k, v in fields]
            r = rng.random()
            if r < 0.02:
                del fields[rng.randrange(len(fields))]
            elif r < 0.04:
                fields.append(rng.choice(fields))
            elif r < 0.06:
                fields.append(("zz_future", rng.choice(_WRONG)))
            rng.shuffle(fields)
            evs.append(mp_map([(_enc_str(rng, k), v) for k, v in fields]))
            ev_id += rng.choice([1, 1, 1, 5, 0 if rng.random() < 0.1 else 1])
        out.append(b"\x93" + _enc_uint(rng, ts) + mp_arr(*evs) + _enc_uint(rng, rng.choice([0, 2**32 - 1])))
    return out
