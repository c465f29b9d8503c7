"""Gets whose first replica list the agent refuses: its tokens expired while
the agent was frozen (make soak's SIGSTOP past the read lease), or they are
tokens the agent does not accept. Every read path (get, get_into, get_many,
get_many_into, and the Mooncake store's calls on them), on both data paths
(agent-a's transfer listener, agent-b's DataService), fetches a fresh list
once and reads from it, as the Go SDK's getAgain does, pausing
TOKEN_RETRY_PAUSE first after INVALID_TOKEN; when that round fails too, the
error is the second round's, naming (and keeping, .first) the first's."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from crescent import Client, CrescentError, DistributedStore, ErrorCode, ReplicateConfig
from crescent import client as client_mod

OK = 0
LEASE = 1.0  # the master's --lease-ttl here
PAST = 0.5  # an agent is woken this long after the first list's lease ended
SMALL, LARGE = 5000, 300 << 10  # LARGE > small_object (256 KiB): read alone, not in a grouped request


@pytest.fixture(scope="module")
def short_lease():
    """A cluster whose read leases (and so read tokens) last LEASE, and whose
    master suspects a silent agent only after 5 s, so that the lists it
    hands out while an agent is frozen still name that agent's replicas."""
    from conftest import Cluster

    c = Cluster(agent_memory="64MiB", gateway=False,
                master_flags=["--lease-ttl", f"{int(LEASE * 1000)}ms", "--suspect-after", "5s", "--unmount-after", "10s"])
    yield c
    c.stop()


# host-a has a bulk transfer listener, host-b none: its bytes go through DataService.
PATHS = pytest.mark.parametrize("host", ["host-a", "host-b"], ids=["transfer", "dataservice"])


def _eq(got, want):
    assert got is not None and bytes(got) == want, f"{'no' if got is None else len(got)} bytes, not the {len(want)} put"


# Each read path, on the objects "small" and "large" (data: key -> bytes);
# each asserts that it read them.


def _get_small(s, data):
    _eq(s.client.get("small"), data["small"])


def _get_large(s, data):
    _eq(s.client.get("large"), data["large"])


def _get_into(s, data):
    buf = bytearray(LARGE + 10)
    assert s.client.get_into("large", buf) == LARGE
    _eq(buf[:LARGE], data["large"])


def _get_many(s, data):
    outs, errs = s.client.get_many(["small", "large"])
    assert errs == [None, None], errs
    _eq(outs[0], data["small"])
    _eq(outs[1], data["large"])


def _get_many_into(s, data):
    bufs = [bytearray(SMALL + 10), bytearray(LARGE)]
    sizes, errs = s.client.get_many_into(["small", "large"], bufs)
    assert errs == [None, None], errs
    assert sizes == [SMALL, LARGE]
    _eq(bufs[0][:SMALL], data["small"])
    _eq(bufs[1], data["large"])


def _store_get(s, data):
    assert s.get("small") == data["small"], s.last_error


def _store_get_batch(s, data):
    assert s.get_batch(["small", "large"]) == [data["small"], data["large"]], s.last_error


def _store_batch_get_into(s, data):
    bufs = [bytearray(SMALL), bytearray(LARGE)]
    assert s.batch_get_into(["small", "large"], bufs, [SMALL, LARGE]) == [SMALL, LARGE], s.last_error
    _eq(bufs[0], data["small"])
    _eq(bufs[1], data["large"])


OPS = pytest.mark.parametrize("op", [_get_small, _get_large, _get_into, _get_many, _get_many_into, _store_get,
                                     _store_get_batch, _store_batch_get_into],
                              ids=lambda f: f.__name__.lstrip("_"))


class _Lookups:
    """Counts Client._lookup calls (one per round of a get: its replica
    lists) and forges the tokens of the first `forge` lists it hands out;
    first is set once the first list is in, at first_at."""

    def __init__(self, monkeypatch, forge=0):
        self.calls = 0
        self.forge = forge
        self.first = threading.Event()
        self.first_at = 0.0
        real = Client._lookup
        lk = self

        def spy(client, keys, idx):
            lk.calls += 1
            pairs = real(client, keys, idx)
            if not lk.first.is_set():
                lk.first_at = time.monotonic()
                lk.first.set()
            if lk.calls <= lk.forge:
                for _, _, rl in pairs:
                    for d in rl.replicas:
                        d.token = b"not a token"
            return pairs

        monkeypatch.setattr(Client, "_lookup", spy)


@pytest.fixture
def on_agent(short_lease, tenant):
    """make(host): a DistributedStore on short_lease holding "small" and
    "large", each with one replica, on host's agent; (store, data)."""
    made = []

    def make(host):
        s = DistributedStore()
        assert s.setup(short_lease.master, tenant) == OK
        made.append(s)
        seg = {x.host_id: x.info.segment_id for x in short_lease.segments()}
        cfg = ReplicateConfig(preferred_segment=seg[host])
        data = {"small": os.urandom(SMALL), "large": os.urandom(LARGE)}
        for k, v in data.items():
            assert s.put(k, v, cfg) == OK, s.last_error
            assert [d.host_id for d in s.client.stat(k).replicas] == [host]
        return s, data

    yield make
    for s in made:
        s.close()


@PATHS
@OPS
def test_get_outlives_an_agent_frozen_past_the_lease(short_lease, on_agent, host, op, monkeypatch):
    """make soak's failure: the agent holding the only replica is stopped
    (SIGSTOP) just before a get and woken (SIGCONT), while the get waits for
    it, PAST after the lease of the get's list ended. It then answers the
    read with INVALID_TOKEN 'token expired'; the get fetches a fresh list (a
    second lookup) and reads. Without that round the get failed with
    INVALID_TOKEN (PERMISSION_DENIED), TRANSFER_FAIL to Mooncake."""
    s, data = on_agent(host)
    agent = next(a for a in short_lease.agents if a.host_id == host)
    lk = _Lookups(monkeypatch)
    out = {}

    def run():
        try:
            op(s, data)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    os.kill(agent.p.pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=run)
        t.start()
        # Its list is handed out while the agent is stopped; the agent
        # wakes after that list's tokens expired, however slow the lookup.
        assert lk.first.wait(20), "no replica list within 20 s"
        time.sleep(max(0.0, lk.first_at + LEASE + PAST - time.monotonic()))
    finally:
        os.kill(agent.p.pid, signal.SIGCONT)
    t.join(30)
    assert not t.is_alive(), "the get did not end within 30 s of the agent waking"
    if "error" in out:
        raise out["error"]
    # A get's (a batch's) rounds: the first list's read failed, the fresh one's did not.
    assert lk.calls == 2, lk.calls


@PATHS
@OPS
def test_get_refetches_refused_tokens(on_agent, host, op, monkeypatch):
    """The first list's tokens are ones the agent refuses (INVALID_TOKEN):
    the get waits TOKEN_RETRY_PAUSE, fetches a fresh list and reads."""
    s, data = on_agent(host)
    pauses = []
    real_sleep = time.sleep

    def sleep(t):
        pauses.append(t)
        real_sleep(t)

    monkeypatch.setattr(client_mod.time, "sleep", sleep)
    lk = _Lookups(monkeypatch, forge=1)
    op(s, data)
    assert lk.calls == 2, lk.calls
    assert client_mod.TOKEN_RETRY_PAUSE in pauses, f"no pause before the fresh list: {pauses}"


@PATHS
def test_second_round_failure_names_both(on_agent, host, monkeypatch):
    """Every list's tokens are refused: each read path fails after two
    rounds, no more, with the second round's error (INVALID_TOKEN, so
    TRANSFER_FAIL to Mooncake, as before), whose message names the first
    round's failure too and which keeps it (.first)."""
    s, _ = on_agent(host)
    cl = s.client
    lk = _Lookups(monkeypatch, forge=1 << 30)

    def raised(fn):
        with pytest.raises(CrescentError) as ei:
            fn()
        return [ei.value]

    for name, fn, rounds in [
        ("get", lambda: raised(lambda: cl.get("small")), 2),
        ("get_into", lambda: raised(lambda: cl.get_into("large", bytearray(LARGE))), 2),
        ("get_many", lambda: cl.get_many(["small", "large"])[1], 2),
        ("get_many_into", lambda: cl.get_many_into(["small", "large"], [bytearray(SMALL), bytearray(LARGE)])[1], 2),
    ]:
        lk.calls = 0
        errs = fn()
        assert lk.calls == rounds, (name, lk.calls)
        for e in errs:
            assert e is not None and e.reason == "INVALID_TOKEN", (name, e)
            assert "(the first read: INVALID_TOKEN: " in e.message, (name, e)
            assert e.first is not None and e.first.reason == "INVALID_TOKEN", (name, e)
            assert e.mooncake_code == ErrorCode.TRANSFER_FAIL
    assert s.get_batch(["small", "large"]) == [b"", b""]
    assert "(the first read: " in str(s.last_error), s.last_error
    assert s.batch_get_into(["small"], [bytearray(SMALL)], [SMALL]) == [ErrorCode.TRANSFER_FAIL]
