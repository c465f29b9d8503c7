"""crescent._wire against the generated classes: the hand-encoded requests
are byte for byte what SerializeToString gives for the same values, over
random values at every varint and length boundary; and what it declines
(None) is what the generated classes then judge."""

from __future__ import annotations

import random

import pytest

from crescent import _buf, _wire
from crescent._gen.agent.v1 import transfer_pb2
from crescent._gen.master.v1 import object_pb2, types_pb2

_INTS = [0, 1, 127, 128, 255, 16383, 16384, 2**21 - 1, 2**21, 2**32 - 1, 2**32, 2**63, 2**64 - 1]


def _rand_str(r: random.Random) -> str:
    n = r.choice([0, 1, 5, 40, 120, 127, 128, 200, 5000])
    alphabet = "abcXYZ/_-.0123456789" + "é漢🙂"
    return "".join(r.choice(alphabet) for _ in range(n))


def _rand_int(r: random.Random) -> int:
    return r.choice(_INTS + [r.randrange(2**64) for _ in range(3)])


def test_uvarint():
    for n in _INTS + list(range(300)):
        m = types_pb2.ReplicaDescriptor(allocation_id=n)
        want = m.SerializeToString()
        got = b"\x30" + _wire.uvarint(n) if n else b""
        assert got == want, n


@pytest.mark.parametrize("seed", range(40))
def test_master_requests_match_protobuf(seed):
    r = random.Random(seed)
    tenant, host, cid = _rand_str(r), _rand_str(r), _rand_str(r)
    keys = [_rand_str(r) for _ in range(r.randrange(1, 20))]
    idx = sorted(r.sample(range(len(keys)), r.randrange(1, len(keys) + 1)))

    want = object_pb2.BatchGetReplicaListRequest(
        items=[object_pb2.GetReplicaListRequest(tenant=tenant, key=keys[i], client_host=host) for i in idx])
    assert _wire.batch_get_replica_list(tenant, keys, idx, host) == want.SerializeToString()

    sizes = [_rand_int(r) for _ in idx]
    cfg = r.choice([None, types_pb2.ReplicateConfig(replica_num=3, hard_pin=True, group_id=_rand_str(r)),
                    types_pb2.ReplicateConfig(preferred_segments=["a", "b"])])
    upsert = r.random() < 0.5
    want = object_pb2.BatchPutStartRequest()
    for i, size in zip(idx, sizes):
        it = want.items.add(tenant=tenant, key=keys[i], size=size, client_id=cid, upsert=upsert)
        if cfg is not None:
            it.config.CopyFrom(cfg)
    got = _wire.batch_put_start(tenant, keys, idx, sizes, cfg.SerializeToString() if cfg is not None else b"", cid, upsert)
    assert got == want.SerializeToString()

    sums = [_rand_int(r) for _ in idx]
    want = object_pb2.BatchPutEndRequest(
        items=[object_pb2.PutEndRequest(tenant=tenant, key=keys[i], client_id=cid, checksum=s) for i, s in zip(idx, sums)])
    assert _wire.batch_put_end(tenant, keys, idx, cid, sums) == want.SerializeToString()


@pytest.mark.parametrize("seed", range(40))
def test_transfer_request_matches_protobuf(seed):
    r = random.Random(seed)
    segs = [_rand_str(r) for _ in range(3)]
    descs = [types_pb2.ReplicaDescriptor(segment_id=r.choice(segs), allocation_id=_rand_int(r),
                                         token=r.randbytes(r.choice([0, 1, 32, 127, 128, 300])))
             for _ in range(r.randrange(1, 30))]
    lengths = [_rand_int(r) for _ in descs]
    offsets = r.choice([None, [_rand_int(r) for _ in descs]])
    op = r.choice([transfer_pb2.TRANSFER_OP_READ, transfer_pb2.TRANSFER_OP_WRITE, 0])
    want = transfer_pb2.TransferRequest(op=op, items=[
        transfer_pb2.TransferItem(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token,
                                  offset=offsets[k] if offsets else 0, length=lengths[k])
        for k, d in enumerate(descs)])
    assert _wire.transfer_request(op, descs, lengths, offsets) == want.SerializeToString()


def test_declines_what_it_does_not_handle():
    """Keys that are not plain str, or not UTF-8 encodable: None, and the
    caller's generated message decides (it raises, as before)."""
    for bad in ([b"bytes-key"], [7], ["\ud800"], [None]):
        keys = ["ok"] + bad
        assert _wire.batch_get_replica_list("t", keys, [0, 1], "h") is None
        assert _wire.batch_put_start("t", keys, [0, 1], [1, 1], b"", "c", False) is None
        assert _wire.batch_put_end("t", keys, [0, 1], "c", [1, 1]) is None
    with pytest.raises((TypeError, ValueError)):
        object_pb2.GetReplicaListRequest(key="\ud800").SerializeToString()


def test_checksum_backends_agree():
    """The xxhash module (when installed) and libxxhash through ctypes
    give the same XXH3-64 (seed 0) for every size the hash treats apart."""
    if _buf._XXH3 is None:
        pytest.skip("libxxhash0 not installed")
    r = random.Random(1)
    for n in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4096, 65537, 1 << 20):
        b = r.randbytes(n)
        mv = _buf.as_view(bytearray(b))
        want = _buf._XXH3(_buf.address_of(mv), n) if n else _buf._XXH3(None, 0)
        assert _buf.checksum(mv) == want, n
        assert _buf.checksum(_buf.as_view(b)) == want, n
