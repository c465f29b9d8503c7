"""A scripted KV-event publisher for the subscriber tests: an XPUB (so a test
knows when the subscription arrived), a replay ROUTER and a snapshot ROUTER
speaking the contract's wire (docs/kv-events-contract.md), serving from a
ring the test fills. It lets a test skip sequences, repeat them, change the
epoch or send hostile frames, which a real gateway never does on purpose.
"""

import threading

import zmq

from _events_vectors import mp_map, payload, valid_kvs

END = (0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")


def batch(first_id, *specs, ts=1_700_000_000_000):
    """A payload of events given as (type, key) or (type, key, medium) or
    ("cleared", tenant); ids from first_id. Tenant "t" unless cleared."""
    evs = []
    for i, spec in enumerate(specs):
        t = spec[0]
        if t == "cleared":
            evs.append(mp_map(valid_kvs("cleared", False, first_id + i, tenant=spec[1], ts=ts)))
        else:
            medium = spec[2] if len(spec) > 2 else "cpu"
            evs.append(mp_map(valid_kvs(t, False, first_id + i, key=spec[1], medium=medium, ts=ts)))
    return payload(*evs, ts=ts)


class FakeGateway:
    def __init__(self, epoch=None):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a reconnecting peer's too
        self.pub_ep = "tcp://127.0.0.1:%d" % self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_sock = self.ctx.socket(zmq.ROUTER)
        self.replay_sock.setsockopt(zmq.LINGER, 0)
        self.replay_ep = "tcp://127.0.0.1:%d" % self.replay_sock.bind_to_random_port("tcp://127.0.0.1")
        self.snap_sock = self.ctx.socket(zmq.ROUTER)
        self.snap_sock.setsockopt(zmq.LINGER, 0)
        self.snap_ep = "tcp://127.0.0.1:%d" % self.snap_sock.bind_to_random_port("tcp://127.0.0.1")
        self.epoch = epoch  # None: Mooncake format; 16 bytes: snapshot format
        self.mu = threading.Lock()
        self.ring = {}             # seq -> payload, what replay serves
        self.snapshot = None       # (cut, epoch, [chunks]) what the snapshot endpoint answers
        self.replay_requests = 0
        self.snapshot_requests = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def seq_frame(self, seq):
        s = seq.to_bytes(8, "big")
        return s if self.epoch is None else s + self.epoch

    def wait_subscribed(self, timeout=5):
        """Blocks until a subscriber's subscription reached the XPUB."""
        while True:
            if not self.pub.poll(int(timeout * 1000)):
                raise AssertionError("no subscriber")
            m = self.pub.recv()
            if m[:1] == b"\x01":  # not an unsubscription (b"\x00") of a dropped peer
                return m

    def publish(self, seq, p, ring=True, live=True):
        """Publishes (live) and/or retains (ring) batch seq."""
        with self.mu:
            if ring:
                self.ring[seq] = p
        if live:
            self.send_raw([b"", self.seq_frame(seq), p])

    def send_raw(self, frames):
        # The XPUB is used only from this method and wait_subscribed, both on
        # the test's thread.
        self.pub.send_multipart(frames)

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.replay_sock, zmq.POLLIN)
        poller.register(self.snap_sock, zmq.POLLIN)
        while not self.stop.is_set():
            for s, _ in poller.poll(50):
                m = s.recv_multipart()
                if s is self.replay_sock:
                    ident, start = m[0], int.from_bytes(m[-1], "big")
                    self.replay_requests += 1
                    with self.mu:
                        items = sorted((k, v) for k, v in self.ring.items() if k >= start)
                    for k, v in items:
                        s.send_multipart([ident, b"", b"", k.to_bytes(8, "big"), v])
                    s.send_multipart([ident, b"", b"", END, b""])
                else:
                    ident = m[0]
                    self.snapshot_requests += 1
                    with self.mu:
                        cut, epoch, chunks = self.snapshot
                    s.send_multipart([ident, b"", cut.to_bytes(8, "big", signed=True), epoch] + list(chunks))

    def close(self):
        self.stop.set()
        self.t.join()
        for s in (self.pub, self.replay_sock, self.snap_sock):
            s.close(0)
        self.ctx.term()
