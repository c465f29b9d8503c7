"""Mooncake's `MooncakeDistributedStore` Python API, backed by Crescent.

A connector written against Mooncake's API reference
(docs/source/python-api-reference/mooncake-store.md) runs unchanged except
for `setup`, which takes Crescent's master address(es), tenant and TLS
credentials instead of Mooncake's local hostname, metadata server, segment
and buffer sizes, protocol and RDMA devices. Every method returns what
Mooncake documents (0 or a negative Mooncake error code, a count, a
list of per-item codes) and never raises for a Crescent failure; the
code of the last failure and its message are kept (last_error). Every
difference from Mooncake is listed in clients/python/README.md.

Zero-copy calls take `buffer_ptr` as Mooncake does (an int address, from
numpy's arr.ctypes.data, ctypes.addressof or torch's data_ptr()) and also
any Python buffer (memoryview, bytearray, a numpy array). A raw address
must lie inside a buffer given to register_buffer (else INVALID_PARAMS):
Python cannot check a bare address, and an unchecked one would make a bad
argument crash the interpreter instead of failing the call.
"""

from __future__ import annotations

import bisect
import threading

from ._buf import as_view, view_at
from .client import Client, ReplicateConfig
from .errors import CrescentError, ErrorCode, mooncake_code

__all__ = ["DistributedStore", "MooncakeDistributedStore", "ReplicateConfig", "ErrorCode"]


class DistributedStore:
    """Mooncake's MooncakeDistributedStore surface on a Crescent cluster."""

    def __init__(self):
        self._client: Client | None = None
        self._reg_mu = threading.Lock()  # guards _reg_starts, _reg
        self._reg_starts: list[int] = []  # sorted start addresses of registered buffers
        self._reg: dict[int, tuple[int, object]] = {}  # start -> (size, keepalive)
        self.last_error: CrescentError | Exception | None = None

    # --- setup --------------------------------------------------------------------

    def setup(self, master_server_addr: str, tenant: str = "default", *, tls_ca: str | None = None,
              tls_cert: str | None = None, tls_key: str | None = None, bearer_token: str = "",
              local_hostname: str = "", **options) -> int:
        """Connect to Crescent: master_server_addr is "host:port" or several,
        comma-separated (HA); tenant scopes every key; tls_ca/tls_cert/
        tls_key (PEM files) turn on (mutual) TLS; bearer_token needs TLS.
        local_hostname is this client's host id (replicas on it are read
        first; prefer_alloc_in_same_node places on it). Other keyword
        options go to crescent.Client (disable_transfer, max_concurrency,
        timeout...). Returns 0, or INVALID_PARAMS for bad arguments. No
        I/O: the first call connects."""
        if self._client is not None:
            self._client.close()
            self._client = None
        try:
            self._client = Client(master_server_addr, tenant, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                  bearer_token=bearer_token, host_id=local_hostname, **options)
        except (ValueError, TypeError, OSError) as e:
            self.last_error = e
            return ErrorCode.INVALID_PARAMS
        return 0

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        with self._reg_mu:
            self._reg_starts.clear()
            self._reg.clear()
        return 0

    def get_hostname(self) -> str:
        return self._c().host_id

    @property
    def client(self) -> Client:
        """The underlying crescent.Client (raising API)."""
        return self._c()

    def _c(self) -> Client:
        if self._client is None:
            raise CrescentError("INVALID_PARAMS", "setup() has not been called")
        return self._client

    def _code(self, e: BaseException) -> int:
        self.last_error = e
        return mooncake_code(e)

    # --- buffers ----------------------------------------------------------------------

    def register_buffer(self, buffer_ptr, size: int | None = None) -> int:
        """Register [buffer_ptr, buffer_ptr+size) for raw-address calls. With a
        Python buffer instead of an address, its memory is registered (and
        kept alive until unregistered). Overlapping an existing registration
        is INVALID_PARAMS. Returns 0 or a negative code."""
        try:
            keep = None
            if isinstance(buffer_ptr, int):
                addr = buffer_ptr
                if size is None or size <= 0 or addr <= 0:
                    raise ValueError("register_buffer needs an address > 0 and a size > 0")
            else:
                from ._buf import address_of

                mv = as_view(buffer_ptr)
                addr, keep = address_of(mv), buffer_ptr
                size = mv.nbytes if size is None else size
                if size <= 0 or size > mv.nbytes:
                    raise ValueError(f"size {size} is not within the {mv.nbytes}-byte buffer")
            with self._reg_mu:
                k = bisect.bisect_right(self._reg_starts, addr)
                if k > 0:
                    s = self._reg_starts[k - 1]
                    if s + self._reg[s][0] > addr:
                        raise ValueError("buffer overlaps a registered one")
                if k < len(self._reg_starts) and self._reg_starts[k] < addr + size:
                    raise ValueError("buffer overlaps a registered one")
                self._reg_starts.insert(k, addr)
                self._reg[addr] = (size, keep)
            return 0
        except (ValueError, TypeError) as e:
            return self._code(e)

    def unregister_buffer(self, buffer_ptr) -> int:
        try:
            if not isinstance(buffer_ptr, int):
                from ._buf import address_of

                buffer_ptr = address_of(as_view(buffer_ptr))
            with self._reg_mu:
                if buffer_ptr not in self._reg:
                    raise ValueError(f"no buffer registered at {buffer_ptr:#x}")
                del self._reg[buffer_ptr]
                self._reg_starts.remove(buffer_ptr)
            return 0
        except (ValueError, TypeError) as e:
            return self._code(e)

    def _view(self, buffer_ptr, size: int, writable: bool):
        """The caller's memory for a zero-copy call, size bytes long."""
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, not {size!r}")
        if isinstance(buffer_ptr, int):
            with self._reg_mu:
                k = bisect.bisect_right(self._reg_starts, buffer_ptr)
                ok = k > 0 and (lambda s: buffer_ptr + size <= s + self._reg[s][0])(self._reg_starts[k - 1])
            if not ok:
                raise ValueError(f"[{buffer_ptr:#x}, +{size}) is not inside a registered buffer (register_buffer)")
            return view_at(buffer_ptr, size)
        mv = as_view(buffer_ptr, writable=writable)
        if size > mv.nbytes:
            raise CrescentError("BUFFER_TOO_SMALL", f"size {size} exceeds the {mv.nbytes}-byte buffer")
        return mv[:size]

    # --- puts -------------------------------------------------------------------------

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._put1(key, value, config, False)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._put1(key, value, config, True)

    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        return self._parts(key, parts, config, False)

    def upsert_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        return self._parts(key, parts, config, True)

    def _parts(self, key, parts, config, upsert):
        try:
            data = b"".join(as_view(p) for p in parts)
        except (TypeError, ValueError) as e:
            return self._code(e)
        return self._put1(key, data, config, upsert)

    def _put1(self, key, value, config, upsert):
        try:
            self._c().put(key, value, config, upsert)
            return 0
        except (CrescentError, ValueError, TypeError) as e:
            return self._code(e)

    def put_batch(self, keys, values, config: ReplicateConfig | None = None) -> int:
        """0 when every object was stored, else the first failure's code."""
        return self._first(self._batch_put(keys, values, config, False))

    def upsert_batch(self, keys, values, config: ReplicateConfig | None = None) -> int:
        return self._first(self._batch_put(keys, values, config, True))

    def put_from(self, key: str, buffer_ptr, size: int, config: ReplicateConfig | None = None) -> int:
        return self._batch_from([key], [buffer_ptr], [size], config, False)[0]

    def upsert_from(self, key: str, buffer_ptr, size: int, config: ReplicateConfig | None = None) -> int:
        return self._batch_from([key], [buffer_ptr], [size], config, True)[0]

    def batch_put_from(self, keys, buffer_ptrs, sizes, config: ReplicateConfig | None = None) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, config, False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config: ReplicateConfig | None = None) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, config, True)

    def _first(self, codes) -> int:
        if isinstance(codes, int):
            return codes
        for c in codes:
            if c != 0:
                return c
        return 0

    def _batch_put(self, keys, values, config, upsert):
        try:
            keys, values = list(keys), list(values)
            if len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys but {len(values)} values")
            errs = self._c().put_many(keys, values, config, upsert)
        except (CrescentError, ValueError, TypeError) as e:
            return self._code(e)
        return [0 if e is None else self._code(e) for e in errs]

    def _views(self, keys, ptrs, sizes, writable: bool):
        """The buffers of a batch_*_from/into call: (keys, out, views, idx),
        out holding each key's code so far (a bad buffer's), views the good
        buffers and idx their keys' positions. When the three lists differ in
        length every key is INVALID_PARAMS and views and idx are None."""
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        if not (len(keys) == len(ptrs) == len(sizes)):
            self.last_error = ValueError(f"{len(keys)} keys, {len(ptrs)} buffers, {len(sizes)} sizes")
            return keys, [ErrorCode.INVALID_PARAMS] * len(keys), None, None
        out = [0] * len(keys)
        views, idx = [], []
        for i in range(len(keys)):
            try:
                views.append(self._view(ptrs[i], sizes[i], writable=writable))
                idx.append(i)
            except (CrescentError, ValueError, TypeError) as e:
                out[i] = self._code(e)
        return keys, out, views, idx

    def _batch_from(self, keys, ptrs, sizes, config, upsert) -> list[int]:
        keys, out, views, idx = self._views(keys, ptrs, sizes, writable=False)
        if idx:
            try:
                errs = self._c().put_many([keys[i] for i in idx], views, config, upsert)
            except (CrescentError, ValueError, TypeError) as e:
                c = self._code(e)
                errs = None
                for i in idx:
                    out[i] = c
            if errs is not None:
                for i, e in zip(idx, errs):
                    if e is not None:
                        out[i] = self._code(e)
        return out

    # --- gets -------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The object's bytes; b"" when it is missing or on any error (Mooncake)."""
        try:
            return self._c().get(key)
        except (CrescentError, ValueError, TypeError) as e:
            self._code(e)
            return b""

    def get_batch(self, keys) -> list[bytes]:
        try:
            outs, errs = self._c().get_many(list(keys))
        except (CrescentError, ValueError, TypeError) as e:
            self._code(e)
            return [b""] * len(keys)
        res = []
        for o, e in zip(outs, errs):
            if e is not None:
                self._code(e)
                res.append(b"")
            else:
                res.append(bytes(o))
        return res

    def get_into(self, key: str, buffer_ptr, size: int) -> int:
        """Bytes read into the buffer, or a negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys, buffer_ptrs, sizes) -> list[int]:
        keys, out, views, idx = self._views(keys, buffer_ptrs, sizes, writable=True)
        if idx:
            try:
                got, errs = self._c().get_many_into([keys[i] for i in idx], views)
            except (CrescentError, ValueError, TypeError) as e:
                c = self._code(e)
                for i in idx:
                    out[i] = c
                return out
            for i, n, e in zip(idx, got, errs):
                out[i] = n if e is None else self._code(e)
        return out

    def get_size(self, key: str) -> int:
        try:
            return self._c().size(key)
        except (CrescentError, ValueError, TypeError) as e:
            return self._code(e)

    # --- existence and removal ----------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 exists, 0 does not, -1 error (Mooncake)."""
        try:
            return 1 if self._c().exists(key) else 0
        except (CrescentError, ValueError, TypeError) as e:
            self._code(e)
            return -1

    def batch_is_exist(self, keys) -> list[int]:
        try:
            return [1 if x else 0 for x in self._c().exists_many(list(keys))]
        except (CrescentError, ValueError, TypeError) as e:
            self._code(e)
            return [-1] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        try:
            self._c().remove(key, force)
            return 0
        except (CrescentError, ValueError, TypeError) as e:
            return self._code(e)

    def batch_remove(self, keys, force: bool = False) -> list[int]:
        try:
            errs = self._c().remove_many(list(keys), force)
        except (CrescentError, ValueError, TypeError) as e:
            return [self._code(e)] * len(keys)
        return [0 if e is None else self._code(e) for e in errs]

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        """Objects removed, or a negative code."""
        try:
            return self._c().remove_by_regex(regex, force)[0]
        except (CrescentError, ValueError, TypeError) as e:
            return self._code(e)

    def remove_all(self, force: bool = False) -> int:
        """Objects of the tenant removed, or -1 on error (Mooncake)."""
        try:
            return self._c().remove_all(force)[0]
        except (CrescentError, ValueError, TypeError) as e:
            self._code(e)
            return -1


MooncakeDistributedStore = DistributedStore
