"""TRANSFER_OP_VERIFY (and DataService.Verify, its twin on the gRPC data
path): a client whose read of a replica failed the checksum asks the
replica's agent to read it again itself. Intact: nothing changes. Bad: the
agent drops the allocation and reports it lost, and the master removes the
replica. The protocol side against fake agents (crescent._xfer), the
best-effort side of the client (Client._verify_replica, both paths), and
real corruption: a byte flipped in an agent's disk segment (a memory
segment cannot be corrupted from outside the agent's process), for VERIFY
alone (both paths) and for a get of an object over 16 MiB (read in several
requests, which the agent does not check itself)."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from crescent import Client, CrescentError, DistributedStore, ReplicateConfig
from crescent import _xfer
from crescent._gen.agent.v1 import data_pb2, data_pb2_grpc, transfer_pb2
from crescent._gen.master.v1 import object_pb2, types_pb2

OK = 0


def _replica_list(client: Client, key: str):
    return client._call("GetReplicaList", object_pb2.GetReplicaListRequest(tenant=client.tenant, key=key))


def _item(d):
    return transfer_pb2.TransferItem(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token)


def _eventually(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)


def _gone(client: Client, key: str) -> bool:
    try:
        _replica_list(client, key)
    except CrescentError as e:
        assert e.reason == "OBJECT_NOT_FOUND", e
        return True
    return False


def _flip_byte(path, off: int):
    """Flip a byte of a file in place (internal/testutil.FlipByte)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        assert len(b) == 1, f"{path} has no byte at {off}"
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
    finally:
        os.close(fd)


# --- the protocol, against fake agents -------------------------------------------------


class _FakeAgent:
    """A transfer listener that reads one request and answers with `reply`
    (None: closes without answering, as an agent that predates VERIFY)."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.endpoint = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.reply = reply
        self.got = b""
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                self.got = conn.recv(1 << 20)
                if self.reply is not None:
                    conn.sendall(self.reply)
            except OSError:
                pass
        self.done.set()

    def request(self):
        """The request the agent got: (TransferRequest, bytes after its header)."""
        assert self.got.startswith(b"CXF1")
        (n,) = _xfer._U32.unpack(self.got[4:8])
        req = transfer_pb2.TransferRequest()
        req.ParseFromString(self.got[8 : 8 + n])
        return req, self.got[8 + n :]

    def close(self):
        self.sock.close()


def _response(*results) -> bytes:
    b = transfer_pb2.TransferResponse(results=results).SerializeToString()
    return _xfer._U32.pack(len(b)) + b


def _status(code, reason):
    return transfer_pb2.TransferResult(status={"code": code, "reason": reason, "message": reason.lower()})


_ITEMS = [transfer_pb2.TransferItem(segment_id="s", allocation_id=k + 1, token=b"t") for k in range(3)]


def test_verify_answers_per_item():
    """One result per item, no payload either way: OK is None, an error is
    that item's; the request is a VERIFY header alone."""
    agent = _FakeAgent(_response(transfer_pb2.TransferResult(object_size=4, checksum=7),
                                 _status(15, "CHECKSUM_MISMATCH"), _status(8, "LIMIT_EXCEEDED")))
    pool = _xfer.Pool(io_timeout=5)
    try:
        errs = pool.verify(agent.endpoint, _ITEMS, timeout=5)
        assert errs[0] is None
        assert [e.reason for e in errs[1:]] == ["CHECKSUM_MISMATCH", "LIMIT_EXCEEDED"]
        req, rest = agent.request()
        assert req.op == transfer_pb2.TRANSFER_OP_VERIFY
        assert [(it.allocation_id, it.token) for it in req.items] == [(1, b"t"), (2, b"t"), (3, b"t")]
        assert rest == b""  # no payload
    finally:
        pool.close()
        agent.close()


@pytest.mark.parametrize(
    "reply,reason",
    [
        (None, "AGENT_UNAVAILABLE"),  # an agent that predates VERIFY closes the connection
        (_response(*[transfer_pb2.TransferResult(length=5)] * 3), "INTERNAL"),  # a payload length
        (_response(transfer_pb2.TransferResult()), "INTERNAL"),  # one result for three items
    ],
)
def test_verify_protocol_violations(reply, reason):
    agent = _FakeAgent(reply)
    pool = _xfer.Pool(io_timeout=5)
    try:
        with pytest.raises(CrescentError) as ei:
            pool.verify(agent.endpoint, _ITEMS, timeout=5)
        assert ei.value.reason == reason
    finally:
        pool.close()
        agent.close()


def test_verify_item_limit():
    """At most 64 items, refused before any connection (nothing listens at
    the endpoint: a request would fail AGENT_UNAVAILABLE); none: no request."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = "127.0.0.1:%d" % sk.getsockname()[1]
    pool = _xfer.Pool(io_timeout=5)
    try:
        with pytest.raises(CrescentError) as ei:
            pool.verify(dead, [_ITEMS[0]] * (_xfer.MAX_VERIFY_ITEMS + 1))
        assert ei.value.reason == "INVALID_PARAMS"
        assert pool.verify(dead, []) == []
        with pytest.raises(CrescentError) as ei:
            pool.verify(dead, [_ITEMS[0]] * _xfer.MAX_VERIFY_ITEMS, timeout=5)
        assert ei.value.reason == "AGENT_UNAVAILABLE"
    finally:
        pool.close()


def test_verify_replica_is_best_effort(monkeypatch):
    """Client._verify_replica ignores every error (an agent that closes, one
    that never answers: bounded by VERIFY_TIMEOUT), asks only over the
    transfer path, and lets KeyboardInterrupt through."""
    from crescent import client as client_mod

    monkeypatch.setattr(client_mod, "VERIFY_TIMEOUT", 0.5)
    c = Client("127.0.0.1:1", "t")  # no master I/O here
    closing = _FakeAgent(None)
    hung = socket.socket()  # connections complete in the backlog; nothing answers
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    calls = []
    real = _xfer.Pool.verify

    def spy(self, endpoint, items, timeout=None):
        calls.append((endpoint, timeout))
        return real(self, endpoint, items, timeout)

    monkeypatch.setattr(_xfer.Pool, "verify", spy)
    try:
        d = types_pb2.ReplicaDescriptor(segment_id="s", allocation_id=1, token=b"t", data_endpoint="127.0.0.1:1",
                                        transfer_endpoint=closing.endpoint)
        assert c._verify_replica(d) is None
        assert closing.done.wait(5)
        assert closing.request()[0].op == transfer_pb2.TRANSFER_OP_VERIFY
        d.transfer_endpoint = "127.0.0.1:%d" % hung.getsockname()[1]
        t0 = time.monotonic()
        assert c._verify_replica(d) is None
        assert time.monotonic() - t0 < 60  # bounded (0.5 s here), not the default io_timeout times retries
        assert calls == [(closing.endpoint, 0.5), (d.transfer_endpoint, 0.5)]
        d.transfer_endpoint = ""
        assert c._verify_replica(d) is None  # DataService only: asked over gRPC (nothing listens), not over transfer
        assert len(calls) == 2

        def interrupted(self, endpoint, items, timeout=None):
            raise KeyboardInterrupt

        monkeypatch.setattr(_xfer.Pool, "verify", interrupted)
        d.transfer_endpoint = closing.endpoint
        with pytest.raises(KeyboardInterrupt):
            c._verify_replica(d)
    finally:
        c.close()
        closing.close()
        hung.close()
    off = Client("127.0.0.1:1", "t", disable_transfer=True)
    try:
        off._verify_replica(d)  # no transfer path: not asked over it (would raise KeyboardInterrupt)
    finally:
        off.close()


class _FakeData(data_pb2_grpc.DataServiceServicer):
    """A DataService whose Verify records its requests and answers OK."""

    def __init__(self):
        self.got = []

    def Verify(self, request, context):
        self.got.append((request, dict(context.invocation_metadata())))
        return data_pb2.VerifyResponse(results=[data_pb2.VerifyResult(object_size=4)] * len(request.items))


def _data_server(servicer):
    """A gRPC server on loopback with servicer (None: no service at all, as
    an agent that predates DataService.Verify answers UNIMPLEMENTED)."""
    srv = grpc.server(ThreadPoolExecutor(2))
    if servicer is not None:
        data_pb2_grpc.add_DataServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, "127.0.0.1:%d" % port


@pytest.mark.parametrize("disable_transfer", [False, True])
def test_verify_replica_grpc(monkeypatch, disable_transfer):
    """On the gRPC data path (a replica with no transfer endpoint, or a
    client with disable_transfer) Client._verify_replica asks
    DataService.Verify at the replica's data endpoint, with the client's
    metadata, one item, its read token; never the transfer path. An agent
    that answers UNIMPLEMENTED is ignored."""
    from crescent import client as client_mod

    monkeypatch.setattr(client_mod, "VERIFY_TIMEOUT", 5)
    calls = []
    monkeypatch.setattr(_xfer.Pool, "verify", lambda self, *a, **k: calls.append(a))
    fake = _FakeData()
    srv, ep = _data_server(fake)
    old, old_ep = _data_server(None)
    c = Client("127.0.0.1:1", "t", disable_transfer=disable_transfer)
    try:
        d = types_pb2.ReplicaDescriptor(segment_id="s", allocation_id=7, token=b"tok", data_endpoint=ep,
                                        transfer_endpoint="" if not disable_transfer else "127.0.0.1:1")
        assert c._verify_replica(d) is None
        assert len(fake.got) == 1
        (req, _), = fake.got
        assert [(it.segment_id, it.allocation_id, it.token) for it in req.items] == [("s", 7, b"tok")]
        d.data_endpoint = old_ep
        assert c._verify_replica(d) is None  # UNIMPLEMENTED: ignored
        assert calls == []
    finally:
        c.close()
        srv.stop(None)
        old.stop(None)


# --- a real cluster ----------------------------------------------------------------------


def test_verify_intact_replica(cluster, tenant):
    """An intact replica verifies OK (64 items at once too) and stays; a bad
    token fails its item alone."""
    c = Client(cluster.master, tenant, host_id="host-a")
    try:
        cfg = ReplicateConfig(preferred_segment=next(x.info.segment_id for x in cluster.segments() if x.host_id == "host-a"))
        data = os.urandom(5000)
        c.put("ok", data, cfg)
        (d,) = _replica_list(c, "ok").replicas
        assert d.transfer_endpoint
        assert c._xfer.verify(d.transfer_endpoint, [_item(d)], timeout=5) == [None]
        assert c._xfer.verify(d.transfer_endpoint, [_item(d)] * _xfer.MAX_VERIFY_ITEMS, timeout=5) == [None] * 64
        forged = _item(d)
        forged.token = b"not a token"
        errs = c._xfer.verify(d.transfer_endpoint, [forged, _item(d)], timeout=5)
        assert errs[0] is not None and errs[0].reason == "INVALID_TOKEN", errs[0]
        assert errs[1] is None
        (again,) = _replica_list(c, "ok").replicas
        assert (again.segment_id, again.allocation_id) == (d.segment_id, d.allocation_id)
        assert c.get("ok") == data
    finally:
        c.close()


@pytest.fixture(scope="module")
def disk_cluster():
    """Agents with a disk segment each (agent-a with a transfer listener)."""
    from conftest import Cluster

    c = Cluster(agent_memory="64MiB", gateway=False, disk="64MiB")
    yield c
    c.stop()


def _disk_segments(c):
    return {x.host_id: x.info.segment_id for x in c.segments() if x.info.medium == types_pb2.MEDIUM_DISK}


def test_verify_drops_corrupt_disk_replica(disk_cluster, tenant):
    """A byte flipped in a disk object nobody read since: VERIFY finds it
    (CHECKSUM_MISMATCH), the agent drops the allocation and the master the
    replica, its only one. Another object on the same disk stays."""
    c = Client(disk_cluster.master, tenant, host_id="host-a")
    try:
        cfg = ReplicateConfig(medium="disk", preferred_segment=_disk_segments(disk_cluster)["host-a"])
        rot, intact = os.urandom(300 << 10), os.urandom(200 << 10)
        c.put("disk/rot", rot, cfg)
        c.put("disk/intact", intact, cfg)
        (d,) = _replica_list(c, "disk/rot").replicas
        assert d.medium == types_pb2.MEDIUM_DISK and d.transfer_endpoint
        _flip_byte(disk_cluster.dir / "agent-a-disk" / "segment.data", d.offset + (100 << 10))
        (err,) = c._xfer.verify(d.transfer_endpoint, [_item(d)], timeout=5)
        assert err is not None and err.reason == "CHECKSUM_MISMATCH", err
        _eventually(lambda: _gone(c, "disk/rot"), 20, "the master removes the dropped replica")
        assert c.get("disk/intact") == intact
    finally:
        c.close()


def test_verify_grpc_drops_corrupt_disk_replica(disk_cluster, tenant):
    """DataService.Verify on a real agent: an intact replica OK with its size
    and checksum, a write of its token refused for the item alone, more than
    64 items refuse the call (INVALID_ARGUMENT) before any is read; a byte
    flipped in a disk object nobody read since: a client on the gRPC data
    path (disable_transfer) has the agent verify it, which drops it, and the
    master removes the replica."""
    c = Client(disk_cluster.master, tenant, host_id="host-a", disable_transfer=True)
    try:
        cfg = ReplicateConfig(medium="disk", preferred_segment=_disk_segments(disk_cluster)["host-a"])
        rot, intact = os.urandom(300 << 10), os.urandom(200 << 10)
        c.put("grpc/rot", rot, cfg)
        c.put("grpc/intact", intact, cfg)
        (good,) = _replica_list(c, "grpc/intact").replicas
        stub = c._data(good.data_endpoint)
        item = data_pb2.BatchReadItem(segment_id=good.segment_id, allocation_id=good.allocation_id, token=good.token)
        forged = data_pb2.BatchReadItem(segment_id=good.segment_id, allocation_id=good.allocation_id, token=b"not a token")
        resp = stub.Verify(data_pb2.VerifyRequest(items=[item, forged]), timeout=5)
        ok, bad = resp.results
        assert ok.status.code == OK and ok.object_size == len(intact) and ok.checksum, ok
        assert bad.status.reason == "INVALID_TOKEN", bad
        (d,) = _replica_list(c, "grpc/rot").replicas
        assert d.medium == types_pb2.MEDIUM_DISK
        _flip_byte(disk_cluster.dir / "agent-a-disk" / "segment.data", d.offset + (100 << 10))
        rot_item = data_pb2.BatchReadItem(segment_id=d.segment_id, allocation_id=d.allocation_id, token=d.token)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Verify(data_pb2.VerifyRequest(items=[rot_item] * (_xfer.MAX_VERIFY_ITEMS + 1)), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not _gone(c, "grpc/rot")  # refused before any item was read
        c._verify_replica(d)
        _eventually(lambda: _gone(c, "grpc/rot"), 20, "the master removes the dropped replica")
        assert c.get("grpc/intact") == intact
    finally:
        c.close()


def test_get_verifies_corrupt_large_disk_replica(disk_cluster, tenant, monkeypatch):
    """A 17 MiB object (two transfer requests, which the agent does not check
    itself) on two disk replicas, agent-a's corrupt: the get returns agent-b's
    bytes, then has agent-a verify its replica, which it drops."""
    s = DistributedStore()
    assert s.setup(disk_cluster.master, tenant, local_hostname="host-a") == OK  # agent-a's replica read first
    c = s.client
    verified = []
    real = _xfer.Pool.verify

    def spy(self, endpoint, items, timeout=None):
        out = real(self, endpoint, items, timeout)
        verified.append((endpoint, [(it.segment_id, it.allocation_id) for it in items], out))
        return out

    try:
        segs = _disk_segments(disk_cluster)
        data = os.urandom(17 << 20)
        cfg = ReplicateConfig(replica_num=2, medium="disk", preferred_segments=[segs["host-a"], segs["host-b"]])
        assert s.put("big", data, cfg) == OK, s.last_error
        reps = {d.host_id: d for d in _replica_list(c, "big").replicas}
        assert set(reps) == {"host-a", "host-b"}
        a = reps["host-a"]
        _flip_byte(disk_cluster.dir / "agent-a-disk" / "segment.data", a.offset + (1 << 20))
        monkeypatch.setattr(_xfer.Pool, "verify", spy)
        assert s.get("big") == data, s.last_error
        assert len(verified) == 1, verified
        ep, items, (err,) = verified[0]
        assert (ep, items) == (a.transfer_endpoint, [(a.segment_id, a.allocation_id)])
        assert err is not None and err.reason == "CHECKSUM_MISMATCH", err
        _eventually(lambda: [d.host_id for d in _replica_list(c, "big").replicas] == ["host-b"], 20,
                    "the master removes agent-a's replica")
        assert s.get("big") == data
        assert len(verified) == 1  # a clean read asks nothing
    finally:
        s.close()


def test_get_of_only_replica_gone_bad_names_the_checksum(disk_cluster, tenant):
    """A get whose only replica's bytes went bad fails; when the list it
    fetches again already says OBJECT_NOT_FOUND (the agent dropped the
    replica meanwhile), the error still names the checksum failure, as the
    Go SDK's does."""
    c = Client(disk_cluster.master, tenant, host_id="host-a")
    try:
        cfg = ReplicateConfig(medium="disk", preferred_segment=_disk_segments(disk_cluster)["host-a"])
        c.put("disk/only", os.urandom(300 << 10), cfg)
        (d,) = _replica_list(c, "disk/only").replicas
        _flip_byte(disk_cluster.dir / "agent-a-disk" / "segment.data", d.offset + 7)
        with pytest.raises(CrescentError) as ei:
            c.get("disk/only")
        assert ei.value.reason in ("CHECKSUM_MISMATCH", "OBJECT_NOT_FOUND"), ei.value
        assert "checksum mismatch" in str(ei.value), ei.value
        # Failed twice (the list, then a fresh one): the first round's error is kept.
        assert ei.value.first is not None and ei.value.first.reason == "CHECKSUM_MISMATCH", ei.value
        _eventually(lambda: _gone(c, "disk/only"), 20, "the master removes the dropped replica")
    finally:
        c.close()
