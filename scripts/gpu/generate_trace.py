#!/usr/bin/env python3
"""Totals of an `oflaunch --trace` timeline by lane and name: count, total and mean time of
each event name on each lane (lane 4 is the CUDA compute stream, timed by device events), and
each lane's busy time over the traced span. Usage: generate_trace.py TRACE.json [--top N]"""
import argparse, json
from collections import defaultdict
ap = argparse.ArgumentParser(); ap.add_argument("trace"); ap.add_argument("--top", type=int, default=20)
a = ap.parse_args()
ev = json.load(open(a.trace)); ev = ev["traceEvents"] if isinstance(ev, dict) else ev
xs = [e for e in ev if e.get("ph") == "X" and e.get("pid") == 0]
lanes = defaultdict(list)
for e in xs: lanes[e.get("tid")].append(e)
for tid, es in sorted(lanes.items(), key=lambda kv: str(kv[0])):
    t0 = min(e["ts"] for e in es); t1 = max(e["ts"] + e["dur"] for e in es)
    busy = sum(e["dur"] for e in es)
    print(f"lane {tid}: {len(es)} events over {(t1-t0)/1e3:.1f} ms, {busy/1e3:.1f} ms busy")
    by = defaultdict(lambda: [0, 0.0])
    for e in es:
        k = e.get("name", "?")
        if k in ("matmul", "matmul_t"):
            k += " " + str(e.get("args", {}).get("inputs", ""))
        by[k][0] += 1; by[k][1] += e["dur"]
    for name, (n, d) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"   {d/1e3:9.2f} ms {n:6d} x {d/n:8.1f} us  {name[:90]}")
