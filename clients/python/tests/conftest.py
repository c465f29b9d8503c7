"""A real local Crescent cluster for the Python client's tests.

The binaries are the ones `make build` puts in bin/ (or $CRESCENT_BIN):
one master, two agents on distinct host ids (agent-a with a bulk transfer
listener, agent-b with --transfer-addr off, so that every test that
touches both agents covers the transfer protocol and the DataService
fallback), and a gateway, each on free loopback ports, with the e2e
suite's fast failure detection (heartbeats every 100 ms, suspect after
600 ms). Logs go to the cluster's directory.

Fixtures:
  cluster          one cluster for the session (do not kill its processes)
  cluster_factory  cluster_factory(**opts) starts a cluster of the test's
                   own (stopped at the test's end): kill agents freely
  store            a DistributedStore set up on `cluster`, in a fresh tenant

cluster_factory(tls=True) runs the cluster with mTLS on every gRPC and admin
port (development certificates from `crescentctl certs init` in .certs:
tenant certificates for "default" and "tls-tenant", .cert(role, name)
gives a (cert, key) pair, .certs / "ca.pem" the CA).

A Cluster has .master ("host:port"), .gateway_pub / .gateway_replay /
.gateway_snapshot ("tcp://host:port"), .gateway_grpc, .agents (Proc with
.kill() and .host_id, .transfer), .dir, and .segments() (AdminService's view).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the crescent package, without installing it
REPO = HERE.parent.parent.parent


def _bin_dir() -> Path:
    return Path(os.environ.get("CRESCENT_BIN") or REPO / "bin")


def free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, admin: str):
        self.name, self.argv, self.log, self.admin = name, argv, log, admin
        self.p: subprocess.Popen | None = None
        self.host_id = ""
        self.transfer = ""

    def start(self):
        self._logf = open(self.log, "ab")
        self.p = subprocess.Popen(self.argv, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    ssl_ctx = None  # an SSLContext with the admin's certificate, in TLS mode

    def ready(self) -> bool:
        if self.p is None or self.p.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.p.returncode if self.p else '?'}); log:\n{self.tail()}")
        scheme = "https" if self.ssl_ctx else "http"
        try:
            with urllib.request.urlopen(f"{scheme}://{self.admin}/readyz", timeout=1, context=self.ssl_ctx) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self):
        """SIGKILL: the process dies without telling anyone (a crashed agent)."""
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)

    def stop(self):
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        if getattr(self, "_logf", None):
            self._logf.close()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while True:
        if cond():
            return
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Cluster:
    def __init__(self, agent_memory: str = "256MiB", transfer=(True, False), gateway: bool = True, tls: bool = False,
                 disk: str = "", disk_mount=None, master_flags=()):
        """disk: each agent's --disk-size (none when empty), in <dir>/agent-X-disk;
        disk_mount(i, path), when set, is called with agent i's disk directory
        before it starts (to mount a filesystem there). master_flags: more
        flags for the master, after (so overriding) the fixture's own
        (["--lease-ttl", "1s"])."""
        bindir = _bin_dir()
        for b in ("crescent-master", "crescent-agent", "crescent-gateway", "crescentctl"):
            if not (bindir / b).exists():
                msg = f"{bindir / b} is missing: run `make build` (or set CRESCENT_BIN)"
                if os.environ.get("CI") == "true":
                    pytest.fail(msg)
                pytest.skip(msg)
        self.dir = Path(tempfile.mkdtemp(prefix="crescent-py-"))
        self.tls = tls
        self.certs = self.dir / "certs"
        self._ssl = None
        if tls:
            import ssl

            subprocess.run([str(bindir / "crescentctl"), "certs", "init", str(self.certs), "--agents", "host-a,host-b",
                            "--tenants", "default,tls-tenant"], check=True, capture_output=True)
            self._ssl = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
            self._ssl.load_cert_chain(*self.cert("admin", "admin"))
        self.procs: list[Proc] = []
        self.agents: list[Proc] = []
        self.master = free_addr()
        m = self._proc("master", ["master", "master-1"], [str(bindir / "crescent-master"), "--grpc-addr", self.master,
                                  "--heartbeat-interval", "100ms", "--suspect-after", "600ms", "--unmount-after", "3s",
                                  *master_flags])
        try:
            m.start()
            _wait(m.ready, 20, "the master's /readyz")
            for i, xfer in enumerate(transfer):
                name, host = f"agent-{'ab'[i]}", f"host-{'ab'[i]}"
                taddr = free_addr() if xfer else "off"
                argv = [str(bindir / "crescent-agent"), "--master", self.master, "--grpc-addr", free_addr(),
                        "--transfer-addr", taddr, "--host-id", host, "--agent-id", name,
                        "--memory", agent_memory, "--shutdown-grace", "200ms"]
                if disk:
                    ddir = self.dir / f"{name}-disk"
                    ddir.mkdir()
                    if disk_mount:
                        disk_mount(i, ddir)
                    argv += ["--disk-dir", str(ddir), "--disk-size", disk]
                a = self._proc(name, ["agent", host], argv)
                a.host_id, a.transfer = host, "" if taddr == "off" else taddr
                a.start()
                self.agents.append(a)
            for a in self.agents:
                _wait(a.ready, 20, f"{a.name}'s /readyz")
            want = len(self.agents) * (2 if disk else 1)
            _wait(lambda: sum(s.can_allocate for s in self.segments()) >= want, 20, "every segment to allocate")
            self.gateway_pub = self.gateway_replay = self.gateway_snapshot = self.gateway_grpc = ""
            if gateway:
                self.gateway_pub = "tcp://" + free_addr()
                self.gateway_replay = "tcp://" + free_addr()
                self.gateway_snapshot = "tcp://" + free_addr()
                self.gateway_grpc = free_addr()
                (self.dir / "gateway-state").mkdir()
                g = self._proc("gateway", ["gateway", "gateway-1"], [str(bindir / "crescent-gateway"), "--master", self.master,
                                           "--pub", self.gateway_pub, "--replay", self.gateway_replay,
                                           "--snapshot-endpoint", self.gateway_snapshot, "--grpc-addr", self.gateway_grpc,
                                           "--state-dir", str(self.dir / "gateway-state"), "--backend-id", "pytest"])
                g.start()
                _wait(g.ready, 20, "the gateway's /readyz")
                self.gateway = g
        except BaseException:
            self.stop()
            raise

    def cert(self, role: str, name: str):
        """(certificate, key) file names of role/name's development certificate (TLS mode)."""
        return str(self.certs / f"{role}-{name}.pem"), str(self.certs / f"{role}-{name}-key.pem")

    def _proc(self, name, principal, argv):
        admin = free_addr()
        argv = argv + ["--admin-addr", admin, "--log-level", "debug"]
        if self.tls:
            cert, key = self.cert(*principal)
            argv += ["--tls-ca", str(self.certs / "ca.pem"), "--tls-cert", cert, "--tls-key", key]
        p = Proc(name, argv, self.dir / f"{name}.log", admin)
        p.ssl_ctx = self._ssl
        self.procs.append(p)
        return p

    def segments(self):
        import grpc

        from crescent._gen.master.v1 import admin_pb2, admin_pb2_grpc

        if self.tls:
            cert, key = self.cert("admin", "admin")
            creds = grpc.ssl_channel_credentials(
                (self.certs / "ca.pem").read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())
            ch = grpc.secure_channel(self.master, creds)
        else:
            ch = grpc.insecure_channel(self.master)
        with ch:
            try:
                return admin_pb2_grpc.AdminServiceStub(ch).ListSegments(admin_pb2.ListSegmentsRequest(), timeout=2).segments
            except grpc.RpcError:
                return []

    def wait_segments(self, n: int, timeout: float = 20):
        """Wait until exactly n segments can allocate (after an agent died: n-1)."""
        _wait(lambda: sum(s.can_allocate for s in self.segments()) == n, timeout, f"{n} allocatable segments")

    def stop(self):
        for p in reversed(self.procs):
            p.stop()
        if os.environ.get("CRESCENT_PY_KEEP"):
            print(f"cluster directory kept: {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.procs)


@pytest.fixture(scope="session")
def cluster():
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture
def cluster_factory():
    made = []

    def make(**opts):
        c = Cluster(**opts)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def tenant():
    """A fresh tenant per test: its keys and remove_all touch no other test."""
    return "t-" + uuid.uuid4().hex[:10]


@pytest.fixture
def store(cluster, tenant):
    from crescent import DistributedStore

    s = DistributedStore()
    assert s.setup(cluster.master, tenant) == 0
    yield s
    s.close()
