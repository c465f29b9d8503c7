#!/usr/bin/env python3
"""A plain Python subscriber for crescent-gateway's KV event stream.

Prints every batch as one JSON line: {"seq": N, "timestamp_ms": T,
"dp_rank": R, "events": [...]}, and checks the transport the way a
Mooncake consumer does: three frames, an empty topic, an 8-byte big-endian
sequence without gaps, a msgpack payload [timestamp_ms, [events], dp_rank]
with integer timestamps.

    pip/apt: python3-zmq python3-msgpack
    sub.py [--endpoint tcp://127.0.0.1:5557] [--count N] [--timeout S]
           [--replay tcp://127.0.0.1:5558 --from SEQ]

With --replay, it first asks the replay ROUTER (as a DEALER) for every
retained batch from --from and prints those (marked "replayed": true),
until the end marker (sequence 0xFFFFFFFFFFFFFFFF, empty payload).
"""
import argparse
import json
import sys

import msgpack
import zmq

END_SEQ = 0xFFFFFFFFFFFFFFFF


def decode(seq_frame, payload):
    if len(seq_frame) != 8:
        raise ValueError("sequence frame has %d bytes" % len(seq_frame))
    seq = int.from_bytes(seq_frame, "big")
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(ts, int) or isinstance(ts, bool):
        raise ValueError("timestamp_ms is %r, not an integer" % (ts,))
    if not 1 <= len(events) <= 64:
        raise ValueError("%d events in one batch" % len(events))
    return {"seq": seq, "timestamp_ms": ts, "dp_rank": dp_rank, "events": events}


def replay(ctx, endpoint, start, timeout_ms):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        frames = sock.recv_multipart()
        if len(frames) == 4 and frames[0] == b"" and frames[1] == b"":
            seq_frame, payload = frames[2], frames[3]  # [b"", topic, seq, payload]
        elif len(frames) == 3 and frames[0] == b"":
            seq_frame, payload = frames[1], frames[2]  # older [b"", seq, payload]
        else:
            raise ValueError("replay reply with %d frames" % len(frames))
        if int.from_bytes(seq_frame, "big") == END_SEQ:
            break
        b = decode(seq_frame, payload)
        b["replayed"] = True
        out.append(b)
    sock.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--replay", default="")
    ap.add_argument("--from", dest="start", type=int, default=1)
    ap.add_argument("--count", type=int, default=0, help="exit after this many live batches")
    ap.add_argument("--timeout", type=float, default=0, help="exit after this many idle seconds")
    args = ap.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if args.timeout:
        sub.setsockopt(zmq.RCVTIMEO, int(args.timeout * 1000))
    sub.connect(args.endpoint)

    last = None
    if args.replay:
        for b in replay(ctx, args.replay, args.start, int((args.timeout or 10) * 1000)):
            print(json.dumps(b), flush=True)
            last = b["seq"]

    n = 0
    while not args.count or n < args.count:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            break
        if len(frames) != 3 or frames[0] != b"":
            print("BAD MESSAGE: %d frames, topic %r" % (len(frames), frames[0][:16]), file=sys.stderr)
            return 1
        b = decode(frames[1], frames[2])
        if last is not None and b["seq"] <= last:
            continue  # already printed from the replay
        if last is not None and b["seq"] != last + 1:
            print("GAP: %d..%d missing" % (last + 1, b["seq"] - 1), file=sys.stderr)
        last = b["seq"]
        print(json.dumps(b), flush=True)
        n += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
