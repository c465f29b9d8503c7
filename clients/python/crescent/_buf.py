"""Buffers and checksums: the caller's memory as the client sees it.

Every payload the client sends or receives is a memoryview of bytes
(format "B", one dimension, C-contiguous) over memory the caller owns:
bytes, bytearray, memoryview, numpy arrays, or a raw address + size
(Mooncake's buffer_ptr). Nothing here copies an object's bytes.

The checksum is xxhash64 with seed 0, the one the Go SDK computes
(github.com/cespare/xxhash/v2 Sum64) and the agents verify at seal.
It is computed by Debian's libxxhash (package libxxhash0, loaded with
ctypes straight on the buffer's address, without the GIL); without it by
the `xxhash` module (python3-xxhash) when installed, and as a last resort
by a pure-Python implementation that is correct but slow (about 50 MB/s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct

__all__ = ["as_view", "view_at", "address_of", "xxh64", "XXH64_BACKEND"]


def as_view(obj, writable: bool = False) -> memoryview:
    """obj (any object with the buffer protocol) as a flat byte view.

    Raises TypeError for objects without the buffer protocol, ValueError
    for non-contiguous buffers and, with writable, for read-only ones.
    """
    mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if writable and mv.readonly:
        raise ValueError("buffer is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def view_at(addr: int, size: int) -> memoryview:
    """A writable byte view of size bytes at a raw address (no copy)."""
    if size == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


_np = None


def address_of(mv: memoryview) -> int:
    """The address of mv's first byte (mv as returned by as_view)."""
    global _np
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    obj = mv.obj
    if type(obj) is bytes and len(obj) == mv.nbytes:
        return ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value or 0
    if _np is None:
        import numpy  # Debian's python3-numpy; only for read-only non-bytes views

        _np = numpy
    return _np.frombuffer(mv, dtype=_np.uint8).ctypes.data


def _load_lib():
    for name in ("libxxhash.so.0", ctypes.util.find_library("xxhash")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.XXH64
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
        return fn
    return None


_XXH64 = _load_lib()

_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5
_M = (1 << 64) - 1


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc, lane):
    acc = (acc + lane * _P2) & _M
    return (_rotl(acc, 31) * _P1) & _M


def _merge(acc, val):
    acc ^= _round(0, val)
    return (acc * _P1 + _P4) & _M


def xxh64_pure(data) -> int:
    """xxhash64 (seed 0) in pure Python: the reference the fast paths are tested against."""
    b = bytes(data)
    n = len(b)
    i = 0
    if n >= 32:
        v1 = (_P1 + _P2) & _M
        v2 = _P2
        v3 = 0
        v4 = (-_P1) & _M
        while i + 32 <= n:
            a, bb, c, d = struct.unpack_from("<4Q", b, i)
            v1, v2, v3, v4 = _round(v1, a), _round(v2, bb), _round(v3, c), _round(v4, d)
            i += 32
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & _M
        for v in (v1, v2, v3, v4):
            h = _merge(h, v)
    else:
        h = _P5
    h = (h + n) & _M
    while i + 8 <= n:
        (k,) = struct.unpack_from("<Q", b, i)
        h ^= _round(0, k)
        h = (_rotl(h, 27) * _P1 + _P4) & _M
        i += 8
    if i + 4 <= n:
        (k,) = struct.unpack_from("<I", b, i)
        h ^= (k * _P1) & _M
        h = (_rotl(h, 23) * _P2 + _P3) & _M
        i += 4
    while i < n:
        h ^= (b[i] * _P5) & _M
        h = (_rotl(h, 11) * _P1) & _M
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    h ^= h >> 32
    return h


if _XXH64 is not None:
    XXH64_BACKEND = "libxxhash"

    def xxh64(mv: memoryview) -> int:
        """xxhash64 (seed 0) of a byte view, computed in place."""
        n = mv.nbytes
        if n == 0:
            return _XXH64(None, 0, 0)
        return _XXH64(address_of(mv), n, 0)

else:  # pragma: no cover - depends on the machine
    try:
        import xxhash as _xxhash_mod

        XXH64_BACKEND = "xxhash-module"

        def xxh64(mv: memoryview) -> int:
            return _xxhash_mod.xxh64_intdigest(mv)

    except ImportError:
        XXH64_BACKEND = "pure-python"
        xxh64 = xxh64_pure
