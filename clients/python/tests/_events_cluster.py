"""A real local Crescent cluster for the crescent.events tests: one master,
two agents (memory and disk), gateways, all from ./bin as separate
processes on loopback (as deploy/run-local.sh and e2e/harness_test.go start
them), plus crescentctl for objects and the master's listing, and a TCP
proxy that can cut a subscriber off its gateway.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BIN = os.environ.get("CRESCENT_BIN", os.path.join(REPO, "bin"))
BINARIES = ("crescent-master", "crescent-agent", "crescent-gateway", "crescentctl")


def missing_binaries():
    return [b for b in BINARIES if not os.access(os.path.join(BIN, b), os.X_OK)]


_handed_out = set()


def free_addr():
    """A loopback host:port nobody listens on (and not handed out before)."""
    for _ in range(100):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % s.getsockname()[1]
        s.close()
        if addr not in _handed_out:
            _handed_out.add(addr)
            return addr
    raise RuntimeError("no free loopback port")


def wait_until(pred, timeout, what, interval=0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception as e:  # not up yet
            last = e
        time.sleep(interval)
    raise AssertionError("%s: not within %.0fs (last error: %r)" % (what, timeout, last))


class Proc:
    """One running binary with its admin port and a log file."""

    def __init__(self, name, binary, args, log_dir):
        self.name = name
        self.admin = free_addr()
        self.argv = [os.path.join(BIN, binary)] + list(args) + ["--admin-addr", self.admin]
        self.log = os.path.join(log_dir, name + ".log")
        self.p = None

    def start(self):
        with open(self.log, "ab") as f:
            f.write(("==== start %s\n" % " ".join(self.argv)).encode())
            self.p = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT)
        return self

    def get(self, path):
        with urllib.request.urlopen("http://%s%s" % (self.admin, path), timeout=5) as r:
            return r.status, r.read()

    def wait_ready(self, timeout=20):
        def ready():
            assert self.p.poll() is None, "%s exited: %s" % (self.name, self.tail())
            return self.get("/readyz")[0] == 200
        wait_until(ready, timeout, "%s /readyz" % self.name)

    def kill(self):
        """SIGKILL: a crash."""
        self._signal(signal.SIGKILL)

    def stop(self):
        """SIGTERM: a clean stop."""
        self._signal(signal.SIGTERM)

    def _signal(self, sig):
        if self.p is None or self.p.poll() is not None:
            return
        self.p.send_signal(sig)
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()

    def tail(self, n=40):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class Gateway(Proc):
    """A gateway; "{pub}" in a flag is its PUB address (host:port), as in
    vLLM's topic form kv@{pub}@model."""

    def __init__(self, name, master, log_dir, flags=()):
        self.pub = "tcp://" + free_addr()
        self.replay = "tcp://" + free_addr()
        self.snapshot = "tcp://" + free_addr()
        self.state_dir = os.path.join(log_dir, name + "-state")
        super().__init__(name, "crescent-gateway", [
            "--master", master, "--pub", self.pub, "--replay", self.replay, "--grpc-addr", free_addr(),
            "--snapshot-endpoint", self.snapshot, "--state-dir", self.state_dir, "--backend-id", name,
            "--log-level", "debug", "--resume-hold", "500ms",
        ] + [f.replace("{pub}", self.pub[len("tcp://"):]) for f in flags], log_dir)

    def status(self):
        return json.loads(self.get("/kv_events/status")[1])

    def lose_state(self):
        shutil.rmtree(self.state_dir, ignore_errors=True)


class Cluster:
    def __init__(self, work_dir):
        self.dir = work_dir
        self.procs = []
        self.master_addr = free_addr()
        self.master = self._add(Proc("master", "crescent-master", [
            "--grpc-addr", self.master_addr, "--log-level", "debug",
            "--heartbeat-interval", "100ms", "--suspect-after", "600ms", "--unmount-after", "3s"], work_dir))
        self.agents = []
        for i in range(2):
            disk = os.path.join(work_dir, "agent-%d-disk" % i)
            os.makedirs(disk, exist_ok=True)
            self.agents.append(self._add(Proc("agent-%d" % i, "crescent-agent", [
                "--master", self.master_addr, "--grpc-addr", free_addr(), "--host-id", "host-%d" % i,
                "--agent-id", "agent-%d" % i, "--memory", "64MiB", "--disk-dir", disk, "--disk-size", "64MiB",
                "--log-level", "debug", "--shutdown-grace", "200ms"], work_dir)))

    def _add(self, p):
        self.procs.append(p)
        return p

    def start(self):
        self.master.start().wait_ready()
        for a in self.agents:
            a.start()
        for a in self.agents:
            a.wait_ready()
        wait_until(lambda: len(self.segments()) >= 4, 20, "4 segments registered")

    def gateway(self, name, flags=()):
        g = self._add(Gateway(name, self.master_addr, self.dir, flags))
        g.start().wait_ready()
        return g

    def stop(self):
        for p in reversed(self.procs):
            p.stop()

    def logs(self):
        return "\n".join("==== %s\n%s" % (p.name, p.tail()) for p in self.procs)

    # crescentctl

    def ctl(self, *args, tenant="default", stdin=None):
        r = subprocess.run([os.path.join(BIN, "crescentctl"), "--master", self.master_addr, "--tenant", tenant,
                            "--timeout", "20s"] + list(args), input=stdin, capture_output=True, timeout=30)
        if r.returncode != 0:
            raise AssertionError("crescentctl %s: exit %d: %s" % (" ".join(args), r.returncode, r.stderr.decode()))
        return r.stdout.decode()

    def put(self, key, tenant="default", medium="memory", data=b"v"):
        self.ctl("put", key, "-", "--medium", medium, tenant=tenant, stdin=data)

    def rm(self, *args, tenant="default"):
        self.ctl("rm", *args, tenant=tenant)

    def segments(self):
        return [json.loads(line) for line in self.ctl("-o", "json", "segments").splitlines() if line.strip()]

    def listing(self, tenants):
        """The master's readable set: {(tenant, key, medium)} from crescentctl ls."""
        out = set()
        for t in tenants:
            for line in self.ctl("-o", "json", "ls", tenant=t).splitlines():
                if line.strip():
                    o = json.loads(line)
                    for m in o["media"]:
                        out.add((t, o["key"], m))
        return out


class _ZmtpDropper:
    """Parses the ZMTP 3 stream a publisher sends (greeting, then frames:
    flags, a 1- or 8-byte size, the body) and drops whole data messages while
    the proxy is dropping; commands and the greeting pass untouched. The
    connection stays up: the subscriber sees a live sequence gap."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.buf = b""
        self.greeting = 64
        self.in_msg = False
        self.drop_cur = False

    def feed(self, data):
        out = []
        self.buf += data
        if self.greeting:
            n = min(self.greeting, len(self.buf))
            out.append(self.buf[:n])
            self.buf, self.greeting = self.buf[n:], self.greeting - n
            if self.greeting:
                return b"".join(out)
        while len(self.buf) >= 2:
            flags = self.buf[0]
            if flags & 0x02:
                if len(self.buf) < 9:
                    break
                hdr, size = 9, int.from_bytes(self.buf[1:9], "big")
            else:
                hdr, size = 2, self.buf[1]
            if len(self.buf) < hdr + size:
                break
            frame, self.buf = self.buf[:hdr + size], self.buf[hdr + size:]
            if flags & 0x04:  # a command
                out.append(frame)
                continue
            if not self.in_msg:
                self.drop_cur = self.proxy.dropping
                if self.drop_cur:
                    self.proxy.dropped += 1
                self.in_msg = True
            if not self.drop_cur:
                out.append(frame)
            if not flags & 0x01:  # the last frame of the message
                self.in_msg = False
        return b"".join(out)


class Proxy:
    """A TCP proxy on loopback in front of a publisher. cut() drops every
    connection and refuses new ones until heal(); while dropping is set,
    the publisher's messages are dropped whole (dropped counts them) and the
    connection stays up."""

    def __init__(self, target):
        host, port = target.replace("tcp://", "").rsplit(":", 1)
        self.target = (host, int(port))
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(16)
        self.endpoint = "tcp://127.0.0.1:%d" % self.ls.getsockname()[1]
        self.up = True
        self.closed = False
        self.dropping = False
        self.dropped = 0
        self.mu = threading.Lock()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            if not self.up:
                c.close()
                continue
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            u.settimeout(None)
            with self.mu:
                self.conns += [c, u]
            threading.Thread(target=self._pipe, args=(c, u, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, _ZmtpDropper(self)), daemon=True).start()

    @staticmethod
    def _pipe(a, b, dropper):
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                if dropper is not None:
                    d = dropper.feed(d)
                if d:
                    b.sendall(d)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self.up = False
        with self.mu:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def heal(self):
        self.up = True

    def close(self):
        self.closed = True
        self.cut()
        self.ls.close()
