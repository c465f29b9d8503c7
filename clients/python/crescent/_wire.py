"""Protobuf wire encoding of the few requests on the hot paths, by hand.

Debian's protobuf runtime (the C++ extension over descriptors, without
generated C++ classes) costs about a microsecond per repeated item added
from Python (`items.add(...)`, one wrapper object each) and as much again
to serialize it by reflection: for a batch of 4 KiB objects that is more
than the bytes cost. These functions write the same bytes straight from
the Python values, a few string joins per item: BatchGetReplicaList,
BatchPutStart and BatchPutEnd to the master (sent through the raw-bytes
callables of crescent._masters), and TransferRequest to an agent's bulk
transfer listener (crescent._xfer).

Each encoder returns exactly what the generated message's
SerializeToString returns for the same values (fields in number order,
defaults omitted: tests/test_wire.py checks this against the generated
classes), or None when a value is not of the simple kind it handles (a key
that is not a str, or not encodable as UTF-8); the caller then builds the
message with the generated classes, which raise as before. Nothing here
decodes: responses go through the generated classes.
"""

from __future__ import annotations

__all__ = ["uvarint", "batch_get_replica_list", "batch_put_start", "batch_put_end", "transfer_request"]

# Varints by 14-bit chunks: _LAST[c] is c (< 2**14) as a whole varint,
# _MORE[c] its two bytes with the continuation bit set on both (more
# follow). 32768 small bytes objects, built once at import (~1 MB, a few ms).
_LAST = [bytes((c,)) for c in range(0x80)] + [bytes(((c & 0x7F) | 0x80, c >> 7)) for c in range(0x80, 0x4000)]
_MORE = [bytes(((c & 0x7F) | 0x80, (c >> 7) | 0x80)) for c in range(0x4000)]


def uvarint(n: int) -> bytes:
    """n (0 <= n < 2**64) as a protobuf varint."""
    if n < 0x4000:
        return _LAST[n]
    if n < 1 << 28:
        return _MORE[n & 0x3FFF] + _LAST[n >> 14]
    if n < 1 << 42:
        return _MORE[n & 0x3FFF] + _MORE[(n >> 14) & 0x3FFF] + _LAST[n >> 28]
    if n < 1 << 56:
        return _MORE[n & 0x3FFF] + _MORE[(n >> 14) & 0x3FFF] + _MORE[(n >> 28) & 0x3FFF] + _LAST[n >> 42]
    if n >> 64:
        raise ValueError(f"{n} does not fit in 64 bits")
    return _MORE[n & 0x3FFF] + _MORE[(n >> 14) & 0x3FFF] + _MORE[(n >> 28) & 0x3FFF] + _MORE[(n >> 42) & 0x3FFF] + _LAST[n >> 56]


def _str_field(tag: bytes, s: str) -> bytes:
    """A string field (omitted when empty, as proto3 does)."""
    if not s:
        return b""
    b = s.encode()
    return tag + uvarint(len(b)) + b


def _bytes_field(tag: bytes, b: bytes) -> bytes:
    if not b:
        return b""
    return tag + uvarint(len(b)) + b


def _msg(tag: bytes, body: bytes) -> bytes:
    return tag + uvarint(len(body)) + body


def _keys(keys, idx):
    """The UTF-8 bytes of keys[i] for i in idx, or None if one is not a
    plain str or does not encode (the generated classes then decide)."""
    try:
        out = [keys[i].encode() for i in idx]
    except (AttributeError, UnicodeEncodeError):
        return None
    for i in idx:
        if type(keys[i]) is not str:
            return None
    return out


def _vlen(n: int) -> bytes:
    return _LAST[n] if n < 0x4000 else uvarint(n)


def batch_get_replica_list(tenant: str, keys, idx, client_host: str):
    """BatchGetReplicaListRequest{items: [GetReplicaListRequest{tenant,
    key: keys[i], client_host} for i in idx]}."""
    kbs = _keys(keys, idx)
    if kbs is None:
        return None
    pre = _str_field(b"\x0a", tenant)
    post = _str_field(b"\x1a", client_host)
    fixed = len(pre) + len(post)
    parts = []
    ap = parts.append
    last = _LAST
    for kb in kbs:
        lk = len(kb)
        if not lk:
            ap(b"\x0a" + _vlen(fixed) + pre + post)
            continue
        vk = last[lk] if lk < 0x4000 else uvarint(lk)
        n = fixed + 1 + len(vk) + lk
        ap(b"\x0a")
        ap(last[n] if n < 0x4000 else uvarint(n))
        ap(pre)
        ap(b"\x12")
        ap(vk)
        ap(kb)
        ap(post)
    return b"".join(parts)


def batch_put_start(tenant: str, keys, idx, sizes, config: bytes, client_id: str, upsert: bool):
    """BatchPutStartRequest{items: [PutStartRequest{tenant, key: keys[i],
    size: sizes[k], config (already serialized, b"" for none), client_id,
    upsert} for k, i in enumerate(idx)]}."""
    kbs = _keys(keys, idx)
    if kbs is None:
        return None
    pre = _str_field(b"\x0a", tenant)
    post = (b"\x22" + uvarint(len(config)) + config if config else b"") + _str_field(b"\x2a", client_id) + (b"\x30\x01" if upsert else b"")
    fixed = len(pre) + len(post)
    parts = []
    ap = parts.append
    last = _LAST
    for kb, size in zip(kbs, sizes):
        lk = len(kb)
        kf = b"\x12" + (last[lk] if lk < 0x4000 else uvarint(lk)) + kb if lk else b""
        sf = b"\x18" + (last[size] if size < 0x4000 else uvarint(size)) if size else b""
        n = fixed + len(kf) + len(sf)
        ap(b"\x0a")
        ap(last[n] if n < 0x4000 else uvarint(n))
        ap(pre)
        ap(kf)
        ap(sf)
        ap(post)
    return b"".join(parts)


def batch_put_end(tenant: str, keys, idx, client_id: str, checksums):
    """BatchPutEndRequest{items: [PutEndRequest{tenant, key: keys[i],
    client_id, checksum: checksums[k]} for k, i in enumerate(idx)]}."""
    kbs = _keys(keys, idx)
    if kbs is None:
        return None
    pre = _str_field(b"\x0a", tenant)
    cid = _str_field(b"\x1a", client_id)
    fixed = len(pre) + len(cid)
    parts = []
    ap = parts.append
    last = _LAST
    for kb, sum_ in zip(kbs, checksums):
        lk = len(kb)
        kf = b"\x12" + (last[lk] if lk < 0x4000 else uvarint(lk)) + kb if lk else b""
        cf = b"\x20" + uvarint(sum_) if sum_ else b""
        n = fixed + len(kf) + len(cf)
        ap(b"\x0a")
        ap(last[n] if n < 0x4000 else uvarint(n))
        ap(pre)
        ap(kf)
        ap(cid)
        ap(cf)
    return b"".join(parts)


def transfer_request(op: int, descs, lengths, offsets=None) -> bytes:
    """TransferRequest{op, items: [TransferItem{segment_id, allocation_id,
    token, offset, length} ...]}: one item per replica descriptor in descs
    (anything with segment_id, allocation_id and token), lengths[k] bytes
    from offsets[k] (0 when offsets is None)."""
    parts = [b"\x08" + uvarint(op)] if op else []
    ap = parts.append
    segs: dict[str, bytes] = {}
    last = _LAST
    for k, d in enumerate(descs):
        seg = d.segment_id
        sf = segs.get(seg)
        if sf is None:
            sf = segs[seg] = _str_field(b"\x0a", seg)
        alloc, tok, n = d.allocation_id, d.token, lengths[k]
        off = offsets[k] if offsets is not None else 0
        lt = len(tok)
        if alloc and lt and n and not off:
            # The batch case, every field set but the offset.
            body = b"".join((sf, b"\x10", uvarint(alloc), b"\x1a", last[lt] if lt < 0x4000 else uvarint(lt), tok,
                             b"\x28", last[n] if n < 0x4000 else uvarint(n)))
        else:
            body = b"".join((
                sf,
                b"\x10" + uvarint(alloc) if alloc else b"",
                b"\x1a" + uvarint(lt) + tok if lt else b"",
                b"\x20" + uvarint(off) if off else b"",
                b"\x28" + uvarint(n) if n else b"",
            ))
        lb = len(body)
        ap(b"\x12")
        ap(last[lb] if lb < 0x4000 else uvarint(lb))
        ap(body)
    return b"".join(parts)
