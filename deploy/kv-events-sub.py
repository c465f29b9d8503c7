#!/usr/bin/env python3
"""A plain KV-event subscriber (pyzmq + msgpack): prints every batch as JSON.

    apt-get install python3-zmq python3-msgpack   # or: pip install pyzmq msgpack
    python3 deploy/kv-events-sub.py [tcp://localhost:5557] [max_batches]

It checks the contract's frame shape as it goes: three frames, an empty
topic, an 8-byte big-endian sequence, and a [timestamp_ms, [events], dp_rank]
payload with an integer timestamp and 1..64 events.
"""
import json
import sys

import msgpack
import zmq

endpoint = sys.argv[1] if len(sys.argv) > 1 else "tcp://localhost:5557"
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 0

sock = zmq.Context().socket(zmq.SUB)
sock.connect(endpoint)
sock.setsockopt(zmq.SUBSCRIBE, b"")
expected = None
n = 0
while limit == 0 or n < limit:
    frames = sock.recv_multipart()
    assert len(frames) == 3, f"want 3 frames, got {len(frames)}"
    topic, seq_b, payload = frames
    assert topic == b"", f"topic must be empty, got {topic!r}"
    assert len(seq_b) == 8, f"sequence must be 8 bytes, got {len(seq_b)}"
    seq = int.from_bytes(seq_b, "big")
    if expected is not None and seq != expected:
        print(json.dumps({"gap": {"from": expected, "to": seq}}), flush=True)
    expected = seq + 1
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    assert isinstance(ts, int) and ts >= 0, f"timestamp_ms must be a non-negative int, got {ts!r}"
    assert 1 <= len(events) <= 64, f"1..64 events per batch, got {len(events)}"
    print(json.dumps({"seq": seq, "timestamp_ms": ts, "dp_rank": dp_rank, "events": events}), flush=True)
    n += 1
