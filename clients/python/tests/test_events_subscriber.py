"""The Subscriber's decisions, one at a time, against a scripted publisher
(_events_fake.FakeGateway: real libzmq sockets, the contract's wire): a
gap repaired from replay, a gap replay cannot fill, no replay at all,
malformed and hostile messages, a publisher restart, the catch-up's
duplicate window, and the snapshot mode's splice, rebuilds, heartbeat
timeout and bad snapshot replies. The real gateway is in
test_events_gateway.py.
"""

import os
import struct
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))  # the _events_* helpers, whatever the import mode

from crescent import events  # noqa: E402
from _events_fake import FakeGateway, batch  # noqa: E402
from _events_vectors import mp_map, payload, valid_kvs  # noqa: E402


@pytest.fixture
def fake():
    f = FakeGateway()
    yield f
    f.close()


def start(fake, **kw):
    got, gaps = [], []
    s = events.Subscriber(fake.pub_ep, on_batch=got.append, on_gap=gaps.append, reconnect_min=0.02,
                          reconnect_max=0.1, rebuild_min=0.05, rebuild_max=0.2, **kw).start()
    fake.wait_subscribed()
    return s, got, gaps


def until(s, pred, what, timeout=5):
    assert s.wait(lambda _: pred(), timeout), "%s; stats %s" % (what, s.stats())


def keys(s):
    return {(k.key, k.medium) for k in s.index.keys()}


def test_gap_repaired_from_replay(fake):
    s, got, gaps = start(fake, replay_endpoint=fake.replay_ep)
    with s:
        fake.publish(1, batch(10, ("stored", "a")))
        fake.publish(2, batch(20, ("stored", "b")))
        fake.publish(3, batch(30, ("stored", "c")), live=False)
        fake.publish(4, batch(40, ("removed", "a")), live=False)
        fake.publish(5, batch(50, ("stored", "e", "disk")))
        until(s, lambda: s.stats().last_seq == 5, "batch 5")
        assert [(b.seq, b.replayed) for b in got] == [(1, False), (2, False), (3, True), (4, True), (5, False)]
        assert keys(s) == {("b", "cpu"), ("c", "cpu"), ("e", "disk")}
        st = s.stats()
        assert (st.missing_seqs, st.unrepaired, st.replayed, st.resets) == (2, 0, 2, 0)
        assert gaps == []


def test_gap_replay_cannot_fill(fake):
    s, got, gaps = start(fake, replay_endpoint=fake.replay_ep)
    with s:
        fake.publish(1, batch(10, ("stored", "a")))
        fake.publish(4, batch(40, ("stored", "d")), live=False)  # 2 and 3 are gone from the ring
        fake.publish(5, batch(50, ("stored", "e")))
        until(s, lambda: s.stats().last_seq == 5, "batch 5")
        assert [b.seq for b in got] == [1, 4, 5]
        assert [(g.from_seq, g.to_seq) for g in gaps] == [(2, 4)] and gaps[0].err is not None
        st = s.stats()
        assert (st.missing_seqs, st.unrepaired, st.replayed) == (3, 2, 1)


def test_gap_without_replay(fake):
    s, got, gaps = start(fake)
    with s:
        fake.publish(1, batch(10, ("stored", "a")))
        fake.publish(4, batch(40, ("stored", "d")))
        until(s, lambda: s.stats().last_seq == 4, "batch 4")
        assert gaps == [events.Gap(2, 4)]
        assert (s.stats().missing_seqs, s.stats().unrepaired) == (2, 2)


def test_malformed_and_hostile_messages(fake):
    s, got, gaps = start(fake, max_frame=4096)
    with s:
        fake.publish(1, batch(10, ("stored", "a")))
        fake.send_raw([b"", (2).to_bytes(8, "big"), b"\xc1"])           # malformed: batch 2 is lost
        fake.send_raw([b"", (3).to_bytes(8, "big")])                    # 2 frames: no sequence to trust
        fake.send_raw([b""] * 10)                                       # over 8 frames: dropped unread
        fake.publish(3, batch(30, ("stored", "c")))
        until(s, lambda: s.stats().last_seq == 3, "batch 3")
        st = s.stats()
        assert (st.malformed, st.protocol_errors) == (2, 1)
        assert len(gaps) == 1 and (gaps[0].from_seq, gaps[0].to_seq) == (2, 3)
        assert isinstance(gaps[0].err, events.MalformedError)
        # A frame over max_frame: libzmq drops the connection before reading
        # it; the subscriber reconnects and goes on.
        fake.send_raw([b"", (4).to_bytes(8, "big"), b"\x00" * 100_000])
        fake.wait_subscribed()
        fake.publish(5, batch(50, ("stored", "e")))
        until(s, lambda: s.stats().last_seq == 5, "batch 5 after the reconnect")
        assert s.stats().reconnects >= 1
        assert keys(s) == {("a", "cpu"), ("c", "cpu"), ("e", "cpu")}


def test_publisher_restart_detected(fake):
    s, got, gaps = start(fake, replay_endpoint=fake.replay_ep)
    with s:
        fake.publish(1, batch(10, ("stored", "a")))
        fake.publish(2, batch(20, ("stored", "b")))
        until(s, lambda: s.stats().last_seq == 2, "batch 2")
        # event_id goes back at the next sequence: another process.
        fake.publish(3, batch(1, ("stored", "c")))
        # The index is rebuilt from the ring, which this publisher shares
        # with its predecessor here: 1 and 2 come back from replay.
        until(s, lambda: s.stats().resets == 1 and s.stats().last_seq == 3, "reset on event_id")
        assert [(b.seq, b.replayed) for b in got] == [(1, False), (2, False), (1, True), (2, True), (3, False)]
        # The sequence goes back: another process again; from 1 the index
        # is rebuilt from the new ring.
        fake.ring.clear()
        fake.publish(1, batch(5, ("stored", "x")))
        until(s, lambda: s.stats().resets == 2, "reset on sequence")
        assert [g.reset for g in gaps] == [True, True]
        assert keys(s) == {("x", "cpu")}


def test_catch_up_skips_duplicates(fake):
    for i in (1, 2, 3):
        fake.publish(i, batch(i * 10, ("stored", "k%d" % i)), live=False)
    s, got, gaps = start(fake, replay_endpoint=fake.replay_ep, from_seq=1)
    with s:
        until(s, lambda: s.stats().last_seq == 3, "catch-up")
        fake.publish(2, batch(20, ("stored", "k2")))  # live copies of replayed batches
        fake.publish(3, batch(30, ("stored", "k3")))
        fake.publish(4, batch(40, ("removed", "k1")))
        until(s, lambda: s.stats().last_seq == 4, "batch 4")
        assert [(b.seq, b.replayed) for b in got] == [(1, True), (2, True), (3, True), (4, False)]
        assert keys(s) == {("k2", "cpu"), ("k3", "cpu")} and gaps == [] and s.stats().resets == 0


def chunk(*ks):
    return payload(*[mp_map(valid_kvs("stored", False, 0, key=k)) for k in ks])


def test_snapshot_bootstrap_splice_and_rebuild(fake):
    epoch = b"A" * 16
    fake.snapshot = (2, epoch, [chunk("a", "b")])
    for i in (1, 2):
        fake.publish(i, batch(i * 10, ("stored", "old%d" % i)), live=False)
    s, got, gaps = start(fake, snapshot_endpoint=fake.snap_ep, replay_endpoint=fake.replay_ep)
    with s:
        until(s, lambda: s.stats().synced, "snapshot installed")
        assert keys(s) == {("a", "cpu"), ("b", "cpu")} and s.stats().epoch == epoch.hex()
        assert got[0].snapshot and got[0].seq == 2
        fake.publish(2, batch(20, ("stored", "old2")))      # at the cut: covered
        fake.publish(3, batch(30, ("stored", "c")))
        fake.publish(4, batch(40, ("stored", "d")), live=False)
        fake.publish(5, batch(50, ("removed", "a")))         # 4 repaired from replay
        until(s, lambda: s.stats().last_seq == 5, "batch 5")
        assert keys(s) == {("b", "cpu"), ("c", "cpu"), ("d", "cpu")}
        # A gap replay cannot fill: rebuild from a new snapshot.
        fake.snapshot = (9, epoch, [chunk("z")])
        fake.publish(9, batch(90, ("stored", "z")))
        until(s, lambda: s.stats().snapshots == 2 and s.stats().synced, "rebuild")
        assert keys(s) == {("z", "cpu")}
        assert [(g.from_seq, g.to_seq, g.rebuilt) for g in gaps] == [(6, 9, True)]
        fake.publish(10, batch(100, ("stored", "y")))
        until(s, lambda: s.stats().last_seq == 10, "batch 10")
        assert keys(s) == {("y", "cpu"), ("z", "cpu")}


def test_snapshot_format_epoch_change_and_heartbeat_timeout():
    e1, e2 = b"1" * 16, b"2" * 16
    fake = FakeGateway(epoch=e1)
    try:
        fake.snapshot = (1, e1, [chunk("a")])
        s, got, gaps = start(fake, snapshot_endpoint=fake.snap_ep, heartbeat_timeout=0.6)
        with s:
            until(s, lambda: s.stats().synced, "snapshot installed")
            fake.publish(2, payload(ts=1))  # a heartbeat (empty event array)
            fake.publish(3, batch(30, ("stored", "b")))
            until(s, lambda: s.stats().last_seq == 3, "batch 3")
            assert s.stats().heartbeats == 1 and keys(s) == {("a", "cpu"), ("b", "cpu")}
            # A new publisher epoch: rebuild.
            fake.epoch = e2
            fake.snapshot = (7, e2, [chunk("n")])
            fake.publish(8, batch(5, ("stored", "m")))
            until(s, lambda: s.stats().snapshots == 2 and s.stats().synced, "rebuild on the epoch change")
            assert keys(s) == {("n", "cpu")} and s.stats().epoch == e2.hex() and s.stats().resets == 1
            assert gaps[-1].reset and gaps[-1].rebuilt
            # Silence longer than the heartbeat timeout: reconnect and rebuild.
            fake.publish(8, payload(ts=1))
            until(s, lambda: s.stats().last_seq == 8, "heartbeat 8")
            fake.snapshot = (8, e2, [chunk("n", "o")])
            until(s, lambda: s.stats().snapshots == 3 and s.stats().synced, "rebuild after silence")
            assert keys(s) == {("n", "cpu"), ("o", "cpu")}
            assert "heartbeat timeout" in str(gaps[-1].err) and gaps[-1].rebuilt and not gaps[-1].reset
    finally:
        fake.close()


def test_bad_snapshot_replies_are_retried(fake):
    epoch = b"E" * 16
    fake.snapshot = (3, epoch, [payload(mp_map(valid_kvs("stored", False, 7)))])  # event_id must be 0
    s, got, gaps = start(fake, snapshot_endpoint=fake.snap_ep)
    with s:
        until(s, lambda: s.stats().snapshot_failures >= 1, "a failed attempt")
        assert not s.stats().synced and len(s.index) == 0
        fake.snapshot = (-2, epoch, [])  # unavailable
        until(s, lambda: s.stats().snapshot_failures >= 3, "more failed attempts")
        fake.snapshot = (3, epoch, [chunk("ok")])
        until(s, lambda: s.stats().synced, "installed at last")
        assert keys(s) == {("ok", "cpu")}


def test_callbacks_that_raise_do_not_stop_the_subscriber(fake):
    def boom(_):
        raise RuntimeError("user bug")
    s = events.Subscriber(fake.pub_ep, on_batch=boom, on_gap=boom).start()
    fake.wait_subscribed()
    with s:
        fake.publish(1, batch(10, ("stored", "a")))
        fake.publish(3, batch(30, ("stored", "c")))
        until(s, lambda: s.stats().last_seq == 3, "batch 3")
        assert len(s.index) == 2 and not s.done.is_set()
    assert s.done.is_set() and s.error is None


def test_replay_rejects_bad_replies(fake):
    fake.publish(1, batch(10, ("stored", "a")), live=False)
    fake.publish(2, b"\x93\x00", live=False)  # truncated payload
    out = []
    with pytest.raises(events.MalformedError):
        for b in events.replay(fake.replay_ep, 1, timeout=2):
            out.append(b.seq)
    assert out == [1]
    assert struct.unpack(">Q", events.put_seq(7))[0] == 7


def _zmtp_publisher_handshake(conn):
    """The server half of a ZMTP 3.0 NULL handshake as a PUB socket."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    conn.sendall(greeting)
    got = b""
    while len(got) < 64:
        d = conn.recv(64 - len(got))
        assert d, "the subscriber hung up during the greeting"
        got += d
    body = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"
    conn.sendall(bytes([0x04, len(body)]) + body)


def _zmtp_frame(body, more):
    flags = 0x01 if more else 0x00
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body


def test_hostile_zmtp_publisher():
    """A publisher announcing a 2^50-byte frame is disconnected before
    anything is allocated for it; the subscriber dials again and takes the
    next (well-behaved) connection's messages."""
    import socket
    import threading
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    ep = "tcp://127.0.0.1:%d" % ls.getsockname()[1]
    conns = []

    def serve():
        c, _ = ls.accept()
        conns.append(c)
        _zmtp_publisher_handshake(c)
        c.sendall(bytes([0x02]) + (1 << 50).to_bytes(8, "big"))  # a frame of 1 PiB
        c2, _ = ls.accept()  # the subscriber dials again
        conns.append(c2)
        _zmtp_publisher_handshake(c2)
        assert c2.recv(1024)[:1] == b"\x04"  # the subscriber's READY: the handshake is done
        p = batch(10, ("stored", "fine"))
        c2.sendall(_zmtp_frame(b"", True) + _zmtp_frame((1).to_bytes(8, "big"), True) + _zmtp_frame(p, False))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    s = events.Subscriber(ep, reconnect_min=0.02, reconnect_max=0.1).start()
    try:
        assert s.wait(lambda x: x.stats().last_seq == 1, 10), s.stats()
        assert keys(s) == {("fine", "cpu")} and s.stats().reconnects >= 1 and not s.done.is_set()
    finally:
        s.close()
        t.join(5)
        for c in conns:
            c.close()
        ls.close()
