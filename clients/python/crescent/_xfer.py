"""The bulk transfer protocol, client side, in Python.

internal/xfer/doc.go and proto/crescent/agent/v1/transfer.proto are
normative; this is their client. A connection starts with the preamble
"CXF1"; then each request is u32le(len(header)) TransferRequest followed,
for a WRITE, by the items' bytes concatenated, and each response is
u32le(len(header)) TransferResponse followed, for a READ, by the bytes of
the items whose result is OK. A VERIFY (the agent reads allocations again
and checks them against their sealed checksums) has no payload either way.

The payload goes to the socket straight from the caller's buffers with
one socket.sendmsg (a gather write, no copy), and comes back straight
into the caller's buffers with socket.recv_into, except for the few bytes
that arrive in the same read as a response header (or, for small items,
within one read-ahead buffer), which are copied once, as Go's bufio does.
With TLS the payload goes through the ssl module's buffers instead
(SSLSocket has no sendmsg), as in Go.

Connections are pooled per agent endpoint (at most max_idle idle ones
each); one request at a time per connection.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time

import grpc

from ._gen.agent.v1 import transfer_pb2
from .errors import CrescentError, from_item

PREAMBLE = b"CXF1"
MAX_HEADER_BYTES = 1 << 20
MAX_ITEMS = 4096
MAX_VERIFY_ITEMS = 64  # internal/xfer MaxVerifyItems: the agent refuses more
OP_WRITE = transfer_pb2.TRANSFER_OP_WRITE
OP_READ = transfer_pb2.TRANSFER_OP_READ
OP_VERIFY = transfer_pb2.TRANSFER_OP_VERIFY

_READ_AHEAD = 256 << 10
_FIRST_READ = 8 << 10
_MAX_IDLE_AGE = 120.0
_IOV_MAX = 1024
_U32 = struct.Struct("<I")


def _unavailable(endpoint: str, err) -> CrescentError:
    return CrescentError("AGENT_UNAVAILABLE", f"xfer {endpoint}: {err}", grpc.StatusCode.UNAVAILABLE)


def _violation(endpoint: str, msg: str) -> CrescentError:
    return CrescentError("INTERNAL", f"xfer {endpoint}: agent broke the transfer protocol: {msg}", grpc.StatusCode.INTERNAL)


class _Stale(Exception):
    """A reused connection the agent had closed before this request."""


class Conn:
    def __init__(self, sock, endpoint: str, gather: bool):
        self.sock = sock
        self.endpoint = endpoint
        self.gather = gather  # sendmsg available (plaintext)
        self._waitall = socket.MSG_WAITALL if gather else 0
        self.greeted = False
        self.reused = False
        self.last_used = 0.0
        self._rbuf = bytearray(_READ_AHEAD)
        self._rmv = memoryview(self._rbuf)
        self._rs = self._re = 0  # buffered bytes are _rbuf[_rs:_re]
        self.dirty = False  # bytes were sent: an error leaves the stream unframed
        self.answered = False  # a response byte arrived

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def set_timeout(self, t: float):
        """Bound each wait on the socket for progress to t seconds (the
        pool's io_timeout unless a call asks for less)."""
        t = max(t, 0.001)  # a zero SO_RCVTIMEO would wait forever
        try:
            if self.gather:
                tv = struct.pack("ll", int(t), int((t % 1) * 1e6))
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            else:
                self.sock.settimeout(t)
        except OSError as e:
            raise _unavailable(self.endpoint, e)

    # --- sending -------------------------------------------------------------

    def _sendall(self, bufs):
        if not self.gather:
            for b in bufs:
                self.sock.sendall(b)
            return
        bufs = [b for b in bufs if b.nbytes]
        i = 0
        while i < len(bufs):
            n = self.sock.sendmsg(bufs[i : i + _IOV_MAX])
            while n > 0:
                k = bufs[i].nbytes
                if n >= k:
                    n -= k
                    i += 1
                else:
                    bufs[i] = bufs[i][n:]
                    n = 0

    def send(self, op, items, payload, hdr=None):
        """Send a request; hdr, when given, is the TransferRequest already
        serialized (crescent._wire.transfer_request), and items unused."""
        if hdr is None:
            hdr = transfer_pb2.TransferRequest(op=op, items=items).SerializeToString()
        if len(hdr) > MAX_HEADER_BYTES:
            raise CrescentError(
                "INVALID_PARAMS",
                f"transfer header of {len(hdr)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit (fewer items or shorter tokens)",
            )
        head = (b"" if self.greeted else PREAMBLE) + _U32.pack(len(hdr)) + hdr
        self.dirty = self.greeted = True
        try:
            self._sendall([memoryview(head)] + (payload or []))
        except OSError as e:
            # The agent may have refused the request and closed: its answer
            # says why.
            try:
                resp = self.response()
            except Exception:
                resp = None
            if resp is not None and resp.HasField("error"):
                raise self._refused(resp.error)
            if self.reused and isinstance(e, (BrokenPipeError, ConnectionResetError)):
                raise _Stale(e)
            raise _unavailable(self.endpoint, e)

    # --- receiving -----------------------------------------------------------

    def _fill(self, want: int = _READ_AHEAD) -> int:
        k = self.sock.recv_into(self._rmv, want)
        if k == 0:
            raise EOFError("connection closed by the agent")
        self._rs, self._re = 0, k
        return k

    def readinto(self, mv: memoryview):
        n = mv.nbytes
        off = 0
        avail = self._re - self._rs
        if avail:
            k = min(avail, n)
            mv[:k] = self._rmv[self._rs : self._rs + k]
            self._rs += k
            off = k
        while off < n:
            rem = n - off
            if rem >= _READ_AHEAD:
                # Plaintext: one recv for the whole item (MSG_WAITALL).
                k = self.sock.recv_into(mv[off:], rem, self._waitall)
                if k == 0:
                    raise EOFError("connection closed by the agent")
                off += k
            else:
                k = min(self._fill(), rem)
                mv[off : off + k] = self._rmv[:k]
                self._rs = k
                off += k

    def read_exact(self, n: int) -> bytes:
        avail = self._re - self._rs
        if avail >= n:
            b = bytes(self._rmv[self._rs : self._rs + n])
            self._rs += n
            return b
        out = bytearray(n)
        self.readinto(memoryview(out))
        return bytes(out)

    def response(self):
        try:
            if self._re == self._rs:
                # A small first read: the header, and no more than a few KiB
                # of payload to copy; a large item's bytes then go straight
                # into its destination.
                self._fill(_FIRST_READ)
            self.answered = True
            (n,) = _U32.unpack(self.read_exact(4))
            if n > MAX_HEADER_BYTES:
                raise _violation(self.endpoint, f"response header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
            hdr = self.read_exact(n)
        except (OSError, EOFError) as e:
            if self.reused and not self.answered:
                raise _Stale(e)
            raise _unavailable(self.endpoint, e)
        resp = transfer_pb2.TransferResponse()
        try:
            resp.ParseFromString(hdr)
        except Exception as e:  # google.protobuf.message.DecodeError
            raise _violation(self.endpoint, f"response header does not decode: {e}")
        return resp

    def _refused(self, st) -> CrescentError:
        err = from_item(st.code, st.reason, st.message)
        if err is None:
            return _violation(self.endpoint, "request refused with code OK")
        err.message = f"xfer {self.endpoint}: request refused: {err.message}"
        return err

    def exchange(self, op, items, payload):
        self.send(op, items, payload)
        return self.results(len(items))

    def results(self, n: int):
        """The response to a request of n items sent with send: one result per item."""
        resp = self.response()
        if resp.HasField("error"):
            raise self._refused(resp.error)
        if len(resp.results) != n:
            raise _violation(self.endpoint, f"{len(resp.results)} results for {n} items")
        return resp.results

    def write(self, items, src, errs):
        self.write_results(self.exchange(OP_WRITE, items, src), src, errs)

    def write_results(self, rs, src, errs):
        """The errors of a WRITE's results (src: the bytes sent, one view per item)."""
        for i, r in enumerate(rs):
            err = None
            if r.HasField("status"):  # an OK result carries none
                st = r.status
                err = from_item(st.code, st.reason, st.message) if st.code else None
            if err is None and r.length != src[i].nbytes:
                raise _violation(self.endpoint, f"item {i}: {r.length} bytes written of {src[i].nbytes} sent")
            errs[i] = err

    def verify(self, items, errs):
        """One VERIFY exchange: errs[i] is None when item i's bytes are
        intact, else why not (DATA_LOSS CHECKSUM_MISMATCH: the agent found
        them bad and dropped the allocation) or why it could not check."""
        for i, r in enumerate(self.exchange(OP_VERIFY, items, None)):
            if r.length:
                raise _violation(self.endpoint, f"item {i}: a VERIFY answered with {r.length} payload bytes")
            err = None
            if r.HasField("status"):  # an OK result carries none
                st = r.status
                err = from_item(st.code, st.reason, st.message) if st.code else None
            errs[i] = err

    def read(self, items, dst, res):
        self.read_results([it.offset for it in items], self.exchange(OP_READ, items, None), dst, res)

    def read_results(self, offsets, rs, dst, res):
        """Read the payload of a READ's results into dst. offsets: where
        each item's read starts, or None when every one starts at 0 (the
        batch path)."""
        rmv = self._rmv
        for i, r in enumerate(rs):
            if r.HasField("status"):  # an OK result carries none
                st = r.status
                if st.code:
                    res[i] = (from_item(st.code, st.reason, st.message), 0, 0)
                    continue
            d = dst[i]
            n, want, size = r.length, d.nbytes, r.object_size
            off = 0 if offsets is None else offsets[i]
            if off > size or n > size - off:
                raise _violation(self.endpoint, f"item {i}: {n} bytes from offset {off} of a {size}-byte object")
            if n != want:
                raise _violation(self.endpoint, f"item {i}: {n} payload bytes for a {want}-byte read")
            rs0 = self._rs
            if self._re - rs0 >= n:  # already buffered: one copy, no call
                d[:] = rmv[rs0 : rs0 + n]
                self._rs = rs0 + n
            else:
                try:
                    self.readinto(d)
                except (OSError, EOFError) as e:
                    raise _unavailable(self.endpoint, e)
            res[i] = (None, size, r.checksum)


class Pool:
    """Connections to the agents' transfer listeners, pooled per endpoint."""

    def __init__(self, max_idle: int = 16, dial_timeout: float = 5.0, io_timeout: float = 5.0, tls: ssl.SSLContext | None = None):
        self.max_idle = max_idle
        self.dial_timeout = dial_timeout
        self.io_timeout = io_timeout
        self.tls = tls
        self._mu = threading.Lock()  # guards _idle, _closed
        self._idle: dict[str, list[Conn]] = {}
        self._closed = False

    def close(self):
        with self._mu:
            self._closed = True
            idle, self._idle = self._idle, {}
        for lst in idle.values():
            for c in lst:
                c.close()

    def _get(self, endpoint: str, fresh: bool, dial_timeout: float | None = None) -> Conn:
        old = []
        with self._mu:
            if self._closed:
                raise CrescentError("", "client closed", grpc.StatusCode.CANCELLED)
            lst = self._idle.get(endpoint, [])
            now = time.monotonic()
            while not fresh and lst:
                c = lst.pop()
                if now - c.last_used > _MAX_IDLE_AGE:
                    old.append(c)
                    continue
                for o in old:
                    o.close()
                return c
        for o in old:
            o.close()
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]")
        try:
            sock = socket.create_connection((host, int(port)), timeout=dial_timeout or self.dial_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=host)
        except (OSError, ValueError) as e:
            raise _unavailable(endpoint, e)
        if self.tls is None:
            # Blocking mode with kernel timeouts: Python's own timeout mode
            # polls before every recv and send (twice the system calls) and
            # cannot wait for a whole item (MSG_WAITALL). A timeout then
            # fails the call as an OSError (EAGAIN), like a broken link.
            # The kernel's timeout bounds a wait for progress, not a whole
            # item: a recv (MSG_WAITALL too) or send that moved some bytes
            # when it ran out returns them, and the next call waits anew.
            sock.settimeout(None)
        c = Conn(sock, endpoint, gather=self.tls is None)
        try:
            c.set_timeout(self.io_timeout)
        except CrescentError:
            c.close()
            raise
        return c

    def _put(self, c: Conn, ok: bool):
        if not ok:
            c.close()
            return
        c.reused = True
        c.last_used = time.monotonic()
        with self._mu:
            if self._closed:
                c.close()
                return
            lst = self._idle.setdefault(c.endpoint, [])
            if len(lst) >= self.max_idle:
                c.close()
                return
            lst.append(c)

    def _drop_idle(self, endpoint: str):
        with self._mu:
            lst = self._idle.pop(endpoint, [])
        for c in lst:
            c.close()

    def _run(self, endpoint: str, fn, deadline: float | None = None):
        for attempt in range(2):
            dial = None
            if deadline is not None:
                dial = deadline - time.monotonic()
                if dial <= 0:
                    raise _unavailable(endpoint, "timed out")
            c = self._get(endpoint, attempt > 0, dial)
            c.dirty = c.answered = False
            try:
                fn(c)
            except _Stale as e:
                c.close()
                if attempt == 0:
                    self._drop_idle(endpoint)
                    continue
                raise _unavailable(endpoint, e.args[0] if e.args else e)
            except CrescentError:
                self._put(c, not c.dirty)
                raise
            except BaseException:
                c.close()
                raise
            self._put(c, True)
            return

    def begin(self, endpoint: str, op, hdr: bytes, bufs, offsets=None) -> "Pending":
        """Send one request (hdr: the TransferRequest serialized, one item
        per buffer, at most MAX_ITEMS) and return at once: requests to
        several agents are then in flight together, without a thread each
        (Pending.end collects the answer). bufs: the WRITE payload, or the
        READ destinations; offsets: where each READ starts (None: all at 0)."""
        if len(bufs) > MAX_ITEMS:
            raise CrescentError("INVALID_PARAMS", f"{len(bufs)} items in one transfer request (at most {MAX_ITEMS})")
        return Pending(self, endpoint, op, hdr, bufs, offsets)

    def write(self, endpoint: str, items, src):
        """Write items (TransferItem, length set to len(src[i])) from src
        (byte memoryviews). Returns one error (or None) per item; raises
        CrescentError when the whole request failed."""
        return self._chunked(endpoint, Conn.write, items, src)

    def read(self, endpoint: str, items, dst):
        """Read items into dst (byte memoryviews of exactly each read's
        length). Returns (error or None, object size, agent checksum) per
        item; raises CrescentError when the whole request failed."""
        return self._chunked(endpoint, Conn.read, items, dst)

    def verify(self, endpoint: str, items, timeout: float | None = None):
        """Ask the agent to check items' SEALED allocations against their
        sealed checksums (TRANSFER_OP_VERIFY; TransferItem with a read
        token, offset and length ignored; at most MAX_VERIFY_ITEMS).
        Returns one error (or None: intact) per item, DATA_LOSS
        CHECKSUM_MISMATCH for one whose bytes were bad (the agent dropped
        the allocation and reported it lost); raises CrescentError when the
        whole request failed (an agent that predates VERIFY closes the
        connection: AGENT_UNAVAILABLE). timeout bounds the whole call,
        dial included."""
        if len(items) > MAX_VERIFY_ITEMS:
            raise CrescentError("INVALID_PARAMS", f"{len(items)} items to verify, at most {MAX_VERIFY_ITEMS}")
        out = [None] * len(items)
        if not items:
            return out
        deadline = None if timeout is None else time.monotonic() + timeout

        def fn(c: Conn):
            if deadline is None:
                c.verify(items, out)
                return
            try:
                c.set_timeout(min(self.io_timeout, deadline - time.monotonic()))
                c.verify(items, out)
                c.set_timeout(self.io_timeout)  # pooled again: as the others
            except BaseException:
                c.dirty = True  # not pooled with the shorter timeout
                raise

        self._run(endpoint, fn, deadline)
        return out

    def _chunked(self, endpoint: str, op, items, bufs):
        """op (Conn.write or Conn.read) on one connection to endpoint, in
        requests of at most MAX_ITEMS items; one answer per item."""
        out = [None] * len(items)

        def fn(c: Conn):
            for lo in range(0, len(items), MAX_ITEMS):
                hi = min(lo + MAX_ITEMS, len(items))
                sub = [None] * (hi - lo)
                op(c, items[lo:hi], bufs[lo:hi], sub)
                out[lo:hi] = sub

        self._run(endpoint, fn)
        return out


class Pending:
    """A request sent by Pool.begin whose response has not been read."""

    def __init__(self, pool: Pool, endpoint: str, op, hdr: bytes, bufs, offsets=None):
        self.pool, self.endpoint, self.op, self.hdr, self.bufs = pool, endpoint, op, hdr, bufs
        self.offsets = offsets  # READ items' offsets, None for all 0
        self.conn = self._send(fresh=False)

    def _send(self, fresh: bool) -> Conn:
        c = self.pool._get(self.endpoint, fresh)
        c.dirty = c.answered = False
        try:
            c.send(self.op, None, self.bufs if self.op == OP_WRITE else None, self.hdr)
        except _Stale as e:
            c.close()
            if fresh:
                raise _unavailable(self.endpoint, e.args[0] if e.args else e)
            self.pool._drop_idle(self.endpoint)
            return self._send(fresh=True)
        except CrescentError:
            self.pool._put(c, not c.dirty)
            raise
        except BaseException:
            c.close()
            raise
        return c

    def end(self):
        """WRITE: one error (or None) per item. READ: (error or None, object
        size, agent checksum) per item, the bytes in the destinations.
        Raises CrescentError when the whole request failed."""
        out = [None] * len(self.bufs)
        for attempt in range(2):
            c = self.conn
            try:
                rs = c.results(len(out))
                if self.op == OP_WRITE:
                    c.write_results(rs, self.bufs, out)
                else:
                    c.read_results(self.offsets, rs, self.bufs, out)
            except _Stale as e:
                # The idle connection had been closed by the agent: once more
                # on a new one.
                c.close()
                if attempt == 1:
                    raise _unavailable(self.endpoint, e.args[0] if e.args else e)
                self.pool._drop_idle(self.endpoint)
                self.conn = self._send(fresh=True)
                continue
            except BaseException:
                c.close()
                raise
            self.pool._put(c, True)
            return out
