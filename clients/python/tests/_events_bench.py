"""Decoder throughput of crescent.events on pkg/kvevent's BenchmarkDecode
batch (64 legacy stored events), against msgpack's C unpackb of the same
bytes in the same process (no validation: the floor a Python consumer
pays just to parse). Run: /usr/bin/python3 clients/python/tests/_events_bench.py
"""

import os
import sys
import time

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


def rate(fn, seconds=1.0):
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(50):
            fn()
        n += 50
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n * 64 / dt


def main():
    p = bench_payload()
    frames = [b"", events.put_seq(1), p]
    d = events.Decoder()
    assert len(d.decode_message(frames).events) == 64
    x = events.Index()
    b = d.decode_message(frames)
    print("%-34s %14s %14s %8s" % ("run", "strict ev/s", "unpackb ev/s", "ratio"))
    for run in range(3):
        strict = rate(lambda: d.decode_message(frames))
        c = rate(lambda: msgpack.unpackb(p))
        print("%-34s %14.0f %14.0f %8.2f" % ("decode_message #%d" % (run + 1), strict, c, strict / c))
    print("%-34s %14.0f" % ("Index.apply_batch", rate(lambda: x.apply_batch(b))))


if __name__ == "__main__":
    main()
