"""The client's side of master high availability: every master call goes
to the leader, following NOT_LEADER redirects and failing over to the next
configured master — the same loop as pkg/client/masters.go (read it for
the reasoning; this is a transcription).
"""

from __future__ import annotations

import random
import threading
import time

import grpc

from ._gen.master.v1 import admin_pb2_grpc, object_pb2, object_pb2_grpc
from .errors import CrescentError, from_rpc_error

MAX_MSG = 256 << 20
MAX_HINTS = 8
MAX_BACKOFF = 0.5
_OBJECT_SERVICE = object_pb2.DESCRIPTOR.services_by_name["ObjectService"].full_name

# What a failed try tells the retry loop (masters.go, classify).
_FINAL, _AGAIN, _RECOVERING, _REDIRECT, _FAILOVER = range(5)


def split_masters(s: str) -> list[str]:
    out: list[str] = []
    for a in (s or "").split(","):
        a = a.strip()
        if a and a not in out:
            out.append(a)
    return out


def channel_options():
    return [
        ("grpc.max_receive_message_length", MAX_MSG),
        ("grpc.max_send_message_length", MAX_MSG),
        # Large windows: bulk DataService streams are bound by flow control otherwise.
        ("grpc.http2.lookahead_bytes", 16 << 20),
        # Reconnect soon after a master comes back (masters.go dialMaster).
        # Not grpc.min_reconnect_backoff_ms: gRPC core also takes it as the
        # time a connection attempt is given, and 100 ms fails handshakes on
        # a loaded machine (masters.go gives 3 s: MinConnectTimeout).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # A master or agent that stops answering (stopped, hung, cut off)
        # keeps its TCP connection open: without pings a call on it would
        # wait until its timeout, or for ever without one. As the Go SDK:
        # a ping after 10 s without traffic, unanswered for 5 s, fails the
        # connection's calls (UNAVAILABLE). The servers accept a ping every
        # 5 s; gRPC core would otherwise stop after two pings without data.
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class Masters:
    """Channels to the configured masters and the address believed to lead."""

    def __init__(self, addrs: list[str], make_channel, attempts: int, backoff: float, failover: float):
        if not addrs:
            raise ValueError("at least one master address is required")
        self.addrs = addrs
        self._make_channel = make_channel
        self.attempts = attempts
        self.backoff = backoff
        self.failover = failover
        self._mu = threading.Lock()  # guards _stubs, _raw, _hints, _leader, _closed
        self._stubs: dict[str, tuple] = {}
        # ObjectService callables taking the request already serialized
        # (crescent._wire), per (address, method).
        self._raw: dict[tuple, object] = {}
        self._hints: list[str] = []
        self._leader = addrs[0]
        self._closed = False

    def current(self) -> str:
        with self._mu:
            if self._closed:
                raise CrescentError("", "client closed", grpc.StatusCode.CANCELLED)
            return self._leader

    def _stub(self, addr: str):
        with self._mu:
            if self._closed:
                raise CrescentError("", "client closed", grpc.StatusCode.CANCELLED)
            s = self._stubs.get(addr)
            if s is None:
                ch = self._make_channel(addr)
                s = (ch, object_pb2_grpc.ObjectServiceStub(ch), admin_pb2_grpc.AdminServiceStub(ch))
                self._stubs[addr] = s
            return s

    def _raw_callable(self, addr: str, method: str, response_type):
        with self._mu:
            fn = self._raw.get((addr, method))
        if fn is None:
            ch = self._stub(addr)[0]
            # No request serializer: the request goes out as the bytes given.
            fn = ch.unary_unary(f"/{_OBJECT_SERVICE}/{method}", request_serializer=None,
                                response_deserializer=response_type.FromString)
            with self._mu:
                self._raw[(addr, method)] = fn
        return fn

    def _follow(self, frm: str, leader: str) -> bool:
        if not leader or leader == frm:
            return False
        with self._mu:
            if leader not in self.addrs and leader not in self._hints:
                if len(self._hints) >= MAX_HINTS:
                    return False
                self._hints.append(leader)
            self._leader = leader
            return True

    def _next(self, addr: str) -> None:
        with self._mu:
            if self._leader != addr:
                return
            i = self.addrs.index(addr) if addr in self.addrs else -1
            self._leader = self.addrs[(i + 1) % len(self.addrs)]

    def close(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._closed = True
            stubs, self._stubs = self._stubs, {}
            self._raw = {}
        for ch, _, _ in stubs.values():
            ch.close()

    def _classify(self, err: CrescentError):
        r = err.reason
        if r == "NOT_LEADER":
            leader = err.metadata.get("leader", "")
            return (_REDIRECT, leader) if leader else (_FAILOVER, "")
        if r == "MASTER_SHUTTING_DOWN":
            return _FAILOVER, ""
        if r == "MASTER_RECOVERING":
            return _RECOVERING, ""
        if r == "AGENT_UNAVAILABLE":
            return _AGAIN, ""
        if r == "" and err.code == grpc.StatusCode.UNAVAILABLE:
            return (_FAILOVER, "") if len(self.addrs) > 1 else (_AGAIN, "")
        return _FINAL, ""

    def call(self, method: str, request, timeout: float | None = None, admin: bool = False, response_type=None):
        """Run ObjectService (or AdminService) `method` on the leader, retrying
        as masters.go's do does. Raises CrescentError. With response_type,
        request is the ObjectService request already serialized (bytes) and
        the answer is decoded as response_type."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tries = redirects = 0
        until = None
        delay = self.backoff
        while True:
            addr = self.current()
            if response_type is not None:
                fn = self._raw_callable(addr, method, response_type)
            else:
                _, obj, adm = self._stub(addr)
                fn = getattr(adm if admin else obj, method)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                return fn(request, timeout=left, metadata=self.metadata)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if deadline is not None and time.monotonic() >= deadline:
                raise err
            v, leader = self._classify(err)
            if v == _REDIRECT and not self._follow(addr, leader):
                v = _FAILOVER
            if v == _FINAL:
                raise err
            if v == _AGAIN:
                tries += 1
                if tries >= self.attempts:
                    raise err
            elif v == _REDIRECT:
                redirects += 1
                if redirects == 1:
                    continue
            elif v == _FAILOVER:
                self._next(addr)
            if v != _AGAIN:
                now = time.monotonic()
                if until is None:
                    until = now + self.failover
                if now >= until:
                    raise err
            wait = delay * (0.5 + random.random() / 2)
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise err
            time.sleep(wait)
            delay = min(delay * 2, max(self.backoff, MAX_BACKOFF))

    metadata: tuple = ()
