"""Failures: a dead agent, masters that are not the leader, agents that
break the transfer protocol, and the DataService fallback."""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from crescent import Client, CrescentError, DistributedStore, ErrorCode, ReplicateConfig
from crescent import _xfer
from crescent._gen.agent.v1 import transfer_pb2

OK = 0


def test_dead_agent(cluster_factory, tenant):
    """SIGKILL one agent: objects on it fail to read with TRANSFER_FAIL (or
    REPLICA_IS_NOT_READY once the master has noticed), objects with a replica
    elsewhere are read from it, and a put placed on the dead agent fails
    without leaving anything readable; once the master has noticed, puts go
    to the live agent."""
    c = cluster_factory(gateway=False)
    s = DistributedStore()
    assert s.setup(c.master, tenant, io_timeout=5.0) == OK
    seg = {x.host_id: x.info.segment_id for x in c.segments()}
    on = {}
    for host in ("host-a", "host-b"):
        cfg = ReplicateConfig()
        cfg.preferred_segment = seg[host]
        on[host] = os.urandom(5000)
        assert s.put(f"on/{host}", on[host], cfg) == OK
    both = os.urandom(300 << 10)  # > small_object: the single-object path
    assert s.put("both", both, ReplicateConfig(replica_num=2)) == OK
    dead = next(a for a in c.agents if a.host_id == "host-b")
    dead.kill()

    assert s.get("on/host-a") == on["host-a"]
    assert s.get("both") == both
    buf = bytearray(5000)
    code = s.get_into("on/host-b", buf, 5000)
    assert code in (ErrorCode.TRANSFER_FAIL, ErrorCode.REPLICA_IS_NOT_READY), s.last_error
    keys = [f"after/{i}" for i in range(40)]
    vals = [os.urandom(4096) for _ in keys]
    codes = s.batch_put_from(keys, vals, [4096] * len(keys))
    assert set(codes) <= {OK, ErrorCode.TRANSFER_FAIL}, s.last_error
    for k, v, code in zip(keys, vals, codes):
        if code == OK:
            assert s.get(k) == v
        else:
            assert s.is_exist(k) == 0  # revoked: nothing half-written

    c.wait_segments(1)
    assert s.get_into("on/host-b", buf, 5000) in (ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.TRANSFER_FAIL)
    assert s.put_batch([k + "/2" for k in keys], vals) == OK
    assert s.get_batch([k + "/2" for k in keys]) == vals
    assert s.get("both") == both
    s.close()


# --- leader redirects ----------------------------------------------------------------


def _pb_len(num: int, b: bytes) -> bytes:
    out = bytearray()
    for x in ((num << 3) | 2, len(b)):
        while True:
            if x < 0x80:
                out.append(x)
                break
            out.append((x & 0x7F) | 0x80)
            x >>= 7
    return bytes(out) + b


def _not_leader(leader: str) -> bytes:
    """google.rpc.Status{UNAVAILABLE, ErrorInfo{NOT_LEADER, metadata leader}}, as a standby master sends it."""
    entry = _pb_len(1, b"leader") + _pb_len(2, leader.encode())
    info = _pb_len(1, b"NOT_LEADER") + _pb_len(2, b"crescent.master.v1") + _pb_len(3, entry)
    anyb = _pb_len(1, b"type.googleapis.com/google.rpc.ErrorInfo") + _pb_len(2, info)
    return b"\x08\x0e" + _pb_len(2, b"this master is not the leader") + _pb_len(3, anyb)


class _Standby(grpc.GenericRpcHandler):
    def __init__(self, leader: str):
        self.leader = leader
        self.calls = 0

    def service(self, details):
        def answer(req, ctx):
            self.calls += 1
            ctx.set_trailing_metadata((("grpc-status-details-bin", _not_leader(self.leader)),))
            ctx.abort(grpc.StatusCode.UNAVAILABLE, "this master is not the leader")

        return grpc.unary_unary_rpc_method_handler(answer)


@pytest.fixture
def standby():
    servers = []

    def make(leader: str):
        h = _Standby(leader)
        srv = grpc.server(ThreadPoolExecutor(4))
        srv.add_generic_rpc_handlers((h,))
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}", h

    yield make
    for s in servers:
        s.stop(0)


def test_follows_not_leader(cluster, tenant, standby):
    addr, h = standby(cluster.master)  # names the real master as leader
    s = DistributedStore()
    assert s.setup(addr, tenant) == OK
    assert s.put("via-standby", b"x") == OK
    assert s.get("via-standby") == b"x"
    assert h.calls == 1  # then the client stays with the leader
    s.close()


def test_fails_over_without_leader(cluster, tenant, standby):
    addr, h = standby("")  # an election in progress: no leader named
    s = DistributedStore()
    assert s.setup(f"{addr},{cluster.master}", tenant) == OK
    assert s.put("failover", b"y") == OK
    assert s.get("failover") == b"y"
    assert h.calls >= 1
    s.close()
    # With no other master, the failover budget runs out with the standby's answer.
    only = DistributedStore()
    assert only.setup(addr, tenant, failover_timeout=0.3) == OK
    assert only.put("never", b"z") == ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
    assert only.last_error.reason == "NOT_LEADER"
    only.close()


def test_unreachable_master():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sk.getsockname()[1]}"
    s = DistributedStore()
    assert s.setup(addr, "x", attempts=2, backoff=0.01, timeout=2.0) == OK
    assert s.put("k", b"v") == ErrorCode.RPC_FAIL
    assert s.is_exist("k") == -1
    assert s.get("k") == b""
    s.close()


def test_setup_bad_arguments():
    s = DistributedStore()
    assert s.setup("") == ErrorCode.INVALID_PARAMS
    assert s.setup("127.0.0.1:1", tls_cert="c.pem") == ErrorCode.INVALID_PARAMS
    assert s.setup("127.0.0.1:1", bearer_token="t") == ErrorCode.INVALID_PARAMS  # never in plaintext
    assert s.put("k", b"v") == ErrorCode.INVALID_PARAMS  # not set up


# --- the transfer protocol against misbehaving agents ------------------------------------


class _FakeAgent:
    """A transfer listener that reads one request and answers with `reply`."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.endpoint = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.reply = reply
        self.got = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(5)
            try:
                self.got = conn.recv(1 << 20)
                if self.reply is not None:
                    conn.sendall(self.reply)
            except OSError:
                pass

    def close(self):
        self.sock.close()


def _item(n=4):
    return [transfer_pb2.TransferItem(segment_id="s", allocation_id=1, token=b"t", length=n)]


@pytest.mark.parametrize(
    "reply,reason",
    [
        (b"", "AGENT_UNAVAILABLE"),  # closes without answering
        (b"\xff\xff\xff\xff", "INTERNAL"),  # header length past the limit
        (b"\x03\x00\x00\x00\xff\xff\xff", "INTERNAL"),  # header that does not decode
        (b"\x00\x00\x00\x00", "INTERNAL"),  # no results for one item
    ],
)
def test_transfer_protocol_violations(reply, reason):
    agent = _FakeAgent(reply)
    pool = _xfer.Pool(io_timeout=5)
    try:
        with pytest.raises(CrescentError) as ei:
            pool.read(agent.endpoint, _item(), [memoryview(bytearray(4))])
        assert ei.value.reason == reason
        assert agent.got.startswith(b"CXF1")  # the preamble opens the connection
        req = transfer_pb2.TransferRequest()
        (n,) = _xfer._U32.unpack(agent.got[4:8])
        req.ParseFromString(agent.got[8 : 8 + n])
        assert req.op == transfer_pb2.TRANSFER_OP_READ and req.items[0].length == 4
    finally:
        pool.close()
        agent.close()


def test_transfer_refused_request():
    resp = transfer_pb2.TransferResponse()
    resp.error.code = 8
    resp.error.reason = "LIMIT_EXCEEDED"
    resp.error.message = "too many connections"
    b = resp.SerializeToString()
    agent = _FakeAgent(_xfer._U32.pack(len(b)) + b)
    pool = _xfer.Pool(io_timeout=5)
    try:
        with pytest.raises(CrescentError) as ei:
            pool.write(agent.endpoint, _item(), [memoryview(b"abcd")])
        assert ei.value.reason == "LIMIT_EXCEEDED"
        assert agent.got.endswith(b"abcd")  # the payload followed the header
    finally:
        pool.close()
        agent.close()


def test_dataservice_fallback_batches(cluster, tenant):
    """disable_transfer moves every byte through DataService (BatchWrite,
    BatchRead, Write and Read streams), as for agents without a transfer
    listener."""
    c = Client(cluster.master, tenant, disable_transfer=True)
    keys = [f"ds/{i}" for i in range(100)]
    vals = [os.urandom(4096 + i) for i in range(100)]
    assert c.put_many(keys, vals) == [None] * 100
    outs, errs = c.get_many(keys + ["ds/missing"])
    assert errs[:100] == [None] * 100 and [bytes(o) for o in outs[:100]] == vals
    assert errs[100].reason == "OBJECT_NOT_FOUND"
    big = os.urandom(3 << 20)
    c.put("ds/big", big)
    assert c.get("ds/big") == big
    c.close()


# --- mutual TLS ------------------------------------------------------------------------


def test_mutual_tls(cluster_factory):
    """With mTLS on every port: a tenant's certificate works for its tenant
    on both data paths (the transfer protocol inside TLS, DataService), is
    refused for another tenant, and a client without a certificate or
    without TLS gets nothing."""
    c = cluster_factory(tls=True, gateway=False, agent_memory="64MiB")
    ca = str(c.certs / "ca.pem")
    cert, key = c.cert("tenant", "tls-tenant")
    big = os.urandom(1 << 20)
    for disable in (False, True):
        s = DistributedStore()
        assert s.setup(c.master, "tls-tenant", tls_ca=ca, tls_cert=cert, tls_key=key, disable_transfer=disable) == OK
        keys = [f"tls/{disable}/{i}" for i in range(20)]
        vals = [os.urandom(4096) for _ in keys]
        assert s.put_batch(keys, vals, ReplicateConfig(replica_num=2)) == OK, s.last_error
        assert s.get_batch(keys) == vals
        assert s.put(f"tls/{disable}/big", big) == OK, s.last_error
        assert s.get(f"tls/{disable}/big") == big
        s.close()
    other = DistributedStore()
    assert other.setup(c.master, "default", tls_ca=ca, tls_cert=cert, tls_key=key) == OK
    assert other.put("k", b"v") == ErrorCode.RPC_FAIL  # PERMISSION_DENIED: another tenant's certificate
    assert other.last_error.code == grpc.StatusCode.PERMISSION_DENIED
    other.close()
    plain = DistributedStore()
    assert plain.setup(c.master, "tls-tenant", attempts=1, timeout=3.0) == OK
    assert plain.put("k", b"v") < 0
    plain.close()


def test_frozen_agent(cluster_factory, tenant):
    """SIGSTOP one agent: its kernel keeps the connections open and moves
    nothing, so only io_timeout ends a transfer to it (it was 60 s, as long
    as a stopped agent could hold a get). A get of an object with a replica
    elsewhere reads that one after it (looking it up again once: the first
    list's tokens may have expired meanwhile); one only on the frozen agent
    fails. The first get goes out at once, before the master suspects the
    agent (600 ms)."""
    import signal
    import time

    c = cluster_factory(gateway=False)
    s = DistributedStore()
    # host-a: the agent with a transfer listener; its replicas are read first.
    assert s.setup(c.master, tenant, local_hostname="host-a") == OK
    seg = {x.host_id: x.info.segment_id for x in c.segments()}
    cfg = ReplicateConfig()
    cfg.preferred_segment = seg["host-a"]
    only = os.urandom(5000)
    assert s.put("only/host-a", only, cfg) == OK
    both = os.urandom(300 << 10)
    assert s.put("both", both, ReplicateConfig(replica_num=2)) == OK
    frozen = next(a for a in c.agents if a.host_id == "host-a")
    os.kill(frozen.p.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert s.get("both") == both, s.last_error
        buf = bytearray(5000)
        code = s.get_into("only/host-a", buf, 5000)
        took = time.monotonic() - start
        # The fixture's master unmounts a silent agent's segments after 3 s.
        assert code in (ErrorCode.TRANSFER_FAIL, ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_NOT_FOUND), s.last_error
        assert took < 15, f"two gets with agent host-a frozen took {took:.1f}s (io_timeout 5 s)"
    finally:
        os.kill(frozen.p.pid, signal.SIGCONT)


def test_put_again_after_segments_dropped(cluster_factory, tenant, monkeypatch):
    """The master drops a put's only replica while the client writes it:
    the agent holding it (host-a's, preferred) is frozen (SIGSTOP) between
    the write and PutEnd until the master, past --unmount-after (3 s here),
    has unmounted its segment. PutEnd then answers PUT_EXPIRED (the put
    was dropped, not stored; the master answered OBJECT_NOT_FOUND before)
    on the master that started the put, and the client puts it again,
    once, like the Go SDK (endAgain). Before, it put again only after a
    failover, so the put failed (LEASE_EXPIRED): about 1 in 5,000 puts
    under `make soak`'s agent freezes."""
    import signal
    import time

    from crescent._gen.master.v1 import segment_pb2

    c = cluster_factory(gateway=False)
    s = DistributedStore()
    assert s.setup(c.master, tenant) == OK
    seg = {x.host_id: x.info.segment_id for x in c.segments()}
    cfg = ReplicateConfig(replica_num=1)
    cfg.preferred_segment = seg["host-a"]
    client = s._c()
    starts, froze = [], []
    real_call_wire, real_run_writes = client._call_wire, client._run_writes

    def call_wire(method, *args, **kwargs):
        if method == "BatchPutStart":
            starts.append(method)
        return real_call_wire(method, *args, **kwargs)

    def dropped(seg_id):
        x = next((x for x in c.segments() if x.info.segment_id == seg_id), None)
        return x is None or x.lifecycle == segment_pb2.SEGMENT_LIFECYCLE_UNMOUNTED

    def run_writes(writes, views, meanwhile=None):
        # After the first put's write returned, before its PutEnd.
        werrs = real_run_writes(writes, views, meanwhile)
        if not froze:
            assert not werrs, werrs
            assert len(writes) == 1, writes
            # host-a's segment, unless the master suspected host-a (a
            # loaded machine): preferred_segment is a preference.
            d = writes[0][1]
            frozen = next(a for a in c.agents if a.host_id == d.host_id)
            froze.append(frozen.host_id)
            os.kill(frozen.p.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 15
                while not dropped(d.segment_id):
                    assert time.monotonic() < deadline, f"the master never unmounted frozen {d.host_id}'s segment"
                    time.sleep(0.05)
            finally:
                os.kill(frozen.p.pid, signal.SIGCONT)
        return werrs

    monkeypatch.setattr(client, "_call_wire", call_wire)
    monkeypatch.setattr(client, "_run_writes", run_writes)
    v = os.urandom(5000)
    assert s.put("dropped/mid-write", v, cfg) == OK, s.last_error
    assert froze and len(starts) == 2, (froze, starts)
    assert s.get("dropped/mid-write") == v, s.last_error
    s.close()


def _agent_metric(proc, name: str) -> float:
    """The sum of a metric's series from a process's /metrics (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{proc.admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_disk_full(cluster_factory, tenant):
    """The filesystem under agent-a's disk segment fills up (another file
    took the room; the segment's journal grows with every seal). Every disk
    put still succeeds: agent-a refuses reservations while its journal
    cannot be written, the master places puts on agent-b's disk, and a put
    whose seal failed on agent-a is put again, once (put_many, like the Go
    SDK). Before, those puts failed INTERNAL."""
    import errno
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mounts = []

    def mount(i, path):
        if i != 0:
            return
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
        mounts.append(path)

    try:
        c = cluster_factory(gateway=False, disk="4MiB", disk_mount=mount)
        s = DistributedStore()
        assert s.setup(c.master, tenant) == OK
        disk = ReplicateConfig(medium="disk")
        fd = os.open(mounts[0] / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * (64 << 10))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        finally:
            os.close(fd)
        agent_a = c.agents[0]
        stored = {}
        n = 0
        while _agent_metric(agent_a, "crescent_agent_segment_journal_failures_total") == 0:
            assert n < 1000, "1000 disk puts and agent-a's journal never failed on a full filesystem"
            v = os.urandom(1000)
            assert s.put(f"full/{n}", v, disk) == OK, s.last_error
            stored[f"full/{n}"] = v
            n += 1
        keys = [f"batch/{i}" for i in range(50)]
        vals = [os.urandom(1000) for _ in keys]
        assert s.put_batch(keys, vals, disk) == OK, s.last_error
        stored.update(zip(keys, vals))
        for i in range(50):
            v = os.urandom(1000)
            assert s.put(f"more/{i}", v, disk) == OK, s.last_error
            stored[f"more/{i}"] = v
        assert _agent_metric(agent_a, "crescent_agent_segment_journal_failing") == 1
        for k, v in stored.items():
            assert s.get(k) == v, (k, s.last_error)
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
