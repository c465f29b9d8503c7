#!/usr/bin/env python3
"""Two independent KV-event consumers for the e2e tests, on real libzmq
(pyzmq), which reconnects silently as every third-party consumer does.
Neither uses Crescent's Go code; both are written from documents:

  --mode contract   docs/kv-events-contract.md, Mooncake format: three
                    frames, 8-byte sequence, strictly +1; a gap is repaired
                    from the replay ROUTER; the sequence going backwards is
                    a reset (counted; the test expects none while the
                    gateway's state is intact). It bootstraps from the
                    replay ring (sequence 1 onwards).
  --mode llmd       llm-d-router PR #2946 (pkg/kvevents/snapshot.go) as
                    described there: it subscribes to "kv@" (llm-d's
                    default topic filter); the first live frame must have
                    a kv@<address:port>@<model> topic (prefix "kv@",
                    exactly two "@") and pins it and the publisher epoch
                    (24-byte sequence frame); a REQ asks the
                    snapshot endpoint while live messages are buffered
                    (4096 messages / 64 MiB); the reply must carry that
                    epoch; chunks are applied to a fresh index, then live
                    messages with seq > cut, each exactly +1. A gap, a
                    topic or epoch change or 5 s without a frame
                    (heartbeats fill idle time) drops the index and starts
                    over, after a jittered backoff from 1 s doubling to
                    30 s. A publisher without a "kv@" topic sends it
                    nothing: it fails on the heartbeat timeout, as llm-d.

The index is the set of (tenant, key, medium) announced readable. The
driving test writes "dump" lines on stdin; each answers one JSON line
{"ready": bool, "index": [[tenant, key, medium], ...], "stats": {...}}.
"""
import argparse
import json
import random
import select
import sys
import time

import msgpack
import zmq

END_SEQ = 0xFFFFFFFFFFFFFFFF


def decode_payload(payload, allow_empty):
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(ts, int) or isinstance(ts, bool) or ts < 0:
        raise ValueError("timestamp_ms %r is not a non-negative integer" % (ts,))
    if not isinstance(dp_rank, int) or dp_rank < 0:
        raise ValueError("dp_rank %r" % (dp_rank,))
    if len(events) > 64 or (not events and not allow_empty):
        raise ValueError("%d events in one batch" % len(events))
    return events


def apply(index, events):
    for ev in events:
        kind = ev["event_type"]
        tenant = ev["tenant_id"]
        if kind == "stored":
            index.add((tenant, ev["object_key"], ev["medium"]))
        elif kind == "removed":
            index.discard((tenant, ev["object_key"], ev["medium"]))
        elif kind == "cleared":
            for k in [k for k in index if k[0] == tenant]:
                index.discard(k)
        else:
            raise ValueError("unknown event_type %r" % (kind,))


class Contract:
    """Mooncake format, repaired by replay."""

    def __init__(self, ctx, args):
        self.ctx, self.args = ctx, args
        self.index = set()
        self.last = 0       # last sequence applied (live or replayed)
        self.last_live = 0  # last sequence received live
        self.stats = {"batches": 0, "replayed": 0, "gaps": 0, "unrepaired": 0, "resets": 0, "malformed": 0}
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(args.pub)
        # Bootstrap from the ring: everything from sequence 1.
        self.repair(0)

    def replay(self, start):
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(self.args.replay)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                f = sock.recv_multipart()
                if len(f) != 4 or f[0] != b"":
                    raise ValueError("replay reply has %d frames" % len(f))
                seq = int.from_bytes(f[2], "big")
                if seq == END_SEQ:
                    return out
                out.append((seq, f[3]))
        finally:
            sock.close()

    def repair(self, upto):
        """Apply every retained batch after self.last and before upto (0:
        everything retained); what replay cannot supply is unrepaired."""
        want = self.last + 1
        for seq, payload in self.replay(want):
            if upto and seq >= upto:
                break
            if seq < want:
                continue
            if seq > want:
                self.stats["unrepaired"] += seq - want
            apply(self.index, decode_payload(payload, False))
            self.stats["replayed"] += 1
            self.last, want = seq, seq + 1
        if upto and want < upto:
            self.stats["unrepaired"] += upto - want
            self.last = upto - 1

    def on_message(self, frames):
        if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
            self.stats["malformed"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self.last_live and seq <= self.last_live:
            self.stats["resets"] += 1  # the sequence went backwards
            return
        self.last_live = seq
        if seq <= self.last:
            return  # already applied through replay
        if seq != self.last + 1:
            self.stats["gaps"] += 1
            self.repair(seq)
        apply(self.index, decode_payload(frames[2], False))
        self.last = seq
        self.stats["batches"] += 1

    def tick(self):
        pass

    def ready(self):
        return True

    def sockets(self):
        return [self.sub]


class Llmd:
    """llm-d-router #2946's snapshot consumer."""

    TOPIC_FILTER = b"kv@"  # llm-d's kvevents.DefaultConfig().TopicFilter
    HEARTBEAT_TIMEOUT = 5.0
    SNAPSHOT_TIMEOUT = 10.0
    BUFFER_MSGS, BUFFER_BYTES = 4096, 64 << 20

    def __init__(self, ctx, args):
        self.ctx, self.args = ctx, args
        self.stats = {"batches": 0, "heartbeats": 0, "bootstraps": 0, "failures": {}, "gaps": 0}
        self.backoff = 1.0
        self.sub = None
        self.start()

    def fail(self, reason):
        self.stats["failures"][reason] = self.stats["failures"].get(reason, 0) + 1
        self.index, self.active = None, False
        delay = self.backoff / 2 + random.random() * self.backoff / 2
        self.backoff = min(2 * self.backoff, 30.0)
        self.retry_at = time.monotonic() + delay

    def start(self):
        if self.sub is not None:
            self.sub.close()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.TOPIC_FILTER)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(self.args.pub)
        self.index, self.active, self.first, self.retry_at = None, False, None, None
        self.last_receive = time.monotonic()

    @staticmethod
    def parse(frames):
        if len(frames) != 3 or len(frames[1]) != 24:
            raise ValueError("expected snapshot-enabled live frames")
        return frames[0], int.from_bytes(frames[1][:8], "big"), frames[1][8:], frames[2]

    def bootstrap(self, first):
        """Buffer live while the REQ waits, then splice."""
        topic, _, epoch, _ = first
        # llm-d: strings.HasPrefix(topic, "kv@") && strings.Count(topic, "@") == 2
        if not topic.startswith(b"kv@") or topic.count(b"@") != 2:
            raise ValueError("snapshot recovery requires kv@<address:port>@<model> topic")
        req = self.ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.args.snapshot)
        req.send(b"snapshot")
        buffered, nbytes = [first], len(first[3])
        deadline = time.monotonic() + self.SNAPSHOT_TIMEOUT
        poller = zmq.Poller()
        poller.register(req, zmq.POLLIN)
        poller.register(self.sub, zmq.POLLIN)
        reply = None
        try:
            while reply is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("snapshot timeout")
                for sock, _ in poller.poll(int(left * 1000)):
                    if sock is req:
                        reply = req.recv_multipart()
                    else:
                        m = self.parse(self.sub.recv_multipart())
                        buffered.append(m)
                        nbytes += len(m[3])
                        if len(buffered) > self.BUFFER_MSGS or nbytes > self.BUFFER_BYTES:
                            raise OverflowError("bootstrap buffer exhausted")
        finally:
            req.close()
        self.last_receive = time.monotonic()
        if len(reply) < 2 or len(reply[0]) != 8 or len(reply[1]) != 16:
            raise ValueError("malformed snapshot reply")
        cut = int.from_bytes(reply[0], "big", signed=True)
        if cut < -1:
            raise LookupError("snapshot unavailable")
        if reply[1] != epoch:
            raise ValueError("publisher changed during bootstrap")
        index = set()
        for chunk in reply[2:]:
            apply(index, decode_payload(chunk, False))
        self.index, self.topic, self.epoch, self.next = index, topic, epoch, cut + 1
        for m in buffered:
            self.advance(m)
        self.active = True
        self.backoff = 1.0
        self.stats["bootstraps"] += 1

    def advance(self, m):
        topic, seq, epoch, payload = m
        if topic != self.topic or epoch != self.epoch:
            raise ValueError("publisher identity changed")
        if seq < self.next:
            return
        if seq != self.next:
            self.stats["gaps"] += 1
            raise ValueError("live sequence gap")
        events = decode_payload(payload, True)
        if not events:
            self.stats["heartbeats"] += 1
        apply(self.index, events)
        self.next += 1
        self.stats["batches"] += 1

    def on_message(self, frames):
        self.last_receive = time.monotonic()
        if self.retry_at is not None:
            return  # backing off; the SUB socket is drained meanwhile
        try:
            m = self.parse(frames)
            if self.active:
                self.advance(m)
            else:
                self.bootstrap(m)
        except (ValueError, TimeoutError, OverflowError, LookupError, zmq.ZMQError) as e:
            self.fail(str(e).split(": ")[0])

    def tick(self):
        now = time.monotonic()
        if self.retry_at is not None and now >= self.retry_at:
            self.start()
        elif self.retry_at is None and now - self.last_receive > self.HEARTBEAT_TIMEOUT:
            self.fail("publisher heartbeat timeout")

    def ready(self):
        return self.active

    def sockets(self):
        return [self.sub]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["contract", "llmd"], required=True)
    ap.add_argument("--pub", required=True)
    ap.add_argument("--replay")
    ap.add_argument("--snapshot")
    args = ap.parse_args()
    ctx = zmq.Context()
    c = Contract(ctx, args) if args.mode == "contract" else Llmd(ctx, args)
    print(json.dumps({"started": True}), flush=True)
    while True:
        poller = zmq.Poller()
        for s in c.sockets():
            poller.register(s, zmq.POLLIN)
        poller.register(sys.stdin, zmq.POLLIN)
        for sock, _ in poller.poll(100):
            if sock is sys.stdin or sock == sys.stdin.fileno():
                line = sys.stdin.readline()
                if not line:
                    return
                if line.strip() == "dump":
                    index = sorted(getattr(c, "index", None) or [])
                    print(json.dumps({"ready": c.ready(), "index": index, "stats": c.stats}), flush=True)
            else:
                c.on_message(sock.recv_multipart())
        c.tick()


if __name__ == "__main__":
    main()
