#!/usr/bin/env python3
"""Kernels of an Nsight Compute CSV (metric gpu__time_duration.sum) by total time, names cut at
their argument lists. With --per PREFIX, times and counts are per occurrence of the kernels whose
names start with PREFIX (e.g. argmax: one a decoding step).
Usage: ncu_table.py NCU.csv [--per PREFIX] [--top N]"""
import argparse, csv
from collections import defaultdict
ap = argparse.ArgumentParser(); ap.add_argument("csv"); ap.add_argument("--per"); ap.add_argument("--top", type=int, default=40)
a = ap.parse_args()
rows = []
lines = [l for l in open(a.csv, errors="replace") if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
        rows.append((r["Kernel Name"], v))
tot = sum(v for _, v in rows)
per = max(1, sum(1 for n, _ in rows if n.startswith(a.per))) if a.per else 1
what = f"per {a.per} kernel ({per} of them)" if a.per else "in all"
print(f"{len(rows)} kernels, {tot / per / 1e3:.3f} ms and {len(rows) / per:.0f} kernels {what}")
by = defaultdict(lambda: [0.0, 0])
for n, v in rows:
    k = n.split("(")[0][:100]
    by[k][0] += v
    by[k][1] += 1
for k, (t, c) in sorted(by.items(), key=lambda x: -x[1][0])[: a.top]:
    print(f"  {t / per / 1e3:8.3f} ms {c / per:7.1f}x {t / c:8.1f} us  {k}")
