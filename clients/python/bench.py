#!/usr/bin/python3
"""Put/get load from Python, with the parameters of `crescentctl bench`
(cli/internal/ctl/bench.go), so the two can run against the same cluster
in the same sitting (BENCHMARKS.md, "Python client").

    /usr/bin/python3 clients/python/bench.py --master 127.0.0.1:50051 \\
        --mode put --size 4096 --batch 128 --concurrency 4 --duration 8

put writes fresh keys with upsert (as crescentctl bench does); get first
stores --keys objects, then reads them in calls of --batch keys cycling
over the key space, into buffers each worker owns and reuses
(Client.get_many_into, as crescentctl's BatchGetInto/GetInto). Prints one
line of JSON with the same field names as `crescentctl bench --output json`.

--processes N spreads the --concurrency workers over N processes, each with
its own Client (one per process, as an engine's GPU workers each have
theirs): the threads of one process share the interpreter's lock, so one
process uses about one core however many workers it runs. The children
start their timed phase at the same instant; the result adds up their
objects/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from crescent import Client, ReplicateConfig  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--tenant", default="default")
    ap.add_argument("--mode", choices=("put", "get"), default="put")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--disable-transfer", action="store_true")
    ap.add_argument("--processes", type=int, default=1, help="spread the workers over this many processes")
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)  # a child's start (time.time())
    a = ap.parse_args(argv)
    if min(a.size, a.batch, a.concurrency, a.keys, a.processes) < 1:
        ap.error("--size, --batch, --concurrency, --keys and --processes must be >= 1")
    if a.processes > 1:
        return spread(a, argv if argv is not None else sys.argv[1:])
    c = Client(a.master, a.tenant, disable_transfer=a.disable_transfer, max_concurrency=16)
    prefix = "pybench/%06x/" % (time.time_ns() & 0xFFFFFF)
    payload = os.urandom(a.size)
    cfg = ReplicateConfig(replica_num=a.replicas)

    def key(i):
        return "%s%08d" % (prefix, i)

    if a.mode == "get":
        for lo in range(0, a.keys, 256):
            ks = [key(i) for i in range(lo, min(lo + 256, a.keys))]
            errs = c.put_many(ks, [payload] * len(ks), cfg, upsert=True)
            bad = [e for e in errs if e is not None]
            if bad:
                print(f"populate: {bad[0]}", file=sys.stderr)
                return 1
    lock = threading.Lock()
    nxt = [0]
    objects = [0]
    errors = [0]
    first_err = [None]
    lats: list[float] = []
    if a.start_at:
        time.sleep(max(0.0, a.start_at - time.time()))
    stop_at = time.monotonic() + a.duration

    def worker():
        bufs = [bytearray(a.size) for _ in range(a.batch)]
        local = []
        while True:
            with lock:
                n = nxt[0]
                nxt[0] += a.batch
            t0 = time.monotonic()
            if t0 >= stop_at:
                break
            if a.mode == "put":
                ks = [key(n + i) for i in range(a.batch)]
                errs = c.put_many(ks, [payload] * a.batch, cfg, upsert=True)
            else:
                ks = [key((n + i) % a.keys) for i in range(a.batch)]
                _, errs = c.get_many_into(ks, bufs)
            t1 = time.monotonic()
            if t1 >= stop_at:
                break
            local.append(t1 - t0)
            bad = [e for e in errs if e is not None]
            with lock:
                if bad:
                    errors[0] += 1
                    first_err[0] = first_err[0] or str(bad[0])
                else:
                    objects[0] += a.batch
        with lock:
            lats.extend(local)

    start = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.monotonic() - start
    try:
        c.remove_by_prefix(prefix, force=True)
    except Exception as e:  # cleanup only
        print(f"cleanup: {e}", file=sys.stderr)
    c.close()
    lats.sort()

    def pct(p):
        return lats[min(len(lats) - 1, int(p * len(lats)))] * 1e3 if lats else 0.0

    ops = objects[0] / secs
    print(json.dumps({
        "client": "python", "mode": a.mode, "object_size": a.size, "batch": a.batch, "concurrency": a.concurrency,
        "seconds": round(secs, 3), "objects": objects[0], "errors": errors[0], "objects_per_s": round(ops, 1),
        "gb_per_s": round(ops * a.size / 1e9, 4), "p50_ms": round(pct(0.5), 3), "p99_ms": round(pct(0.99), 3),
        **({"first_error": first_err[0]} if first_err[0] else {}),
    }))
    return 0 if objects[0] > 0 or errors[0] == 0 else 1


def spread(a, argv) -> int:
    """Run a.processes children of this script with the workers divided
    among them, starting their timed phase together, and print their sum."""
    # This process's arguments without --processes and --concurrency.
    cleaned, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in ("--processes", "--concurrency"):
            skip = True
            continue
        if x.startswith(("--processes=", "--concurrency=")):
            continue
        cleaned.append(x)
    start_at = time.time() + 3.0 + 0.002 * a.keys  # room for every child to populate
    per = [a.concurrency // a.processes + (1 if i < a.concurrency % a.processes else 0) for i in range(a.processes)]
    children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *cleaned, "--concurrency", str(max(n, 1)),
                                  "--start-at", repr(start_at)], stdout=subprocess.PIPE, text=True) for n in per]
    res = []
    for ch in children:
        out, _ = ch.communicate()
        if ch.returncode != 0:
            print(f"a child failed with status {ch.returncode}", file=sys.stderr)
            return 1
        res.append(json.loads(out.strip().splitlines()[-1]))
    ops = sum(r["objects_per_s"] for r in res)
    errors = sum(r["errors"] for r in res)
    first = next((r["first_error"] for r in res if r.get("first_error")), None)
    print(json.dumps({
        "client": "python", "mode": a.mode, "object_size": a.size, "batch": a.batch, "concurrency": a.concurrency,
        "processes": a.processes, "seconds": max(r["seconds"] for r in res), "objects": sum(r["objects"] for r in res),
        "errors": errors, "objects_per_s": round(ops, 1), "gb_per_s": round(ops * a.size / 1e9, 4),
        "p50_ms": round(max(r["p50_ms"] for r in res), 3), "p99_ms": round(max(r["p99_ms"] for r in res), 3),
        **({"first_error": first} if first else {}),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
