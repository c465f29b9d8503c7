"""crescent.events against a real gateway: a cluster of ./bin processes
(master, two agents with memory and disk, gateways), objects written with
crescentctl, and subscribers whose index must equal the master's listing
(crescentctl ls) after every step: batches dropped on the wire (a live gap,
repaired from replay), a subscriber cut off its gateway (a reconnect, the
outage filled from replay), the gateway killed and restarted with its state,
and restarted without it (a reset: rebuilt from replay or a snapshot).
Skipped when ./bin is not built (make build).
"""

import os
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))  # the _events_* helpers, whatever the import mode

from crescent import events  # noqa: E402
import _events_cluster as ec  # noqa: E402

TENANTS = ("default", "demo", "gone")


@pytest.fixture(scope="module")
def cluster():
    missing = ec.missing_binaries()
    if missing:
        pytest.skip("%s missing from %s: run `make build`" % (", ".join(missing), ec.BIN))
    with tempfile.TemporaryDirectory(prefix="crescent-events-") as d:
        c = ec.Cluster(d)
        try:
            c.start()
            yield c
        except BaseException:
            print(c.logs())
            raise
        finally:
            c.stop()


def index_set(sub_or_index):
    x = sub_or_index.index if isinstance(sub_or_index, events.Subscriber) else sub_or_index
    return {tuple(k) for k in x.keys()}


def wait_equal(c, subs, step, timeout=20):
    """Waits until every subscriber's index equals the master's listing
    (and, in snapshot mode, the subscriber says it is synced)."""
    want = c.listing(TENANTS)
    fetched = time.monotonic()
    deadline = fetched + timeout
    while True:
        bad = [s for s in subs
               if index_set(s) != want or (s._snapshot_ep is not None and not s.stats().synced)]
        if not bad:
            return want
        if time.monotonic() > deadline:
            s = bad[0]
            got = index_set(s)
            raise AssertionError("%s: index != master listing: missing %s, extra %s; stats %s"
                                 % (step, sorted(want - got)[:5], sorted(got - want)[:5], s.stats()))
        time.sleep(0.05)
        if time.monotonic() - fetched > 1:
            want, fetched = c.listing(TENANTS), time.monotonic()


def sub(endpoint, **kw):
    gaps = []
    s = events.Subscriber(endpoint, on_gap=gaps.append, reconnect_max=0.3, rebuild_min=0.2, rebuild_max=1,
                          **kw).start()
    s.gaps = gaps
    return s


def test_mooncake_stream(cluster):
    c = cluster
    gw = c.gateway("gw-moon")
    proxy = ec.Proxy(gw.pub)
    # A: Mooncake format, repaired by replay, started from sequence 1, behind
    # a proxy that can cut it off. B: bootstrapped from the snapshot endpoint.
    a = sub(proxy.endpoint, replay_endpoint=gw.replay, from_seq=1)
    b = sub(gw.pub, snapshot_endpoint=gw.snapshot, replay_endpoint=gw.replay)
    try:
        for i in range(8):
            c.put("obj/%02d" % i)
        for i in range(3):
            c.put("disk/%02d" % i, medium="disk")
        for i in range(3):
            c.put("d/%d" % i, tenant="demo")
        for i in range(2):
            c.put("g/%d" % i, tenant="gone")
        c.rm("obj/00", "obj/01")
        c.rm("--all", tenant="gone")  # a cleared event
        want = wait_equal(c, [a, b], "initial")
        assert len(want) == 12
        assert a.stats().unrepaired == 0 and a.stats().resets == 0

        # The plain exchanges: replay from 1 rebuilds the same set, a replay
        # from the next sequence is empty (the subscriber is current), and
        # the snapshot's cut is the last sequence.
        st = gw.status()
        x = events.Index()
        for rb in events.replay(gw.replay, 1):
            assert rb.replayed
            x.apply_batch(rb)
        assert index_set(x) == want
        assert list(events.replay(gw.replay, st["next_sequence"])) == []
        snap = events.fetch_snapshot(gw.snapshot)
        assert snap.cut == st["last_sequence"] and len(snap.epoch) == events.EPOCH_LEN
        y = events.Index()
        for chunk in snap.batches:
            y.apply_batch(chunk)
        assert index_set(y) == want

        # 1. The proxy drops A's messages while its connection stays up: A
        # sees the sequence skip on the next message and fills the gap from
        # replay.
        before, seq0 = a.stats(), gw.status()["last_sequence"]
        proxy.dropping = True
        for i in range(3):
            c.put("gap/%d" % i)
        c.rm("obj/03")
        # Every batch published since is dropped on its way to A.
        ec.wait_until(lambda: proxy.dropped >= 1 and proxy.dropped == gw.status()["last_sequence"] - seq0, 5,
                      "the proxy dropping what the gateway published")
        proxy.dropping = False
        n = proxy.dropped
        c.put("gap/3")
        wait_equal(c, [a, b], "after dropped batches")
        after = a.stats()
        assert after.missing_seqs == before.missing_seqs + n, (n, after)
        assert after.replayed == before.replayed + n and after.unrepaired == 0, (n, after)
        assert after.reconnects == before.reconnects and after.resets == 0, after
        assert a.gaps == []  # repaired: nothing to report

        # 2. A is cut off while objects change: it reconnects, sees that
        # the publisher is the same process (replay holds its last batch)
        # and fills the outage from replay.
        before, st0 = a.stats(), gw.status()
        proxy.cut()
        for i in range(5):
            c.put("cut/%d" % i)
        c.rm("obj/02")
        ec.wait_until(lambda: gw.status()["published_events"] >= st0["published_events"] + 6, 5, "6 events published")
        n = gw.status()["last_sequence"] - st0["last_sequence"]
        assert a.stats().last_seq <= st0["last_sequence"]  # A missed them all
        proxy.heal()
        wait_equal(c, [a, b], "after the cut")
        after = a.stats()
        assert after.reconnects > before.reconnects
        assert after.replayed >= before.replayed + n, (n, after)
        assert after.unrepaired == 0 and after.resets == 0, after

        # 3. The gateway is killed and restarted with its state: the sequence
        # continues, nothing is lost, nobody is reset.
        gw.kill()
        for i in range(3):
            c.put("down/%d" % i)
        c.rm("--prefix", "cut/")
        gw.start().wait_ready()
        c.put("up/0")
        wait_equal(c, [a, b], "after SIGKILL and restart")
        assert a.stats().resets == 0 and a.stats().unrepaired == 0, a.stats()
        assert b.stats().resets == 0, b.stats()

        # 4. The gateway loses its state: its sequence starts again at 1.
        # A notices the reset and rebuilds from the new process's replay
        # ring; B rebuilds from a fresh snapshot.
        snaps = b.stats().snapshots
        gw.stop()
        gw.lose_state()
        c.rm("down/0")
        gw.start().wait_ready()
        assert gw.status()["state"] != "restored"
        c.put("after/0")
        wait_equal(c, [a, b], "after a restart without state")
        assert a.stats().resets >= 1 and any(g.reset for g in a.gaps), a.stats()
        assert b.stats().snapshots > snaps and any(g.rebuilt for g in b.gaps), b.stats()
        assert a.stats().malformed == 0 and b.stats().malformed == 0
    finally:
        a.close()
        b.close()
        proxy.close()
        gw.stop()
    assert a.done.is_set() and a.error is None and b.error is None


def test_snapshot_stream_format(cluster):
    c = cluster
    # With llm-d's topic form: every message, replies of replay included, carries it.
    gw = c.gateway("gw-snap", ["--stream-format", "snapshot", "--heartbeat-interval", "200ms",
                               "--topic", "kv@{pub}@e2e-model"])
    topic = "kv@%s@e2e-model" % gw.pub[len("tcp://"):]
    s = sub(gw.pub, snapshot_endpoint=gw.snapshot, replay_endpoint=gw.replay, heartbeat_timeout=2, topic=topic)
    p = sub(gw.pub, replay_endpoint=gw.replay, from_seq=1, topic=topic)
    try:
        c.put("snap/0")
        c.put("snap/1", medium="disk")
        wait_equal(c, [s, p], "snapshot format, initial")
        epoch = gw.status()["publisher_epoch"]
        assert s.stats().epoch == epoch and p.stats().epoch == epoch
        ec.wait_until(lambda: s.stats().heartbeats >= 2 and p.stats().heartbeats >= 2, 5, "heartbeats")

        # Killed and restarted with its state: the same epoch, no rebuild.
        snaps = s.stats().snapshots
        gw.kill()
        c.rm("snap/0")
        gw.start().wait_ready()
        assert gw.status()["publisher_epoch"] == epoch
        wait_equal(c, [s, p], "snapshot format, SIGKILL and restart")
        assert s.stats().snapshots == snaps and s.stats().resets == 0, s.stats()
        assert p.stats().resets == 0, p.stats()

        # Without its state: a new epoch, a rebuild.
        gw.stop()
        gw.lose_state()
        c.put("snap/2")
        gw.start().wait_ready()
        assert gw.status()["publisher_epoch"] != epoch
        wait_equal(c, [s, p], "snapshot format, new epoch")
        # s rebuilds either on the epoch change (a reset) or, when the
        # gateway was down longer than its heartbeat timeout, on the silence
        # (then the new epoch simply comes with the next snapshot).
        assert s.stats().snapshots > snaps and any(g.rebuilt for g in s.gaps), s.stats()
        assert p.stats().resets >= 1, p.stats()
        assert s.stats().epoch == gw.status()["publisher_epoch"]
        assert s.stats().malformed == 0 and p.stats().malformed == 0
        # A subscriber told no topic takes every message for malformed.
        with sub(gw.pub) as q:
            assert q.wait(lambda q: q.stats().malformed >= 2, 5), q.stats()
            assert len(q.index) == 0
    finally:
        s.close()
        p.close()
        gw.stop()


def test_unreachable_endpoints_fail_fast(cluster):
    dead = "tcp://" + ec.free_addr()
    t0 = time.monotonic()
    with pytest.raises(events.ReplayError):
        list(events.replay(dead, 1, timeout=0.5))
    with pytest.raises(events.ReplayError):
        events.fetch_snapshot(dead, timeout=0.5)
    with pytest.raises(ConnectionError):
        events.Subscriber(dead, dial_timeout=0.5).start()
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError):
        events.Subscriber("localhost:5557")
    with pytest.raises(ValueError):
        events.Subscriber("tcp://x:1", snapshot_endpoint="tcp://x:2", from_seq=1)
