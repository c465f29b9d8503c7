#!/usr/bin/python3
"""Python client against the Go SDK in the same sitting (BENCHMARKS.md,
"Python client"): `crescentctl bench` and bench.py with the same
parameters against the same running cluster, alternated, RUNS runs each,
printed as a Markdown table with each run's Python/Go ratio.

    make build && make run            # in another terminal, or any cluster
    /usr/bin/python3 clients/python/bench_vs_go.py --master 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

CASES = [
    # (name, mode, size, batch, keys, metric)
    ("4 KiB batch put", "put", 4096, 128, 4096, "objects_per_s"),
    ("4 KiB batch get", "get", 4096, 128, 4096, "objects_per_s"),
    ("1 MiB get", "get", 1 << 20, 1, 128, "gb_per_s"),
]


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--crescentctl", default=os.path.join(REPO, "bin", "crescentctl"))
    ap.add_argument("--processes", type=int, default=1,
                    help="Python's workers in this many processes (bench.py --processes); Go's stay in one")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this (e.g. '1 MiB')")
    a = ap.parse_args()
    print(f"| case | run | Go | Python | Python/Go |\n|---|---|---|---|---|")
    for name, mode, size, batch, keys, metric in CASES:
        if a.only not in name:
            continue
        ratios = []
        for r in range(1, a.runs + 1):
            common = ["--mode", mode, "--batch", str(batch), "--concurrency", str(a.concurrency), "--keys", str(keys)]
            go = run([a.crescentctl, "--master", a.master, "bench", "--size", str(size), "--duration", f"{a.duration}s", "-o", "json"] + common)
            py = run([sys.executable, os.path.join(HERE, "bench.py"), "--master", a.master, "--size", str(size),
                      "--duration", str(a.duration), "--processes", str(a.processes)] + common)
            for res in (go, py):
                if res.get("errors"):
                    print(f"warning: {name} run {r}: {res['errors']} failed calls: {res.get('first_error')}", file=sys.stderr)
            ratio = py[metric] / go[metric] if go[metric] else float("nan")
            ratios.append(ratio)
            unit = "objects/s" if metric == "objects_per_s" else "GB/s"
            fmt = "{:.0f}" if metric == "objects_per_s" else "{:.3f}"
            print(f"| {name} | {r} | {fmt.format(go[metric])} {unit} | {fmt.format(py[metric])} {unit} | {ratio:.2f} |", flush=True)
        print(f"| {name} | median | | | **{statistics.median(ratios):.2f}** |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
