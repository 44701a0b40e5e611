#!/usr/bin/env python3
"""GPU time per kernel from Nsight Compute's CSV (`ncu --metrics gpu__time_duration.sum --csv`).

With --last-token, only the last decode step: the shortest tail of kernel names that repeats
exactly just before itself (a decode step launches the same kernels each token). Prints the
step's kernel count and summed GPU time, then the kernels by their share of it.
usage: ncu_table.py NCU.csv [--last-token] [--top N]
"""
import argparse
import collections
import csv

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}


def rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            value = float(r["Metric Value"].replace(",", ""))
            unit = r["Metric Unit"]
            if unit not in SCALE:
                raise SystemExit(f"unknown time unit {unit!r} in {path}")
            yield r["Kernel Name"], value * SCALE[unit]


def last_period(names, shortest=20):
    for p in range(shortest, len(names) // 2 + 1):
        if names[-p:] == names[-2 * p : -p]:
            return p
    return len(names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--last-token", action="store_true")
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    kernels = list(rows(a.csv))
    if not kernels:
        print("no kernels in", a.csv)
        return
    if a.last_token:
        kernels = kernels[-last_period([k for k, _ in kernels]) :]
    total = sum(t for _, t in kernels)
    print(f"{len(kernels)} kernels, {total:.1f} us of GPU time")
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, t in kernels:
        by[name.split("(")[0][:70]][0] += 1
        by[name.split("(")[0][:70]][1] += t
    print("| kernel | share | calls | avg us |")
    print("|---|---|---|---|")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"| `{name}` | {100 * t / total:.1f} % | {n} | {t / n:.1f} |")


if __name__ == "__main__":
    main()
