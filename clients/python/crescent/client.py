"""Crescent's Python client: the Go SDK's (pkg/client) put and get paths.

Metadata goes to the master (ObjectService, through crescent._masters,
which follows the leader); bytes go straight to the agents the master's
replica descriptors name: their bulk transfer listener (crescent._xfer)
when the descriptor has a transfer endpoint, else their gRPC DataService.

A put is BatchPutStart -> every replica written -> BatchPutEnd with the
XXH3-64 checksum, and a BatchPutRevoke of every item whose write or end
failed, so nothing is ever half-visible; an item whose end the master did
not acknowledge but may on a second try (_end_again: the put dropped,
PUT_EXPIRED; not there after a failover; no segment could seal it) is put
again, once. A get is BatchGetReplicaList
(granting a read lease) -> the nearest replica read -> the checksum
verified -> the next replica on any failure -> when every replica failed, a
fresh list (second and last round: the first list's tokens may have expired
while an agent stalled). Single puts and gets take the same path with one
item (a single get asks for its replicas with GetReplicaList, as the Go SDK
does).

Methods raise CrescentError (crescent.errors); the batch methods return
one error (or None) per item instead. crescent.store wraps this in
Mooncake's API, which returns integer codes.
"""

from __future__ import annotations

import os
import secrets
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf import duration_pb2

from . import _wire
from ._buf import as_view, checksum
from ._gen.agent.v1 import data_pb2, data_pb2_grpc, transfer_pb2
from ._gen.master.v1 import object_pb2, types_pb2
from ._masters import Masters, channel_options, split_masters
from ._xfer import OP_READ as _xfer_op_read
from ._xfer import OP_WRITE as _xfer_op_write
from ._xfer import Pool
from .errors import CrescentError, from_item, from_rpc_error

__all__ = ["Client", "ReplicateConfig"]

# Limits of one data-plane batch call and of one master batch RPC (batch.go).
MAX_BATCH_ITEMS = 256
MAX_BATCH_BYTES = 32 << 20
MASTER_BATCH = 4096
# One transfer request carries at most this many bytes of one object (transfer.go).
XFER_CHUNK = 16 << 20
# Bounds asking an agent to verify a replica whose bytes failed their checksum (data.go).
VERIFY_TIMEOUT = 5.0
# How long a get whose replicas refused their tokens (INVALID_TOKEN) waits
# before it fetches a fresh replica list (data.go tokenRetryPause): an agent
# that just registered with a master may not know the key of the fresh
# list's tokens for a moment.
TOKEN_RETRY_PAUSE = 0.025


class ReplicateConfig:
    """Where and how a put places its replicas (Mooncake's ReplicateConfig,
    mapped to crescent.master.v1.ReplicateConfig).

    replica_num: replicas on distinct segments (default 1).
    preferred_segment / preferred_segments: Crescent segment ids tried
      first (`crescentctl ls segments`), not Mooncake's "host:port".
    prefer_alloc_in_same_node: place replicas on this client's host first
      (its host id: setup's local_hostname, else the machine's hostname).
    with_soft_pin (soft_pin_ttl seconds, 0: the master's default) and
      with_hard_pin: eviction protection.
    medium: "memory" (default) or "disk"; group_id: carried on KV events.
    """

    def __init__(self, replica_num: int = 1, *, with_soft_pin: bool = False, with_hard_pin: bool = False,
                 preferred_segment: str = "", preferred_segments=None, prefer_alloc_in_same_node=False,
                 soft_pin_ttl: float = 0.0, medium: str = "", group_id: str = ""):
        self.replica_num = replica_num
        self.with_soft_pin = with_soft_pin
        self.with_hard_pin = with_hard_pin
        self.preferred_segment = preferred_segment
        self.preferred_segments = list(preferred_segments or [])
        self.prefer_alloc_in_same_node = prefer_alloc_in_same_node
        self.soft_pin_ttl = soft_pin_ttl
        self.medium = medium
        self.group_id = group_id

    def __repr__(self):
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin}, "
                f"with_hard_pin={self.with_hard_pin}, preferred_segment={self.preferred_segment!r}, "
                f"prefer_alloc_in_same_node={self.prefer_alloc_in_same_node!r})")

    def to_proto(self, host_id: str):
        """The wire form, or None when every field has its default."""
        if not isinstance(self.replica_num, int) or self.replica_num < 1 or self.replica_num > 2**32 - 1:
            raise ValueError(f"replica_num must be an int >= 1, not {self.replica_num!r}")
        c = types_pb2.ReplicateConfig()
        if self.replica_num != 1:
            c.replica_num = self.replica_num
        segs = ([self.preferred_segment] if self.preferred_segment else []) + list(self.preferred_segments)
        if segs:
            c.preferred_segments.extend(segs)
        same = self.prefer_alloc_in_same_node
        if isinstance(same, str):
            same = same.strip().lower() in ("1", "true", "yes")
        if same:
            c.prefer_local_host = host_id
        if self.with_soft_pin:
            c.soft_pin = True
            if self.soft_pin_ttl and self.soft_pin_ttl > 0:
                d = duration_pb2.Duration()
                d.FromNanoseconds(int(self.soft_pin_ttl * 1e9))
                c.soft_pin_ttl.CopyFrom(d)
        if self.with_hard_pin:
            c.hard_pin = True
        if self.medium:
            m = {"memory": types_pb2.MEDIUM_MEMORY, "disk": types_pb2.MEDIUM_DISK}.get(self.medium.lower())
            if m is None:
                raise ValueError(f"medium must be 'memory' or 'disk', not {self.medium!r}")
            c.medium = m
        if self.group_id:
            c.group_id = self.group_id
        return c if c.ByteSize() else None


def _err_for(key: str, err: CrescentError, what: str = "") -> CrescentError:
    """err with the key (and what failed) in its message, keeping reason and code."""
    return CrescentError(err.reason, f"{what}{key!r}: {err.message}", err.code, err.metadata)


def _too_small(key: str, have: int, size: int) -> CrescentError:
    return CrescentError("BUFFER_TOO_SMALL", f"{key!r}: buffer of {have} bytes is smaller than the {size}-byte object",
                         grpc.StatusCode.INVALID_ARGUMENT)


def _agent_err(e: grpc.RpcError) -> CrescentError:
    """A failed DataService call: one that carries no reason failed in
    transport (the agent is down or unreachable), AGENT_UNAVAILABLE as on
    the transfer path."""
    err = from_rpc_error(e)
    if not err.reason and err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
        err.reason = "AGENT_UNAVAILABLE"
    return err


def _mismatch(d) -> CrescentError:
    """Replica d's bytes, read here, failed the object's checksum."""
    return CrescentError("CHECKSUM_MISMATCH", f"replica {d.replica_id} on {d.data_endpoint}: checksum mismatch")


def _both(key: str, err: CrescentError, first: CrescentError) -> CrescentError:
    """err, a get's second round's failure, naming the first round's too
    (data.go getAgain's 'the first read: ...'), which it keeps as .first."""
    msg = first.message
    prefix = f"get {key!r}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix):]
    e = CrescentError(err.reason, f"{err.message} (the first read: {first.reason + ': ' if first.reason else ''}{msg})",
                      err.code, err.metadata)
    e.first = e.__cause__ = first
    return e


def _end_again(err: CrescentError, started_at: str, ended_at: str) -> bool:
    """Whether a put whose PutEnd failed with err, on the master ended_at
    where it started at started_at, is worth a second put (the Go SDK's
    endAgain, pkg/client/data.go): the master dropped it before its end
    (PUT_EXPIRED, on any master: nothing of it was kept), a master other
    than the one that started it has no put to end (OBJECT_NOT_FOUND after
    a failover), or no segment could seal it (SEGMENT_UNAVAILABLE)."""
    if err.reason == "PUT_EXPIRED" or (ended_at != started_at and err.reason == "OBJECT_NOT_FOUND"):
        return True
    return err.reason == "SEGMENT_UNAVAILABLE"


def _abandoned(err: CrescentError) -> bool:
    return err.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class Client:
    """A client of one Crescent cluster; safe for use from many threads.

    master: "host:port", or several separated by commas (HA: the client
    follows the leader). tenant scopes every key ("" is "default"). TLS:
    tls_ca (PEM bundle verifying the servers) and, for mutual TLS,
    tls_cert + tls_key; bearer_token (requires TLS) for a principal
    without a certificate, in which case bytes go through DataService (the
    transfer listener knows callers by certificate only). io_timeout bounds
    each wait on an agent's transfer socket for any progress (a send or
    receive that moves nothing for that long fails the call
    AGENT_UNAVAILABLE, and a get goes on to the next replica): an agent
    that is stopped or hung keeps its connections open, so only this ends
    a transfer to it. 5 s, as the Go SDK's StallTimeout.
    """

    def __init__(self, master: str, tenant: str = "default", *, client_id: str = "", host_id: str = "",
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 bearer_token: str = "", disable_transfer: bool = False, max_concurrency: int = 16,
                 small_object: int = 256 << 10, chunk_size: int = 1 << 20, attempts: int = 3,
                 backoff: float = 0.05, failover_timeout: float = 15.0, timeout: float | None = None,
                 io_timeout: float = 5.0):
        addrs = split_masters(master)
        if not addrs:
            raise ValueError("a master address is required")
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if (tls_cert or bearer_token) and not tls_ca:
            raise ValueError("tls_cert/tls_key and bearer_token require tls_ca (never sent in plaintext)")
        self.tenant = tenant or "default"
        self.client_id = client_id or "client-" + secrets.token_hex(8)
        self.host_id = host_id or socket.gethostname()
        self.small_object = small_object
        self.chunk_size = chunk_size
        self.max_concurrency = max(1, max_concurrency)
        self.timeout = timeout
        self._creds = None
        tls_ctx = None
        if tls_ca:
            with open(tls_ca, "rb") as f:
                ca = f.read()
            cert = key = None
            if tls_cert:
                with open(tls_cert, "rb") as f:
                    cert = f.read()
                with open(tls_key, "rb") as f:
                    key = f.read()
            self._creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            tls_ctx = ssl.create_default_context(cafile=tls_ca)
            if tls_cert:
                tls_ctx.load_cert_chain(tls_cert, tls_key)
        md = (("authorization", "Bearer " + bearer_token),) if bearer_token else ()
        self._md = md
        self._masters = Masters(addrs, self._channel, attempts, backoff, failover_timeout)
        self._masters.metadata = md
        self._xfer = None
        if not disable_transfer and not bearer_token:
            self._xfer = Pool(max_idle=self.max_concurrency, io_timeout=io_timeout, tls=tls_ctx)
        self._mu = threading.Lock()  # guards _agents, _pool, _closed
        self._agents: dict[str, tuple] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # --- plumbing --------------------------------------------------------------

    def _channel(self, addr: str):
        if self._creds is not None:
            return grpc.secure_channel(addr, self._creds, options=channel_options())
        return grpc.insecure_channel(addr, options=channel_options())

    def _data(self, endpoint: str):
        with self._mu:
            if self._closed:
                raise CrescentError("", "client closed", grpc.StatusCode.CANCELLED)
            s = self._agents.get(endpoint)
            if s is None:
                ch = self._channel(endpoint)
                s = (ch, data_pb2_grpc.DataServiceStub(ch))
                self._agents[endpoint] = s
            return s[1]

    def _call(self, method: str, req, admin: bool = False):
        return self._masters.call(method, req, timeout=self.timeout, admin=admin)

    def _call_wire(self, method: str, wire, build, response_type):
        """ObjectService method with the request crescent._wire encoded
        (wire: its bytes), or, when the encoder declined (None), the
        message build() makes."""
        if wire is None:
            return self._call(method, build())
        return self._masters.call(method, wire, timeout=self.timeout, response_type=response_type)

    def _run(self, tasks):
        """Run tasks, at most max_concurrency at once; the first exception
        that is not a CrescentError is re-raised (tasks record their own
        item errors)."""
        if not tasks:
            return
        if len(tasks) == 1:
            tasks[0]()
            return
        with self._mu:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="crescent")
            pool = self._pool
        # The caller's thread runs the first task itself: one thread handoff
        # fewer, and with two agents half the batch never leaves it.
        futs = [pool.submit(t) for t in tasks[1:]]
        try:
            tasks[0]()
        finally:
            for f in futs:
                f.result()

    def close(self):
        """Close every connection. Idempotent."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            agents, self._agents = self._agents, {}
            pool, self._pool = self._pool, None
        self._masters.close()
        if self._xfer is not None:
            self._xfer.close()
        for ch, _ in agents.values():
            ch.close()
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _route(self, d):
        if self._xfer is not None and d.transfer_endpoint:
            return (d.transfer_endpoint, True)
        return (d.data_endpoint, False)

    def _order(self, reps):
        """Replicas on this host first, the master's order otherwise."""
        if len(reps) == 1:
            return reps
        reps = list(reps)
        if any(r.host_id == self.host_id for r in reps):
            reps.sort(key=lambda r: r.host_id != self.host_id)
        return reps

    # --- writes ------------------------------------------------------------------

    def put(self, key: str, data, config: ReplicateConfig | None = None, upsert: bool = False) -> None:
        """Store data (any buffer) under key; returns after the object is
        readable on every replica. Raises CrescentError."""
        err = self.put_many([key], [data], config, upsert)[0]
        if err is not None:
            raise err

    def put_many(self, keys, datas, config: ReplicateConfig | None = None, upsert: bool = False):
        """Store many objects; one error (or None) per key, in order. Items
        whose data is not a usable buffer fail alone with INVALID_PARAMS."""
        if len(keys) != len(datas):
            raise ValueError(f"{len(keys)} keys but {len(datas)} values")
        cfg = (config or ReplicateConfig()).to_proto(self.host_id)
        errs = [None] * len(keys)
        views = _views(datas, False)
        for i, v in enumerate(views):
            if type(v) is not memoryview:
                views[i] = None
                errs[i] = CrescentError("INVALID_PARAMS", f"{keys[i]!r}: value is not a contiguous buffer: {v}")
        for lo in range(0, len(keys), MASTER_BATCH):
            idx = [i for i in range(lo, min(lo + MASTER_BATCH, len(keys))) if errs[i] is None]
            if not idx:
                continue
            again = self._put_batch(keys, views, idx, errs, cfg, upsert)
            if again:
                # Not acknowledged, so put again, once (data.go endAgain):
                # PutEnd found the put dropped (PUT_EXPIRED: every replica's
                # segment went away while the client wrote, its agent lost
                # or cut off past the master's --unmount-after, or the put
                # timed out), or found no put to end on a master other than
                # the one that started it (OBJECT_NOT_FOUND after a
                # failover), or no segment could seal it
                # (SEGMENT_UNAVAILABLE: a disk journal that cannot be
                # written).
                for i in again:
                    errs[i] = None
                self._put_batch(keys, views, again, errs, cfg, upsert)
        return errs

    def _put_batch(self, keys, views, idx, errs, cfg, upsert):
        tenant, cid = self.tenant, self.client_id

        def build():
            req = object_pb2.BatchPutStartRequest()
            for i in idx:
                it = req.items.add(tenant=tenant, key=keys[i], size=views[i].nbytes, client_id=cid, upsert=upsert)
                if cfg is not None:
                    it.config.CopyFrom(cfg)
            return req

        sizes = [views[i].nbytes for i in idx]
        wire = _wire.batch_put_start(tenant, keys, idx, sizes, cfg.SerializeToString() if cfg is not None else b"", cid, upsert)
        try:
            resp = self._call_wire("BatchPutStart", wire, build, object_pb2.BatchPutStartResponse)
            if len(resp.results) != len(idx):
                raise CrescentError("INTERNAL", f"master answered {len(resp.results)} results for {len(idx)} items")
        except CrescentError as e:
            for i in idx:
                errs[i] = _err_for(keys[i], e, "put ")
            if _abandoned(e):
                self._revoke(keys, idx)
            return []
        started_at = self._masters.current()
        writes = []  # (item, descriptor)
        ap = writes.append
        for i, r in zip(idx, resp.results):
            st = r.status
            if st.code:
                errs[i] = _err_for(keys[i], from_item(st.code, st.reason, st.message), "put ")
                continue
            for d in r.replicas:
                ap((i, d))
        sums = {}

        def hash_started():
            # While the agents store the bytes just sent.
            for i in idx:
                if errs[i] is None:
                    sums[i] = checksum(views[i])

        werrs = self._run_writes(writes, views, hash_started)
        end, revoke = [], []
        if not werrs:
            end = [i for i in idx if errs[i] is None]
        for i in idx if werrs else ():
            if errs[i] is not None:
                continue
            if i in werrs:
                errs[i] = _err_for(keys[i], werrs[i], "put (write replica) ")
                revoke.append(i)
            else:
                end.append(i)
        if revoke:
            self._revoke(keys, revoke)
        if not end:
            return []
        sums = [sums.get(i) or checksum(views[i]) for i in end]

        def build_end():
            ereq = object_pb2.BatchPutEndRequest()
            for i, sum_ in zip(end, sums):
                ereq.items.add(tenant=tenant, key=keys[i], client_id=cid, checksum=sum_)
            return ereq

        try:
            eresp = self._call_wire("BatchPutEnd", _wire.batch_put_end(tenant, keys, end, cid, sums), build_end,
                                    object_pb2.BatchPutEndResponse)
            if len(eresp.results) != len(end):
                raise CrescentError("INTERNAL", f"master answered {len(eresp.results)} results for {len(end)} items")
        except CrescentError as e:
            for i in end:
                errs[i] = _err_for(keys[i], e, "put ")
            self._revoke(keys, end)
            return []
        ended_at = self._masters.current()
        failed, again = [], []
        for i, st in zip(end, eresp.results):
            if st.code:
                e = from_item(st.code, st.reason, st.message)
                errs[i] = _err_for(keys[i], e, "put ")
                failed.append(i)
                if _end_again(e, started_at, ended_at):
                    again.append(i)
        if failed:
            self._revoke(keys, failed)
        if ended_at != started_at:
            ok = [i for i in end if errs[i] is None]
            self._fewer_replicas(keys, ok, errs, cfg)
        return again

    def _fewer_replicas(self, keys, ok, errs, cfg):
        """After a failover between start and end: flag objects stored with
        fewer readable replicas than asked (client.go ErrFewerReplicas)."""
        want = max(cfg.replica_num if cfg is not None else 1, 1)
        if want == 1 or not ok:
            return
        req = object_pb2.BatchGetReplicaListRequest()
        for i in ok:
            req.items.add(tenant=self.tenant, key=keys[i])
        try:
            resp = self._call("BatchGetReplicaList", req)
        except CrescentError:
            return
        if len(resp.results) != len(ok):
            return
        for i, r in zip(ok, resp.results):
            n = len(r.replica_list.replicas)
            if not r.status.code and n < want:
                errs[i] = CrescentError("FEWER_REPLICAS", f"put {keys[i]!r}: stored with {n} of {want} replicas (a master failover cut the put)")

    def _revoke(self, keys, idx):
        req = object_pb2.BatchPutRevokeRequest()
        for i in idx:
            req.items.add(tenant=self.tenant, key=keys[i], client_id=self.client_id)
        try:
            self._masters.call("BatchPutRevoke", req, timeout=5.0)
        except CrescentError:
            pass  # the master preempts a put that never ends

    def _run_writes(self, writes, views, meanwhile=None):
        """Write every (item, descriptor): small replicas grouped per route
        into one request per MAX_BATCH_ITEMS/MAX_BATCH_BYTES, large ones
        alone. meanwhile() runs once every request is sent, before the
        transfer answers are read. Returns {item: first error}."""
        errs: dict[int, CrescentError] = {}
        mu = threading.Lock()

        def fail(i, e):
            with mu:
                errs.setdefault(i, e)

        tasks = []
        pending = []  # transfer requests in flight: (chunk, Pending)
        groups: dict[tuple, list] = {}
        small, xfer = self.small_object, self._xfer is not None
        for w in writes:
            i, d = w
            if views[i].nbytes > small:
                tasks.append(lambda i=i, d=d: self._write_large(i, d, views[i], fail))
                continue
            te = d.transfer_endpoint if xfer else ""
            rt = (te, True) if te else (d.data_endpoint, False)  # _route
            g = groups.get(rt)
            if g is None:
                groups[rt] = [w]
            else:
                g.append(w)
        for rt, ws in groups.items():
            for chunk in _chunks(ws, lambda w: views[w[0]].nbytes):
                if rt[1]:
                    # Sent now, answered below: the agents work in parallel
                    # without a thread per request.
                    src = [views[i] for i, _ in chunk]
                    hdr = _wire.transfer_request(_xfer_op_write, [d for _, d in chunk], [v.nbytes for v in src])
                    try:
                        pending.append((chunk, self._xfer.begin(rt[0], _xfer_op_write, hdr, src)))
                    except CrescentError as e:
                        for i, _ in chunk:
                            fail(i, e)
                else:
                    tasks.append(lambda ep=rt[0], c=chunk: self._write_grpc(ep, c, views, fail))
        try:
            self._run(tasks)
            if meanwhile is not None:
                meanwhile()
        finally:
            for chunk, p in pending:
                try:
                    ierrs = p.end()
                except CrescentError as e:
                    for i, _ in chunk:
                        fail(i, e)
                    continue
                for (i, _), e in zip(chunk, ierrs):
                    if e is not None:
                        fail(i, e)
        return errs

    def _write_grpc(self, ep, chunk, views, fail):
        req = data_pb2.BatchWriteRequest()
        for i, d in chunk:
            req.items.add(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token, data=views[i].tobytes())
        try:
            resp = self._data(ep).BatchWrite(req, timeout=self.timeout, metadata=self._md)
            if len(resp.results) != len(chunk):
                raise CrescentError("INTERNAL", f"agent {ep} answered {len(resp.results)} results for {len(chunk)} items")
        except grpc.RpcError as e:
            err = _agent_err(e)
            for i, _ in chunk:
                fail(i, err)
            return
        except CrescentError as e:
            for i, _ in chunk:
                fail(i, e)
            return
        for (i, _), st in zip(chunk, resp.results):
            if st.code:
                fail(i, from_item(st.code, st.reason, st.message))

    def _write_large(self, i, d, v, fail):
        try:
            if self._xfer is not None and d.transfer_endpoint:
                ep = d.transfer_endpoint
                size = v.nbytes
                for off in range(0, size, XFER_CHUNK):
                    n = min(XFER_CHUNK, size - off)
                    hdr = _wire.transfer_request(_xfer_op_write, (d,), (n,), (off,))
                    e = self._xfer.begin(ep, _xfer_op_write, hdr, [v[off : off + n]]).end()[0]
                    if e is not None:
                        raise e
                return
            ep = d.data_endpoint
            chunk = self.chunk_size

            def reqs():
                for off in range(0, v.nbytes, chunk):
                    r = data_pb2.WriteRequest(data=v[off : off + chunk].tobytes())
                    if off == 0:
                        r.header.segment_id = d.segment_id
                        r.header.allocation_id = d.allocation_id
                        r.header.token = d.token
                    yield r

            try:
                resp = self._data(ep).Write(reqs(), timeout=self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                raise _agent_err(e)
            if resp.bytes_written != v.nbytes:
                raise CrescentError("INTERNAL", f"agent {ep} wrote {resp.bytes_written} of {v.nbytes} bytes")
        except CrescentError as e:
            fail(i, e)

    # --- reads -------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The object's bytes. Raises CrescentError."""
        outs, errs = self.get_many([key])
        if errs[0] is not None:
            raise errs[0]
        return bytes(outs[0])

    def get_into(self, key: str, buf) -> int:
        """Read the object into buf (a writable buffer at least as large);
        returns its size. Raises CrescentError."""
        sizes, errs = self.get_many_into([key], [buf])
        if errs[0] is not None:
            raise errs[0]
        return sizes[0]

    def get_many(self, keys):
        """(data, errors) per key: data[i] a bytearray, or None on error."""
        outs = [None] * len(keys)
        errs = [None] * len(keys)
        for lo in range(0, len(keys), MASTER_BATCH):
            self._get_batch(keys, range(lo, min(lo + MASTER_BATCH, len(keys))), outs, errs, None)
        return outs, errs

    def get_many_into(self, keys, bufs):
        """Read each object into the caller's buffer: (sizes, errors) per key.
        A buffer smaller than its object is BUFFER_TOO_SMALL for that key;
        a buffer that is not writable is INVALID_PARAMS."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        n = len(keys)
        outs = [None] * n
        errs = [None] * n
        views = _views(bufs, True)
        for i, v in enumerate(views):
            if type(v) is not memoryview:
                views[i] = None
                errs[i] = CrescentError("INVALID_PARAMS", f"{keys[i]!r}: not a writable contiguous buffer: {v}")
        for lo in range(0, n, MASTER_BATCH):
            idx = [i for i in range(lo, min(lo + MASTER_BATCH, n)) if errs[i] is None]
            if idx:
                self._get_batch(keys, idx, outs, errs, views)
        sizes = [0 if e is not None else o.nbytes for o, e in zip(outs, errs)]
        return sizes, errs

    def _lookup(self, keys, idx):
        """The master's answer for keys[i], i in idx: [(i, status or None,
        replica list)]. Raises CrescentError."""
        tenant, host = self.tenant, self.host_id
        if len(idx) == 1:
            # One key: the single RPC, as the Go SDK's Get and GetInto.
            rl = self._call("GetReplicaList", object_pb2.GetReplicaListRequest(
                tenant=tenant, key=keys[idx[0]], client_host=host))
            return [(idx[0], None, rl)]

        def build():
            req = object_pb2.BatchGetReplicaListRequest()
            add = req.items.add
            for i in idx:
                add(tenant=tenant, key=keys[i], client_host=host)
            return req

        resp = self._call_wire("BatchGetReplicaList", _wire.batch_get_replica_list(tenant, keys, idx, host), build,
                               object_pb2.BatchGetReplicaListResponse)
        rs = resp.results
        if len(rs) != len(idx):
            raise CrescentError("INTERNAL", f"master answered {len(rs)} results for {len(idx)} items")
        return [(i, r.status, r.replica_list) for i, r in zip(idx, rs)]

    def _get_batch(self, keys, idx, outs, errs, into, refetch=True):
        """Look keys[i], i in idx, up and read them into outs (errors into
        errs). Every read path (get, get_into, get_many, get_many_into) is
        this. With refetch, items whose every replica failed get a second
        round (_get_again)."""
        idx = list(idx)
        try:
            pairs = self._lookup(keys, idx)
        except CrescentError as e:
            for i in idx:
                errs[i] = _err_for(keys[i], e, "get ")
            return
        groups: dict[tuple, list] = {}
        tasks = []
        retry = []
        read = []  # the items whose replicas are read
        mu = threading.Lock()
        small, xfer = self.small_object, self._xfer is not None
        for i, st, rl in pairs:
            if st is not None and st.code:
                errs[i] = _err_for(keys[i], from_item(st.code, st.reason, st.message), "get ")
                continue
            reps = rl.replicas
            nreps = len(reps)
            if nreps > 1:
                reps = self._order(reps)
            elif not nreps:
                errs[i] = CrescentError("REPLICA_IS_NOT_READY", f"get {keys[i]!r}: no readable replica")
                continue
            size = rl.size
            if into is not None:
                dst = into[i]
                if dst.nbytes != size:
                    if dst.nbytes < size:
                        errs[i] = _too_small(keys[i], dst.nbytes, size)
                        continue
                    dst = dst[:size]
            else:
                dst = memoryview(bytearray(size))
            d0 = reps[0]
            rd = (i, rl, reps, dst, d0)
            read.append(i)
            if size > small:
                tasks.append(lambda rd=rd: self._read_any_item(keys, rd, rd[2], outs, errs))
                continue
            te = d0.transfer_endpoint if xfer else ""
            rt = (te, True) if te else (d0.data_endpoint, False)
            g = groups.get(rt)
            if g is None:
                groups[rt] = [rd]
            else:
                g.append(rd)
        pending = []  # transfer requests in flight: (chunk, Pending)
        for rt, rds in groups.items():
            for lo in range(0, len(rds), MAX_BATCH_ITEMS):
                chunk = rds[lo : lo + MAX_BATCH_ITEMS]
                if rt[1]:
                    # Sent now, answered below: the agents work in parallel
                    # without a thread per request.
                    dsts = [rd[3] for rd in chunk]
                    hdr = _wire.transfer_request(_xfer_op_read, [rd[4] for rd in chunk], [v.nbytes for v in dsts])
                    try:
                        pending.append((chunk, self._xfer.begin(rt[0], _xfer_op_read, hdr, dsts)))
                    except CrescentError as e:
                        retry.extend((rd, e, False) for rd in chunk)
                    continue

                def task(rt=rt, chunk=chunk):
                    failed = self._read_chunk(rt, chunk, outs)
                    if failed:
                        with mu:
                            retry.extend(failed)

                tasks.append(task)
        try:
            self._run(tasks)
        finally:
            for chunk, p in pending:
                try:
                    res = p.end()
                except CrescentError as e:
                    retry.extend((rd, e, False) for rd in chunk)
                    continue
                for rd, r in zip(chunk, res):
                    e = r[0]
                    dst = rd[3]
                    if e is None:
                        if checksum(dst) == rd[1].checksum:
                            outs[rd[0]] = dst
                            continue
                        retry.append((rd, _mismatch(rd[4]), True))
                        continue
                    retry.append((rd, e, False))
        # Fall back, per item, to the remaining replicas (and then have the
        # first one verified when its bytes failed the checksum).
        if retry:
            self._run([lambda rd=rd, e=e, bad=bad: self._read_any_item(keys, rd, rd[2][1:], outs, errs, e, bad)
                       for rd, e, bad in retry])
        if refetch:
            again = [i for i in read if outs[i] is None and errs[i] is not None]
            if again:
                self._get_again(keys, again, outs, errs, into)

    def _get_again(self, keys, again, outs, errs, into):
        """A get's second and last round (the Go SDK's getAgain) for the
        items in again, every replica of whose first list failed (errs[i]):
        a fresh list, read into outs. It may differ from the first: that
        one's tokens may have expired while an agent stalled (a SIGSTOP, a
        long pause: the agent then answers INVALID_TOKEN 'token expired'), a
        replica whose bytes failed the checksum may have been dropped (it
        was verified before this round), the object may have moved or been
        replaced, an agent the master since suspected is left out. After
        INVALID_TOKEN it first waits TOKEN_RETRY_PAUSE. An item that fails
        again fails with the second round's reason and code, and a message
        that names the first round's failure too, which it also keeps
        (.first, and __cause__): a list that says OBJECT_NOT_FOUND after
        the first read found the only replica bad is still a checksum
        failure to the caller."""
        first = {i: errs[i] for i in again}
        if any(e.reason == "INVALID_TOKEN" for e in first.values()):
            time.sleep(TOKEN_RETRY_PAUSE)
        for i in again:
            errs[i] = None
        self._get_batch(keys, again, outs, errs, into, refetch=False)
        for i in again:
            if errs[i] is not None:
                errs[i] = _both(keys[i], errs[i], first[i])

    def _read_any_item(self, keys, rd, reps, outs, errs, first=None, bad=False):
        """Read item rd from reps. first: why its first replica, not in
        reps, failed; bad: that replica's bytes failed the checksum here,
        so its agent is asked to verify it once reps were tried."""
        i, rl, _, dst, d0 = rd
        try:
            self._read_any(rl, reps, dst, (first,) if first is not None else ())
            outs[i] = dst
        except CrescentError as e:
            errs[i] = _err_for(keys[i], e, "get ")
        if bad:
            self._verify_replica(d0)

    def _read_chunk(self, rt, chunk, outs):
        """Read the first replica of each item from one agent in one request;
        returns the items that failed, with their error and whether it was
        the checksum: [(rd, error, bad)]."""
        ep = rt[0]
        failed = []

        req = data_pb2.BatchReadRequest()
        for _, _, _, _, d in chunk:
            req.items.add(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token)
        try:
            resp = self._data(ep).BatchRead(req, timeout=self.timeout, metadata=self._md)
            if len(resp.results) != len(chunk):
                raise CrescentError("INTERNAL", f"agent {ep} answered {len(resp.results)} results for {len(chunk)} items")
        except grpc.RpcError as e:
            err = _agent_err(e)
            return [(rd, err, False) for rd in chunk]
        except CrescentError as e:
            return [(rd, e, False) for rd in chunk]
        for rd, r in zip(chunk, resp.results):
            i, rl, reps, dst, _ = rd
            data = r.data
            if r.status.code:
                failed.append((rd, from_item(r.status.code, r.status.reason, r.status.message), False))
                continue
            if len(data) != rl.size:
                failed.append((rd, CrescentError("INTERNAL", f"agent {ep} sent {len(data)} bytes of a {rl.size}-byte object"), False))
                continue
            if checksum(memoryview(data)) != rl.checksum:
                failed.append((rd, _mismatch(reps[0]), True))
                continue
            dst[:] = data
            outs[i] = dst
        return failed

    def _read_any(self, rl, reps, dst, prior=()):
        """Try each replica in order until one returns bytes matching the
        checksum; those whose bytes did not are then verified by their agent.
        prior: the failures of replicas before reps (a batch's first one),
        named first when every one of reps fails too."""
        if not reps:
            if prior:
                raise prior[0]  # the only replica failed: say how
            raise CrescentError("REPLICA_IS_NOT_READY", "no readable replica")
        errs = list(prior)
        bad = None  # replicas whose bytes failed the checksum
        for d in reps:
            try:
                self._read_one(d, dst)
            except CrescentError as e:
                errs.append(e)
                continue
            if checksum(dst) == rl.checksum:
                if bad:
                    for b in bad:
                        self._verify_replica(b)
                return
            if bad is None:
                bad = []
            bad.append(d)
            errs.append(_mismatch(d))
        for b in bad or ():
            self._verify_replica(b)
        if len(errs) == 1:
            raise errs[0]
        # Several replicas failed: the first error's reason, every message.
        raise CrescentError(errs[0].reason, "; ".join(f"replica {k}: {e}" for k, e in enumerate(errs)), errs[0].code)

    def _verify_replica(self, d):
        """Ask d's agent to check the replica whose bytes failed their
        checksum here (TRANSFER_OP_VERIFY over the bulk transfer path, where
        the read went, DataService.Verify over gRPC): the agent reads the
        allocation again itself and, when its bytes are bad, drops it and
        reports it lost, so that the master stops handing it out. The agent
        trusts its own reading: when the bytes went wrong on the way here,
        nothing changes. Best effort and synchronous, within VERIFY_TIMEOUT,
        every error ignored (an agent that predates VERIFY closes the
        connection, or answers UNIMPLEMENTED over gRPC)."""
        try:
            if self._xfer is not None and d.transfer_endpoint:
                item = transfer_pb2.TransferItem(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token)
                self._xfer.verify(d.transfer_endpoint, [item], timeout=VERIFY_TIMEOUT)
                return
            item = data_pb2.BatchReadItem(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token)
            self._data(d.data_endpoint).Verify(data_pb2.VerifyRequest(items=[item]), timeout=VERIFY_TIMEOUT, metadata=self._md)
        except Exception:
            pass

    def _read_one(self, d, dst):
        size = dst.nbytes
        if self._xfer is not None and d.transfer_endpoint:
            ep = d.transfer_endpoint
            for off in range(0, max(size, 1), XFER_CHUNK):
                n = min(XFER_CHUNK, size - off)
                hdr = _wire.transfer_request(_xfer_op_read, (d,), (n,), (off,))
                e, osize, _ = self._xfer.begin(ep, _xfer_op_read, hdr, [dst[off : off + n]], (off,)).end()[0]
                if e is not None:
                    raise e
                if osize != size:
                    raise CrescentError("INTERNAL", f"agent {ep} holds {osize} bytes, the master said {size}")
            return
        stub = self._data(d.data_endpoint)
        try:
            if size <= self.small_object:
                resp = stub.BatchRead(data_pb2.BatchReadRequest(items=[data_pb2.BatchReadItem(
                    segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token)]),
                    timeout=self.timeout, metadata=self._md)
                if len(resp.results) != 1:
                    raise CrescentError("INTERNAL", f"{len(resp.results)} results for 1 item")
                r = resp.results[0]
                if r.status.code:
                    raise from_item(r.status.code, r.status.reason, r.status.message)
                if len(r.data) != size:
                    raise CrescentError("INTERNAL", f"got {len(r.data)} bytes, want {size}")
                dst[:] = r.data
                return
            off = 0
            for chunk in stub.Read(data_pb2.ReadRequest(segment_id=d.segment_id, allocation_id=d.allocation_id,
                                                         token=d.token, chunk_size=self.chunk_size),
                                   timeout=self.timeout, metadata=self._md):
                n = len(chunk.data)
                if off + n > size:
                    raise CrescentError("INTERNAL", f"agent sent more than {size} bytes")
                dst[off : off + n] = chunk.data
                off += n
            if off != size:
                raise CrescentError("INTERNAL", f"got {off} bytes, want {size}")
        except grpc.RpcError as e:
            raise _agent_err(e)

    # --- metadata ------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self._call("Exist", object_pb2.ExistRequest(tenant=self.tenant, key=key)).exists

    def exists_many(self, keys) -> list[bool]:
        out: list[bool] = []
        for lo in range(0, len(keys), MASTER_BATCH):
            part = keys[lo : lo + MASTER_BATCH]
            req = object_pb2.BatchExistRequest()
            for k in part:
                req.items.add(tenant=self.tenant, key=k)
            resp = self._call("BatchExist", req)
            if len(resp.exists) != len(part):
                raise CrescentError("INTERNAL", f"master answered {len(resp.exists)} results for {len(part)} keys")
            out.extend(resp.exists)
        return out

    def size(self, key: str) -> int:
        return self._call("GetSize", object_pb2.GetSizeRequest(tenant=self.tenant, key=key)).size

    def remove(self, key: str, force: bool = False) -> None:
        try:
            self._call("Remove", object_pb2.RemoveRequest(tenant=self.tenant, key=key, force=force))
        except CrescentError as e:
            raise _err_for(key, e, "remove ")

    def remove_many(self, keys, force: bool = False):
        errs = [None] * len(keys)
        for lo in range(0, len(keys), MASTER_BATCH):
            hi = min(lo + MASTER_BATCH, len(keys))
            req = object_pb2.BatchRemoveRequest()
            for k in keys[lo:hi]:
                req.items.add(tenant=self.tenant, key=k, force=force)
            try:
                resp = self._call("BatchRemove", req)
                if len(resp.results) != hi - lo:
                    raise CrescentError("INTERNAL", f"master answered {len(resp.results)} results for {hi - lo} items")
            except CrescentError as e:
                for i in range(lo, hi):
                    errs[i] = _err_for(keys[i], e, "remove ")
                continue
            for i, st in zip(range(lo, hi), resp.results):
                if st.code:
                    errs[i] = _err_for(keys[i], from_item(st.code, st.reason, st.message), "remove ")
        return errs

    def remove_all(self, force: bool = False):
        """(removed, skipped) of the tenant's objects."""
        r = self._call("RemoveAll", object_pb2.RemoveAllRequest(tenant=self.tenant, force=force))
        return r.removed, r.skipped

    def remove_by_regex(self, regex: str, force: bool = False):
        """(removed, skipped) of the tenant's objects whose key matches an RE2
        regex (anywhere in the key), following the master's page tokens."""
        return self._remove_pages("RemoveByRegex", lambda token: object_pb2.RemoveByRegexRequest(
            tenant=self.tenant, regex=regex, force=force, page_token=token))

    def remove_by_prefix(self, prefix: str, force: bool = False):
        """(removed, skipped) of the tenant's objects under prefix."""
        return self._remove_pages("RemoveByPrefix", lambda token: object_pb2.RemoveByPrefixRequest(
            tenant=self.tenant, prefix=prefix, force=force, page_token=token))

    def _remove_pages(self, method: str, request):
        """Call method with request(page_token) until the master's last page;
        the sums of its removed and skipped counts."""
        removed = skipped = 0
        token = ""
        while True:
            r = self._call(method, request(token))
            removed, skipped, token = removed + r.removed, skipped + r.skipped, r.next_page_token
            if not token:
                return removed, skipped

    def stat(self, key: str):
        """The object's QueryRouteResponse: size, checksum, every replica (no lease)."""
        return self._call("QueryRoute", object_pb2.QueryRouteRequest(tenant=self.tenant, key=key))


def _views(bufs, writable: bool):
    """as_view of each buffer, or, for one it refuses, the exception."""
    out = []
    ap = out.append
    for b in bufs:
        t = type(b)
        if t is bytearray or (t is bytes and not writable):
            ap(memoryview(b))  # flat bytes already: as_view's checks all pass
            continue
        try:
            ap(as_view(b, writable))
        except (TypeError, ValueError) as e:
            ap(e)
    return out


def _chunks(ws, size_of):
    if len(ws) <= MAX_BATCH_ITEMS and sum(map(size_of, ws)) <= MAX_BATCH_BYTES:
        yield ws  # the common case: one chunk
        return
    start, nbytes = 0, 0
    for k, w in enumerate(ws):
        n = size_of(w)
        if k > start and (k - start >= MAX_BATCH_ITEMS or nbytes + n > MAX_BATCH_BYTES):
            yield ws[start:k]
            start, nbytes = k, 0
        nbytes += n
    if start < len(ws):
        yield ws[start:]
