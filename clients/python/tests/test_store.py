"""DistributedStore (Mooncake's API) against a real cluster: every call,
with good and bad input. A failure must give the documented code and leave
nothing half-written: no object readable under a key whose put failed, no
byte of a caller's buffer touched by a get that failed before reading."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from crescent import Client, DistributedStore, ErrorCode, ReplicateConfig
from crescent._gen.master.v1 import object_pb2

OK = 0


def rnd(n: int) -> bytes:
    return os.urandom(n)


def objects(client: Client):
    """The tenant's objects (ObjectInfo) by key."""
    r = client._call("ListObjects", object_pb2.ListObjectsRequest(tenant=client.tenant))
    return {o.key: o for o in r.objects}


# --- put / get and friends -----------------------------------------------------


def test_put_get_size_exist(store):
    v = rnd(1000)
    assert store.put("a", v) == OK
    assert store.get("a") == v
    assert store.get_size("a") == 1000
    assert store.is_exist("a") == 1
    assert store.is_exist("b") == 0
    assert store.batch_is_exist(["a", "b", "a"]) == [1, 0, 1]


def test_put_existing_key_and_upsert(store):
    assert store.put("k", b"one") == OK
    assert store.put("k", b"two!") == ErrorCode.OBJECT_ALREADY_EXISTS
    assert store.upsert("k", b"three") == OK
    assert store.get("k") == b"three"
    # A read grants a lease (10 s) during which an upsert, which removes the
    # old replicas, is refused as a remove would be.
    assert store.upsert("k", b"four") == ErrorCode.OBJECT_HAS_LEASE
    assert store.get("k") == b"three"
    assert store.upsert("new", b"fresh") == OK  # upsert of a missing key inserts
    assert store.get("new") == b"fresh"


def test_missing_key(store):
    assert store.get("missing") == b""  # Mooncake: empty bytes
    assert store.get_size("missing") == ErrorCode.OBJECT_NOT_FOUND
    assert store.remove("missing") == ErrorCode.OBJECT_NOT_FOUND
    buf = bytearray(b"\xaa" * 16)
    assert store.get_into("missing", buf, 16) == ErrorCode.OBJECT_NOT_FOUND
    assert buf == bytearray(b"\xaa" * 16)
    assert store.last_error.reason == "OBJECT_NOT_FOUND"


def test_bad_values(store):
    assert store.put("empty", b"") == ErrorCode.INVALID_PARAMS  # Crescent objects have size > 0
    assert store.put("", b"x") == ErrorCode.INVALID_PARAMS
    assert store.put("notabuffer", 12345) == ErrorCode.INVALID_PARAMS
    assert store.put("k" * 5000, b"x") == ErrorCode.INVALID_PARAMS  # keys are at most 4096 bytes
    assert store.put("cfg", b"x", ReplicateConfig(replica_num=0)) == ErrorCode.INVALID_PARAMS
    assert store.put("cfg", b"x", ReplicateConfig(replica_num=3)) == ErrorCode.NO_AVAILABLE_HANDLE  # two segments
    assert store.batch_is_exist(["empty", "notabuffer", "cfg"]) == [0, 0, 0]
    assert store.batch_is_exist(["ok", ""]) == [-1, -1]  # an invalid key fails the whole batch


def test_put_batch_get_batch(store):
    keys = [f"b/{i}" for i in range(300)]
    vals = [rnd(4096) for _ in keys]
    assert store.put_batch(keys, vals) == OK
    assert store.get_batch(keys) == vals
    # One bad item fails alone: its code comes back, the others are stored.
    assert store.put_batch(["b/0", "b/new"], [b"again", b"new"]) == ErrorCode.OBJECT_ALREADY_EXISTS
    assert store.get("b/new") == b"new" and store.get("b/0") == vals[0]
    assert store.get_batch(["b/1", "nope", "b/2"]) == [vals[1], b"", vals[2]]
    assert store.put_batch(["x", "y"], [b"1"]) == ErrorCode.INVALID_PARAMS  # lengths differ
    assert store.batch_is_exist(["x", "y"]) == [0, 0]


def test_upsert_batch_and_parts(store):
    assert store.upsert_batch(["u1", "u2"], [b"a", b"b"]) == OK
    assert store.upsert_batch(["u1", "u2"], [b"aa", b"bb"]) == OK
    assert store.get_batch(["u1", "u2"]) == [b"aa", b"bb"]
    assert store.put_parts("p", b"Hello, ", memoryview(b"World"), bytearray(b"!")) == OK
    assert store.put_parts("p", b"x") == ErrorCode.OBJECT_ALREADY_EXISTS
    assert store.get("p") == b"Hello, World!"
    assert store.upsert_parts("p2", b"x", b"y") == OK
    assert store.upsert_parts("p2", b"x", b"y", b"z") == OK
    assert store.get("p2") == b"xyz"
    assert store.put_parts("q", b"ok", 3) == ErrorCode.INVALID_PARAMS
    assert store.is_exist("q") == 0


def test_large_objects_both_paths(cluster, tenant):
    """17 MiB crosses the transfer protocol's 16 MiB request size and the
    DataService stream's chunks; two replicas put one on each agent (one has
    a transfer listener, the other only DataService)."""
    big = rnd(17 << 20)
    for disable in (False, True):
        s = DistributedStore()
        assert s.setup(cluster.master, tenant, disable_transfer=disable) == OK
        key = f"big/{disable}"
        assert s.put(key, big, ReplicateConfig(replica_num=2)) == OK, s.last_error
        out = np.zeros(len(big), dtype=np.uint8)
        assert s.get_into(key, out, out.nbytes) == len(big), s.last_error
        assert out.tobytes() == big
        assert s.get(key) == big
        reps = s.client.stat(key).replicas
        assert len({r.segment_id for r in reps}) == 2
        s.close()


# --- zero-copy calls ---------------------------------------------------------------


def test_put_from_get_into_buffer_kinds(store):
    data = rnd(64 << 10)
    srcs = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(bytearray(data)),
        "numpy": np.frombuffer(data, dtype=np.uint8).copy(),
        "numpy-f32-2d": np.frombuffer(data, dtype=np.float32).reshape(128, -1).copy(),
    }
    for name, src in srcs.items():
        assert store.put_from(f"z/{name}", src, len(data)) == OK, (name, store.last_error)
    for name in srcs:
        for dst in (bytearray(len(data)), np.empty(len(data) // 4, dtype=np.float32), memoryview(bytearray(len(data) + 10))):
            assert store.get_into(f"z/{name}", dst, memoryview(dst).nbytes) == len(data), (name, store.last_error)
            assert bytes(memoryview(dst).cast("B")[: len(data)]) == data


def test_raw_pointers_need_registration(store):
    src = np.frombuffer(rnd(8192), dtype=np.uint8).copy()
    dst = np.zeros(8192, dtype=np.uint8)
    ps, pd = src.ctypes.data, dst.ctypes.data
    # Not registered: refused, nothing stored, nothing read.
    assert store.put_from("raw", ps, 8192) == ErrorCode.INVALID_PARAMS
    assert store.is_exist("raw") == 0
    assert store.register_buffer(ps, 8192) == OK
    assert store.register_buffer(pd, 8192) == OK
    assert store.register_buffer(ps + 100, 10) == ErrorCode.INVALID_PARAMS  # overlaps
    assert store.put_from("raw", ps, 8192) == OK
    assert store.put_from("raw-part", ps + 4096, 4096) == OK  # inside a registration
    assert store.put_from("raw-over", ps + 4096, 8192) == ErrorCode.INVALID_PARAMS  # runs past it
    assert store.is_exist("raw-over") == 0
    assert store.get_into("raw", pd, 8192) == 8192
    assert (dst == src).all()
    assert store.get_into("raw-part", pd, 4096) == 4096
    assert (dst[:4096] == src[4096:]).all()
    # ctypes memory works the same way.
    cbuf = (ctypes.c_ubyte * 4096)()
    assert store.register_buffer(ctypes.addressof(cbuf), 4096) == OK
    assert store.get_into("raw-part", ctypes.addressof(cbuf), 4096) == 4096
    assert bytes(cbuf) == src[4096:].tobytes()
    assert store.unregister_buffer(ctypes.addressof(cbuf)) == OK
    assert store.unregister_buffer(ctypes.addressof(cbuf)) == ErrorCode.INVALID_PARAMS
    assert store.get_into("raw-part", ctypes.addressof(cbuf), 4096) == ErrorCode.INVALID_PARAMS
    assert store.unregister_buffer(ps) == OK and store.unregister_buffer(pd) == OK
    # A Python buffer object registers itself.
    assert store.register_buffer(dst) == OK
    assert store.get_into("raw", pd, 8192) == 8192
    assert store.unregister_buffer(dst) == OK


def test_buffer_too_small_and_wrong_sizes(store):
    data = rnd(10000)
    assert store.put("obj", data) == OK
    small = bytearray(b"\x55" * 9999)
    assert store.get_into("obj", small, 9999) == ErrorCode.BUFFER_OVERFLOW
    assert small == bytearray(b"\x55" * 9999)  # untouched
    assert store.last_error.reason == "BUFFER_TOO_SMALL"
    # A size larger than the buffer object: refused before anything moves.
    buf = bytearray(100)
    assert store.get_into("obj", buf, 10000) == ErrorCode.BUFFER_OVERFLOW
    assert store.put_from("too-big", buf, 101) == ErrorCode.BUFFER_OVERFLOW
    assert store.is_exist("too-big") == 0
    assert store.get_into("obj", buf, -1) == ErrorCode.INVALID_PARAMS
    assert store.get_into("obj", bytes(10000), 10000) == ErrorCode.INVALID_PARAMS  # read-only
    # size 0 means an empty object: Crescent stores none.
    assert store.put_from("zero", buf, 0) == ErrorCode.INVALID_PARAMS


def test_batch_put_from_get_into_mixed(store):
    n = 8
    src = np.frombuffer(rnd(n * 4096), dtype=np.uint8).copy()
    views = [src[i * 4096 : (i + 1) * 4096] for i in range(n)]
    sizes = [4096] * n
    sizes[3] = 5000  # larger than its buffer
    keys = [f"m/{i}" for i in range(n)]
    codes = store.batch_put_from(keys, views, sizes)
    assert codes == [OK, OK, OK, ErrorCode.BUFFER_OVERFLOW, OK, OK, OK, OK]
    assert store.batch_upsert_from(keys[:2], views[2:4], [4096, 4096]) == [OK, OK]
    views[0], views[1] = views[2], views[3]
    assert store.batch_is_exist(keys) == [1, 1, 1, 0, 1, 1, 1, 1]
    assert store.batch_put_from(["a", "b"], views[:2], [4096]) == [ErrorCode.INVALID_PARAMS] * 2
    dst = np.zeros(n * 4096, dtype=np.uint8)
    dviews = [dst[i * 4096 : (i + 1) * 4096] for i in range(n)]
    dsizes = [4096] * n
    dviews[5] = dst[5 * 4096 : 5 * 4096 + 100]
    dsizes[5] = 100
    got = store.batch_get_into(keys, dviews, dsizes)
    assert got == [4096, 4096, 4096, ErrorCode.OBJECT_NOT_FOUND, 4096, ErrorCode.BUFFER_OVERFLOW, 4096, 4096]
    for i in (0, 1, 2, 4, 6, 7):
        assert (dst[i * 4096 : (i + 1) * 4096] == views[i]).all()
    assert not dst[3 * 4096 : 4 * 4096].any() and not dst[5 * 4096 : 6 * 4096].any()


# --- removal -----------------------------------------------------------------------------


def test_remove_calls(cluster, tenant):
    s = DistributedStore()
    assert s.setup(cluster.master, tenant) == OK
    keys = [f"r/{i}" for i in range(10)] + ["other/1", "other/2"]
    assert s.put_batch(keys, [b"v"] * len(keys)) == OK
    assert s.remove("r/0") == OK
    assert s.is_exist("r/0") == 0
    assert s.batch_remove(["r/1", "r/0", "r/2"]) == [OK, ErrorCode.OBJECT_NOT_FOUND, OK]
    # A read lease keeps an object from being removed without force.
    assert s.get("r/3") == b"v"
    assert s.remove("r/3") == ErrorCode.OBJECT_HAS_LEASE
    assert s.batch_remove(["r/3"], force=True) == [OK]
    assert s.remove_by_regex("^r/[4-6]$") == 3
    assert s.batch_is_exist(["r/4", "r/5", "r/6", "r/7"]) == [0, 0, 0, 1]
    assert s.remove_by_regex("(") == ErrorCode.INVALID_PARAMS
    # batch_is_exist took a lease on r/7 (Exist grants one): remove_all skips it.
    assert s.remove_all() == 4  # r/8, r/9, other/1, other/2
    assert s.remove_all(force=True) == 1
    assert s.batch_is_exist(keys) == [0] * len(keys)
    assert s.remove_all() == 0
    s.close()


def test_tenants_are_separate(cluster, tenant):
    a, b = DistributedStore(), DistributedStore()
    assert a.setup(cluster.master, tenant) == OK
    assert b.setup(cluster.master, tenant + "-b") == OK
    assert a.put("shared", b"A") == OK
    assert b.is_exist("shared") == 0
    assert b.put("shared", b"B") == OK
    assert a.get("shared") == b"A" and b.get("shared") == b"B"
    assert b.remove_all(force=True) == 1
    assert a.get("shared") == b"A"
    a.close(), b.close()


# --- ReplicateConfig ---------------------------------------------------------------------


def test_replicate_config(cluster, tenant):
    s = DistributedStore()
    assert s.setup(cluster.master, tenant, local_hostname="host-b") == OK
    c = s.client
    segs = {x.host_id: x.info.segment_id for x in cluster.segments()}
    assert s.put("two", b"x", ReplicateConfig(replica_num=2)) == OK
    assert sorted(r.host_id for r in c.stat("two").replicas) == ["host-a", "host-b"]
    for host in ("host-a", "host-b"):
        cfg = ReplicateConfig()
        cfg.preferred_segment = segs[host]
        assert s.put(f"pref/{host}", b"x" * 5000, cfg) == OK
        assert [r.host_id for r in c.stat(f"pref/{host}").replicas] == [host]
        assert s.get(f"pref/{host}") == b"x" * 5000  # agent-b has no transfer listener: DataService
    cfg = ReplicateConfig()
    cfg.prefer_alloc_in_same_node = True
    for i in range(4):
        assert s.put(f"local/{i}", b"y", cfg) == OK
        assert [r.host_id for r in c.stat(f"local/{i}").replicas] == ["host-b"]
    soft, hard = ReplicateConfig(), ReplicateConfig()
    soft.with_soft_pin = True
    hard.with_hard_pin = True
    assert s.put("soft", b"s", soft) == OK
    assert s.put("hard", b"h", hard) == OK
    objs = objects(c)
    assert objs["soft"].soft_pinned and not objs["soft"].hard_pinned
    assert objs["hard"].hard_pinned
    assert s.remove("hard") == ErrorCode.REPLICA_IS_NOT_READY  # OBJECT_BUSY: hard-pinned
    assert s.remove("hard", force=True) == OK
    bad = ReplicateConfig()
    bad.preferred_segment = "no-such-segment"
    assert s.put("bad-pref", b"z", bad) in (OK, ErrorCode.SEGMENT_NOT_FOUND, ErrorCode.INVALID_PARAMS)
    s.close()


# --- checksums -----------------------------------------------------------------------------


def test_checksum_verified_on_read(cluster, tenant, monkeypatch):
    """Bytes that do not match the master's checksum are never returned: the
    next replica is read, and with none left the get fails CHECKSUM_MISMATCH.
    The replica whose bytes failed is then verified by its agent (a transfer
    VERIFY), which re-reads it and finds it intact (the bytes went wrong
    here, not there): nothing is dropped."""
    from crescent import _xfer

    s = DistributedStore()
    assert s.setup(cluster.master, tenant, local_hostname="host-a") == OK  # host-a (transfer) read first
    data = rnd(4096)
    assert s.put("two", data, ReplicateConfig(replica_num=2)) == OK
    cfg = ReplicateConfig()
    cfg.preferred_segment = next(x.info.segment_id for x in cluster.segments() if x.host_id == "host-a")
    assert s.put("one", data, cfg) == OK
    real = _xfer.Conn.read_results

    def corrupt(self, items, rs, dst, res, *args):
        real(self, items, rs, dst, res, *args)
        for d in dst:
            d[0] ^= 0xFF

    verified = []  # (endpoint, segment and allocation ids, answer)
    real_verify = _xfer.Pool.verify

    def spy(self, endpoint, items, timeout=None):
        out = real_verify(self, endpoint, items, timeout)
        verified.append((endpoint, [(it.segment_id, it.allocation_id) for it in items], out))
        return out

    def replicas(key):
        rl = s.client._call("GetReplicaList", object_pb2.GetReplicaListRequest(tenant=tenant, key=key))
        return [(d.segment_id, d.allocation_id, d.transfer_endpoint) for d in rl.replicas]

    two, one = replicas("two"), replicas("one")
    on_a = [(seg, alloc) for seg, alloc, ep in two if ep]
    assert len(two) == 2 and len(on_a) == 1
    monkeypatch.setattr(_xfer.Pool, "verify", spy)
    monkeypatch.setattr(_xfer.Conn, "read_results", corrupt)
    assert s.get("two") == data  # the transfer replica is corrupt; agent-b's (DataService) is not
    ep_a = next(ep for _, _, ep in two if ep)
    assert verified == [(ep_a, on_a, [None])]  # the agent's own reading: intact
    verified.clear()
    buf = bytearray(4096)
    assert s.get_into("one", buf, 4096) == ErrorCode.CHECKSUM_MISMATCH
    # Every read of the only replica (the get refetches its list once) is verified.
    assert verified and all(v == (ep_a, [one[0][:2]], [None]) for v in verified), verified
    monkeypatch.setattr(_xfer.Conn, "read_results", real)
    assert sorted(replicas("two")) == sorted(two) and replicas("one") == one  # nothing dropped
    assert s.get("one") == data
    assert s.get("two") == data
    s.close()


def test_checksum_is_xxh3():
    """XXH3-64 (seed 0), internal/checksum's: the xxHash project's vectors,
    and every kind of buffer giving the same value."""
    from crescent._buf import as_view, checksum

    assert checksum(as_view(b"")) == 0x2D06800538D394C2
    assert checksum(as_view(b"abc")) == 0x78AF5F94892F3950
    for n in (1, 3, 4, 8, 16, 17, 128, 129, 240, 241, 4096, 65537):
        b = rnd(n)
        want = checksum(as_view(b))
        assert checksum(as_view(bytearray(b))) == want
        assert checksum(as_view(np.frombuffer(b, dtype=np.uint8))) == want
        assert checksum(memoryview(b"x" + b)[1:]) == want
    try:
        import xxhash
    except ImportError:
        return
    for n in (0, 1, 17, 129, 241, 4096, 65537):
        b = rnd(n)
        assert checksum(as_view(b)) == xxhash.xxh3_64_intdigest(b)
