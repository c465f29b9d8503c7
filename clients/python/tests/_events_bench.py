"""Decoder throughput of crescent.events on pkg/kvevent's BenchmarkDecode
batch (64 legacy stored events): Decoder.decode_message (msgpack fast path,
strict checks), the strict reader alone, and msgpack's C unpackb of the
same bytes in the same process (no checks at all: the floor a Python
consumer pays just to parse). Ratios are against unpackb, same run.
Run: /usr/bin/python3 clients/python/tests/_events_bench.py
"""

import os
import sys
import timeit

import msgpack

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from crescent import events  # noqa: E402

TS = 1_700_000_000_000


def bench_payload():
    evs = []
    for i in range(64):
        evs.append({
            "event_id": 1000 + i, "timestamp": TS, "event_type": "stored", "model_name": "llama-3-8b",
            "block_size": 16, "additional_salt": None, "lora_name": None, "tenant_id": "tenant-a",
            "backend_id": "gw-1", "medium": "cpu", "dp_rank": 2, "type": "BlockStored", "group_id": "g",
            "object_key": "model/llama/layer-%02d/block-%08d" % (i % 32, i), "seq_hashes": [],
            "base_block_idx": None, "parent_hash": None, "token_ids": None, "block_hashes": [],
            "parent_block_hash": None,
        })
    return msgpack.packb([TS, evs, 2])


def per_event(fn, number=200):
    """Best of 5 repeats, seconds per event."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number / 64


def main():
    p = bench_payload()
    frames = [b"", events.put_seq(1), p]
    d = events.Decoder()
    b = d.decode_message(frames)
    assert len(b.events) == 64 and b == d._decode_payload_strict(1, p, events._KIND_LIVE)
    x = events.Index()
    print("%-6s %12s %12s %12s %10s %10s" % ("run", "default ev/s", "strict ev/s", "unpackb ev/s",
                                            "default/C", "strict/C"))
    for run in range(5):
        fast = per_event(lambda: d.decode_message(frames))
        strict = per_event(lambda: d._decode_payload_strict(1, p, events._KIND_LIVE))
        c = per_event(lambda: msgpack.unpackb(p))
        print("%-6d %12.0f %12.0f %12.0f %10.2f %10.2f" % (run + 1, 1 / fast, 1 / strict, 1 / c, c / fast, c / strict))
    print("Index.apply_batch: %.0f events/s" % (1 / per_event(lambda: x.apply_batch(b))))


if __name__ == "__main__":
    main()
