"""Buffers and checksums: the caller's memory as the client sees it.

Every payload the client sends or receives is a memoryview of bytes
(format "B", one dimension, C-contiguous) over memory the caller owns:
bytes, bytearray, memoryview, numpy arrays, or a raw address + size
(Mooncake's buffer_ptr). Nothing here copies an object's bytes.

The object checksum is XXH3-64 with seed 0, the one the Go SDK computes
(internal/checksum: github.com/zeebo/xxh3 Hash) and the agents verify at
seal. It is computed by Debian's libxxhash, through the `xxhash` module
(python3-xxhash) when it is installed, else loaded with ctypes (package
libxxhash0) and run straight on the buffer's address. Large buffers are
hashed without the GIL either way; small ones, through the module, with it
(a GIL handoff would cost more than the hash). With neither, importing the package fails and says what to
install.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["as_view", "view_at", "address_of", "checksum", "CHECKSUM_BACKEND"]


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
            fn = lib.XXH3_64bits
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_XXH3 = _load_lib()

# From this size on the checksum lets other threads run while it hashes
# (17 us and more at ~15 GB/s); below it, keeping the GIL is cheaper than
# handing it over and waiting to take it back.
RELEASE_GIL_AT = 256 << 10

try:
    # python3-xxhash (optional): the same libxxhash, called without ctypes'
    # per-call conversions (a third of the time for a 4 KiB object). Its
    # one-shot xxh3_64_intdigest keeps the GIL; a hasher's update releases it.
    from xxhash import xxh3_64 as _xxh3_hasher
    from xxhash import xxh3_64_intdigest as _xxh3_intdigest
except ImportError:  # pragma: no cover - depends on the machine
    _xxh3_intdigest = None

if _xxh3_intdigest is not None:
    CHECKSUM_BACKEND = "xxhash-module"

    def checksum(mv: memoryview) -> int:
        """The object checksum, XXH3-64 (seed 0), of a byte view, computed in place."""
        if mv.nbytes < RELEASE_GIL_AT:
            return _xxh3_intdigest(mv)
        h = _xxh3_hasher()
        h.update(mv)  # without the GIL
        return h.intdigest()

elif _XXH3 is not None:
    CHECKSUM_BACKEND = "libxxhash"

    def checksum(mv: memoryview) -> int:
        """The object checksum, XXH3-64 (seed 0), of a byte view, computed in place."""
        n = mv.nbytes
        if n == 0:
            return _XXH3(None, 0)
        return _XXH3(address_of(mv), n)

else:  # pragma: no cover - depends on the machine
    raise ImportError(
        "crescent needs an XXH3 implementation for the object checksum: "
        "install Debian's python3-xxhash or libxxhash0 (apt-get install python3-xxhash libxxhash0)"
    )
